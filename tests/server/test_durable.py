"""Durable server state: verified checkpoints, fsync'd writes, one metrics row per round, and
the output-folder rule (no run starts over another's outputs unless told to)."""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from fedcybgd.client.app import app as client_app
from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.core import atomic
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.model.loading import load_model
from fedcybgd.server import app as server_app
from fedcybgd.server import checkpoint as checkpoint_module
from fedcybgd.server.app import run_server
from fedcybgd.server.baselines import run_fedavg
from fedcybgd.server.checkpoint import Checkpointer, CheckpointError
from fedcybgd.server.metrics import MetricsWriter


class ServerKilled(BaseException):
    """Stands for SIGKILL: nothing in the server may catch it."""


def block(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3,), value)}


def grid_for(config: dict[str, Any], cache: Path, nodes: int = 4) -> LoopbackGrid:
    return LoopbackGrid(client_app, nodes, config,
                        node_config=lambda i: {"cache-dir": str(cache)})


def run(config: dict[str, Any], cache: Path,
        on_checkpoint_file: Callable[[Path], None] | None = None) -> dict[str, Any]:
    return run_server(grid_for(config, cache), RunConfig.from_run_config(config),
                      on_checkpoint_file=on_checkpoint_file)


def rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_model(str(a)), load_model(str(b))
    return all(torch.allclose(pa, pb, atol=1e-6) for pa, pb in
               zip(wa.parameters(), wb.parameters(), strict=True))


# ------------------------------------------------------------------------------- checkpoints


def test_resave_after_an_interrupted_save_keeps_the_new_content(tmp_path, monkeypatch):
    # Prepare: round 1 saved; round 2's save dies after its block file, before state.json
    Checkpointer(tmp_path).save(1, {"a": (1, block(0.0))}, {})

    def disk_gone(*args: Any) -> None:
        raise OSError("disk gone")

    with monkeypatch.context() as m:
        m.setattr(checkpoint_module, "write_bytes", disk_gone)
        with pytest.raises(OSError):
            Checkpointer(tmp_path).save(2, {"a": (2, block(1.0))}, {})
    # Execute: the restarted server loads round 1 and trains round 2 again, to other values
    restarted = Checkpointer(tmp_path)
    state, _ = restarted.load()
    restarted.save(2, {"a": (2, block(2.0))}, {})
    # Assert: the checkpoint holds what the second attempt saved, not the first
    state, blocks = Checkpointer(tmp_path).load()
    assert state["round"] == 2
    assert torch.equal(blocks["a"]["w"], torch.full((3,), 2.0))


def test_kill_between_block_files_and_state_keeps_the_previous_checkpoint(tmp_path, caplog):
    # Prepare: a server killed right after the first block file of round 2
    Checkpointer(tmp_path).save(1, {"a": (1, block(0.0)), "b": (1, block(0.5))}, {"x": 1})

    def kill(path: Path) -> None:
        if path.name != "state.json":
            raise ServerKilled

    with pytest.raises(ServerKilled):
        Checkpointer(tmp_path, on_file_written=kill).save(
            2, {"a": (2, block(1.0)), "b": (2, block(1.5))}, {"x": 2})
    # Execute
    restarted = Checkpointer(tmp_path)
    state, blocks = restarted.load()
    with caplog.at_level(logging.WARNING, logger="fedcybgd.server.checkpoint"):
        restarted.save(2, {"a": (2, block(3.0)), "b": (2, block(3.5))}, {"x": 2})
    # Assert: round 1 intact; the orphan file was removed by name on the next save
    assert state["round"] == 1 and state["x"] == 1
    assert torch.equal(blocks["a"]["w"], torch.full((3,), 0.0))
    assert "no checkpoint refers to" in caplog.text and "a@v2-" in caplog.text
    _, blocks = Checkpointer(tmp_path).load()
    assert torch.equal(blocks["a"]["w"], torch.full((3,), 3.0))
    assert len(list(tmp_path.glob("*.safetensors"))) == 2


@pytest.mark.parametrize("damage", ["altered", "truncated", "missing"])
def test_load_refuses_a_block_file_that_is_not_what_state_names(tmp_path, damage):
    # Prepare
    Checkpointer(tmp_path).save(1, {"a": (1, block(1.0))}, {})
    file = next(tmp_path.glob("a@v1*.safetensors"))
    if damage == "altered":
        save_file(block(9.0), str(file))  # a valid file with other content
    elif damage == "truncated":
        file.write_bytes(file.read_bytes()[:-4])
    else:
        file.unlink()
    # Execute / Assert: a clear error naming the file
    with pytest.raises(CheckpointError, match=f"checkpoint file .*{file.name}"):
        Checkpointer(tmp_path).load()


def test_load_refuses_a_state_file_of_the_old_format(tmp_path):
    # Prepare: state.json as written before checksums (block -> "name@vN.safetensors")
    save_file(block(1.0), str(tmp_path / "a@v1.safetensors"))
    (tmp_path / "state.json").write_text(json.dumps(
        {"round": 1, "block_files": {"a": "a@v1.safetensors"}}))
    # Execute / Assert
    with pytest.raises(CheckpointError, match=r"format 1.*overwrite = true"):
        Checkpointer(tmp_path).load()


def test_atomic_writes_fsync_the_file_and_its_folder(tmp_path, monkeypatch):
    # Prepare: record what each fsync was called on
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    # Execute / Assert: every kind of write makes its data and its directory entry durable
    atomic.save_tensors(tmp_path / "t.safetensors", block(1.0))
    assert synced == ["file", "dir"]
    synced.clear()
    atomic.write_bytes(tmp_path / "new" / "s.json", b"{}")
    assert synced.count("file") == 1 and synced.count("dir") >= 2  # new folder + its entry
    synced.clear()
    writer = MetricsWriter(tmp_path / "out")
    synced.clear()
    writer.write({"round": 0})
    assert synced == ["file"]


# ------------------------------------------------------------------------------- metrics rows


def test_metrics_resume_drops_later_rows_and_skips_torn_lines(tmp_path, caplog):
    # Prepare: rows 0..3, a garbled line, and a torn last line without its newline
    lines = [json.dumps({"round": r}) for r in range(4)] + ["#garbage", '{"round": 4, "bl']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[:4]) + "\n" + lines[4] + "\n"
                                            + lines[5])
    # Execute: resume from the checkpoint of round 2
    with caplog.at_level(logging.WARNING, logger="fedcybgd.server.metrics"):
        writer = MetricsWriter(tmp_path, keep_through=2)
    writer.write({"round": 3, "x": 1.0})
    # Assert
    assert [r["round"] for r in writer.records] == [0, 1, 2, 3]
    assert [r["round"] for r in rows(tmp_path)] == [0, 1, 2, 3]
    assert rows(tmp_path)[-1] == {"round": 3, "x": 1.0}
    assert "line 5 is torn or unreadable" in caplog.text
    assert "line 6 is torn or unreadable" in caplog.text
    assert "line 4: dropping the row of round 3" in caplog.text


@pytest.mark.slow
def test_redone_round_appears_once_in_metrics(tiny_run_config, tmp_path, monkeypatch):
    # Prepare: a 3-round run whose server dies while checkpointing round 2
    config = dict(tiny_run_config, **{"num-server-rounds": 3})
    out = Path(config["output-dir"])

    class DiesInRound2(Checkpointer):
        def save(self, server_round: int, *args: Any, **kwargs: Any) -> None:
            if server_round == 2:
                raise ServerKilled
            super().save(server_round, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(server_app, "Checkpointer", DiesInRound2)
        with pytest.raises(ServerKilled):
            run(config, tmp_path / "cache")
    # Execute
    run(dict(config, resume=True), tmp_path / "cache")
    # Assert
    assert [r["round"] for r in rows(out)] == [0, 1, 2, 3]


@pytest.mark.slow
def test_kill_between_checkpoint_and_its_row_restores_the_row(tiny_run_config, tmp_path,
                                                              monkeypatch):
    # Prepare: the server dies after checkpointing round 2, before writing its metrics row
    config = dict(tiny_run_config, **{"num-server-rounds": 3})
    out = Path(config["output-dir"])
    real_write = MetricsWriter.write

    def write(self: MetricsWriter, record: dict[str, Any]) -> None:
        if record["round"] == 2:
            raise ServerKilled
        real_write(self, record)

    with monkeypatch.context() as m:
        m.setattr(MetricsWriter, "write", write)
        with pytest.raises(ServerKilled):
            run(config, tmp_path / "cache")
    # Execute
    run(dict(config, resume=True), tmp_path / "cache")
    # Assert: round 2 (not redone) got its row from the checkpoint
    records = rows(out)
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    assert records[2]["blocks"] and records[2]["train_loss"] is not None


@pytest.mark.slow
def test_torn_last_metrics_line_does_not_stop_resume(tiny_run_config, tmp_path, caplog):
    # Prepare: 2 rounds done, then a torn write of a third row
    config = dict(tiny_run_config, **{"num-server-rounds": 2})
    out = Path(config["output-dir"])
    run(config, tmp_path / "cache")
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"round": 3, "blocks": ["lay')
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedcybgd"):
        run(dict(config, **{"num-server-rounds": 3, "resume": True}), tmp_path / "cache")
    # Assert
    assert [r["round"] for r in rows(out)] == [0, 1, 2, 3]
    assert "metrics.jsonl line 4 is torn or unreadable" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["first block file", "state.json"])
def test_killed_checkpoint_resumes_to_the_uninterrupted_model(tiny_run_config, tmp_path,
                                                              kill_at):
    # Prepare: the same 3-round run straight, and killed during round 2's checkpoint
    straight = dict(tiny_run_config, **{"num-server-rounds": 3,
                                        "output-dir": str(tmp_path / "straight")})
    killed = dict(straight, **{"output-dir": str(tmp_path / "killed")})
    run(straight, tmp_path / "cache-a")
    saves = {"state.json": 0}

    def kill(path: Path) -> None:
        if path.name == "state.json":
            saves["state.json"] += 1
        if saves["state.json"] == 1 and kill_at == "first block file" and \
                path.suffix == ".safetensors":
            raise ServerKilled  # round 2: a block file written, state.json not
        if saves["state.json"] == 2 and kill_at == "state.json":
            raise ServerKilled  # round 2: state.json written, old files not yet pruned

    with pytest.raises(ServerKilled):
        run(killed, tmp_path / "cache-b", on_checkpoint_file=kill)
    # Execute
    run(dict(killed, resume=True), tmp_path / "cache-b")
    # Assert: one row per round, and the model the uninterrupted run made
    assert [r["round"] for r in rows(tmp_path / "killed")] == [0, 1, 2, 3]
    assert same_weights(tmp_path / "straight" / "final", tmp_path / "killed" / "final")
    state = json.loads((tmp_path / "killed" / "checkpoint" / "state.json").read_text())
    files = {p.name for p in (tmp_path / "killed" / "checkpoint").iterdir()}
    assert files == {"state.json"} | {e["file"] for e in state["blocks"].values()}


@pytest.mark.slow
def test_resumed_quantized_install_run_ends_where_the_uninterrupted_one_does(tiny_run_config,
                                                                             tmp_path):
    # Prepare: four nodes on one block a round, installs rounded to int8 deltas (the server
    # keeps the rounding and each block's install payload, both checkpointed)
    straight = dict(tiny_run_config, **{
        "num-server-rounds": 6, "clients-per-round": 4, "clients-per-block": 0,
        "install-codec": "delta+int8+zstd", "output-dir": str(tmp_path / "straight")})
    stopped = dict(straight, **{"num-server-rounds": 3, "output-dir": str(tmp_path / "resumed")})
    run(straight, tmp_path / "cache-a")
    run(stopped, tmp_path / "cache-b")
    # Execute: the stopped run resumed to the same six rounds
    run(dict(stopped, **{"num-server-rounds": 6, "resume": True}), tmp_path / "cache-b")
    # Assert: the same rows' traffic and the same model as without the stop
    a, b = rows(tmp_path / "straight"), rows(tmp_path / "resumed")
    assert [r.get("bytes_down") for r in a] == [r.get("bytes_down") for r in b]
    assert same_weights(tmp_path / "straight" / "final", tmp_path / "resumed" / "final")


# ------------------------------------------------------------------------------- output folder


def test_second_fresh_run_refuses_the_used_output_dir(tiny_run_config, tmp_path):
    # Prepare
    out = Path(tiny_run_config["output-dir"])
    run(tiny_run_config, tmp_path / "cache")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    # Execute / Assert: refused at start, naming both ways out, nothing touched
    with pytest.raises(ConfigError, match=r"resume = true .* overwrite = true"):
        run(tiny_run_config, tmp_path / "cache")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_overwrite_replaces_the_outputs_and_says_so(tiny_run_config, tmp_path, caplog):
    # Prepare: an earlier run's outputs and a file of the user's
    out = Path(tiny_run_config["output-dir"])
    run(tiny_run_config, tmp_path / "cache")
    (out / "notes.txt").write_text("mine")
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedcybgd.server.outputs"):
        run(dict(tiny_run_config, overwrite=True), tmp_path / "cache")
    # Assert: each removal logged, the user's file kept, a complete new run
    for name in ("metrics.jsonl", "summary.json", "checkpoint", "final"):
        assert f"removing {out / name}" in caplog.text
    assert f"leaving {out / 'notes.txt'} in place" in caplog.text
    assert (out / "notes.txt").read_text() == "mine"
    assert [r["round"] for r in rows(out)] == [0, 1, 2]


@pytest.mark.slow
def test_the_launchers_logs_folder_does_not_count_as_outputs(tiny_run_config, tmp_path):
    # Prepare: fedcybgd.deploy.local writes <output-dir>/logs before the ServerApp starts
    out = Path(tiny_run_config["output-dir"])
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "superlink.log").write_text("...")
    # Execute
    run(tiny_run_config, tmp_path / "cache")
    # Assert
    assert (out / "logs" / "superlink.log").exists()
    assert [r["round"] for r in rows(out)] == [0, 1, 2]


def test_resume_and_overwrite_together_are_refused(tiny_run_config, tmp_path):
    config = dict(tiny_run_config, resume=True, overwrite=True)
    with pytest.raises(ConfigError, match="contradict"):
        run(config, tmp_path / "cache")


@pytest.fixture
def fedavg_config(tiny_run_config: dict[str, Any]) -> dict[str, Any]:
    return dict(tiny_run_config, **{"strategy": "fedavg", "fedavg-params": "full",
                                    "num-server-rounds": 1})


@pytest.mark.slow
def test_fedavg_follows_the_same_output_rule(fedavg_config, tmp_path):
    # Prepare: a folder holding an earlier run's metrics
    out = Path(fedavg_config["output-dir"])
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"round": 0}\n')
    grid = LoopbackGrid(client_app, 2, fedavg_config)
    # Execute / Assert: a fresh run is refused; resume is refused (no checkpoint to resume)
    with pytest.raises(ConfigError, match="not empty"):
        run_fedavg(grid, RunConfig.from_run_config(fedavg_config))
    with pytest.raises(ConfigError, match="keeps no checkpoint"):
        run_fedavg(grid, RunConfig.from_run_config(dict(fedavg_config, resume=True)))
    assert (out / "metrics.jsonl").read_text() == '{"round": 0}\n'
    # Execute: overwrite replaces it
    run_fedavg(grid, RunConfig.from_run_config(dict(fedavg_config, overwrite=True)))
    assert [r["round"] for r in rows(out)] == [0, 1]
