"""ZeroLock's calibrated local head and auxiliary layers on the 4-layer tied tiny Llama."""

from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fedcybgd.client.updates import TrainOutcome, TrainTask, get_rule
from fedcybgd.client.updates.calibration import (
    EMBEDDINGS,
    calibration_path,
    collect_rows,
    fit_least_squares,
    lens_kl,
    moved,
    weight_sketch,
)
from fedcybgd.client.updates.local_heads import LocalHead
from fedcybgd.data.prompts import Batch
from fedcybgd.memory.estimate import ModelShape, estimate_peak_mb
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_model, load_tokenizer
from fedcybgd.tasks import shares
from fedcybgd.tasks.objective import label_loss


@pytest.fixture(scope="module")
def base_model() -> Any:
    return load_model("tiny-llama")


@pytest.fixture(scope="module")
def frame() -> Any:
    return shares.load_split("rotten-tomatoes", "train").iloc[:64]


@pytest.fixture(scope="module")
def batch_list(frame: Any) -> list[Batch]:
    return list(itertools.islice(shares.batches(frame, load_tokenizer("tiny-llama"), 4, 32, seed=0),
                                 8))


@pytest.fixture
def model(base_model: Any) -> Any:
    return copy.deepcopy(base_model)


def make_task(model: Any, block: str, batches: Any, state_dir: Path | None, steps: int = 2,
              **options: Any) -> TrainTask:
    return TrainTask(model=model, stack=LayerStack(model), blocks=BlockMap(model, 1),
                     block=block, batches=batches, steps=steps, lr=1e-2, weight_decay=0.0,
                     seed=3, state_dir=state_dir,
                     options={f"zerolock-{k.replace('_', '-')}": v for k, v in options.items()})


def train(task: TrainTask) -> TrainOutcome:
    return get_rule("zerolock").train(task)


def true_loss(model: Any, batch: Batch) -> float:
    with torch.no_grad():
        logits = LayerStack(model).forward_logits(batch.input_ids, batch.attention_mask,
                                                  batch.last_index)
        return float(label_loss(logits, batch))


def test_least_squares_recovers_an_affine_map():
    # Prepare: rows whose targets are an exact affine image of the sources
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400, 16, generator=gen)
    a = torch.eye(16) + 0.3 * torch.randn(16, 16, generator=gen)
    b = torch.randn(16, generator=gen)
    y = x @ a + b
    # Execute
    translator = fit_least_squares(x, y, ridge=1e-8)
    same = fit_least_squares(x, x, ridge=1e-2)
    # Assert: the map, and the identity for a layer mapped onto itself
    with torch.no_grad():
        assert torch.allclose(translator(x), y, atol=1e-3)
        assert torch.allclose(same(x), x, atol=1e-4)
    with pytest.raises(ValueError, match="ridge must be > 0"):
        fit_least_squares(x, y, ridge=0.0)
    with pytest.raises(ValueError, match="must be \\[N, H\\] alike"):
        fit_least_squares(x, y[:, :8])


def test_calibration_brings_the_lens_closer_to_the_final_layer(model, batch_list):
    # Prepare: fit on four batches, judge on four others
    stack = LayerStack(model)
    fit = collect_rows(stack, batch_list[:4], [0, EMBEDDINGS])
    held = collect_rows(stack, batch_list[4:], [0, EMBEDDINGS])
    # Execute
    for layer in (0, EMBEDDINGS):
        translator = fit_least_squares(fit.sources[layer], fit.target)
        before = lens_kl(stack, None, held.sources[layer], held.target)
        after = lens_kl(stack, translator, held.sources[layer], held.target)
        # Assert: the logit lens of a random tiny model is far off; the calibrated one less so
        assert after < 0.7 * before, (layer, before, after)


def test_calibrated_head_is_fitted_once_then_reused_until_the_layers_above_move(
        model, frame, tmp_path):
    # Prepare
    tokenizer = load_tokenizer("tiny-llama")

    def round_batches(step: int = 0) -> Any:
        return shares.batches(frame, tokenizer, 4, 32, seed=5, start_step=step)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Execute: round 1 fits; round 2 (nothing moved above) reuses; then layer 2 moves
    batches = round_batches()
    first = train(make_task(model, "layer.0", batches, tmp_path, head="calibrated"))
    step_after = batches.step
    second = train(make_task(model, "layer.0", round_batches(), tmp_path, head="calibrated"))
    with torch.no_grad():
        for p in LayerStack(model).layers[2].parameters():
            p.mul_(1.5)
    third = train(make_task(model, "layer.0", round_batches(), tmp_path, head="calibrated",
                            calib_refit=0.05))
    # Assert
    assert calibration_path(tmp_path, 0).is_file()
    assert first.metrics["zerolock_calib_fitted"] == 1
    assert first.metrics["zerolock_calib_kl"] < first.metrics["zerolock_calib_kl_lens"]
    assert second.metrics["zerolock_calib_fitted"] == 0
    # nothing fitted, no KL measured: no NaN metric (the server drops an upload carrying one)
    assert "zerolock_calib_kl" not in second.metrics
    assert all(math.isfinite(v) for v in second.metrics.values())
    assert second.metrics["zerolock_calib_moved"] == pytest.approx(0.0, abs=1e-6)
    assert third.metrics["zerolock_calib_fitted"] == 1
    assert third.metrics["zerolock_calib_moved"] > 0.05
    # the fit peeked at the round's batches and put them back: training took its 2 steps
    assert step_after == 2 and first.steps == 2 and first.examples == 8
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all(n.startswith("model.layers.0.") or n.startswith("model.layers.2.")
                           for n in changed)


def test_calibrated_head_trains_on_every_batch_of_a_plain_iterator(model, batch_list):
    # Execute: a plain iterator cannot be rewound; the peeked batches are trained on first
    fed = iter(batch_list)
    outcome = train(make_task(model, "layer.1", fed, None, steps=3, head="calibrated",
                              calib_batches=2))
    # Assert: two peeked for the fit, three trained on (the two peeked among them)
    assert outcome.steps == 3 and outcome.examples == 12
    assert next(fed) is batch_list[3]


def test_calibrated_head_on_the_last_layer_is_the_true_loss(model, batch_list):
    # Prepare
    expected = true_loss(model, batch_list[0])
    # Execute
    outcome = train(make_task(model, "layer.3", iter(batch_list), None, steps=1,
                              head="calibrated"))
    # Assert: no translator there (the loss is taken before the step)
    assert outcome.loss == pytest.approx(expected, rel=1e-6)
    assert outcome.metrics["zerolock_calib_fitted"] == 0


def test_unreadable_calibration_is_refitted(model, batch_list, tmp_path):
    # Prepare
    path = calibration_path(tmp_path, 1)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a safetensors file")
    # Execute
    outcome = train(make_task(model, "layer.1", iter(batch_list), tmp_path, head="calibrated"))
    # Assert
    assert outcome.metrics["zerolock_calib_fitted"] == 1
    assert path.stat().st_size > 100


def test_aux_layers_reaching_the_top_give_the_true_loss(model, batch_list):
    # Prepare: layer.1 with two frozen layers above (2, 3): its head reads the last layer
    expected = true_loss(model, batch_list[0])
    stack = LayerStack(model)
    calls = [0] * stack.num_layers
    for i, layer in enumerate(stack.layers):
        layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Execute
    outcome = train(make_task(model, "layer.1", iter(batch_list), None, steps=1,
                              aux_layers=5))  # capped at the two layers there are
    # Assert: the true loss; layers 2 and 3 ran but did not change
    assert outcome.loss == pytest.approx(expected, rel=1e-6)
    assert calls[2] == calls[3] == 1
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all(n.startswith("model.layers.1.") for n in changed)


def test_aux_layers_head_matches_a_local_head_run_by_hand(model, batch_list):
    # Prepare: layer.0's head through frozen layer 1
    stack = LayerStack(model)
    batch = batch_list[0]
    with torch.no_grad():
        out = stack.run(stack.embed(batch.input_ids, batch.attention_mask), 0, 1)
        expected = LocalHead(stack, aux_layers=1, aux_start=1).loss(out, batch)
        lens = LocalHead(stack).loss(out, batch)
    # Execute
    outcome = train(make_task(model, "layer.0", iter(batch_list), None, steps=1, aux_layers=1))
    # Assert
    assert outcome.loss == pytest.approx(float(expected), rel=1e-6)
    assert outcome.loss != pytest.approx(float(lens), rel=1e-3)


def test_memory_estimate_counts_the_aux_layers(model):
    # Prepare
    blocks = BlockMap(model, 1)
    shape = ModelShape.of(model, blocks)

    def estimate(**options: Any) -> float:
        return estimate_peak_mb(shape, blocks, "zerolock", "layer.0", 8, 64,
                                options={f"zerolock-{k}": v for k, v in options.items()})

    # Assert: more aux layers, more memory, up to the layers there are above the block
    assert estimate() < estimate(**{"aux-layers": 1}) < estimate(**{"aux-layers": 3})
    assert estimate(**{"aux-layers": 3}) == estimate(**{"aux-layers": 30})


def test_sketch_moves_with_the_layers_above_only(model):
    # Prepare
    stack = LayerStack(model)
    then = weight_sketch(stack, 2)
    # Execute
    with torch.no_grad():
        for p in stack.layers[1].parameters():
            p.add_(1.0)  # below: not in the sketch
    same = weight_sketch(stack, 2)
    with torch.no_grad():
        for p in stack.layers[3].parameters():
            p.mul_(1.1)
    now = weight_sketch(stack, 2)
    # Assert
    assert moved(then, same) == 0.0
    assert 0.0 < moved(then, now) < 0.1
    assert moved(then, now[:-1]) == float("inf")
