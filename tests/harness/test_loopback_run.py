"""FedCyBGD end to end in one process: real ServerApp logic, real ClientApp, loopback Grid."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MessageType

from fedcybgd.client.app import app as client_app
from fedcybgd.compression import encode
from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.loading import load_model
from fedcybgd.server.app import build_strategy, run_server


def make_grid(run_config: dict[str, Any], tmp_path: Path, num_nodes: int = 4) -> LoopbackGrid:
    cache = tmp_path / "client-cache"
    return LoopbackGrid(client_app, num_nodes, run_config,
                        node_config=lambda i: {"cache-dir": str(cache)})


def make_strategy(run: RunConfig) -> tuple[Any, Any, BlockMap]:
    model = load_model(run.model)
    blocks = BlockMap(model, run.layers_per_block)
    weights = dict(model.named_parameters())
    strategy = build_strategy(run, blocks, weights, lineage="test", base_hash=_hash(weights))
    return model, strategy, blocks


def _hash(weights: dict[str, torch.Tensor]) -> str:
    from fedcybgd.core.checksum import content_checksum

    return content_checksum(weights)


def play_round(strategy: Any, grid: LoopbackGrid, server_round: int) -> None:
    messages = strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid)
    strategy.aggregate_train(server_round, grid.send_and_receive(messages))


def changed_blocks(blocks: BlockMap, before: dict[str, torch.Tensor], model: Any) -> set[str]:
    after = dict(model.named_parameters())
    return {blocks.block_of(n) for n, t in before.items() if not torch.equal(t, after[n])}


def snapshot(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_each_round_changes_exactly_the_assigned_blocks(tiny_run_config, tmp_path):
    # Prepare
    run = RunConfig.from_run_config(tiny_run_config)
    grid = make_grid(tiny_run_config, tmp_path)
    model, strategy, blocks = make_strategy(run)
    for server_round in (1, 2, 3):
        before = snapshot(model)
        # Execute
        play_round(strategy, grid, server_round)
        # Assert
        assigned = set(strategy.history[-1].blocks)
        assert len(assigned) == 2
        assert changed_blocks(blocks, before, model) == assigned
        assert all(strategy.versions[b] == server_round for b in assigned)


def test_one_client_ascending_cycle_trains_every_block(tiny_run_config, tmp_path):
    # Prepare: embeddings and head in the cycle too, one client per round
    config = dict(tiny_run_config, **{"clients-per-round": 1, "train-embeddings": True,
                                      "train-head": True})
    run = RunConfig.from_run_config(config)
    grid = make_grid(config, tmp_path)
    model, strategy, blocks = make_strategy(run)
    before = snapshot(model)
    cycle = blocks.cycle(True, True)
    # Execute
    for server_round in range(1, len(cycle) + 1):
        play_round(strategy, grid, server_round)
    # Assert: ascending order, and every block moved away from the pretrained weights
    assert [h.blocks[0] for h in strategy.history] == cycle
    assert changed_blocks(blocks, before, model) == set(cycle)


def test_failed_client_block_is_retried_next_round(tiny_run_config, tmp_path):
    # Prepare: every node loses its train reply in round 1 (the node-key queries are answered)
    config = dict(tiny_run_config, **{"clients-per-round": 1})
    run = RunConfig.from_run_config(config)
    grid = make_grid(config, tmp_path)
    _, strategy, _ = make_strategy(run)
    # Execute
    messages = strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid)
    grid.silent = set(grid.get_node_ids())
    strategy.aggregate_train(1, grid.send_and_receive(messages))
    grid.silent = set()
    play_round(strategy, grid, 2)
    play_round(strategy, grid, 3)
    # Assert: retried with the same seed (so a client could resume its in-round checkpoint)
    seeds = [m.content["config"]["seed"] for m in grid.sent
             if m.metadata.message_type == MessageType.TRAIN]
    assert seeds[0] == seeds[1] != seeds[2]
    assert strategy.history[0].failed_blocks == ["layer.0"]
    assert strategy.versions["layer.0"] == 2
    assert [h.blocks for h in strategy.history] == [["layer.0"], ["layer.0"], ["layer.1"]]


def test_crashing_client_block_is_requeued(tiny_run_config, tmp_path):
    # Prepare: a client whose cache folder is a file cannot work -> the ClientApp raises
    config = dict(tiny_run_config, **{"clients-per-round": 1})
    run = RunConfig.from_run_config(config)
    bad = tmp_path / "not-a-dir"
    bad.write_text("x")
    grid = LoopbackGrid(client_app, 2, config, node_config=lambda i: {"cache-dir": str(bad)})
    _, strategy, _ = make_strategy(run)
    # Execute
    play_round(strategy, grid, 1)
    # Assert
    assert strategy.history[0].failed_blocks == ["layer.0"]
    assert strategy.schedule.take(1) == ["layer.0"]


def test_bytes_up_is_one_block_payload(tiny_run_config, tmp_path):
    # Prepare: plain fp32 uploads, so the expected size is that of the block's tensors
    config = dict(tiny_run_config, **{"upload-codec": "fp32"})
    run = RunConfig.from_run_config(config)
    grid = make_grid(config, tmp_path)
    model, strategy, blocks = make_strategy(run)
    # Execute
    play_round(strategy, grid, 1)
    # Assert: each upload is exactly one block's payload, far below the model's size
    log = strategy.history[0]
    expected = sum(
        len(encode(blocks.get(model, b), run.upload_codec, block=b, target_version=1))
        for b in log.blocks
    )
    assert log.bytes_up == expected
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert log.bytes_up < 0.2 * model_bytes
    assert log.bytes_up_raw == sum(blocks.info(b).numel * 4 for b in log.blocks)


def test_delta_sync_downloads_only_changed_blocks(tiny_run_config, tmp_path):
    # Prepare
    config = dict(tiny_run_config, **{"clients-per-round": 4})
    run = RunConfig.from_run_config(config)
    grid = make_grid(config, tmp_path)
    _, strategy, _ = make_strategy(run)
    # Execute: round 1 changes 4 blocks; round 2 each node needs exactly those, but the one it
    # trained itself (self-sync: it computed that block and holds it)
    play_round(strategy, grid, 1)
    play_round(strategy, grid, 2)

    def own(server_round: int, node: int) -> set[str]:
        accepted = strategy.history[server_round - 1].accepted
        return {block for block, nodes in accepted.items() if node in nodes}

    # Assert
    assert strategy.history[0].bytes_down == 0  # everyone starts from the pretrained model
    round2 = [m for m in grid.sent if m.content["config"]["server-round"] == 2]
    for message in round2:
        node = message.metadata.dst_node_id
        assert own(1, node)
        assert sorted(message.content["download"].keys()) == sorted(
            set(strategy.history[0].blocks) - own(1, node))
    # and a node that already holds everything downloads only what changed in round 2
    play_round(strategy, grid, 3)
    round3 = [m for m in grid.sent if m.content["config"]["server-round"] == 3]
    for message in round3:
        node = message.metadata.dst_node_id
        assert sorted(message.content["download"].keys()) == sorted(
            set(strategy.history[1].blocks) - own(2, node))


def test_resume_gives_the_same_next_round(tiny_run_config, tmp_path):
    # Prepare
    straight = dict(tiny_run_config, **{"num-server-rounds": 3,
                                        "output-dir": str(tmp_path / "straight")})
    first = dict(tiny_run_config, **{"num-server-rounds": 2,
                                     "output-dir": str(tmp_path / "resumed")})
    second = dict(first, **{"num-server-rounds": 3, "resume": True})
    # Execute
    run_server(make_grid(straight, tmp_path / "a"), RunConfig.from_run_config(straight))
    run_server(make_grid(first, tmp_path / "b"), RunConfig.from_run_config(first))
    run_server(make_grid(second, tmp_path / "b"), RunConfig.from_run_config(second))
    # Assert
    a = json.loads((tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()[-1])
    b = json.loads((tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()[-1])
    assert a["round"] == b["round"] == 3
    assert a["blocks"] == b["blocks"]
    assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
    assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-6)
    wa = load_model(str(tmp_path / "straight" / "final"))
    wb = load_model(str(tmp_path / "resumed" / "final"))
    for (name, pa), (_, pb) in zip(wa.named_parameters(), wb.named_parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-6), name


def test_run_writes_the_metrics_contract(tiny_run_config, tmp_path):
    # Execute
    summary = run_server(make_grid(tiny_run_config, tmp_path),
                         RunConfig.from_run_config(tiny_run_config))
    # Assert
    out = Path(tiny_run_config["output-dir"])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == [0, 1, 2]
    required = {"round", "blocks", "clients", "update_rule", "bytes_down", "bytes_up",
                "bytes_down_raw", "bytes_up_raw", "train_loss", "eval_loss", "eval_accuracy",
                "client_peak_mem_mb", "client_train_s", "round_s"}
    for record in lines[1:]:
        assert required <= set(record)
        assert record["client_peak_mem_mb"] > 0
    assert json.loads((out / "summary.json").read_text())["rounds"] == 2
    assert (out / "final" / "config.json").exists()
    assert (out / "checkpoint" / "state.json").exists()
    assert summary["bytes_up"] == sum(r["bytes_up"] for r in lines[1:])


def test_strategy_runs_under_flower_start(tiny_run_config, tmp_path):
    # Prepare: Flower's own Strategy.start loop, arrays passed around as ArrayRecords
    run = RunConfig.from_run_config(tiny_run_config)
    grid = make_grid(tiny_run_config, tmp_path)
    model, strategy, _ = make_strategy(run)
    strategy.return_arrays = True
    initial = ArrayRecord({n: p.detach().clone() for n, p in model.named_parameters()})
    # Execute
    result = strategy.start(grid, initial, num_rounds=2)
    # Assert
    final = result.arrays.to_torch_state_dict()
    changed = {n for n, t in initial.to_torch_state_dict().items() if not torch.equal(t, final[n])}
    assert changed and all(n.startswith("model.layers.") for n in changed)


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("update-rule", "sgd", "update-rule"),
        ("num-server-rounds", -1, "num-server-rounds"),
        ("block-schedule", "side ways", "block-schedule"),  # registered or not: at start
        ("lr", "fast", "lr"),
    ],
)
def test_bad_run_config_names_the_key(tiny_run_config, key, value, fragment):
    with pytest.raises(ConfigError, match=fragment):
        RunConfig.from_run_config(dict(tiny_run_config, **{key: value}))


def test_more_clients_than_nodes_stops_at_start(tiny_run_config, tmp_path):
    config = dict(tiny_run_config, **{"clients-per-round": 8})
    with pytest.raises(ConfigError, match="clients-per-round"):
        run_server(make_grid(config, tmp_path, num_nodes=3), RunConfig.from_run_config(config),
                   node_wait_s=0.0)


def test_client_rejects_a_different_base_model(tiny_run_config, tmp_path):
    # Prepare: the server announces another pretrained model
    run = RunConfig.from_run_config(tiny_run_config)
    grid = make_grid(tiny_run_config, tmp_path, num_nodes=2)
    _, strategy, _ = make_strategy(run)
    strategy.base_hash = "0" * 64
    # Execute
    play_round(strategy, grid, 1)
    # Assert: both nodes excluded, both blocks re-queued, nothing trained
    assert len(strategy.excluded) == 2
    assert "pretrained weights differ" in next(iter(strategy.excluded.values()))
    assert strategy.history[0].failed_blocks == ["layer.0", "layer.1"]


def test_node_whose_budget_fits_nothing_is_told_and_left_out(tiny_run_config, tmp_path):
    # Prepare: node 0 declares 1 MB, far below any rule's estimate; node 1 declares plenty
    config = dict(tiny_run_config, **{"clients-per-round": 2})
    budgets = {0: 1.0, 1: 50_000.0, 2: 0.0}
    grid = LoopbackGrid(client_app, 3, config, node_config=lambda i: {
        "cache-dir": str(tmp_path / "cache"), "memory-budget-mb": budgets[i]})
    run = RunConfig.from_run_config(config)
    _, strategy, _ = make_strategy(run)
    # Execute
    for server_round in (1, 2, 3, 4):
        play_round(strategy, grid, server_round)
    # Assert: the small node was told why and excluded; the run went on; budgets were learnt
    small, large = 1001, 1002
    assert "memory-budget-mb = 1 fits no update rule" in strategy.excluded[small]
    told = next(i for i, h in enumerate(strategy.history) if small in h.clients)
    assert all(small not in h.clients for h in strategy.history[told + 1:])
    assert strategy.budgets[large] == 50_000.0
    assert all(strategy.versions[b] > 0 for b in ("layer.0", "layer.1", "layer.2", "layer.3"))


def test_run_config_defaults_match_pyproject():
    import tomllib

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    defaults = tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"]
    assert RunConfig.from_run_config(defaults) == RunConfig()
