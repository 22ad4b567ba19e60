"""Compression on the real wire: delta sync, exact trained blocks, bad payloads both ways."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, MessageType

from fedcybgd import protocol
from fedcybgd.client.app import app as client_app
from fedcybgd.client.runtime import client_model
from fedcybgd.compression import payload_from_array, payload_to_array, read_header
from fedcybgd.config import RunConfig
from fedcybgd.core.checksum import content_checksum
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.loading import load_model
from fedcybgd.server.app import build_strategy

COMPRESSED = {"upload-codec": "delta+int8+zstd", "download-codec": "delta+int8+zstd"}


def setup(config: dict[str, Any], tmp_path: Path, nodes: int = 4) -> tuple[Any, Any, Any]:
    run = RunConfig.from_run_config(config)
    grid = LoopbackGrid(client_app, nodes, config,
                        node_config=lambda i: {"cache-dir": str(tmp_path / "cache")})
    model = load_model(run.model)
    blocks = BlockMap(model, run.layers_per_block)
    weights = dict(model.named_parameters())
    strategy = build_strategy(run, blocks, weights, "wire", content_checksum(weights))
    return grid, strategy, model


def play(strategy: Any, grid: LoopbackGrid, server_round: int, tamper: Any = None) -> None:
    messages = list(strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid))
    if tamper is not None:
        tamper(messages)
    strategy.aggregate_train(server_round, grid.send_and_receive(messages))


def test_compressed_run_keeps_server_and_client_records_in_step(tiny_run_config, tmp_path):
    # Prepare: lossy frozen downloads and lossy uploads, 4 nodes, 2 per round
    grid, strategy, _ = setup(dict(tiny_run_config, **COMPRESSED), tmp_path)
    # Execute
    for server_round in range(1, 7):
        play(strategy, grid, server_round)
    # Assert: no round needed a resync or lost a block, and uploads were compressed
    assert all(not h.failed_blocks for h in strategy.history)
    assert all(h.bytes_up < 0.4 * h.bytes_up_raw for h in strategy.history)
    # every node's record of a block is either exact (current) or an approximate copy
    for held in strategy.holdings.values():
        for block, holding in held.items():
            assert holding.version <= strategy.versions[block]


def test_trained_block_arrives_exact_even_after_a_lossy_copy(tiny_run_config, tmp_path):
    # Prepare: one node; every other block reaches it lossy first (without self-sync: with it
    # the node holds every block it trained exactly, see tests/client/test_traffic.py)
    # (installs unrounded: a rounded install would leave the node an exact copy, no lossy one)
    config = dict(tiny_run_config, **COMPRESSED, **{"clients-per-round": 1, "self-sync": False,
                                                    "install-codec": "none"})
    grid, strategy, _ = setup(config, tmp_path, nodes=1)
    for server_round in range(1, 5):  # trains layer.0..3 in turn
        play(strategy, grid, server_round)
    # Execute: the next cycle asks the node to train layer.0 again
    messages = list(strategy.configure_train(5, ArrayRecord(), ConfigRecord(), grid))
    # Assert: layer.0 travels through the exact codec and reproduces the global block
    download = messages[0].content[protocol.DOWNLOAD]
    payload = payload_from_array(download["layer.0"])
    header = read_header(payload, max_bytes=len(payload))
    assert header.spec == "xor+zstd"
    assert header.checksum == strategy.checksums["layer.0"]
    strategy.aggregate_train(5, grid.send_and_receive(messages))
    assert strategy.history[-1].failed_blocks == []


def test_corrupted_upload_is_dropped_and_block_requeued(tiny_run_config, tmp_path, caplog):
    # Prepare: a client app whose replies are corrupted on the way
    grid, strategy, model = setup(dict(tiny_run_config, **{"clients-per-round": 1}), tmp_path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    original = grid.client_app

    def corrupting(message, context):
        reply = original(message, context)
        if message.metadata.message_type != MessageType.TRAIN:
            return reply  # the node-key query
        upload = reply.content.array_records[protocol.UPLOAD]
        for name in list(upload.keys()):
            data = bytearray(payload_from_array(upload[name]))
            data[len(data) // 2] ^= 0xFF
            upload[name] = payload_to_array(bytes(data))
        return reply

    grid.client_app = corrupting
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedcybgd"):
        play(strategy, grid, 1)
    # Assert: global model untouched, block back in the queue, the node named in the log
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert strategy.history[0].failed_blocks == ["layer.0"]
    node = strategy.history[0].clients[0]
    assert f"dropped node {node}'s upload of block layer.0" in caplog.text
    grid.client_app = original
    play(strategy, grid, 2)
    assert strategy.history[1].blocks == ["layer.0"] and not strategy.history[1].failed_blocks


def test_corrupted_download_makes_the_client_resync(tiny_run_config, tmp_path):
    # Prepare: one node, 2 rounds so that round 3 carries downloads (without self-sync the
    # node is sent back the blocks it trained)
    config = dict(tiny_run_config, **{"clients-per-round": 1, "self-sync": False})
    grid, strategy, _ = setup(config, tmp_path, nodes=1)
    play(strategy, grid, 1)
    play(strategy, grid, 2)

    def corrupt(messages):
        download = messages[0].content[protocol.DOWNLOAD]
        for name in list(download.keys()):
            data = bytearray(payload_from_array(download[name]))
            data[-3] ^= 0x55
            download[name] = payload_to_array(bytes(data))

    # Execute: round 3's download is damaged in transit
    play(strategy, grid, 3, tamper=corrupt)
    # Assert: nothing trained, the block re-queued, and the node's record reset
    assert strategy.history[2].failed_blocks == ["layer.2"]
    assert strategy.holdings[next(iter(grid.contexts))] == {}
    play(strategy, grid, 4)  # a full resync, then training goes on
    assert strategy.history[3].blocks == ["layer.2"] and not strategy.history[3].failed_blocks
    assert len(strategy.history[3].blocks) == 1


def test_damaged_client_cache_costs_one_resync(tiny_run_config, tmp_path):
    # Prepare
    config = dict(tiny_run_config, **{"clients-per-round": 1})
    grid, strategy, _ = setup(config, tmp_path, nodes=1)
    play(strategy, grid, 1)
    play(strategy, grid, 2)
    for file in (tmp_path / "cache").rglob("*.safetensors"):
        file.write_bytes(b"garbage")
    client_model.cache_clear()  # a restarted client process reads its cache from disk
    # Execute
    play(strategy, grid, 3)
    play(strategy, grid, 4)
    # Assert: round 3 detected the damage (resync), round 4 trained the same block
    assert strategy.history[2].failed_blocks == ["layer.2"]
    assert strategy.history[3].blocks == ["layer.2"] and not strategy.history[3].failed_blocks


def test_paper_random_dropping_sends_a_fraction_of_stale_blocks(tiny_run_config, tmp_path):
    # Prepare: 4 blocks change in round 1; with fraction 0.5 a node then gets 2 of the 3 stale
    # frozen blocks it lacks (ceil(0.5 * 3)) plus its own block exact (the paper's scheme: no
    # self-sync, which would leave the node holding the block it trained)
    config = dict(tiny_run_config, **{"clients-per-round": 4, "download-fraction": 0.5,
                                      "download-codec": "fp16", "self-sync": False})
    grid, strategy, _ = setup(config, tmp_path, nodes=4)
    play(strategy, grid, 1)
    # Execute
    messages = list(strategy.configure_train(2, ArrayRecord(), ConfigRecord(), grid))
    # Assert
    for message in messages:
        download = message.content[protocol.DOWNLOAD]
        assert len(download) == 3
        own = message.content[protocol.CONFIG][protocol.BLOCK]
        assert read_header(payload_from_array(download[own]), max_bytes=1 << 30).spec == "xor+zstd"
    strategy.aggregate_train(2, grid.send_and_receive(messages))
    assert not strategy.history[1].failed_blocks


def test_lezo_seedlog_upload_is_replayed_exactly(tiny_run_config, tmp_path):
    # Prepare: zeroth-order clients upload their step log instead of weights
    config = dict(tiny_run_config, **{"update-rule": "lezo", "upload-codec": "seedlog",
                                      "lr": 1e-3, "local-steps": 3})
    grid, strategy, _ = setup(config, tmp_path)
    # Execute
    play(strategy, grid, 1)
    # Assert: the blocks changed through replay, and the uploads are tiny
    entry = strategy.history[0]
    assert not entry.failed_blocks and all(strategy.versions[b] == 1 for b in entry.blocks)
    assert entry.bytes_up < 2_000 < entry.bytes_up_raw
    # training goes on from the replayed blocks: round 2's downloads verify on the clients
    play(strategy, grid, 2)
    assert not strategy.history[1].failed_blocks


def test_seedlog_falls_back_to_weights_for_first_order_clients(tiny_run_config, tmp_path):
    config = dict(tiny_run_config, **{"update-rule": "fo", "upload-codec": "seedlog"})
    grid, strategy, _ = setup(config, tmp_path)
    play(strategy, grid, 1)
    entry = strategy.history[0]
    assert not entry.failed_blocks
    assert entry.bytes_up > 10_000  # weights, through the fallback codec
