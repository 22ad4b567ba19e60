"""Zeroth-order rules (LeZO, MeZO) and their seed log, on the 4-layer tiny Llama."""

from __future__ import annotations

import copy
import functools
import math
import struct
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedcybgd.client.updates import TrainTask, get_rule, lezo
from fedcybgd.client.updates.fo import block_loss
from fedcybgd.data.prompts import Batch
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_model, load_tokenizer
from fedcybgd.protocol import seedlog, zeroth_order
from fedcybgd.tasks import shares


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer("tiny-llama")


@pytest.fixture(scope="module")
def batches(tokenizer) -> list[Batch]:
    frame = shares.load_split("rotten-tomatoes", "train").iloc[:64]
    stream = shares.batches(frame, tokenizer, 4, 32, seed=0)
    return [next(stream) for _ in range(4)]


@functools.lru_cache(maxsize=1)
def _tiny_model() -> PreTrainedModel:
    return load_model("tiny-llama")


def _tiny(dtype: torch.dtype) -> PreTrainedModel:
    """A fresh ``load_model("tiny-llama", dtype)``, without reloading the tokenizer each time."""
    return copy.deepcopy(_tiny_model()).to(dtype).eval()


def make_task(
    batches: list[Batch],
    block: str,
    layers_per_block: int = 1,
    *,
    steps: int = 3,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    dtype: torch.dtype = torch.float32,
    **options: Any,
) -> TrainTask:
    model = _tiny(dtype)
    cycle: Iterator[Batch] = iter(batches * 10)
    return TrainTask(
        model=model,
        stack=LayerStack(model),
        blocks=BlockMap(model, layers_per_block),
        block=block,
        batches=cycle,
        steps=steps,
        lr=lr,
        weight_decay=weight_decay,
        seed=7,
        options=options,
    )


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and bool(
        torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def test_projected_gradient_matches_directional_derivative(batches):
    # Prepare: one MeZO step with lr=0 on a single-layer block (units = its 9 tensors)
    task = make_task(batches, "layer.1", steps=1, lr=0.0, **{"zo-eps": 1e-4})
    rule = get_rule("mezo")
    layout = zeroth_order.unit_layout(task.blocks, "layer.1")
    params = dict(task.model.named_parameters())

    # Execute
    rule.train(task)
    step = rule.last_log.steps[0]
    for p in params.values():
        p.requires_grad_(False)
    block_params = [params[name] for unit in layout for name in unit]
    for p in block_params:
        p.requires_grad_(True)
    loss = block_loss(task.stack, batches[0], task.blocks.lowest_layer(["layer.1"]))
    loss.backward()
    directional = 0.0
    for unit in step.units:
        names = layout[unit]
        zs = zeroth_order.unit_z(zeroth_order.unit_seed(step.seed, unit),
                                 [params[n].shape for n in names])
        for z, name in zip(zs, names, strict=True):
            directional += float((z * params[name].grad).sum())

    # Assert
    assert step.units == tuple(range(len(layout)))
    assert abs(directional) > 1e-3
    assert step.g == pytest.approx(directional, rel=0.01)


@pytest.mark.parametrize("cache_mb", [0.0, 256.0], ids=["sparse-restore", "step-cache"])
@pytest.mark.parametrize(
    ("rule_name", "block", "layers_per_block", "dtype"),
    [
        ("lezo", "layer.0-3", 4, torch.float32),
        ("mezo", "layer.2", 1, torch.float32),
        ("mezo", "embed", 1, torch.float32),  # 3.1M elements: several z chunks
        ("lezo", "layer.0-3", 4, torch.bfloat16),  # fp32 master path
    ],
)
def test_lr_zero_leaves_weights_bit_identical(batches, rule_name, block, layers_per_block, dtype,
                                              cache_mb):
    # Prepare
    task = make_task(batches, block, layers_per_block, steps=3, lr=0.0, dtype=dtype,
                     **{"lezo-density": 0.5, "zo-step-cache-mb": cache_mb})
    before = snapshot(task.model)

    # Execute
    outcome = get_rule(rule_name).train(task)

    # Assert
    after = snapshot(task.model)
    assert outcome.steps == 3 and outcome.skipped_steps == 0
    assert all(bit_equal(before[n], after[n]) for n in before)
    if dtype == torch.float32 and block != "embed" and cache_mb == 0:
        assert outcome.metrics["restore_patch_frac"] > 0  # the exact-restore patch was needed


@pytest.mark.parametrize(
    ("rule_name", "block", "layers_per_block", "dtype"),
    [
        ("lezo", "layer.0-3", 4, torch.float32),
        ("mezo", "embed", 1, torch.float32),  # several z chunks a tensor
        ("lezo", "layer.0-3", 4, torch.bfloat16),  # fp32 master path
    ],
)
def test_the_step_cache_trains_the_same_weights_and_log_as_the_sparse_restore(
        batches, rule_name, block, layers_per_block, dtype):
    # Prepare: the same round three times, z drawn three times a step (no cache) and once a
    # step (cache), the cache's units drawn one after another and on three threads at once
    def train(cache_mb: float, threads: int = 1
              ) -> tuple[dict[str, torch.Tensor], Any, int]:
        task = make_task(batches, block, layers_per_block, steps=3, lr=1e-2, weight_decay=0.1,
                         dtype=dtype, **{"lezo-density": 0.5, "zo-step-cache-mb": cache_mb})
        rule = get_rule(rule_name)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            outcome = rule.train(task)
        finally:
            torch.set_num_threads(before)
        return snapshot(task.model), outcome, rule.last_cached_steps

    # Execute
    lean, lean_outcome, lean_drawn = train(0.0)
    cached, cached_outcome, cached_drawn = train(256.0)
    threaded, threaded_outcome, _ = train(256.0, threads=3)

    # Assert: bit for bit the same weights and step log; the cached round drew z up front (its
    # steps are counted) and patched nothing; the other drew none up front
    start = _tiny(dtype).state_dict()
    assert any(not bit_equal(lean[n], start[n]) for n in lean)  # it trained
    assert all(bit_equal(lean[n], cached[n]) for n in lean)
    assert all(bit_equal(lean[n], threaded[n]) for n in lean)
    assert lean_outcome.step_log == cached_outcome.step_log == threaded_outcome.step_log
    assert cached_drawn == 3 and lean_drawn == 0
    assert cached_outcome.metrics["restore_patch_frac"] == 0
    # the reply's metrics keep their keys (z drawing counted in perturb_s)
    assert set(cached_outcome.metrics) == set(lean_outcome.metrics)
    assert "z_s" not in cached_outcome.metrics


def test_a_step_whose_units_exceed_the_cache_takes_the_sparse_restore(batches):
    # Prepare: a cache too small for one layer's z and starting values
    task = make_task(batches, "layer.0-3", 4, steps=2, lr=1e-2, **{"zo-step-cache-mb": 0.01})
    # Execute
    outcome = get_rule("lezo").train(task)
    # Assert: the sparse path ran (elements were patched back), and z was never cached
    assert outcome.steps == 2 and outcome.metrics["restore_patch_frac"] > 0


def test_only_chosen_units_change(batches):
    # Prepare: one LeZO step, half of the 4 layers of block layer.0-3
    task = make_task(batches, "layer.0-3", 4, steps=1, lr=1e-2, weight_decay=0.1,
                     **{"lezo-density": 0.5})
    rule = get_rule("lezo")
    before = snapshot(task.model)
    layout = zeroth_order.unit_layout(task.blocks, "layer.0-3")

    # Execute
    rule.train(task)

    # Assert
    after = snapshot(task.model)
    chosen = rule.last_log.steps[0].units
    assert len(chosen) == 2
    inside = {name for unit in layout for name in unit}
    for name in before:
        if name not in inside:
            assert bit_equal(before[name], after[name]), name
    for index, unit in enumerate(layout):
        for name in unit:
            changed = not torch.equal(before[name], after[name])
            assert changed == (index in chosen), (index, name)


@pytest.mark.parametrize(
    ("rule_name", "block", "layers_per_block", "density", "per_step", "units"),
    [
        ("lezo", "layer.0-3", 4, 0.25, 1, 4),
        ("mezo", "layer.0-3", 4, 0.25, 4, 4),
        ("lezo", "layer.1", 1, 0.25, 3, 9),  # a single layer: its 9 tensors are the units
    ],
)
def test_density_sets_units_per_step(batches, rule_name, block, layers_per_block, density,
                                     per_step, units):
    # Prepare
    task = make_task(batches, block, layers_per_block, steps=3, **{"lezo-density": density})
    rule = get_rule(rule_name)

    # Execute
    outcome = rule.train(task)

    # Assert
    assert rule.last_log.units == units
    assert [len(s.units) for s in rule.last_log.steps] == [per_step] * 3
    assert outcome.metrics["units_per_step"] == per_step
    if per_step < units:  # a fresh draw each step
        assert len({s.units for s in rule.last_log.steps}) > 1 or units == 1


def test_nan_loss_skips_the_step_and_restores(batches, monkeypatch):
    # Prepare: the second forward of the first step returns NaN
    task = make_task(batches, "layer.0-3", 4, steps=1, lr=1e-2, **{"lezo-density": 0.5})
    before = snapshot(task.model)
    real = lezo.perturbed_loss
    calls = iter([None, math.nan])

    def flaky(*args: Any) -> float:
        value = real(*args)
        fake = next(calls, None)
        return value if fake is None else fake

    monkeypatch.setattr(lezo, "perturbed_loss", flaky)
    rule = get_rule("lezo")

    # Execute
    outcome = rule.train(task)

    # Assert
    after = snapshot(task.model)
    assert outcome.skipped_steps == 1 and outcome.steps == 0
    assert rule.last_log.steps == ()
    assert all(bit_equal(before[n], after[n]) for n in before)


def test_a_failing_forward_restores_the_weights(batches, monkeypatch):
    # Prepare
    task = make_task(batches, "layer.2", steps=1, lr=1e-2)
    before = snapshot(task.model)

    def broken(*args: Any) -> float:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(lezo, "perturbed_loss", broken)

    # Execute
    with pytest.raises(RuntimeError):
        get_rule("mezo").train(task)

    # Assert
    after = snapshot(task.model)
    assert all(bit_equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize(
    ("block", "layers_per_block", "dtype"),
    [("layer.0-3", 4, torch.float32), ("layer.1", 1, torch.bfloat16)],
)
def test_replay_reproduces_the_clients_block(batches, block, layers_per_block, dtype):
    # Prepare
    task = make_task(batches, block, layers_per_block, steps=3, lr=1e-2, weight_decay=0.1,
                     dtype=dtype, **{"lezo-density": 0.5})
    start = task.blocks.get(task.model, block)
    rule = get_rule("lezo")

    # Execute
    rule.train(task)
    log = seedlog.decode_seedlog(seedlog.encode_seedlog(rule.last_log))
    replayed = zeroth_order.replay(start, log, zeroth_order.unit_layout(task.blocks, block))

    # Assert
    trained = task.blocks.get(task.model, block)
    assert len(log.steps) == 3
    assert any(not torch.equal(start[n], trained[n]) for n in start)
    assert all(bit_equal(replayed[n], trained[n]) for n in trained)


def test_replay_on_several_threads_gives_the_clients_block(batches):
    # Prepare: a log whose steps each chose two units (of four)
    task = make_task(batches, "layer.0-3", 4, steps=3, lr=1e-2, weight_decay=0.1,
                     **{"lezo-density": 0.5})
    start = task.blocks.get(task.model, "layer.0-3")
    rule = get_rule("lezo")
    rule.train(task)
    layout = zeroth_order.unit_layout(task.blocks, "layer.0-3")

    # Execute: the units of a step replayed side by side on three threads
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        replayed = zeroth_order.replay(start, rule.last_log, layout)
    finally:
        torch.set_num_threads(before)

    # Assert
    trained = task.blocks.get(task.model, "layer.0-3")
    assert all(len(step.units) == 2 for step in rule.last_log.steps)
    assert all(bit_equal(replayed[n], trained[n]) for n in trained)


def test_replay_refuses_other_torch_and_other_starts(batches):
    # Prepare
    task = make_task(batches, "layer.1", steps=1, lr=1e-2)
    start = task.blocks.get(task.model, "layer.1")
    layout = zeroth_order.unit_layout(task.blocks, "layer.1")
    rule = get_rule("lezo")
    rule.train(task)
    log = rule.last_log
    other_torch = zeroth_order.SeedLog(**{**log.__dict__, "torch": "1.0.0"})
    other_z = zeroth_order.SeedLog(**{**log.__dict__, "z": "0" * 16})
    moved = {n: t + 1 for n, t in start.items()}

    # Execute / Assert
    with pytest.raises(zeroth_order.ReplayError, match="torch"):
        zeroth_order.replay(start, other_torch, layout)
    with pytest.raises(zeroth_order.ReplayError, match="fingerprint"):
        zeroth_order.replay(start, other_z, layout)
    with pytest.raises(zeroth_order.ReplayError, match="start"):
        zeroth_order.replay(moved, log, layout)
    with pytest.raises(ValueError, match="layout"):
        zeroth_order.replay(start, log, layout[:-1])


def _sample_log(units: int = 30) -> zeroth_order.SeedLog:
    return zeroth_order.SeedLog(
        block="layer.0-29", units=units, layout="0123456789abcdef", eps=1e-3, weight_decay=0.0,
        torch=torch.__version__, z=zeroth_order.z_fingerprint(), base="a" * 64, result="",
        steps=(
            zeroth_order.SeedStep(2**64 - 1, (0, 7, 29), zeroth_order.to_f32(-1.25),
                                  zeroth_order.to_f32(1e-6)),
            zeroth_order.SeedStep(3, tuple(range(units)), zeroth_order.to_f32(0.5),
                                  zeroth_order.to_f32(1e-6)),
        ),
    )


def test_seedlog_round_trips_and_is_compact():
    # Prepare
    log = _sample_log()

    # Execute
    encoded = seedlog.encode_seedlog(log)

    # Assert
    assert seedlog.decode_seedlog(encoded) == log
    empty = zeroth_order.SeedLog(**{**log.__dict__, "steps": ()})
    assert len(seedlog.encode_seedlog(empty)) + 2 * 20 == len(encoded)  # 8+4+4+4 B per step


def _reframe(encoded: bytes, edit: Any) -> bytes:
    """``encoded`` with its JSON header edited by ``edit`` and the header length fixed."""
    _, _, head_len = struct.unpack_from("<4sHI", encoded)
    header = edit(encoded[10:10 + head_len])
    return encoded[:6] + struct.pack("<I", len(header)) + header + encoded[10 + head_len:]


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b: b"",
        lambda b: b[:5],
        lambda b: b"XXXX" + b[4:],
        lambda b: b[:4] + struct.pack("<H", 9) + b[6:],
        lambda b: b[:6] + struct.pack("<I", 10**6) + b[10:],
        lambda b: b[:-1],
        lambda b: b + b"\x00",
        lambda b: b[:-1] + b"\x80",  # unit 31 of 30
        lambda b: bytes(range(256)),
        lambda b: _reframe(b, lambda h: h.replace(b'"units":30', b'"units":"x"')),
        lambda b: _reframe(b, lambda h: h.replace(b'"units":30', b'"units":true')),
        lambda b: _reframe(b, lambda h: h.replace(b'"eps":0.001', b'"eps":-1.0')),
        lambda b: _reframe(b, lambda h: h.replace(b'"layout":"', b'"layout":"Z')),
        lambda b: _reframe(b, lambda h: h.replace(b'"steps":2', b'"steps":3')),
        lambda b: _reframe(b, lambda h: h.replace(b',"base"', b',"bas"')),
        lambda b: _reframe(b, lambda h: h.replace(b"{", b"[", 1)),
        lambda b: _reframe(b, lambda h: b"\xff" + h),
    ],
)
def test_seedlog_rejects_garbage(mangle):
    # Prepare
    encoded = seedlog.encode_seedlog(_sample_log())
    bad = mangle(encoded)

    # Execute / Assert
    assert bad != encoded
    with pytest.raises(ValueError):
        seedlog.decode_seedlog(bad)


def test_seedlog_refuses_to_encode_non_fp32_values():
    # Prepare
    log = _sample_log()
    step = zeroth_order.SeedStep(1, (0,), 0.1, 1e-6)  # 0.1 is not an fp32 value

    # Execute / Assert
    with pytest.raises(ValueError, match="fp32"):
        seedlog.encode_seedlog(zeroth_order.SeedLog(**{**log.__dict__, "steps": (step,)}))


def test_prefix_layers_run_once_per_step(batches):
    # Prepare: block layer.2 of 4; layers 0-1 are the prefix
    task = make_task(batches, "layer.2", steps=3)
    calls = [0] * 4
    handles = [
        layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, layer in enumerate(task.stack.layers)
    ]

    # Execute
    try:
        outcome = get_rule("lezo").train(task)
    finally:
        for handle in handles:
            handle.remove()

    # Assert
    assert calls == [3, 3, 6, 6]
    assert outcome.metrics["prefix_s"] > 0 and outcome.metrics["zo_forward_s"] > 0


def test_prefix_extends_to_the_lowest_chosen_layer(batches):
    # Prepare: block layer.0-3 of 4, one layer perturbed per step
    task = make_task(batches, "layer.0-3", 4, steps=4, **{"lezo-density": 0.25})
    rule = get_rule("lezo")
    calls = [0] * 4
    handles = [
        layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, layer in enumerate(task.stack.layers)
    ]

    # Execute
    try:
        rule.train(task)
    finally:
        for handle in handles:
            handle.remove()

    # Assert: a layer runs twice in a step iff it is at or above that step's chosen layer
    lowest = [step.units[0] for step in rule.last_log.steps]
    assert calls == [sum(1 + (i >= low) for low in lowest) for i in range(4)]
    assert len(set(lowest)) > 1


def test_options_are_validated(batches):
    # Prepare
    bad = make_task(batches, "layer.1", **{"lezo-density": 0.0})
    mezo_task = make_task(batches, "layer.1", steps=1, **{"lezo-density": 0.0})
    rule = get_rule("mezo")

    # Execute / Assert
    with pytest.raises(ValueError, match="lezo-density"):
        get_rule("lezo").train(bad)
    rule.train(mezo_task)  # MeZO ignores lezo-density
    assert len(rule.last_log.steps[0].units) == 9


def test_z_is_the_same_with_or_without_a_reused_buffer():
    # Prepare
    numels = [5, zeroth_order.Z_CHUNK + 17, 300]
    buffer = torch.empty(zeroth_order.Z_CHUNK)

    # Execute
    fresh = [z.clone() for _, _, z in zeroth_order.unit_z_chunks(11, numels)]
    reused = [z.clone() for _, _, z in zeroth_order.unit_z_chunks(11, numels, out=buffer)]
    whole = zeroth_order.unit_z(11, [(n,) for n in numels])

    into = zeroth_order.unit_z_into(11, numels, torch.empty(sum(numels)))

    # Assert
    assert [z.numel() for z in fresh] == [5, zeroth_order.Z_CHUNK, 17, 300]
    assert all(torch.equal(a, b) for a, b in zip(fresh, reused, strict=True))
    assert torch.equal(torch.cat(fresh), torch.cat([z.reshape(-1) for z in whole]))
    assert torch.equal(torch.cat(fresh), into)
    with pytest.raises(ValueError, match="flat CPU fp32"):
        zeroth_order.unit_z_into(11, numels, torch.empty(sum(numels) - 1))
