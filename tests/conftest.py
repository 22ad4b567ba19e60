"""Shared fixtures: offline hub, Flower task identity, tiny-model run configs."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Round-0 evaluations the tests cache stay in a folder of this session (subprocesses inherit
# it), not in the user's ~/.cache/fedcybgd/evals.
os.environ.setdefault("FEDCYBGD_EVAL_CACHE", tempfile.mkdtemp(prefix="fedcybgd-evals-"))
# Under pytest-xdist (make test: one worker per core) torch's intra-op threads, one per core
# by default in each worker and in every process a test starts, would make the workers fight
# over the same cores: one thread each.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.supercore.task_identity import TaskIdentity


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with the most whole-run (``slow``) tests first, each file's tests kept together
    and in order: under ``--dist loadfile`` the longest files start early, so no worker is left
    with a long file at the end while the other has nothing to do."""
    slow: dict[str, int] = {}
    for item in items:
        slow[item.nodeid.split("::")[0]] = slow.get(item.nodeid.split("::")[0], 0) + \
            int(item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.nodeid.split("::")[0]])  # stable: order within


@pytest.fixture(autouse=True)
def _flower_task_identity() -> Iterator[None]:
    """Building an instruction Message outside a Flower runtime needs a task identity."""
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = 1
    TaskIdentity.task_id = 1
    yield


@pytest.fixture
def tiny_run_config(tmp_path: Path) -> dict[str, Any]:
    """A run config for a 4-layer tiny Llama that trains in well under a second per round."""
    return {
        "model": "tiny-llama",
        "partitioner": "iid",
        "num-server-rounds": 2,
        "clients-per-round": 2,
        "clients-per-block": 1,
        "block-schedule": "ascending",
        "layers-per-block": 1,
        "train-embeddings": False,
        "train-head": False,
        "update-rule": "fo",
        "local-steps": 2,
        "batch-size": 4,
        "max-seq-len": 48,
        "lr": 1e-3,
        "eval-every": 1,
        "eval-examples": 16,
        "eval-batch-size": 16,
        "output-dir": str(tmp_path / "out"),
        "seed": 0,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def private_flower(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private Flower home and private local-SuperLink ports, so the managed SuperLink that
    `flwr run . local` starts is this test's alone (another `flwr run` on the machine, e.g. a
    `make demo`, would otherwise share the fixed default port and be stopped with it)."""
    home = tmp_path / "flwr-home"
    monkeypatch.setenv("FLWR_HOME", str(home))
    monkeypatch.setenv("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", str(_free_port()))
    monkeypatch.setenv("FLWR_LOCAL_CONTROL_API_PORT", str(_free_port()))
    return home
