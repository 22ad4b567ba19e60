"""Example-level differential privacy (``dp = "example"``): DP-SGD on the node's block, the
Poisson-sampled batches it needs, the node's own ledger and budget, and a run that ends when the
nodes' budgets are spent."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from fedcybgd.client.privacy import LedgerError, NodeLedger, round_entry
from fedcybgd.client.updates.fo import block_loss, private_gradients
from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_model, load_tokenizer
from fedcybgd.protocol.dp import epsilon_of
from fedcybgd.rules import ExampleDp
from fedcybgd.tasks import shares

EXAMPLE_DP = {"dp": "example", "class-balance": False, "logit-adjust": False,
              "class-prior": "uniform"}


@pytest.fixture(scope="module")
def tiny() -> tuple[LayerStack, BlockMap, list[torch.nn.Parameter]]:
    model = load_model("tiny-llama").eval()
    for p in model.parameters():
        p.requires_grad_(False)
    blocks = BlockMap(model, 1)
    params = blocks.parameters(model, "layer.1")
    for p in params:
        p.requires_grad_(True)
    return LayerStack(model), blocks, params


@pytest.fixture(scope="module")
def frame():
    return shares.load_split("rotten-tomatoes", "train").iloc[:40]


@pytest.fixture(scope="module")
def batch(frame):
    stream = shares.batches(frame, load_tokenizer("tiny-llama"), 6, 32, seed=0)
    return next(stream)


def _grads(loss, params):
    return torch.autograd.grad(loss, params)


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


# -------------------------------------------------------------------------------- batches


def test_a_row_of_a_batch_is_scored_as_in_the_batch(tiny, batch):
    stack, _, _ = tiny
    with torch.no_grad():
        whole = float(block_loss(stack, batch, 1))
        rows = [float(block_loss(stack, batch.row(i), 1)) for i in range(len(batch))]
    # classification scores one position a row: the batch's loss is the mean of its rows'
    assert whole == pytest.approx(sum(rows) / len(rows), rel=1e-5)
    with pytest.raises(IndexError):
        batch.row(len(batch))


def test_poisson_batches_sample_each_row_at_the_rate_and_are_seeded(frame):
    tokenizer = load_tokenizer("tiny-llama")
    draws = shares.PoissonBatches(frame, tokenizer, 4, 32, seed=7)
    again = shares.PoissonBatches(frame, tokenizer, 4, 32, seed=7)
    other = shares.PoissonBatches(frame, tokenizer, 4, 32, seed=8)
    assert draws.rate == pytest.approx(4 / 40)
    sizes = [len(next(draws)) for _ in range(300)]
    # the sizes vary, empty samples happen, and the mean is the expected batch
    assert len(set(sizes)) > 3 and 0 in sizes
    assert sum(sizes) / len(sizes) == pytest.approx(4.0, rel=0.15)
    first = [next(again).input_ids.tolist() for _ in range(5)]
    assert first != [next(other).input_ids.tolist() for _ in range(5)]
    replay = shares.PoissonBatches(frame, tokenizer, 4, 32, seed=7)
    assert first == [next(replay).input_ids.tolist() for _ in range(5)]
    # a node with fewer rows than the batch takes every row every step (no amplification)
    assert shares.PoissonBatches(frame.iloc[:3], tokenizer, 4, 32, seed=0).rate == 1.0


# -------------------------------------------------------------------------------- DP-SGD


def test_without_clipping_or_noise_dp_sgd_is_the_batch_gradient(tiny, batch):
    stack, _, params = tiny
    privacy = ExampleDp(clip=1e9, noise_multiplier=1e-30, expected_batch=len(batch), seed=0)
    got, losses = private_gradients(stack, batch, 1, None, params, privacy,
                                    torch.Generator().manual_seed(0))
    want = _grads(block_loss(stack, batch, 1), params)
    assert len(losses) == len(batch)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4 * float(w.abs().max()))


def test_each_example_moves_the_step_by_at_most_the_clip(tiny, batch):
    stack, _, params = tiny
    clip = 1e-3
    # every example's gradient is far above the clip, so each is cut to it exactly
    sizes = [_norm(_grads(block_loss(stack, batch.row(i), 1), params)) for i in range(len(batch))]
    assert min(sizes) > 10 * clip
    privacy = ExampleDp(clip=clip, noise_multiplier=1e-30, expected_batch=1.0, seed=0)
    got, _ = private_gradients(stack, batch, 1, None, params, privacy,
                               torch.Generator().manual_seed(0))
    assert _norm(got) <= len(batch) * clip * (1 + 1e-5)
    # replacing one example changes the sum by at most twice the clip
    swapped = batch.row(0)
    alone, _ = private_gradients(stack, swapped, 1, None, params, privacy,
                                 torch.Generator().manual_seed(0))
    assert _norm(alone) == pytest.approx(clip, rel=1e-4)


def test_the_noise_has_the_asked_scale(tiny):
    stack, _, params = tiny
    privacy = ExampleDp(clip=0.5, noise_multiplier=2.0, expected_batch=4.0, seed=0)
    got, losses = private_gradients(stack, shares.empty_batch(), 1, None, params, privacy,
                                    torch.Generator().manual_seed(3))
    flat = torch.cat([g.flatten() for g in got])
    # an empty sample: the step is the noise alone, z x clip / expected batch a coordinate
    assert losses == [] and flat.numel() > 10_000
    assert float(flat.std()) == pytest.approx(2.0 * 0.5 / 4.0, rel=0.03)
    assert abs(float(flat.mean())) < 4 * 0.25 / math.sqrt(flat.numel())


# -------------------------------------------------------------------------------- ledger


def test_the_ledger_accounts_steps_and_refuses_beyond_either_budget(tmp_path):
    ledger = NodeLedger.open(tmp_path, "site-a")
    entry = round_entry(0.05, 1.0, 10)
    assert ledger.spent(1e-5) == 0.0
    ledger.record("run-1", entry)
    one = epsilon_of([entry], 1e-5)
    assert ledger.spent(1e-5, "run-1") == pytest.approx(one)
    # the file is what the next round reads (each round builds a new client app)
    reopened = NodeLedger.open(tmp_path, "site-a")
    two = epsilon_of([entry, entry], 1e-5)
    assert reopened.check("run-1", entry, 1e-5, run_budget=two * 1.01, node_budget=0) == \
        (None, pytest.approx(two))
    why, _ = reopened.check("run-1", entry, 1e-5, run_budget=two * 0.99, node_budget=0)
    assert why is not None and why.startswith("privacy budget") and "dp-target-epsilon" in why
    # a new lineage starts the run's account afresh but not the node's own
    assert reopened.check("run-2", entry, 1e-5, 0, node_budget=two * 1.01)[0] is None
    why, _ = reopened.check("run-2", entry, 1e-5, 0, node_budget=two * 0.99)
    assert why is not None and "max-dp-epsilon" in why


def test_an_unreadable_ledger_stops_training(tmp_path):
    (tmp_path / "dp-ledger-n1.json").write_text("{not json")
    with pytest.raises(LedgerError, match="cannot know what it has spent"):
        NodeLedger.open(tmp_path, "n1")
    (tmp_path / "dp-ledger-n2.json").write_text(json.dumps({"runs": {"r": [[2.0, 1.0, 5]]}}))
    with pytest.raises(LedgerError, match="impossible entry"):
        NodeLedger.open(tmp_path, "n2")


# -------------------------------------------------------------------------------- config


@pytest.mark.parametrize(("overrides", "fragment"), [
    ({"class-balance": True}, "set class-balance = false"),
    ({"logit-adjust": True}, "set logit-adjust = false"),
    ({"class-prior": "global"}, "class counts in the clear"),
    ({"update-rule": "zerolock"}, "does not run DP-SGD"),
    ({"dp-noise-multiplier": 0.0}, "adds no noise"),
])
def test_example_dp_settings_that_would_not_be_private_are_refused(overrides, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        RunConfig.from_run_config({**EXAMPLE_DP, **overrides})
    assert RunConfig.from_run_config(EXAMPLE_DP).dp == "example"


# -------------------------------------------------------------------------------- a run


@pytest.mark.slow
def test_a_run_ends_cleanly_when_the_nodes_budgets_are_spent(tiny_run_config, tmp_path):
    from fedcybgd.client.app import app as client_app
    from fedcybgd.harness.loopback import LoopbackGrid
    from fedcybgd.server.app import run_server

    # Prepare: 4 nodes, 2 a round; a budget one round of 2 steps fits in and two do not (at
    # the nodes' sampling rates, 4 of over 1000 rows)
    config = {**tiny_run_config, **EXAMPLE_DP, "num-server-rounds": 6, "clients-per-round": 2,
              "clients-per-block": 0, "batch-size": 4, "dp-noise-multiplier": 1.0,
              "dp-clip-norm": 1.0, "dp-target-epsilon": 0.6663, "eval-every": 0}
    grid = LoopbackGrid(client_app, 4, config,
                        node_config=lambda i: {"cache-dir": str(tmp_path / f"cache-{i}")})
    # Execute
    summary = run_server(grid, RunConfig.from_run_config(config), node_wait_s=5)
    # Assert: the nodes that trained declined a second round; the run completed, saying why
    out = Path(config["output-dir"])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert summary["status"] == "completed"
    assert summary["dp_stop"] and "privacy budget spent" in summary["dp_stop"]
    assert 0 < summary["dp_epsilon"] <= 0.6663
    assert len(rows) < 6 and rows[0]["accepted"]
    spent = [r["dp_epsilon"] for r in rows]
    assert spent == sorted(spent)
    ledgers = list(tmp_path.glob("cache-*/privacy/dp-ledger-*.json"))
    assert ledgers, "every node that trained keeps its own ledger"
    for path in ledgers:
        runs = json.loads(path.read_text())["runs"]
        assert all(len(entries) == 1 for entries in runs.values())  # one round each, no more
        assert epsilon_of([tuple(e) for e in next(iter(runs.values()))], 1e-5) <= 0.6663


# ------------------------------------------------------------------ zeroth order (lezo, mezo)


def test_zeroth_order_rows_are_clipped_and_the_scalar_noised():
    from fedcybgd.client.updates.lezo import private_projection

    quiet = ExampleDp(clip=0.5, noise_multiplier=1e-30, expected_batch=4.0, seed=0)
    generator = torch.Generator().manual_seed(0)
    # rows' projected gradients: 100 (clipped to 0.5), -0.2, not finite (dropped), 0.1
    plus, minus = [1.2, 1.0, math.inf, 1.0001], [1.0, 1.0004, 1.0, 0.9999]
    g, loss = private_projection(plus, minus, 1e-3, quiet, generator)
    assert g == pytest.approx((0.5 - 0.2 + 0.1) / 4.0, rel=1e-6)
    assert loss == pytest.approx((1.1 + 1.0002 + 1.0) / 3)
    noisy = ExampleDp(clip=0.5, noise_multiplier=2.0, expected_batch=4.0, seed=0)
    draws = [private_projection([], [], 1e-3, noisy, generator)[0] for _ in range(4000)]
    assert float(torch.tensor(draws).std()) == pytest.approx(2.0 * 0.5 / 4.0, rel=0.05)


@pytest.mark.parametrize("rule", ["lezo", "mezo"])
def test_a_private_zeroth_order_round_replays_exactly_from_its_step_log(rule, frame):
    from fedcybgd.client.updates import TrainTask, get_rule
    from fedcybgd.protocol import seedlog, zeroth_order

    model = load_model("tiny-llama").eval()
    blocks = BlockMap(model, 1)
    stream = shares.PoissonBatches(frame, load_tokenizer("tiny-llama"), 4, 32, seed=11)
    task = TrainTask(model=model, stack=LayerStack(model), blocks=blocks, block="layer.2",
                     batches=stream, steps=4, lr=1e-2, weight_decay=0.0, seed=7,
                     options={"zo-eps": 1e-3},
                     privacy=ExampleDp(clip=1.0, noise_multiplier=1.0, expected_batch=4.0,
                                       seed=5))
    start = blocks.get(model, "layer.2")
    implementation = get_rule(rule)
    outcome = implementation.train(task)
    log = seedlog.decode_seedlog(seedlog.encode_seedlog(implementation.last_log))
    replayed = zeroth_order.replay(start, log, zeroth_order.unit_layout(blocks, "layer.2"))
    trained = blocks.get(model, "layer.2")
    # every step is applied (an empty sample's step is noise alone) and the server rebuilds
    # the block bit for bit from the released scalars
    assert outcome.steps == 4 and len(log.steps) == 4
    assert all(torch.equal(replayed[n], trained[n]) for n in trained)
    assert any(not torch.equal(start[n], trained[n]) for n in start)
