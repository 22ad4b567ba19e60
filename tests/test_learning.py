"""The learning controls: server step, parallel damping, client lr schedule, spread schedule."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedcybgd import protocol
from fedcybgd.blocks import BlockMap
from fedcybgd.checksum import content_checksum
from fedcybgd.client.app import app as client_app
from fedcybgd.compression import decode
from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.faults import upload_of
from fedcybgd.loopback import LoopbackGrid
from fedcybgd.models import load_model
from fedcybgd.server.app import Evaluator, build_strategy
from fedcybgd.strategies.lr_schedule import FLOOR, build_lr_schedule
from fedcybgd.strategies.schedule import BlockSchedule
from fedcybgd.strategies.server_step import ServerStep, damping_factor


def test_step_of_one_installs_the_merged_block_itself():
    merged = {"w": torch.randn(4)}
    assert ServerStep().apply({"w": torch.zeros(4)}, merged, parallel=4) is merged


@pytest.mark.parametrize(("kind", "k", "factor"), [("none", 4, 1.0), ("inverse", 4, 0.25),
                                                   ("inverse-sqrt", 4, 0.5), ("inverse", 1, 1.0)])
def test_damping_factor(kind, k, factor):
    assert damping_factor(kind, k) == factor


def test_server_step_moves_a_share_of_the_way():
    start, merged = {"w": torch.zeros(3)}, {"w": torch.tensor([4.0, -8.0, 2.0])}
    out = ServerStep(server_lr=0.5, damping="inverse").apply(start, merged, parallel=2)
    assert torch.equal(out["w"], torch.tensor([1.0, -2.0, 0.5]))


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cosine = build_lr_schedule("cosine", 1e-4, num_rounds=10, warmup_rounds=2)
    assert cosine(1) == pytest.approx(1e-4 / 3) and cosine(2) == pytest.approx(2e-4 / 3)
    assert cosine(3) == pytest.approx(1e-4)
    assert cosine(10) == pytest.approx(FLOOR * 1e-4)
    assert all(cosine(r) >= cosine(r + 1) for r in range(3, 10))
    linear = build_lr_schedule("linear", 1.0, num_rounds=5)
    assert [linear(r) for r in (1, 3, 5)] == pytest.approx([1.0, 0.55, FLOOR])
    assert build_lr_schedule("constant", 2.0, 5)(4) == 2.0


def test_spread_schedule_covers_every_block_each_cycle_and_keeps_neighbours_apart():
    blocks = [f"layer.{i}" for i in range(8)]
    schedule = BlockSchedule(blocks, "spread")
    rounds = [schedule.take(2) for _ in range(8)]
    for cycle in range(2):
        seen = [b for r in rounds[4 * cycle:4 * cycle + 4] for b in r]
        assert sorted(seen) == sorted(blocks)
    for pair in rounds:
        a, b = (int(x.split(".")[1]) for x in pair)
        assert abs(a - b) > 1, rounds


def setup(config, tmp_path, nodes=2):
    run = RunConfig.from_run_config(config)
    grid = LoopbackGrid(client_app, nodes, config,
                        node_config=lambda i: {"cache-dir": str(tmp_path / "cache")})
    model = load_model(run.model)
    weights = dict(model.named_parameters())
    strategy = build_strategy(run, BlockMap(model, run.layers_per_block), weights, "learn",
                              content_checksum(weights))
    return grid, strategy


def test_server_lr_and_damping_through_the_strategy(tiny_run_config, tmp_path):
    # Prepare: two blocks in parallel, exact uploads, server-lr 0.5 with 1/k damping
    config = dict(tiny_run_config, **{"upload-codec": "fp32", "server-lr": 0.5,
                                      "parallel-damping": "inverse"})
    grid, strategy = setup(config, tmp_path)
    starts = {}
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    replies = list(grid.send_and_receive(messages))
    uploads = {}
    for reply in replies:
        block, payload = upload_of(reply)
        starts[block] = {k: v.detach().clone() for k, v in strategy.block_tensors(block).items()}
        uploads[block] = decode(payload, max_bytes=len(payload)).tensors
    # Execute
    strategy.aggregate_train(1, replies)
    # Assert: each block moved a quarter of its client's update
    for block, trained in uploads.items():
        for name, value in trained.items():
            expected = starts[block][name] + 0.25 * (value - starts[block][name])
            assert torch.allclose(strategy.weights[name].detach(), expected, atol=1e-7)


def test_client_lr_follows_the_server_schedule(tiny_run_config, tmp_path):
    config = dict(tiny_run_config, **{"lr-schedule": "linear", "num-server-rounds": 3,
                                      "lr": 1e-3})
    grid, strategy = setup(config, tmp_path)
    rates = []
    for server_round in (1, 2, 3):
        messages = list(strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(),
                                                 grid))
        rates.append(messages[0].content[protocol.CONFIG][protocol.LR])
        strategy.aggregate_train(server_round, grid.send_and_receive(messages))
        assert not strategy.history[-1].failed_blocks
    assert rates == pytest.approx([1e-3, 0.55e-3, 0.1e-3])


def test_bad_learning_keys_are_refused():
    for key, value in (("server-lr", 0.0), ("server-lr", math.inf), ("parallel-damping", "x"),
                       ("lr-schedule", "step"), ("warmup-rounds", -1), ("eval-split", "train")):
        with pytest.raises(ConfigError, match=key):
            RunConfig.from_run_config({key: value})


def test_eval_split_validation_reads_the_validation_rows(tiny_run_config):
    run = RunConfig.from_run_config(dict(tiny_run_config, **{"eval-split": "validation"}))
    test = RunConfig.from_run_config(tiny_run_config)
    model = load_model(run.model)
    from fedcybgd.layerwise import LayerStack
    stack = LayerStack(model)
    assert not set(Evaluator(run, stack).frame["text"]) & set(Evaluator(test, stack).frame["text"])
