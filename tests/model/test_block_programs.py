"""A block's training step as an ExecuTorch program: exported per block with its weights outside,
trained through the runtime with AdamW, equal to eager PyTorch on three tiny families.

The tests marked ``executorch`` run in ``.venv-executorch`` (``make executorch``; ``make test``
runs them there); the one without the mark runs in the project's venv, which has no ExecuTorch.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from fedcybgd.core.checksum import content_checksum
from fedcybgd.model.block_programs import (
    ExecuTorchError,
    ProgramLoss,
    ProgramTrainer,
    WithLMLoss,
    export_block,
    lm_inputs,
    named_tensors,
    read_manifest,
    tied_weights,
    write_weights,
)
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.loading import load_model

BATCH, SEQ, STEPS, LR = 2, 16, 3, 1e-3


def batches(vocab: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """``STEPS`` batches of one full window and one short (padded) window."""
    g = torch.Generator().manual_seed(seed)
    return [lm_inputs([torch.randint(0, vocab, (SEQ,), generator=g).tolist(),
                       torch.randint(0, vocab, (SEQ - 5,), generator=g).tolist()], SEQ, 0)
            for _ in range(STEPS)]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-mistral", "tiny-qwen2"])
def exported(request, tmp_path_factory):
    """A tiny model of each family with its second block exported."""
    model = load_model(request.param)
    blocks = BlockMap(model, 1)
    block = blocks.names[1]
    out = tmp_path_factory.mktemp(request.param)
    entry = export_block(model, blocks, block, out, name=request.param, base_hash="h",
                         batch=BATCH, seq=SEQ)
    return model, blocks, block, out, entry


@pytest.mark.executorch
def test_adamw_steps_through_the_program_equal_eager_pytorchs(exported):
    assert_steps_equal_eager(*exported)


@pytest.mark.executorch
def test_a_tied_embedding_trains_through_both_programs_as_eager(tmp_path):
    # Prepare: tiny-llama's output projection is its input embedding (one tensor, two names)
    model = load_model("tiny-llama")
    assert model.config.tie_word_embeddings
    blocks = BlockMap(model, 1)
    assert tied_weights(model, {"model.embed_tokens.weight"}) == [
        ("model.embed_tokens.weight", "lm_head.weight")]
    # Execute / Assert: the head block (the final norm) trains as eager PyTorch
    entry = export_block(model, blocks, "head", tmp_path, name="tiny-llama", base_hash="h",
                         batch=BATCH, seq=SEQ)
    assert_steps_equal_eager(model, blocks, "head", tmp_path, entry)
    # the embedding's training step: one parameter, its gradient the sum of its two uses (the
    # lookup and the head) as in the model; no second copy of it under the head's name among
    # the program's weights, and the model's head tied again after the export
    entry = export_block(model, blocks, "embed", tmp_path, name="tiny-llama", base_hash="h",
                         batch=BATCH, seq=SEQ)
    assert list(entry.trainable) == ["model.model.embed_tokens.weight"]
    assert not [n for n in entry.constants if "lm_head" in n]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert_steps_equal_eager(model, blocks, "embed", tmp_path, entry)
    # its forward program takes the embedding as an input that the head reads too: eager
    # PyTorch's loss at a perturbed embedding (the tied head perturbed with it)
    entry = export_block(model, blocks, "embed", tmp_path, name="tiny-llama", base_hash="h",
                         batch=BATCH, seq=SEQ, kind="forward")
    assert list(entry.trainable) == ["model.model.embed_tokens.weight"]
    assert not [n for n in entry.constants if "embed_tokens" in n or "lm_head" in n]
    assert_forward_scores_as_eager(model, blocks, "embed", tmp_path, entry)


@pytest.mark.executorch
def test_a_tied_head_the_training_step_cannot_carry_is_refused_by_name(tmp_path):
    # Prepare: a tied head with a bias of its own (not a plain projection on the embedding)
    model = load_model("tiny-llama")
    head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    head.weight = model.model.embed_tokens.weight
    model.lm_head = head
    # Execute / Assert: refused before anything is exported, naming what it can carry
    with pytest.raises(ExecuTorchError, match=r"bias-free nn\.Linear.*forward program"):
        export_block(model, BlockMap(model, 1), "embed", tmp_path, name="tiny-llama",
                     base_hash="h", batch=BATCH, seq=SEQ)
    assert not list(tmp_path.iterdir())

def assert_steps_equal_eager(model, blocks, block, out, entry) -> None:
    """``STEPS`` AdamW steps on ``block`` through its program and in eager PyTorch: the same
    losses, the same trained block."""
    # Prepare: the eager twin, only the block trainable, AdamW at the same settings
    eager = copy.deepcopy(model)
    own = set(blocks.info(block).param_names)
    for name, p in eager.named_parameters():
        p.requires_grad_(name in own)
    optimizer = torch.optim.AdamW([p for n, p in eager.named_parameters() if n in own], lr=LR,
                                  weight_decay=0.01)
    trainer = ProgramTrainer(out, entry, named_tensors(model), lr=LR, weight_decay=0.01)
    wrapped = WithLMLoss(eager)

    # Execute: the same batches both ways
    losses = []
    for ids, mask, targets in batches(int(model.config.vocab_size)):
        program_loss = trainer.step(ids, mask, targets)
        optimizer.zero_grad()
        loss = wrapped(ids, mask, targets)
        loss.backward()
        optimizer.step()
        losses.append((program_loss, float(loss)))
    trained = trainer.block()
    trainer.close()

    # Assert: same losses; the trained block's change equal within 1e-3 of its size (AdamW
    # turns a near-zero gradient's last-bit difference into up to one lr step on that element)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in losses), losses
    start = dict(model.named_parameters())
    ref = {n: p.detach() for n, p in eager.named_parameters() if n in own}
    assert sorted(trained) == sorted(ref)
    diff = sum(float(((trained[n] - ref[n])).norm() ** 2) for n in ref) ** 0.5
    size = sum(float((ref[n] - start[n]).norm() ** 2) for n in ref) ** 0.5
    assert size > 0 and diff <= 1e-3 * size, (diff, size)


@pytest.mark.executorch
def test_the_forward_program_scores_the_block_tensors_it_is_given_as_eager_pytorch(exported,
                                                                                    tmp_path):
    # Prepare: the block's forward program beside the training step's, in the same folder
    model, blocks, block, out, _ = exported
    entry = export_block(model, blocks, block, out, name="m", base_hash="h", batch=BATCH,
                         seq=SEQ, kind="forward")
    assert_forward_scores_as_eager(model, blocks, block, out, entry)
    # Assert: the block's tensors are not in the weights file; both programs listed under their
    # kinds
    own = sorted(blocks.info(block).param_names)
    assert list(entry.trainable) == [f"model.{n}" for n in own]
    assert not set(entry.trainable) & set(entry.constants)
    assert (out / f"{block}.forward.pte").is_file() and entry.kind == "forward"
    assert block in read_manifest(out) and read_manifest(out, "forward")[block] == entry
    assert read_manifest(out)[block].kind == "fo"
    with pytest.raises(ExecuTorchError, match="not a forward"):
        ProgramLoss(out, read_manifest(out)[block], named_tensors(model))


def assert_forward_scores_as_eager(model, blocks, block, out, entry) -> None:
    """The forward program's loss equals eager PyTorch's at the model's own block tensors and at
    perturbed ones (set into a twin of the model), and differs between the two."""
    own = sorted(blocks.info(block).param_names)
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(3)
    perturbed = {n: params[n].detach() + 1e-3 * torch.randn(params[n].shape, generator=g)
                 for n in own}

    # Execute: the loss at the model's own block and at a perturbed one
    scorer = ProgramLoss(out, entry, named_tensors(model))
    found = []
    for ids, mask, targets in batches(int(model.config.vocab_size)):
        for block_tensors in ({n: params[n].detach() for n in own}, perturbed):
            ours = scorer(ids, mask, targets, {f"model.{n}": t for n, t in block_tensors.items()})
            twin = copy.deepcopy(model)
            with torch.no_grad():
                for n, t in block_tensors.items():
                    dict(twin.named_parameters())[n].copy_(t)
                found.append((ours, float(WithLMLoss(twin)(ids, mask, targets))))
    scorer.close()

    # Assert: eager's loss each time, and the perturbation seen
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in found), found
    assert found[0][0] != found[1][0]


@pytest.mark.executorch
def test_a_rounds_new_weights_reach_the_same_program(exported):
    # Prepare: every weight moved, as a round's downloads move the frozen blocks
    model, _blocks, _block, out, entry = exported
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.02)
    ids, mask, targets = batches(int(model.config.vocab_size))[0]

    # Execute
    trainer = ProgramTrainer(out, entry, named_tensors(moved), lr=LR, weight_decay=0.0)
    loss = trainer.step(ids, mask, targets)
    trainer.close()

    # Assert: the program computes the moved model's loss, not the exported one's
    with torch.no_grad():
        assert abs(loss - float(WithLMLoss(moved)(ids, mask, targets))) <= 1e-5 * abs(loss)
        assert abs(loss - float(WithLMLoss(model)(ids, mask, targets))) > 1e-4


@pytest.mark.executorch
def test_weights_stream_to_the_file_the_serializer_writes_from_whole_bytes(exported, tmp_path):
    # Prepare: the serializer's own way, every weight copied to bytes and the file joined
    from executorch.exir._serialize.data_serializer import DataEntry, DataPayload
    from executorch.exir.scalar_type import ScalarType
    from executorch.exir.tensor_layout import TensorLayout
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    model, _blocks, _block, _out, entry = exported
    tensors = named_tensors(model)
    names = sorted(entry.constants)
    whole = FlatTensorSerializer().serialize(DataPayload(
        buffers=[tensors[k].detach().contiguous().numpy().tobytes() for k in names],
        named_data={k: DataEntry(i, 16, TensorLayout(ScalarType.FLOAT, entry.constants[k],
                                                     list(range(len(entry.constants[k])))))
                    for i, k in enumerate(names)}))

    # Execute
    write_weights(tmp_path / "streamed.ptd", entry, tensors)

    # Assert: the same bytes; the program plans memory for its step
    assert (tmp_path / "streamed.ptd").read_bytes() == bytes(whole)
    assert entry.planned_bytes > 0


@pytest.mark.executorch
def test_weights_of_another_shape_or_a_changed_program_are_refused(exported, tmp_path):
    model, _blocks, _block, out, entry = exported
    tensors = dict(named_tensors(model))
    name = next(iter(entry.trainable))
    tensors[name] = torch.zeros(3, 3)
    with pytest.raises(ExecuTorchError, match=name.replace(".", r"\.")):
        write_weights(tmp_path / "w.ptd", entry, tensors)
    missing = {k: v for k, v in named_tensors(model).items() if k != name}
    with pytest.raises(ExecuTorchError, match="lack"):
        write_weights(tmp_path / "w.ptd", entry, missing)
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / entry.program).write_bytes((out / entry.program).read_bytes() + b"\0")
    with pytest.raises(ExecuTorchError, match="checksum"):
        ProgramTrainer(changed, entry, named_tensors(model), lr=LR, weight_decay=0.0)


@pytest.mark.executorch
def test_export_command_writes_programs_weights_and_a_manifest(tmp_path):
    out = tmp_path / "programs"
    done = subprocess.run([sys.executable, "-m", "fedcybgd.cli", "export", "tiny-llama",
                           "--executorch", str(out), "--layers-per-block", "1", "--block",
                           "layer.0", "--batch-size", "2", "--max-seq-len", "16"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    entry = read_manifest(out)["layer.0"]
    model = load_model("tiny-llama")
    assert entry.base_hash == content_checksum(dict(model.named_parameters()))
    assert (entry.batch, entry.seq, entry.task) == (2, 16, "lm")
    assert (out / "layer.0.pte").stat().st_size < 1_000_000  # the graph only: weights outside
    assert (out / "layer.0.ptd").stat().st_size > 4 * sum(p.numel() for p in model.parameters())
    assert set(entry.trainable) == {f"model.{n}" for n in BlockMap(model, 1).info(
        "layer.0").param_names}
    unknown = subprocess.run([sys.executable, "-m", "fedcybgd.cli", "export", "tiny-llama",
                              "--executorch", str(out), "--layers-per-block", "1", "--block",
                              "layer.9"],
                             capture_output=True, text=True, timeout=600)
    assert unknown.returncode == 2 and "no block 'layer.9'" in unknown.stderr
    assert json.loads((out / "manifest.json").read_text())["programs"][0]["block"] == "layer.0"


@pytest.mark.skipif(importlib.util.find_spec("executorch") is not None,
                    reason="ExecuTorch is installed here")
def test_export_without_executorch_names_the_install_step(tmp_path):
    done = subprocess.run([sys.executable, "-m", "fedcybgd.cli", "export", "tiny-llama",
                           "--executorch", str(tmp_path / "p")], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 2
    assert "make executorch" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "p").exists()


def test_a_manifest_entry_of_another_release_is_left_out_and_the_rest_read(tmp_path):
    # Prepare: one current entry, one written before the manifest had its later fields (no
    # kind, no vocab), one forward program
    current = {"model": "m", "block": "layer.0", "task": "lm", "batch": 2, "seq": 16,
               "program": "layer.0.pte", "weights": "layer.0.ptd", "program_sha256": "0" * 64,
               "base_hash": "h", "planned_bytes": 1, "vocab": 32, "trainable": {},
               "constants": {}, "kind": "fo"}
    older = {k: v for k, v in current.items() if k not in ("vocab", "kind")} | {
        "block": "layer.1", "program": "layer.1.pte"}
    forward = current | {"kind": "forward", "program": "layer.0.forward.pte"}
    (tmp_path / "manifest.json").write_text(json.dumps({"programs": [current, older, forward]}))
    # Execute
    fo, fwd = read_manifest(tmp_path), read_manifest(tmp_path, "forward")
    # Assert: the older entry's block is not there (a node exports it again)
    assert list(fo) == ["layer.0"] and fo["layer.0"].kind == "fo"
    assert list(fwd) == ["layer.0"] and fwd["layer.0"].program == "layer.0.forward.pte"
