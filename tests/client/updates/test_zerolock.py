"""The ZeroLock update rule on the 4-layer tied tiny Llama: local losses, isolation, resume."""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from fedcybgd.client.updates import TrainOutcome, TrainTask, get_rule
from fedcybgd.client.updates.local_heads import LocalHead, Translator
from fedcybgd.client.updates.zerolock import (
    ZeroLockOptions,
    checkpoint_path,
    heads_path,
    split_layers,
)
from fedcybgd.data.prompts import Batch
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_model, load_tokenizer
from fedcybgd.tasks import shares
from fedcybgd.tasks.objective import label_loss

SEED = 11


@pytest.fixture(scope="module")
def base_model() -> Any:
    return load_model("tiny-llama")


@pytest.fixture(scope="module")
def batch_list() -> list[Batch]:
    tokenizer = load_tokenizer("tiny-llama")
    frame = shares.load_split("rotten-tomatoes", "train").iloc[:64]
    return list(itertools.islice(shares.batches(frame, tokenizer, 4, 32, seed=0), 8))


@pytest.fixture
def model(base_model: Any) -> Any:
    fresh = copy.deepcopy(base_model)  # deepcopy keeps the tied embedding/head tensor shared
    assert fresh.get_output_embeddings().weight is fresh.get_input_embeddings().weight
    return fresh


def make_task(
    model: Any,
    block: str,
    batches: Iterator[Batch],
    state_dir: Path | None,
    steps: int = 2,
    layers_per_block: int = 1,
    lr: float = 1e-2,
    **options: Any,
) -> TrainTask:
    return TrainTask(
        model=model,
        stack=LayerStack(model),
        blocks=BlockMap(model, layers_per_block),
        block=block,
        batches=batches,
        steps=steps,
        lr=lr,
        weight_decay=0.0,
        seed=SEED,
        options={f"zerolock-{k.replace('_', '-')}": v for k, v in options.items()},
        state_dir=state_dir,
    )


def train(task: TrainTask) -> TrainOutcome:
    return get_rule("zerolock").train(task)


def snapshot(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def true_label_loss(model: Any, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        logits = LayerStack(model).forward_logits(
            batch.input_ids, batch.attention_mask, batch.last_index
        )
        return label_loss(logits, batch)


class StepRecorder:
    """Wraps AdamW.step: which model parameters hold a gradient when each optimizer steps."""

    def __init__(self, model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.steps: list[tuple[set[str], set[str], set[str]]] = []
        original = torch.optim.AdamW.step

        def step(opt: torch.optim.AdamW, *args: Any, **kwargs: Any) -> Any:
            owned = {self.names[id(p)] for g in opt.param_groups for p in g["params"]
                     if id(p) in self.names}
            with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
            trainable = {n for n, p in model.named_parameters() if p.requires_grad}
            self.steps.append((owned, with_grad, trainable))
            return original(opt, *args, **kwargs)

        monkeypatch.setattr(torch.optim.AdamW, "step", step)


def test_last_block_frozen_lm_loss_is_the_true_loss(model, batch_list):
    # Prepare
    batch = batch_list[0]
    expected = true_label_loss(model, batch)
    stack = LayerStack(model)
    # Execute: the head alone, and the rule's first step (its loss is taken before the update)
    with torch.no_grad():
        below = stack.run(stack.embed(batch.input_ids, batch.attention_mask), 0, 3)
        direct = LocalHead(stack).loss(stack.run(below, 3, 4), batch)
    outcome = train(make_task(model, "layer.3", iter(batch_list), None, steps=1, slice=3))
    # Assert
    assert torch.allclose(direct, expected, rtol=1e-6, atol=1e-6)
    assert outcome.loss == pytest.approx(float(expected), rel=1e-6)


def test_next_token_objective_on_last_block_is_the_lm_loss(model, batch_list):
    # Prepare: the model's own LM loss on prompt + label word, over real positions
    batch = batch_list[0]
    ids = torch.cat([batch.input_ids, batch.input_ids[:, :1]], dim=1)
    rows = torch.arange(ids.shape[0])
    ids[rows, batch.last_index + 1] = batch.target_ids
    mask = batch.attention_mask.bool()
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1], attention_mask=batch.attention_mask).logits
    expected = F.cross_entropy(logits[mask].float(), ids[:, 1:][mask])
    # Execute: sliced into slices of 7 rows
    outcome = train(make_task(model, "layer.3", iter(batch_list), None, steps=1,
                              objective="next-token", slice=7))
    # Assert
    assert outcome.loss == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize(("block", "layers_per_block", "chunks"), [
    ("layer.1", 1, 1), ("embed", 1, 1), ("head", 1, 1), ("layer.0-1", 2, 2),
])
def test_a_step_changes_the_block_and_nothing_else(model, batch_list, block,
                                                   layers_per_block, chunks):
    # Prepare
    blocks = BlockMap(model, layers_per_block)
    before = snapshot(model)
    # Execute
    outcome = train(make_task(model, block, iter(batch_list), None,
                              layers_per_block=layers_per_block, chunks=chunks))
    # Assert
    after = snapshot(model)
    inside = set(blocks.info(block).param_names)
    for name in before:
        if name in inside:
            assert not torch.equal(before[name], after[name]), f"{name} did not change"
        else:
            assert torch.equal(before[name], after[name]), f"{name} changed"
    assert outcome.steps == 2 and outcome.examples == 8
    assert not any(p.requires_grad or p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(("block", "ran", "never"), [
    ("layer.1", {0, 1}, {2, 3}),  # prefix + block; nothing above
    ("embed", {0}, {1, 2, 3}),  # the embed block's head: frozen layer 0 only
    ("layer.3", {0, 1, 2, 3}, set()),
])
def test_layers_above_the_block_never_run(model, batch_list, block, ran, never):
    # Prepare
    stack = LayerStack(model)
    calls = [0] * stack.num_layers
    for i, layer in enumerate(stack.layers):
        layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    # Execute
    train(make_task(model, block, iter(batch_list), None, steps=3))
    # Assert
    assert {i for i, c in enumerate(calls) if c} == ran
    assert all(calls[i] == 0 for i in never)


def test_prefix_outputs_are_cached_when_a_batch_repeats(model, batch_list):
    # Prepare: the same batch three times
    stack = LayerStack(model)
    calls = [0] * stack.num_layers
    for i, layer in enumerate(stack.layers):
        layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    # Execute
    outcome = train(make_task(model, "layer.2", itertools.repeat(batch_list[0]), None, steps=3))
    # Assert: the prefix (layers 0, 1) ran once; the block every step
    assert calls == [1, 1, 3, 0]
    assert outcome.metrics["zerolock_cache_hits"] == 2


@pytest.mark.parametrize(("block", "layers_per_block", "chunks", "head"), [
    ("layer.2", 1, 1, "frozen-lm"), ("embed", 1, 1, "tuned"), ("head", 1, 1, "frozen-lm"),
    ("layer.0-1", 2, 2, "tuned"),
])
def test_gradients_reach_only_the_chunk_being_stepped(model, batch_list, monkeypatch, block,
                                                      layers_per_block, chunks, head):
    # Prepare
    blocks = BlockMap(model, layers_per_block)
    inside = set(blocks.info(block).param_names)
    recorder = StepRecorder(model, monkeypatch)
    # Execute
    train(make_task(model, block, iter(batch_list), None, layers_per_block=layers_per_block,
                    chunks=chunks, head=head))
    # Assert: every optimizer step sees grads on its own parameters only, inside the block
    stepped: list[str] = []
    for owned, with_grad, trainable in recorder.steps:
        assert owned <= inside
        assert with_grad == owned
        assert trainable == inside
        stepped.extend(owned)
    assert set(stepped) == inside
    assert len(stepped) == 2 * len(inside)  # two local steps, each parameter stepped once
    if chunks == 2:  # early forwarding order: layer 0's chunk steps before layer 1's
        layer_of = [0 if ".layers.0." in n else 1 for n in stepped]
        half = len(layer_of) // 2
        assert layer_of[:half] == sorted(layer_of[:half])


def test_embed_block_keeps_its_local_head_frozen_with_tied_weights(model, batch_list,
                                                                     monkeypatch):
    # Prepare: the embed block owns the (tied) LM head tensor; record the head each step uses
    import fedcybgd.client.updates.local_heads as lh

    used: list[torch.Tensor] = []
    original = lh.LocalHead.logits

    def logits(self: LocalHead, rows: torch.Tensor) -> torch.Tensor:
        assert self.head_weight is not None
        used.append(self.head_weight.clone())
        return original(self, rows)

    monkeypatch.setattr(lh.LocalHead, "logits", logits)
    start = model.get_output_embeddings().weight.detach().clone()
    # Execute
    train(make_task(model, "embed", iter(batch_list), None, steps=3))
    # Assert: the live tied tensor moved, the local head did not
    assert not torch.equal(model.get_output_embeddings().weight, start)
    assert len(used) == 3 and all(torch.equal(w, start) for w in used)


def test_tuned_head_persists_across_rounds(model, batch_list, tmp_path):
    # Execute: round 1, then round 2 on the same node folder
    train(make_task(model, "layer.1", iter(batch_list), tmp_path, steps=2,
                            head="tuned", head_lr=1e-2))
    saved = load_file(str(heads_path(tmp_path, "layer.1")))
    stack = LayerStack(model)
    translator = Translator(64)
    translator.load_state_dict({k.removeprefix("layer.1."): v for k, v in saved.items()})
    batch = batch_list[0]
    with torch.no_grad():
        below = stack.run(stack.embed(batch.input_ids, batch.attention_mask), 0, 1)
        out = stack.run(below, 1, 2)
        expected = LocalHead(stack, translator=translator).loss(out, batch)
        identity = LocalHead(stack).loss(out, batch)
    second = train(make_task(model, "layer.1", iter(batch_list), tmp_path, steps=1,
                             head="tuned"))
    # Assert: the saved map moved away from the identity; round 2 starts from it
    assert sorted(saved) == ["layer.1.bias", "layer.1.delta"]
    assert saved["layer.1.delta"].abs().max() > 0
    assert second.loss == pytest.approx(float(expected), rel=1e-6)
    assert second.loss != pytest.approx(float(identity), rel=1e-6)


def test_fused_step_is_the_same_update_as_one_optimizer(model, base_model, batch_list):
    # Prepare
    plain = copy.deepcopy(base_model)
    # Execute
    train(make_task(model, "layer.0-1", iter(batch_list), None, layers_per_block=2, steps=3,
                    chunks=2))
    train(make_task(plain, "layer.0-1", iter(batch_list), None, layers_per_block=2, steps=3,
                    chunks=2, fused_step=False))
    # Assert
    for (name, a), (_, b) in zip(model.named_parameters(), plain.named_parameters(),
                                 strict=True):
        assert torch.allclose(a, b, atol=1e-7), name


def test_tuned_head_starts_as_the_identity(model, base_model, batch_list, tmp_path):
    # Execute
    frozen = train(make_task(copy.deepcopy(base_model), "layer.1", iter(batch_list), None,
                             steps=1))
    tuned = train(make_task(model, "layer.1", iter(batch_list), tmp_path, steps=1,
                            head="tuned", head_rank=8))
    # Assert
    assert tuned.loss == frozen.loss


def test_two_chunks_each_have_a_loss_and_update(model, batch_list):
    # Prepare
    before = snapshot(model)
    stack = LayerStack(model)
    batch = batch_list[0]
    with torch.no_grad():
        h1 = stack.run(stack.embed(batch.input_ids, batch.attention_mask), 0, 1)
        loss1 = LocalHead(stack).loss(h1, batch)
    # Execute
    outcome = train(make_task(model, "layer.0-1", iter(batch_list), None, steps=1,
                              layers_per_block=2, chunks=2))
    # Assert: chunk 0's loss is taken after layer 0; chunk 1's is the block's loss
    assert outcome.metrics["zerolock_chunk0_loss"] == pytest.approx(float(loss1), rel=1e-6)
    assert outcome.metrics["zerolock_chunk1_loss"] == outcome.loss
    after = snapshot(model)
    for layer in (0, 1):
        names = [n for n in before if f".layers.{layer}." in n]
        assert all(not torch.equal(before[n], after[n]) for n in names)


class Crashing(Iterator[Batch]):
    """Yields ``batches`` and raises once ``crash_at`` of them have been taken."""

    def __init__(self, batches: list[Batch], crash_at: int | None) -> None:
        self.batches = iter(batches)
        self.crash_at = crash_at
        self.taken = 0

    def __next__(self) -> Batch:
        if self.taken == self.crash_at:
            raise RuntimeError("client killed")
        self.taken += 1
        return next(self.batches)


def test_a_restarted_client_resumes_from_its_checkpoint(base_model, batch_list, tmp_path):
    # Prepare
    opts = dict(layers_per_block=2, chunks=2, head="tuned", checkpoint_every=1, steps=5)
    straight = copy.deepcopy(base_model)
    expected = train(make_task(straight, "layer.0-1", iter(batch_list), tmp_path / "a", **opts))
    node = tmp_path / "b"
    crashed = copy.deepcopy(base_model)
    # Execute: crash when taking batch 4, then restart from the round's starting weights
    with pytest.raises(RuntimeError, match="client killed"):
        train(make_task(crashed, "layer.0-1", Crashing(batch_list, 3), node, **opts))
    assert checkpoint_path(node).is_file()
    restarted = copy.deepcopy(base_model)
    batches = Crashing(batch_list, None)
    outcome = train(make_task(restarted, "layer.0-1", batches, node, **opts))
    # Assert: resumed at step 3, took only the batches it still needed, same result
    assert outcome.metrics["zerolock_resumed_step"] == 3
    assert batches.taken == 5  # 3 skipped + 2 trained
    assert outcome.steps == expected.steps == 5
    assert outcome.loss == pytest.approx(expected.loss, rel=1e-5)
    for (name, a), (_, b) in zip(straight.named_parameters(), restarted.named_parameters(),
                                 strict=True):
        assert torch.allclose(a, b, atol=1e-6), name
    assert not checkpoint_path(node).exists()
    heads_a = load_file(str(heads_path(tmp_path / "a", "layer.0-1")))
    heads_b = load_file(str(heads_path(node, "layer.0-1")))
    assert all(torch.allclose(heads_a[k], heads_b[k], atol=1e-6) for k in heads_a)


def test_a_checkpoint_of_another_round_is_ignored(base_model, batch_list, tmp_path):
    # Prepare: a crash leaves a checkpoint; the next round has another seed
    with pytest.raises(RuntimeError):
        train(make_task(copy.deepcopy(base_model), "layer.1", Crashing(batch_list, 2), tmp_path,
                        steps=4, checkpoint_every=1))
    task = make_task(copy.deepcopy(base_model), "layer.1", iter(batch_list), tmp_path, steps=2)
    task.seed = SEED + 1
    # Execute
    outcome = train(task)
    # Assert
    assert outcome.metrics["zerolock_resumed_step"] == 0 and outcome.steps == 2
    assert not checkpoint_path(tmp_path).exists()


def test_split_layers_and_options():
    assert split_layers(8, 15, 3) == [(8, 11), (11, 14), (14, 16)]
    assert split_layers(0, 1, 4) == [(0, 1), (1, 2)]
    opts = ZeroLockOptions.from_options({"zerolock-chunks": 2.0, "zo-eps": 1e-3,
                                         "zerolock-head": "tuned"})
    assert (opts.chunks, opts.head) == (2, "tuned")
    with pytest.raises(ValueError, match="unknown option"):
        ZeroLockOptions.from_options({"zerolock-chunk": 2})
    with pytest.raises(ValueError, match="zerolock-head"):
        ZeroLockOptions.from_options({"zerolock-head": "mlp"})


def test_low_precision_weights_train_through_fp32_masters(base_model, batch_list):
    # Prepare
    model = copy.deepcopy(base_model).to(torch.bfloat16)
    before = snapshot(model)
    # Execute
    outcome = train(make_task(model, "layer.1", iter(batch_list), None, lr=1e-3))
    # Assert
    after = snapshot(model)
    for name in before:
        changed = not torch.equal(before[name], after[name])
        assert changed == (".layers.1." in name), name
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert outcome.steps == 2 and math.isfinite(outcome.loss)


def test_clientapp_runs_zerolock_with_a_tuned_head(tiny_run_config, tmp_path):
    # Prepare: two rounds of one client; the tuned head must appear in the node's cache folder
    from fedcybgd.client.app import app as client_app
    from fedcybgd.config import RunConfig
    from fedcybgd.harness.loopback import LoopbackGrid
    from fedcybgd.server.app import run_server

    config = dict(tiny_run_config, **{"update-rule": "zerolock", "zerolock-head": "tuned",
                                      "clients-per-round": 1, "eval-every": 0})
    cache = tmp_path / "client-cache"
    grid = LoopbackGrid(client_app, 1, config, node_config=lambda i: {"cache-dir": str(cache)})
    # Execute
    summary = run_server(grid, RunConfig.from_run_config(config))
    # Assert
    assert summary["rounds"] == 2
    heads = sorted(p.name for p in cache.rglob("zerolock/heads/*.safetensors"))
    assert heads == ["layer.0.safetensors", "layer.1.safetensors"]
    assert not list(cache.rglob("zerolock/checkpoint.safetensors"))


def test_local_head_with_a_frozen_tied_weight_keeps_the_familys_softcap():
    # Prepare: Gemma2 ties its head to the embedding and softcaps the logits
    from fedcybgd.client.updates.local_heads import LocalHead
    from fedcybgd.model.layerwise import LayerStack

    model = load_model("tiny-gemma2")
    stack = LayerStack(model)
    weight = model.get_output_embeddings().weight.detach().clone()
    rows = torch.randn(3, model.config.hidden_size)
    # Execute
    local = LocalHead(stack, head_weight=weight).logits(rows)
    # Assert: the same logits as the model's own head (softcap included)
    with torch.no_grad():
        assert torch.equal(local.detach(), stack.head(stack.final_hidden(rows)))
