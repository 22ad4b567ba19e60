"""A hard kill costs no round: a server killed anywhere (mid-round after its nodes trained and
moved past its checkpoint, or between any two checkpoint files) and resumed ends with the
model the uninterrupted run made, its first resumed round dropping nothing; summary.json
records each segment of the run; a stopped run writes a summary.json that says so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fedcybgd.client.app import app as client_app
from fedcybgd.config import RunConfig
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.server.app import run_server

ROUNDS = 3


class ServerKilled(BaseException):
    """Stands for SIGKILL: nothing in the server may catch it."""


def config_for(tiny_run_config: dict[str, Any], out: Path, **extra: Any) -> dict[str, Any]:
    """Every node trains every round (four nodes, one a block, four blocks): each holds exact
    copies of blocks it trained earlier and is sent deltas against them, and self-syncs the
    block it trains (a pending copy the next instruction promotes)."""
    return dict(tiny_run_config, **{"num-server-rounds": ROUNDS, "clients-per-round": 4,
                                    "clients-per-block": 1, "output-dir": str(out)}, **extra)


def run(config: dict[str, Any], cache: Path,
        on_checkpoint_file: Callable[[Path], None] | None = None) -> dict[str, Any]:
    grid = LoopbackGrid(client_app, 4, config, node_config=lambda i: {"cache-dir": str(cache)})
    return run_server(grid, RunConfig.from_run_config(config),
                      on_checkpoint_file=on_checkpoint_file)


def rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def killer(server_round: int, nth_file: int | str) -> Callable[[Path], None]:
    """A checkpoint-file hook that kills the server at ``server_round``'s save: after its
    ``nth_file``-th file (1: the first block file, when the round's replies are read and
    installed, its nodes trained and moved on), or after its ``state.json``."""
    state = {"saves": 0, "files": 0}

    def kill(path: Path) -> None:
        if state["saves"] == server_round - 1:
            state["files"] += 1
            if (nth_file == "state.json" and path.name == "state.json") or \
                    state["files"] == nth_file:
                raise ServerKilled
        if path.name == "state.json":
            state["saves"] += 1

    return kill


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The uninterrupted run: its output folder and summary."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1
    root = tmp_path_factory.mktemp("straight")
    tiny = {"model": "tiny-llama", "partitioner": "iid", "block-schedule": "ascending",
            "layers-per-block": 1, "train-embeddings": False, "train-head": False,
            "update-rule": "fo", "local-steps": 2, "batch-size": 4, "max-seq-len": 48,
            "lr": 1e-3, "eval-every": 1, "eval-examples": 16, "eval-batch-size": 16, "seed": 0}
    summary = run(config_for(tiny, root / "out"), root / "cache")
    return root / "out", summary


@pytest.mark.slow
@pytest.mark.parametrize(("kill_round", "nth_file"), [(3, 1), (3, 3), (2, "state.json")],
                         ids=["after-the-nodes-trained", "between-block-files", "after-state"])
def test_a_kill_anywhere_in_a_round_costs_no_round(straight, tiny_run_config, tmp_path,
                                                   kill_round, nth_file):
    # Prepare: the same run killed in a round's checkpoint: its nodes have trained, applied the
    # round's downloads (deltas against blocks they hold) and promotions, and keep pending
    # copies the checkpoint knows nothing of
    out_a, _ = straight
    config = config_for(tiny_run_config, tmp_path / "killed")
    with pytest.raises(ServerKilled):
        run(config, tmp_path / "cache", on_checkpoint_file=killer(kill_round, nth_file))
    # Execute
    summary = run(dict(config, resume=True), tmp_path / "cache")
    # Assert: no upload dropped, every block of every round installed, and the model the
    # uninterrupted run made, bit for bit
    resumed, uninterrupted = rows(tmp_path / "killed"), rows(out_a)
    assert [r["round"] for r in resumed] == list(range(ROUNDS + 1))
    assert [r.get("dropped") for r in resumed] == [r.get("dropped") for r in uninterrupted]
    assert all(not r["dropped"] and not r["failed_blocks"] for r in resumed[1:])
    assert [r.get("accepted") for r in resumed] == [r.get("accepted") for r in uninterrupted]
    a, b = weights(out_a), weights(tmp_path / "killed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert summary["status"] == "completed"
