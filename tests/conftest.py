"""Shared fixtures: offline hub, Flower task identity, tiny-model run configs."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import tempfile

# Where the environment sets PYTHONDONTWRITEBYTECODE (CI's machines do), every process a test
# starts (SuperLink, SuperNodes, a ClientApp per message, the harness's client) would compile
# the package's modules again: about 0.45 s a process, hundreds of processes. The tests let
# Python keep its bytecode (__pycache__ folders, git-ignored), as it does by default (this
# process too: below the imports).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Round-0 evaluations the tests cache stay in a folder of this session (subprocesses inherit
# it), not in the user's ~/.cache/fedcybgd/evals.
os.environ.setdefault("FEDCYBGD_EVAL_CACHE", tempfile.mkdtemp(prefix="fedcybgd-evals-"))
# Under pytest-xdist (make test: three workers on two cores) torch's intra-op threads, one per core
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

sys.dont_write_bytecode = False

# Seconds each test file took in a recorded `make test` (3 workers on 2 cores). Under
# `--dist loadfile --no-loadscope-reorder` files start in collection order, so the longest go
# first and no worker is left with a long file at the end while the others have nothing to do.
# A file missing from the record starts first. Refresh the record with
#     FEDCYBGD_RECORD_DURATIONS=tests/file_durations.json make test
FILE_DURATIONS = Path(__file__).with_name("file_durations.json")
_recorded: dict[str, float] = {}


def _test_file(nodeid: str) -> str:
    return nodeid.split("::")[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first by the recorded durations, each file's tests kept together and
    in order."""
    known = json.loads(FILE_DURATIONS.read_text()) if FILE_DURATIONS.is_file() else {}
    items.sort(key=lambda item: -known.get(_test_file(item.nodeid), math.inf))  # stable


_cpu_recorded: dict[str, float] = {}


def _cpu_seconds() -> float:
    """CPU seconds of this process and of every process it started that has ended."""
    own, ended = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + ended.ru_utime + ended.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With FEDCYBGD_RECORD_DURATIONS set, each test's CPU seconds (its own and those of the
    processes it started) go with its last report (``user_properties``)."""
    if not os.environ.get("FEDCYBGD_RECORD_DURATIONS"):
        return (yield)
    start = _cpu_seconds()
    item.user_properties.append(("cpu_start", start))
    return (yield)


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    """The CPU seconds since the test started, on its teardown report."""
    if call.when == "teardown" and os.environ.get("FEDCYBGD_RECORD_DURATIONS"):
        starts = [v for k, v in item.user_properties if k == "cpu_start"]
        if starts:
            item.user_properties.append(("cpu_s", _cpu_seconds() - starts[-1]))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add up each file's time (setup, call and teardown) and CPU seconds; under xdist the
    controller sees every worker's reports."""
    if os.environ.get("FEDCYBGD_RECORD_DURATIONS"):
        name = _test_file(report.nodeid)
        _recorded[name] = _recorded.get(name, 0.0) + report.duration
        for key, value in report.user_properties:
            if key == "cpu_s":
                _cpu_recorded[name] = _cpu_recorded.get(name, 0.0) + float(value)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With FEDCYBGD_RECORD_DURATIONS set, the controller writes the record (workers do not)."""
    target = os.environ.get("FEDCYBGD_RECORD_DURATIONS")
    if target and _recorded and not os.environ.get("PYTEST_XDIST_WORKER"):
        ordered = dict(sorted(((k, round(v, 1)) for k, v in _recorded.items()),
                              key=lambda kv: -kv[1]))
        Path(target).write_text(json.dumps(ordered, indent=1) + "\n")
        cpu = dict(sorted(((k, round(v, 1)) for k, v in _cpu_recorded.items()),
                          key=lambda kv: -kv[1]))
        Path(target).with_suffix(".cpu.json").write_text(json.dumps(cpu, indent=1) + "\n")


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
