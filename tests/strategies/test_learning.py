"""The learning controls: server step, parallel damping, client lr schedule, spread schedule."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedcybgd import protocol
from fedcybgd.client.app import app as client_app
from fedcybgd.compression import decode
from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.core.checksum import content_checksum
from fedcybgd.harness.faults import upload_of
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.loading import load_model
from fedcybgd.server.app import Evaluator, build_strategy
from fedcybgd.strategies.lr_schedule import FLOOR, build_lr_schedule
from fedcybgd.strategies.schedule import BlockSchedule
from fedcybgd.strategies.server_step import ServerStep, damping_factor


def test_step_of_one_installs_the_merged_block_itself():
    merged = {"w": torch.randn(4)}
    out = ServerStep().apply({"w": torch.zeros(4)}, merged, parallel=4)
    assert out.keys() == merged.keys() and all(out[k] is merged[k] for k in merged)  # no copy


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
    from fedcybgd.model.layerwise import LayerStack
    stack = LayerStack(model)
    assert not set(Evaluator(run, stack).frame["text"]) & set(Evaluator(test, stack).frame["text"])


# ------------------------------------------------------------------------- server optimizer

def test_server_momentum_carries_a_blocks_past_updates_into_its_next_visit():
    # Prepare: heavy-ball momentum 0.5 at server-lr 1
    step = ServerStep(optimizer="momentum", beta1=0.5)
    start = {"w": torch.zeros(2)}
    # Execute: two visits of block "b" with updates d1 and d2; another block in between
    first = step.apply(start, {"w": torch.tensor([2.0, -2.0])}, parallel=1, block="b")
    step.apply({"w": torch.zeros(2)}, {"w": torch.ones(2)}, parallel=1, block="other")
    second = step.apply(first, {"w": first["w"] + torch.tensor([1.0, 1.0])}, parallel=1,
                        block="b")
    # Assert: the second step is d2 + 0.5 d1, each block with its own momentum
    assert torch.equal(first["w"], torch.tensor([2.0, -2.0]))
    assert torch.equal(second["w"] - first["w"], torch.tensor([2.0, 0.0]))


def test_server_adam_steps_each_coordinate_by_the_server_lr_at_first():
    # Prepare: Adam, step 1e-3 per coordinate; updates of very different sizes
    step = ServerStep(server_lr=1e-3, optimizer="adam", beta1=0.9, beta2=0.99, eps=1e-12)
    start = {"w": torch.zeros(3)}
    # Execute
    out = step.apply(start, {"w": torch.tensor([1e-6, -5.0, 0.0])}, parallel=1, block="b")
    # Assert: bias-corrected first step is lr * sign(update); a zero update does not move
    assert torch.allclose(out["w"], torch.tensor([1e-3, -1e-3, 0.0]), atol=1e-9)
    assert step.steps == {"b": 1} and set(step.moments["b"]) == {"m", "v"}


def test_a_step_that_is_not_installed_leaves_the_optimizer_state_alone():
    # Prepare: momentum with state on block "b"
    step = ServerStep(optimizer="momentum")
    step.apply({"w": torch.zeros(2)}, {"w": torch.ones(2)}, parallel=1, block="b")
    before = step.moments["b"]["m"]["w"].clone()
    # Execute: a proposal whose result overflows fp16, through merge_block
    from fedcybgd.strategies.server_step import merge_block
    start = {"w": torch.zeros(2, dtype=torch.float16)}
    out = merge_block(lambda ups: ups[0][1], step, "b", start,
                      [(1.0, {"w": torch.full((2,), 1e6)})], parallel=1)
    # Assert: nothing to install and the state is what it was
    assert out is None
    assert torch.equal(step.moments["b"]["m"]["w"], before)


def test_server_adam_state_is_checkpointed_and_resumed(tiny_run_config, tmp_path):
    # Prepare: a 3-round Adam run straight, and the same run stopped after round 2; every
    # block is trained twice, so round 3 reads the moments of round 1
    from fedcybgd.server.app import run_server
    adam = {"server-optimizer": "adam", "server-lr": 1e-3, "num-server-rounds": 3,
            "upload-codec": "fp32"}
    straight = dict(tiny_run_config, **adam, **{"output-dir": str(tmp_path / "straight")})
    stopped = dict(straight, **{"output-dir": str(tmp_path / "stopped"),
                                "num-server-rounds": 2})

    def run(config, cache):
        grid = LoopbackGrid(client_app, 4, config,
                            node_config=lambda i: {"cache-dir": str(tmp_path / cache)})
        return run_server(grid, RunConfig.from_run_config(config))

    run(straight, "a")
    run(stopped, "b")
    saved = {p.name.split("@")[0] for p in (tmp_path / "stopped" / "checkpoint").iterdir()}
    # Execute
    run(dict(stopped, **{"num-server-rounds": 3, "resume": True}), "b")
    # Assert: the moments were saved, and the resumed model is the uninterrupted one
    assert any(name.startswith("server-opt.") for name in saved), saved
    a = load_model(str(tmp_path / "straight" / "final"))
    b = load_model(str(tmp_path / "stopped" / "final"))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-7), name


def test_bad_server_optimizer_keys_are_refused():
    for key, value in (("server-optimizer", "lamb"), ("server-beta1", 1.0),
                       ("server-beta2", -0.1), ("server-eps", 0.0)):
        with pytest.raises(ConfigError, match=key):
            RunConfig.from_run_config({key: value})


# ---------------------------------------------------------------------- logit adjustment

def test_local_log_prior_is_zero_when_balanced_and_suppresses_a_missing_class():
    from fedcybgd.tasks.shares import local_log_prior
    assert torch.allclose(local_log_prior([0, 1, 1, 0], 2), torch.zeros(2))
    skewed = local_log_prior([1] * 98, 2)  # shares (1/100, 99/100)
    assert torch.allclose(skewed, torch.log(torch.tensor([0.02, 1.98])))


def test_logit_adjustment_shifts_only_the_class_logits_of_the_training_loss():
    # Prepare: a 2-class batch over a 6-token vocabulary, a prior favouring class 1
    from fedcybgd.data.prompts import Batch
    from fedcybgd.tasks.objective import adjusted, label_loss
    classes = torch.tensor([2, 4])
    plain = Batch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                  torch.tensor([2, 2]), classes[torch.tensor([0, 1])], torch.tensor([0, 1]),
                  classes)
    prior = torch.tensor([-1.0, 0.5])
    skewed = Batch(**{**plain.__dict__, "class_log_prior": prior})
    logits = torch.randn(2, 6)
    # Execute
    shifted = adjusted(logits, skewed)
    # Assert: class columns move by the prior, the rest and a prior-free batch do not
    assert torch.equal(shifted[:, [0, 1, 3, 5]], logits[:, [0, 1, 3, 5]])
    assert torch.allclose(shifted[:, classes] - logits[:, classes], prior.expand(2, 2))
    assert torch.equal(adjusted(logits, plain), logits)
    assert label_loss(logits, skewed) != label_loss(logits, plain)


def test_adjusted_loss_of_a_one_label_client_does_not_favour_its_label_word():
    # Prepare: a client whose every example is class 0 (prior log(2 x 0.99) vs log(2 x 0.01)),
    # over a vocabulary where the two class tokens start with equal logits
    from fedcybgd.data.prompts import Batch
    from fedcybgd.tasks.objective import label_loss
    classes = torch.tensor([2, 4])
    prior = torch.log(2 * torch.tensor([0.99, 0.01]))
    batch = Batch(torch.zeros(3, 3, dtype=torch.long), torch.ones(3, 3, dtype=torch.long),
                  torch.tensor([2, 2, 2]), classes[torch.tensor([0, 0, 0])],
                  torch.tensor([0, 0, 0]), classes, class_log_prior=prior)
    logits = torch.zeros(3, 6, requires_grad=True)
    # Execute
    label_loss(logits, batch).backward()
    grad = logits.grad
    assert grad is not None
    # Assert: both label words are pushed up (the answer is a label word), and by nearly the
    # same amount: the client's lone label is not taught as the answer to every input
    assert (grad[:, classes] < 0).all()
    assert torch.allclose(grad[:, 2], grad[:, 4], rtol=0.1)
    # (the prior added inside the full-vocabulary softmax pushes only the client's own word up)
    from fedcybgd.tasks.objective import adjusted
    inside = logits.detach().requires_grad_(True)
    torch.nn.functional.cross_entropy(adjusted(inside, batch), batch.target_ids).backward()
    assert inside.grad is not None
    assert (inside.grad[:, 2] < 0).all() and (inside.grad[:, 4] > 0).all()


def test_adjusted_loss_without_a_skew_is_the_plain_cross_entropy():
    from fedcybgd.data.prompts import Batch
    from fedcybgd.tasks.objective import label_loss
    classes = torch.tensor([1, 3])
    batch = Batch(torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.long),
                  torch.tensor([1, 1, 1, 1]), classes[torch.tensor([0, 1, 1, 0])],
                  torch.tensor([0, 1, 1, 0]), classes, class_log_prior=torch.zeros(2))
    logits = torch.randn(4, 7)
    plain = torch.nn.functional.cross_entropy(logits, batch.target_ids)
    assert torch.allclose(label_loss(logits, batch), plain, atol=1e-6)


def test_client_batches_carry_their_partitions_prior_only_when_asked(tiny_run_config):
    from fedcybgd.model.loading import load_tokenizer
    from fedcybgd.tasks import shares
    frame = shares.client_examples("rotten-tomatoes", "dirichlet", 0, 8, 0.5, 0)
    tokenizer = load_tokenizer("tiny-llama")
    on = next(shares.batches(frame, tokenizer, 4, 32, seed=0, logit_adjust=True))
    off = next(shares.batches(frame, tokenizer, 4, 32, seed=0))
    # Assert: the prior is the partition's own (partition 0 of seed 0 is mostly positive)
    assert float(frame["label"].mean()) > 0.6
    assert off.class_log_prior is None
    assert on.class_log_prior is not None
    assert torch.allclose(on.class_log_prior,
                          shares.local_log_prior(frame["label"].astype(int).tolist(), 2))
    assert on.class_log_prior[1] > 0 > on.class_log_prior[0]
    assert torch.equal(on.input_ids, off.input_ids)


def test_demo_user_run_config_overrides_the_demos_size(tmp_path, monkeypatch):
    # Prepare: capture what the demo hands the launcher instead of running it
    from flwr.common.config import parse_config_args

    from fedcybgd.cli import demo
    seen = {}

    def fake_launch(run):
        seen["run"] = run
        return 0

    monkeypatch.setattr(demo, "launch", fake_launch)
    monkeypatch.setattr(demo, "stop_local_superlink", lambda home: 0)
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    # Execute: a user's key that the demo also sets
    demo.main(["--output-dir", str(tmp_path / "out"),
               "--run-config", "num-server-rounds=2 partitioner='dirichlet'"])
    # Assert: Flower's own parser reads the demo's keys, then the user's, which win
    config = parse_config_args(seen["run"].run_config)
    assert config["num-server-rounds"] == 2 and config["partitioner"] == "dirichlet"
    assert config["eval-every"] == 0 and config["overwrite"] is True
    assert seen["run"].stop_on_interrupt and seen["run"].superlink == "local"


def test_reply_arrival_order_does_not_change_the_merge(tiny_run_config, tmp_path):
    # Prepare: three nodes on one block (fp32 uploads, so the average is order-sensitive in
    # its last bits); two equal runs, whose replies reach the strategy in opposite orders
    config = dict(tiny_run_config, **{"clients-per-block": 0, "clients-per-round": 3,
                                      "upload-codec": "fp32"})
    grid, first = setup(config, tmp_path, nodes=3)
    other_grid, second = setup(config, tmp_path / "second", nodes=3)
    messages = list(first.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    replies = list(grid.send_and_receive(messages))
    other = list(other_grid.send_and_receive(
        second.configure_train(1, ArrayRecord(), ConfigRecord(), other_grid)))
    assert len(replies) == len(other) == 3
    # Execute
    first.aggregate_train(1, replies)
    second.aggregate_train(1, list(reversed(other)))
    # Assert: the same weights bit for bit and the same record, nodes in sending order
    for name, value in first.weights.items():
        assert torch.equal(value.detach(), second.weights[name].detach()), name
    sent = [m.metadata.dst_node_id for m in messages]
    assert first.history[-1].accepted == second.history[-1].accepted
    assert list(first.history[-1].accepted.values()) == [sent]
    assert first.history[-1].train_loss == second.history[-1].train_loss
