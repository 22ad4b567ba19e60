"""Devices, frozen blocks in bf16/fp16/int8, recomputation for ``fo``.

This machine has no accelerator: device resolution and its refusals run through a
:class:`DeviceProbe` describing other machines; every tensor path runs on the CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedcybgd.client.app import app as client_app
from fedcybgd.client.runtime import ClientModel
from fedcybgd.client.store import BlockStore
from fedcybgd.client.updates.fo import block_loss
from fedcybgd.config import ConfigError, NodeConfig, RunConfig
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.devices import (
    DeviceProbe,
    DeviceUnavailable,
    node_device,
    resolve_device,
    to_cpu,
)
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_model
from fedcybgd.model.precision import FrozenBlocks, Precision, dequantize_rows, quantize_rows
from fedcybgd.protocol import Holding, zeroth_order
from fedcybgd.server.app import build_strategy

GPU_BOX = DeviceProbe(cuda_count=2, mps=False)
MAC = DeviceProbe(cuda_count=0, mps=True)
BARE = DeviceProbe(cuda_count=0, mps=False)


# ----------------------------------------------------------------------------- devices
def test_auto_takes_cuda_then_mps_then_cpu():
    assert resolve_device("auto", probe=GPU_BOX) == torch.device("cuda", 0)
    assert resolve_device("auto", probe=MAC) == torch.device("mps")
    assert resolve_device("auto", probe=BARE) == torch.device("cpu")
    assert resolve_device("cuda", probe=GPU_BOX) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", probe=GPU_BOX) == torch.device("cuda", 1)
    assert resolve_device("cpu", probe=GPU_BOX) == torch.device("cpu")


@pytest.mark.parametrize(("name", "probe", "says"), [
    ("cuda", BARE, "sees no CUDA device"),
    ("cuda:2", GPU_BOX, "it has 2 CUDA device(s)"),
    ("mps", GPU_BOX, "no usable MPS device"),
])
def test_a_missing_device_is_refused_by_name(name, probe, says):
    with pytest.raises(DeviceUnavailable) as err:
        resolve_device(name, probe=probe)
    assert f"device = {name!r}" in str(err.value)
    assert says in str(err.value)


def test_this_machine_resolves_auto_to_what_torch_has():
    expected = "cuda" if torch.cuda.is_available() else (
        "mps" if torch.backends.mps.is_available() else "cpu")
    assert resolve_device("auto").type == expected


def test_node_config_device_overrides_the_run_config():
    assert node_device("cpu", "cuda:1", GPU_BOX) == torch.device("cuda", 1)
    assert node_device("cuda", "", GPU_BOX) == torch.device("cuda", 0)
    with pytest.raises(DeviceUnavailable, match=r"device \(node config\) = 'cuda:1'"):
        node_device("cpu", "cuda:1", BARE)


def test_bad_device_names_name_the_key():
    with pytest.raises(ConfigError, match="device = 'gpu' is not a device"):
        RunConfig.from_run_config({"device": "gpu"})
    with pytest.raises(ConfigError, match=r"device \(node config\) = 'cuda:x'"):
        NodeConfig.from_node_config({"device": "cuda:x"})
    assert NodeConfig.from_node_config({"device": "mps"}).device == "mps"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_node_asking_for_a_gpu_it_lacks_fails_at_start(tiny_run_config, tmp_path):
    from fedcybgd.client.app import node_key

    # Prepare: the node's own config asks for CUDA on this CPU-only machine
    grid = LoopbackGrid(client_app, 1, tiny_run_config,
                        node_config=lambda i: {"cache-dir": str(tmp_path), "device": "cuda"})
    context = next(iter(grid.contexts.values()))
    # Execute / Assert: the server's first message to a node is the node-key query
    with pytest.raises(DeviceUnavailable, match=r"device \(node config\) = 'cuda'"):
        node_key(None, context)  # type: ignore[arg-type]
    # and a node following a run config that asks for it fails the same way
    context.node_config.pop("device")
    context.run_config["device"] = "cuda:0"
    with pytest.raises(DeviceUnavailable, match=r"device \(run config\) = 'cuda:0'"):
        node_key(None, context)  # type: ignore[arg-type]


def test_to_cpu_returns_cpu_tensors_without_copying_cpu_ones():
    t = torch.ones(3)
    moved = to_cpu({"a": t})
    assert moved["a"].device.type == "cpu"
    assert moved["a"].data_ptr() == t.data_ptr()


def test_z_fingerprint_is_per_device_and_replay_checks_it():
    cpu = zeroth_order.z_fingerprint()
    assert zeroth_order.z_fingerprint(torch.device("cpu")) == cpu == zeroth_order.z_fingerprint(
        "cpu")
    block = {"w": torch.linspace(-1, 1, 12).view(3, 4)}
    layout = (("w",),)
    log = zeroth_order.SeedLog(
        block="layer.0", units=1, layout=zeroth_order.layout_id(layout), eps=1e-3,
        weight_decay=0.0, torch=torch.__version__, z="0" * 16,
        steps=(zeroth_order.SeedStep(5, (0,), 0.5, zeroth_order.to_f32(1e-3)),))
    with pytest.raises(zeroth_order.ReplayError, match="on cpu"):
        zeroth_order.replay(block, log, layout, device="cpu")
    ok = zeroth_order.replay(block, log.__class__(**{**log.__dict__, "z": cpu}), layout,
                             device="cpu")
    assert ok["w"].device.type == "cpu" and not torch.equal(ok["w"], block["w"])


# --------------------------------------------------------------------------- precision
FAMILIES = ["tiny-llama", "tiny-gpt2", "tiny-opt", "tiny-qwen2", "tiny-gpt-neox"]
PRECISIONS = [Precision("bfloat16"), Precision("float16"), Precision("float32", "int8"),
              Precision("bfloat16", "int8")]


def _model(name: str) -> tuple[Any, LayerStack, BlockMap]:
    model = load_model(name)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, LayerStack(model), BlockMap(model, 1)


def _probe() -> tuple[torch.Tensor, torch.Tensor]:
    ids = (torch.arange(24).view(2, 12) * 5 + 1) % 100
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: the masks' padding path (fp16's -inf) runs
    return ids, mask


def test_int8_rows_round_trip_within_half_a_step():
    w = torch.randn(7, 33) * torch.logspace(-3, 1, 7)[:, None]
    w[3] = 0.0
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    err = (dequantize_rows(q, scale, torch.float32) - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())
    assert torch.equal(dequantize_rows(q, scale, torch.float32)[3], torch.zeros(33))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.describe())
def test_frozen_model_is_close_and_thaws_bit_exactly(family, precision):
    # Prepare
    model, stack, blocks = _model(family)
    ids, mask = _probe()
    with torch.no_grad():
        reference = stack.all_logits(ids, mask)
    exact = {b: blocks.get(model, b) for b in blocks.names}
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    frozen = FrozenBlocks(model, blocks, precision)
    # Execute
    for block in blocks.names:
        frozen.freeze(block, exact[block])
    with torch.no_grad():
        low = stack.all_logits(ids, mask)
    low_bytes = frozen.resident_bytes()
    for block in blocks.names:
        frozen.thaw(block, exact[block])
    with torch.no_grad():
        back = stack.all_logits(ids, mask)
    # Assert: close in low precision (2% of the logit scale), exact when thawed
    real = mask.bool()
    scale = float(reference[real].abs().max())
    assert low.dtype == torch.float32 and bool(torch.isfinite(low[real]).all())
    assert float((low[real] - reference[real]).abs().max()) <= 0.02 * max(scale, 1.0)
    assert torch.equal(back, reference)
    assert {n: p.dtype for n, p in model.named_parameters()} == dict.fromkeys(
        dict(model.named_parameters()), torch.float32)
    # bf16/fp16 halve the weights; int8 takes a quarter plus scales (GPT-2's Conv1D layers are
    # not nn.Linear: they stay in frozen-dtype)
    limit = 0.5 if precision.quant == "none" else (0.6 if family == "tiny-gpt2" else 0.3)
    assert low_bytes <= limit * fp32_bytes + 1024


def test_a_tied_embedding_and_head_share_one_int8_copy():
    model, _, blocks = _model("tiny-llama")
    assert blocks.tied
    exact = blocks.get(model, "embed")
    frozen = FrozenBlocks(model, blocks, Precision("float32", "int8"))
    frozen.freeze("embed", exact)
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    assert head.__dict__["_fc_int8"] is embedding.__dict__["_fc_int8"]
    assert "weight" not in dict(head.named_parameters())
    frozen.thaw("embed", exact)
    assert head.weight is embedding.weight
    assert torch.equal(head.weight, exact["model.embed_tokens.weight"])


def test_frozen_blocks_refuse_anything_but_fp32_sources():
    model, _, blocks = _model("tiny-llama")
    frozen = FrozenBlocks(model, blocks, Precision("bfloat16"))
    low = {n: t.bfloat16() for n, t in blocks.get(model, "layer.0").items()}
    with pytest.raises(ValueError, match="exact fp32 tensors only"):
        frozen.thaw("layer.0", low)


def test_fo_backprops_through_frozen_int8_and_bf16_layers():
    for precision in (Precision("bfloat16"), Precision("bfloat16", "int8")):
        model, stack, blocks = _model("tiny-llama")
        frozen = FrozenBlocks(model, blocks, precision)
        for block in blocks.names:
            if block != "layer.0":
                frozen.freeze(block, blocks.get(model, block))
        batch = _batch()
        params = blocks.parameters(model, "layer.0")
        for p in params:
            p.requires_grad_(True)
        block_loss(stack, batch, 0).backward()
        assert all(p.grad is not None and bool(torch.isfinite(p.grad).all())
                   and float(p.grad.abs().sum()) > 0 for p in params)


def _batch() -> Any:
    from fedcybgd.model.loading import load_tokenizer
    from fedcybgd.tasks import shares

    frame = shares.load_split("rotten-tomatoes", "train").head(8)
    return next(iter(shares.batches(frame, load_tokenizer("tiny-llama"), 4, 32, seed=0)))


# ---------------------------------------------------------- the client's fp32 trained block
def test_the_trained_block_is_rebuilt_from_exact_fp32_never_from_the_frozen_copy(tmp_path):
    # Prepare: a node holding version 3 of layer.1 (fp32 in its cache), every block bf16+int8
    cm = ClientModel("tiny-llama", 1, "cpu", Precision("bfloat16", "int8"))
    store = BlockStore(Path(tmp_path), cm.base_hash)
    v3 = {n: t + 0.001 * torch.randn_like(t) for n, t in cm.pretrained("layer.1").items()}
    cm.set_block("layer.1", v3, store.put("layer.1", 3, v3))
    # Execute: train layer.1, then layer.2, then layer.1 again
    cm.train_block("layer.1", store)
    first = to_cpu(cm.blocks.get(cm.model, "layer.1"))
    cm.train_block("layer.2", store)
    layer2 = to_cpu(cm.blocks.get(cm.model, "layer.2"))
    cm.train_block("layer.1", store)
    again = to_cpu(cm.blocks.get(cm.model, "layer.1"))
    # Assert: bit-exact fp32 each time (a bf16 or int8 upcast would differ), frozen otherwise
    for name, t in v3.items():
        assert torch.equal(first[name], t) and torch.equal(again[name], t)
        assert first[name].dtype == torch.float32
    pretrained = cm.pretrained("layer.2")
    assert all(torch.equal(layer2[n], pretrained[n]) for n in pretrained)
    assert cm.frozen is not None and cm.frozen.is_frozen("layer.2")
    assert not cm.frozen.is_frozen("layer.1")
    # the delta base of a frozen block is its exact cached copy
    cm.train_block("layer.2", store)
    base = cm.exact("layer.1", store)
    assert all(torch.equal(base[n], v3[n]) for n in v3)
    assert cm.exact("layer.0", store).keys() == cm.pretrained("layer.0").keys()


def test_a_lost_cache_file_is_a_codec_error_not_a_silent_upcast(tmp_path):
    from fedcybgd.compression import CodecError

    cm = ClientModel("tiny-llama", 1, "cpu", Precision("bfloat16"))
    store = BlockStore(Path(tmp_path), cm.base_hash)
    v2 = cm.pretrained("layer.3")
    cm.set_block("layer.3", v2, store.put("layer.3", 2, v2))
    store.drop("layer.3")
    with pytest.raises(CodecError, match="exact tensors are gone"):
        cm.exact("layer.3", store)
    assert cm._loaded["layer.3"] == Holding(2, cm._loaded["layer.3"].checksum)


def _two_nodes(config, tmp_path):
    """A loopback grid of two nodes sharing a cache folder, and a strategy over one-layer
    blocks of a fresh model (also returned: it holds the server's masters)."""
    from fedcybgd.core.checksum import content_checksum

    run = RunConfig.from_run_config(config)
    grid = LoopbackGrid(client_app, 2, config,
                        node_config=lambda i: {"cache-dir": str(tmp_path / "cache")})
    model = load_model(run.model)
    weights = dict(model.named_parameters())
    strategy = build_strategy(run, BlockMap(model, 1), weights, "t", content_checksum(weights))
    return grid, strategy, model


@pytest.mark.parametrize("frozen", [{"frozen-dtype": "bfloat16"},
                                    {"frozen-dtype": "bfloat16", "frozen-quant": "int8"}])
@pytest.mark.slow
def test_federated_rounds_with_frozen_blocks_sync_by_delta_without_resyncs(
        tiny_run_config, tmp_path, frozen):
    # Prepare: two nodes, delta downloads, several rounds so each node gets blocks that
    # changed while it held them frozen
    config = dict(tiny_run_config, **frozen, **{"num-server-rounds": 4})
    grid, strategy, model = _two_nodes(config, tmp_path)
    # Execute
    for server_round in range(1, 5):
        messages = strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid)
        strategy.aggregate_train(server_round, grid.send_and_receive(messages))
    # Assert: every round installed both blocks; nothing was dropped or resynced; the server's
    # weights are fp32 masters
    for record in strategy.history:
        assert len(record.accepted or {}) == 2, record.dropped
        assert record.dropped == {}
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.slow
def test_lezo_seedlogs_replay_exactly_with_frozen_int8_blocks(tiny_run_config, tmp_path):
    config = dict(tiny_run_config, **{"update-rule": "lezo", "upload-codec": "seedlog",
                                      "frozen-dtype": "bfloat16", "frozen-quant": "int8",
                                      "local-steps": 3})
    grid, strategy, model = _two_nodes(config, tmp_path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for server_round in (1, 2):
        messages = strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid)
        replies = list(grid.send_and_receive(messages))
        kinds = [r.content.config_records["state"].get("upload-kind") for r in replies]
        assert kinds == ["seedlog", "seedlog"]  # no weights fallback
        strategy.aggregate_train(server_round, replies)
        assert len(strategy.history[-1].accepted or {}) == 2
    blocks = BlockMap(model, 1)
    changed = {blocks.block_of(n) for n, p in model.named_parameters()
               if not torch.equal(p, before[n])}
    assert len(changed) == 4


# --------------------------------------------------------------------------- recompute
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("block", ["layer.0", "embed"])
def test_recompute_gives_the_same_gradient(family, block):
    model, stack, blocks = _model(family)
    batch = _batch() if family == "tiny-llama" else _gpt2_batch()
    params = blocks.parameters(model, block)
    grads = []
    for recompute_from in (None, 1 if block == "layer.0" else 0):
        for p in params:
            p.grad = None
            p.requires_grad_(True)
        lowest = blocks.lowest_layer([block])
        loss = block_loss(stack, batch, lowest, recompute_from)
        loss.backward()
        grads.append([p.grad.clone() for p in params])
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
        assert float(a.abs().sum()) > 0


def _gpt2_batch() -> Any:
    from fedcybgd.model.loading import load_tokenizer
    from fedcybgd.tasks import shares

    frame = shares.load_split("rotten-tomatoes", "train").head(8)
    return next(iter(shares.batches(frame, load_tokenizer("tiny-gpt2"), 4, 32, seed=0)))


def test_fo_rule_with_recompute_trains_the_same_block(tiny_run_config):
    from fedcybgd.client.updates import TrainTask, get_rule

    results = []
    for recompute in (False, True):
        model, stack, blocks = _model("tiny-llama")
        batch = _batch()
        task = TrainTask(model=model, stack=stack, blocks=blocks, block="layer.1",
                         batches=iter([batch, batch]), steps=2, lr=1e-3, weight_decay=0.0,
                         seed=0, options={"fo-recompute": recompute})
        get_rule("fo").train(task)
        results.append(blocks.get(model, "layer.1"))
    for name in results[0]:
        assert torch.allclose(results[0][name], results[1][name], rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- evaluator
@pytest.mark.slow
def test_the_evaluator_can_run_as_the_clients_hold_frozen_blocks(tiny_run_config):
    from fedcybgd.server.common import Evaluator

    model, stack, blocks = _model("tiny-llama")
    plain = Evaluator(RunConfig.from_run_config(tiny_run_config), stack, blocks)
    run = RunConfig.from_run_config(dict(tiny_run_config, **{
        "eval-precision": "frozen", "frozen-dtype": "bfloat16", "frozen-quant": "int8"}))
    frozen = Evaluator(run, stack, blocks)
    assert plain.stack is stack and frozen.stack is not stack  # fp32 on the CPU: no copy
    first, low = plain(), frozen()
    assert low.loss != first.loss and abs(low.loss - first.loss) < 0.05 * first.loss
    # the masters change: the copy follows them; the masters stay fp32
    with torch.no_grad():
        for p in blocks.parameters(model, "layer.2"):
            p.mul_(1.5)
    moved = frozen()
    assert moved.loss != low.loss
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert abs(moved.loss - plain().loss) < 0.05 * moved.loss
