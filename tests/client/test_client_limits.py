"""A node bounds what a server may ask of it by its own limits (``--node-config`` ``max-*``).

Each test plays a hostile server: it takes the honest round-1 instruction the strategy builds,
makes one demand beyond the node's limits, sends it to the real ClientApp and checks that the
node answered ``refused`` naming the field, the value and the limit, and did not do the work.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message

from fedcybgd import protocol
from fedcybgd.client.app import app as client_app
from fedcybgd.compression import encode, payload_to_array
from fedcybgd.config import ConfigError, NodeConfig, RunConfig
from fedcybgd.core.checksum import content_checksum
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.loading import load_model
from fedcybgd.protocol import seedlog, seedsync, zeroth_order
from fedcybgd.server.app import build_strategy

Tamper = Callable[[Message, BlockMap], None]


@pytest.fixture
def config(tiny_run_config: dict[str, Any]) -> dict[str, Any]:
    return dict(tiny_run_config, **{"clients-per-round": 1})


@pytest.fixture
def replayed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps of every step log the node replays (the real replay, counted)."""
    steps: list[int] = []
    real = seedsync.replay

    def counting(start: Any, log: Any, *args: Any, **kwargs: Any) -> Any:
        steps.append(len(log.steps))
        return real(start, log, *args, **kwargs)

    monkeypatch.setattr(seedsync, "replay", counting)
    return steps


def one_round(config: dict[str, Any], tmp_path: Path, tamper: Tamper | None = None,
              node: dict[str, Any] | None = None) -> Message:
    """Round 1 of a one-node run, its instruction changed by ``tamper``; the node's reply."""
    run = RunConfig.from_run_config(config)
    grid = LoopbackGrid(client_app, 1, config, node_config=lambda i: {
        "cache-dir": str(tmp_path / "cache"), **(node or {})})
    model = load_model(run.model)
    weights = dict(model.named_parameters())
    block_map = BlockMap(model, run.layers_per_block)
    strategy = build_strategy(run, block_map, weights, "limits", content_checksum(weights))
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    if tamper is not None:
        tamper(messages[0], block_map)
    (reply,) = grid.send_and_receive(messages)
    strategy.aggregate_train(1, iter([reply]))  # the server goes on
    return reply


def state_of(reply: Message) -> ConfigRecord:
    assert not reply.has_error(), reply.error.reason  # an answer, not a crash
    return reply.content.config_records[protocol.STATE]


def assert_refused(reply: Message, *fragments: str) -> None:
    """Refused, the reason naming every fragment; nothing trained or uploaded."""
    state = state_of(reply)
    assert state[protocol.STATUS] == protocol.REFUSED, state[protocol.REASON]
    for fragment in fragments:
        assert fragment in str(state[protocol.REASON]), (fragment, state[protocol.REASON])
    assert protocol.UPLOAD not in reply.content.array_records
    assert protocol.METRICS not in reply.content.metric_records


def config_of(message: Message) -> ConfigRecord:
    return message.content.config_records[protocol.CONFIG]


def other_block(message: Message, block_map: BlockMap) -> str:
    return next(b for b in block_map.names if b != config_of(message)[protocol.BLOCK]
                and b.startswith("layer."))


def step_log_chain(block_map: BlockMap, block: str, logs: int, steps: int) -> bytes:
    """A chain taking ``block`` from the pretrained version to version 1 through ``logs``
    step logs of ``steps`` steps each, every one well formed and replayable here (its
    checksum is made up: only a full replay shows it is wrong)."""
    layout = zeroth_order.unit_layout(block_map, block)
    every = tuple(range(len(layout)))
    step_log = zeroth_order.SeedLog(
        block, len(layout), zeroth_order.layout_id(layout), 1e-3, 0.0, torch.__version__,
        zeroth_order.z_fingerprint("cpu"),
        steps=tuple(zeroth_order.SeedStep(i, every, 0.5, 2.0**-20) for i in range(steps)))
    encoded = seedlog.encode_seedlog(step_log)
    install = seedsync.LoggedInstall(1, "c" * 64, 1.0, (1.0,) * logs, (encoded,) * logs)
    return seedsync.encode_chain(seedsync.LogChain(block, 0, "", (install,)))


def send_chain(logs: int, steps: int) -> Tamper:
    """Add a step-log download of ``logs`` x ``steps`` steps; ``local-steps`` says ``steps``."""
    def tamper(message: Message, block_map: BlockMap) -> None:
        block = other_block(message, block_map)
        config_of(message)[protocol.LOCAL_STEPS] = steps
        message.content.array_records[protocol.DOWNLOAD_LOGS] = ArrayRecord(
            {block: payload_to_array(step_log_chain(block_map, block, logs, steps))})
    return tamper


def send_block(spec: str) -> Tamper:
    """Add a download of another block: its pretrained tensors as version 1, in ``spec``."""
    def tamper(message: Message, block_map: BlockMap) -> None:
        block = other_block(message, block_map)
        tensors = {k: v.detach().clone() for k, v in
                   block_map.get(load_model("tiny-llama"), block).items()}
        payload = encode(tensors, spec, block=block, target_version=1, base=tensors)
        message.content.array_records[protocol.DOWNLOAD] = ArrayRecord(
            {block: payload_to_array(payload)})
        expect = json.loads(str(config_of(message)[protocol.EXPECT]))
        expect[block] = [1, content_checksum(tensors)]
        config_of(message)[protocol.EXPECT] = json.dumps(expect)
    return tamper


def set_field(key: str, value: Any) -> Tamper:
    def tamper(message: Message, block_map: BlockMap) -> None:
        config_of(message)[key] = value
    return tamper


# ----------------------------------------------------------------------------- replay work


def test_a_64_by_200_step_chain_is_refused_before_any_replay(config, tmp_path, replayed):
    # Execute: 64 step logs of 200 steps each (12,800 steps), the node at its defaults
    reply = one_round(config, tmp_path, send_chain(64, 200))
    # Assert: refused by name, not one step replayed
    assert_refused(reply, "'download-logs'", "max-replay-steps = 4096")
    assert replayed == []


def test_replay_steps_beyond_the_nodes_limit_are_refused_by_name(config, tmp_path, replayed):
    reply = one_round(config, tmp_path, send_chain(4, 50), node={"max-replay-steps": 120})
    assert_refused(reply, "steps to replay", "at least 150", "max-replay-steps = 120")
    assert replayed == []


def test_a_chain_longer_than_max_replay_logs_is_refused_by_name(config, tmp_path, replayed):
    reply = one_round(config, tmp_path, send_chain(16, 1), node={"max-replay-logs": 8})
    assert_refused(reply, "'download-logs'", "= 16", "max-replay-logs = 8")
    assert replayed == []


def test_a_log_longer_than_the_nodes_max_local_steps_is_refused(config, tmp_path, replayed):
    # Prepare: the instruction's local-steps (what one log may hold) says 200, the node 100
    reply = one_round(config, tmp_path, send_chain(1, 200), node={"max-local-steps": 100})
    assert_refused(reply, "instruction field 'local-steps' = 200", "max-local-steps = 100")
    assert replayed == []


def test_a_chain_within_the_limits_is_replayed_and_checked(config, tmp_path, replayed):
    # Execute: 2 x 3 steps under the defaults; the made-up checksum shows only after replay
    reply = one_round(config, tmp_path, send_chain(2, 3))
    # Assert: replayed in full, then the checksum mismatch asked for a resync, as before
    state = state_of(reply)
    assert state[protocol.STATUS] == protocol.RESYNC
    assert "checksum" in str(state[protocol.REASON])
    assert replayed == [3, 3]


# ------------------------------------------------------------------------- training work


def test_lr_1e30_is_refused_by_name(config, tmp_path):
    reply = one_round(config, tmp_path, set_field(protocol.LR, 1e30))
    assert_refused(reply, "instruction field 'lr' = 1e+30", "max-lr = 1")


def drop_lr(message: Message, block_map: BlockMap) -> None:
    del config_of(message)[protocol.LR]


def test_a_run_config_lr_beyond_max_lr_is_refused_when_no_lr_is_sent(config, tmp_path):
    reply = one_round(dict(config, lr=0.5), tmp_path, drop_lr, node={"max-lr": 0.1})
    assert_refused(reply, "run-config 'lr' = 0.5", "max-lr = 0.1")


def test_local_steps_beyond_the_nodes_limit_are_refused(config, tmp_path):
    reply = one_round(dict(config, **{"local-steps": 5}), tmp_path,
                      node={"max-local-steps": 4})
    assert_refused(reply, "'local-steps' = 5", "max-local-steps = 4")


def test_a_batch_size_beyond_the_nodes_limit_is_refused(config, tmp_path):
    reply = one_round(config, tmp_path, node={"max-batch-size": 2})
    assert_refused(reply, "run-config 'batch-size' = 4", "max-batch-size = 2")


# ----------------------------------------------------------------------------- payloads


def test_downloads_beyond_max_download_mb_are_refused_and_not_installed(config, tmp_path):
    # Prepare: a 16 kB block in fp32, the node accepting 8 kB
    reply = one_round(config, tmp_path, send_block("fp32"), node={"max-download-mb": 2**-7})
    assert_refused(reply, "'download'", "max-download-mb = 0.0078125")
    assert protocol.load_holdings(str(state_of(reply)[protocol.HOLDINGS])) == {}


def test_a_block_decoding_beyond_max_decoded_mb_is_refused_and_not_decoded(config, tmp_path):
    # Prepare: a delta of zeros compresses to a few hundred bytes and decodes to 16 kB
    reply = one_round(config, tmp_path, send_block("xor+zstd"), node={"max-decoded-mb": 2**-7})
    assert_refused(reply, "'download' block", "(decoded)", "max-decoded-mb = 0.0078125")
    assert protocol.load_holdings(str(state_of(reply)[protocol.HOLDINGS])) == {}


# --------------------------------------------------------------------- malformed fields


@pytest.mark.parametrize("promote", [
    "not json",
    '["layer.1"]',
    '{"layer.1": [1, "short", 1.0]}',
    '{"layer.1": [0, "' + "a" * 64 + '", 1.0]}',
    "[" * 100_000 + "]" * 100_000,
    7,
])
def test_a_malformed_self_sync_promotion_is_refused_by_name(config, tmp_path, promote):
    reply = one_round(config, tmp_path, set_field(protocol.PROMOTE, promote))
    assert_refused(reply, "instruction field 'self-synced'")


@pytest.mark.parametrize(("key", "value"), [
    (protocol.ROUND, "one"),
    (protocol.EXPECT, "{"),
    (protocol.UPLOAD_CODEC, "int3"),
    (protocol.LOCAL_STEPS, 0),
    (protocol.LR, -1.0),
    (protocol.DP_CLIP, float("inf")),
    (protocol.DP_CLIP, 0.0),
    (protocol.RULE, "no-such-rule"),
])
def test_a_malformed_instruction_field_is_refused_by_name(config, tmp_path, key, value):
    reply = one_round(config, tmp_path, set_field(key, value))
    assert_refused(reply, f"instruction field {key!r}")


# ------------------------------------------------------------------------ honest runs


def test_an_honest_run_within_the_limits_is_unaffected(tiny_run_config, tmp_path, replayed):
    # Prepare: step logs both ways, 4 nodes of which 2 train a block each round, so nodes lag
    # installs and are sent them as chains; the nodes at their default limits
    config = dict(tiny_run_config, **{
        "update-rule": "lezo", "upload-codec": "seedlog", "download-codec": "seedlog",
        "lr": 1e-3, "local-steps": 3, "clients-per-block": 2, "num-server-rounds": 4})
    run = RunConfig.from_run_config(config)
    grid = LoopbackGrid(client_app, 4, config,
                        node_config=lambda i: {"cache-dir": str(tmp_path / "cache")})
    model = load_model(run.model)
    weights = dict(model.named_parameters())
    strategy = build_strategy(run, BlockMap(model, run.layers_per_block), weights, "honest",
                              content_checksum(weights))
    # Execute
    statuses = []
    for server_round in range(1, 5):
        messages = list(strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(),
                                                 grid))
        replies = list(grid.send_and_receive(messages))
        statuses += [state_of(r)[protocol.STATUS] for r in replies]
        strategy.aggregate_train(server_round, iter(replies))
    # Assert: every reply ok, chains were replayed, nothing dropped
    assert statuses == [protocol.OK] * 8
    assert replayed and all(0 < s <= 3 for s in replayed)
    assert all(not h.failed_blocks and not any(h.dropped.values()) for h in strategy.history)


def test_the_defaults_are_documented_once_and_must_be_positive():
    from fedcybgd.client import limits

    node = NodeConfig()
    assert (node.max_local_steps, node.max_lr, node.max_batch_size) == (1000, 1.0, 256)
    assert limits.check_training(RunConfig(), node) == RunConfig().lr
    for key in ("max-local-steps", "max-lr", "max-batch-size", "max-replay-steps",
                "max-replay-logs", "max-download-mb", "max-decoded-mb"):
        with pytest.raises(ConfigError, match=key):
            NodeConfig.from_node_config({key: 0})


def test_a_fedavg_round_beyond_the_nodes_limits_is_not_trained(tiny_run_config, tmp_path):
    # Prepare: a FedAvg baseline round (the global model under "arrays") asking lr 0.5
    from flwr.app import MessageType, RecordDict

    from fedcybgd.baselines import ARRAYS, build_baseline, to_record

    config = dict(tiny_run_config, **{"strategy": "fedavg", "fedavg-params": "full",
                                      "lr": 0.5})
    grid = LoopbackGrid(client_app, 1, config, node_config=lambda i: {"max-lr": 0.1})
    arrays = to_record(build_baseline(RunConfig.from_run_config(config)).get())
    message = Message(RecordDict({ARRAYS: arrays, "config": ConfigRecord({"server-round": 1})}),
                      dst_node_id=grid.node_ids[0], message_type=MessageType.TRAIN,
                      group_id="1")
    # Execute
    (reply,) = grid.send_and_receive([message])
    # Assert: Flower's error reply (FedAvg leaves it out of its average), naming the limit
    assert reply.has_error()
    reason = str(reply.error.reason)
    assert "run-config 'lr' = 0.5" in reason
    assert "max-lr = 0.1" in reason


@pytest.mark.parametrize("lr,fragment", [
    (0.5, "instruction field 'lr' = 0.5 is beyond this node's limit max-lr = 0.1"),
    ("fast", "instruction field 'lr'"),
    (-1e-3, "instruction field 'lr'"),
])
def test_a_fedavg_round_at_a_rate_beyond_or_malformed_is_not_trained(tiny_run_config, lr,
                                                                     fragment):
    # Prepare: a FedAvg round whose run config's rate is fine but whose instruction (the
    # server's schedule) asks a rate beyond the node's limit, or not a rate at all
    from flwr.app import MessageType, RecordDict

    from fedcybgd.baselines import ARRAYS, build_baseline, to_record

    config = dict(tiny_run_config, **{"strategy": "fedavg", "fedavg-params": "full",
                                      "lr": 1e-3})
    grid = LoopbackGrid(client_app, 1, config, node_config=lambda i: {"max-lr": 0.1})
    arrays = to_record(build_baseline(RunConfig.from_run_config(config)).get())
    message = Message(RecordDict({ARRAYS: arrays, "config": ConfigRecord(
        {"server-round": 1, "lr": lr})}), dst_node_id=grid.node_ids[0],
        message_type=MessageType.TRAIN, group_id="1")
    # Execute
    (reply,) = grid.send_and_receive([message])
    # Assert: Flower's error reply, naming the field
    assert reply.has_error()
    assert fragment in str(reply.error.reason)
