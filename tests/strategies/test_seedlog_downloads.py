"""Seed-log downloads: blocks made from step logs reach nodes as those logs."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedcybgd import protocol
from fedcybgd.client.app import app as client_app
from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.core.checksum import content_checksum
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.loading import load_model
from fedcybgd.protocol import seedsync, zeroth_order
from fedcybgd.server.app import build_strategy
from fedcybgd.strategies.aggregate import weighted_mean
from fedcybgd.strategies.server_step import ServerStep

LOGS_BOTH_WAYS = {"update-rule": "lezo", "upload-codec": "seedlog", "download-codec": "seedlog",
                  "lr": 1e-3, "local-steps": 3, "clients-per-block": 2,
                  "num-server-rounds": 6}


def _chain(installs: int = 2, logs: int = 2) -> seedsync.LogChain:
    return seedsync.LogChain("layer.0", 3, "a" * 64, tuple(
        seedsync.LoggedInstall(4 + i, "b" * 64, 0.5, tuple(8.0 for _ in range(logs)),
                               tuple(bytes([i, j, 7]) for j in range(logs)))
        for i in range(installs)))


def test_chain_round_trips():
    chain = _chain()
    assert seedsync.decode_chain(seedsync.encode_chain(chain), max_bytes=1 << 20) == chain


def _with_header(data: bytes, edit: Any) -> bytes:
    preamble = struct.Struct("<4sHI")
    magic, version, length = preamble.unpack_from(data)
    header = json.loads(data[preamble.size:preamble.size + length])
    edit(header)
    head = json.dumps(header).encode()
    return preamble.pack(magic, version, len(head)) + head + data[preamble.size + length:]


def _set(**fields: Any) -> Any:
    return lambda h: h.update(fields)


def _set_install(**fields: Any) -> Any:
    return lambda h: h["installs"][0].update(fields)


MANGLES = {
    "bad magic": lambda d: b"XXXX" + d[4:],
    "truncated": lambda d: d[:-1],
    "trailing bytes": lambda d: d + b"\0",
    "empty": lambda d: b"",
    "future format": lambda d: d[:4] + struct.pack("<H", 9) + d[6:],
    "no installs": lambda d: _with_header(d, _set(installs=[])),
    "versions go back": lambda d: _with_header(d, _set_install(version=2)),
    "NaN size": lambda d: d.replace(b'"size":0.5', b'"size":NaN'),
    "zero weight": lambda d: _with_header(d, _set_install(weights=[0.0, 8.0])),
    "weight as bool": lambda d: _with_header(d, _set_install(weights=[True, 8.0])),
    "missing weight": lambda d: _with_header(d, _set_install(weights=[8.0])),
    "log past the data": lambda d: _with_header(d, _set_install(logs=[3, 3000])),
    "short checksum": lambda d: _with_header(d, _set_install(checksum="abc")),
    "base checksum for v0": lambda d: _with_header(d, _set(base_version=0)),
    "not an object": lambda d: _with_header(d, lambda h: h.clear()),
}


@pytest.mark.parametrize("mangle", list(MANGLES))
def test_malformed_chains_are_refused_by_name(mangle):
    data = MANGLES[mangle](seedsync.encode_chain(_chain()))
    with pytest.raises(ValueError, match="seed-log download"):
        seedsync.decode_chain(data, max_bytes=1 << 20)


def test_an_oversized_chain_is_refused_before_parsing():
    data = seedsync.encode_chain(_chain())
    with pytest.raises(ValueError, match="exceeds"):
        seedsync.decode_chain(data, max_bytes=len(data) - 1)


def test_rebuild_is_the_servers_mean_and_sgd_step_bit_for_bit():
    # Prepare: a block, three uploads with uneven weights, a damped sgd step
    torch.manual_seed(0)
    start = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    uploads = [(w, {k: v + 0.01 * torch.randn_like(v) for k, v in start.items()})
               for w in (3.0, 8.0, 5.0)]
    step = ServerStep(0.7, "none", "sgd", 0.9, 0.99, 1e-8)
    # Execute: the server's path (aggregator, cast, step) and what a node runs
    merged = weighted_mean(uploads)
    server = step.propose("b0", start, {k: merged[k].to(start[k].dtype) for k in start},
                          1).tensors
    node = seedsync.rebuild(start, uploads, step.size(1))
    # Assert
    assert all(torch.equal(server[k], node[k]) for k in start)


def _setup(config: dict[str, Any], tmp_path: Path, nodes: int = 4) -> tuple[Any, Any]:
    run = RunConfig.from_run_config(config)
    grid = LoopbackGrid(client_app, nodes, config,
                        node_config=lambda i: {"cache-dir": str(tmp_path / "cache")})
    model = load_model(run.model)
    weights = dict(model.named_parameters())
    strategy = build_strategy(run, BlockMap(model, run.layers_per_block), weights, "logs",
                              content_checksum(weights))
    return grid, strategy


def _play(strategy: Any, grid: LoopbackGrid, rounds: int) -> list[Any]:
    sent = []
    for server_round in range(1, rounds + 1):
        messages = list(strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(),
                                                 grid))
        sent.extend(messages)
        strategy.aggregate_train(server_round, grid.send_and_receive(messages))
    return sent


def test_logs_both_ways_give_the_run_exact_weights_give(tiny_run_config, tmp_path):
    # Prepare: lezo, 2 nodes merged per block, 4 nodes of which 2 train each round, so nodes
    # lag several installs; the reference downloads exact weights instead of logs
    config = dict(tiny_run_config, **LOGS_BOTH_WAYS)
    reference = dict(config, **{"download-codec": "xor+zstd"})
    # Execute
    grid, strategy = _setup(config, tmp_path / "logs")
    sent = _play(strategy, grid, 6)
    grid_ref, strategy_ref = _setup(reference, tmp_path / "weights")
    _play(strategy_ref, grid_ref, 6)
    # Assert: logs went down, no node needed a resync, and the model is bit for bit the one
    # exact weight downloads train
    as_logs = [m for m in sent if protocol.DOWNLOAD_LOGS in m.content.array_records]
    assert len(as_logs) >= 4
    assert all(not h.failed_blocks and not any(h.dropped.values()) for h in strategy.history)
    assert strategy.checksums == strategy_ref.checksums
    assert [h.train_loss for h in strategy.history] == [h.train_loss
                                                         for h in strategy_ref.history]
    down = sum(h.bytes_down for h in strategy.history)
    assert down < 0.2 * sum(h.bytes_down for h in strategy_ref.history)


def test_a_node_with_another_z_fingerprint_gets_weights(tiny_run_config, tmp_path):
    # Prepare: every node reports a fingerprint other than the server's
    config = dict(tiny_run_config, **LOGS_BOTH_WAYS)
    grid, strategy = _setup(config, tmp_path)
    _play(strategy, grid, 2)
    assert strategy.nodes.zo  # the nodes said what they run
    strategy.nodes.zo = {node: "0.0|" + "0" * 16 for node in strategy.nodes.zo}
    # Execute
    messages = list(strategy.configure_train(3, ArrayRecord(), ConfigRecord(), grid))
    # Assert: weights only
    assert not any(protocol.DOWNLOAD_LOGS in m.content.array_records for m in messages)


def test_replay_passes_count_the_units_each_step_draws_z_for():
    log = zeroth_order.SeedLog("b0", 2, "x", 1e-3, 0.0, "t", "z", steps=(
        zeroth_order.SeedStep(1, (0,), 0.1, 1e-3), zeroth_order.SeedStep(2, (0, 1), 0.1, 1e-3)))
    assert zeroth_order.replay_passes(log, [10, 30]) == (10 + 40) / 40


def test_a_chain_costlier_than_seedlog_max_replay_goes_as_weights(tiny_run_config, tmp_path):
    # Prepare: a cap below one step's replay work
    config = dict(tiny_run_config, **LOGS_BOTH_WAYS, **{"seedlog-max-replay": 1e-3})
    grid, strategy = _setup(config, tmp_path)
    # Execute
    sent = _play(strategy, grid, 4)
    # Assert: installs were logged, each costing a node between 0 and 2 logs x 3 steps of
    # passes, but none went down as logs; the run went on without resyncs or drops
    chains = [strategy.blocks.log_chain(b, None) for b in strategy.blocks.block_map.names]
    installs = [i for c in chains if c is not None for i in c.installs]
    assert installs and all(0 < i.replay_passes <= 2 * 3 for i in installs)
    assert not any(protocol.DOWNLOAD_LOGS in m.content.array_records for m in sent)
    assert all(not h.failed_blocks and not any(h.dropped.values()) for h in strategy.history)


def test_seedlog_max_replay_must_not_be_negative(tiny_run_config):
    with pytest.raises(ConfigError, match="seedlog-max-replay"):
        RunConfig.from_run_config(dict(tiny_run_config, **{"seedlog-max-replay": -1.0}))


def test_a_tampered_log_download_makes_the_node_resync_not_hold_a_wrong_block(
        tiny_run_config, tmp_path):
    # Prepare: a run whose round-3 instructions carry log chains
    config = dict(tiny_run_config, **LOGS_BOTH_WAYS)
    grid, strategy = _setup(config, tmp_path)
    _play(strategy, grid, 2)
    messages = list(strategy.configure_train(3, ArrayRecord(), ConfigRecord(), grid))
    carrying = [m for m in messages if protocol.DOWNLOAD_LOGS in m.content.array_records]
    assert carrying
    # Execute: the chain's first install claims another checksum
    from fedcybgd.compression import payload_from_array, payload_to_array
    target = carrying[0].content.array_records[protocol.DOWNLOAD_LOGS]
    block = next(iter(target.keys()))
    chain = seedsync.decode_chain(payload_from_array(target[block]), max_bytes=1 << 30)
    wrong = dataclasses.replace(chain.installs[0], checksum="c" * 64)
    target[block] = payload_to_array(seedsync.encode_chain(
        dataclasses.replace(chain, installs=(wrong, *chain.installs[1:]))))
    replies = list(grid.send_and_receive(messages))
    # Assert: that node answered resync, naming the checksum, and holds no wrong version
    node = carrying[0].metadata.dst_node_id
    reply = next(r for r in replies if r.metadata.src_node_id == node)
    state = reply.content.config_records[protocol.STATE]
    assert state[protocol.STATUS] == protocol.RESYNC
    assert "checksum" in str(state[protocol.REASON])
    holdings = protocol.load_holdings(str(state[protocol.HOLDINGS]))
    assert all(h.checksum == strategy.checksums.get(b) for b, h in holdings.items())
    strategy.aggregate_train(3, iter(replies))  # the server goes on


def test_seedlog_downloads_need_seedlog_uploads(tiny_run_config):
    with pytest.raises(ConfigError, match="upload-codec = 'seedlog'"):
        RunConfig.from_run_config(dict(tiny_run_config, **{"download-codec": "seedlog"}))
