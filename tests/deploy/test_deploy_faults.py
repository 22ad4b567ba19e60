"""Faults on a real loopback deployment.

- A SuperNode crashes (SIGKILL of its process group) in the middle of a round: the round ends
  when the SuperLink declares the node offline (no heartbeat for 2 x 30 s; it then answers the
  pending message with an error) or on ``round-timeout``, whichever comes first; the block the
  dead node was training goes back to the front of the queue and the next round trains it on a
  live node; the run ends ``finished:completed``.
- The ServerApp is stopped (``flwr stop``) after a checkpoint; a new run with ``resume=true``
  and the same ``output-dir`` continues from the last checkpointed round.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedcybgd.deploy.commands import merge_config
from fedcybgd.deploy.local import LocalDeployment

NODES = 3
# Flower marks a node offline after 2 missed heartbeats of 30 s; a round timeout above that
# keeps the crashed node out of the next round's sample, so the test does not depend on luck
# (the crashed round ends after about 60 s, when the SuperLink gives up on the node).
ROUND_TIMEOUT_S = 75.0
RUN_CONFIG: dict[str, object] = {
    "model": "tiny-llama",
    "partitioner": "iid",
    "layers-per-block": 1,
    "num-server-rounds": 2,
    "clients-per-round": 2,
    "clients-per-block": 1,  # each node its own block: the killed node's block is the lost one
    "eval-every": 0,
    "eval-examples": 16,
    "local-steps": 2,
    "batch-size": 4,
    "max-seq-len": 48,
    "round-timeout": ROUND_TIMEOUT_S,
}


@pytest.fixture
def deployment(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalDeployment]:
    dep = LocalDeployment(tmp_path / "state", tmp_path / "out" / "logs", threads_per_process=1)
    request.addfinalizer(dep.stop)
    yield dep


def _node_id(log: Path) -> str:
    match = re.search(r"SuperNode ID: (\d+)", log.read_text())
    assert match, f"no node id in {log}"
    return match.group(1)


def _wait_for_row(path: Path, server_round: int, timeout: float) -> float:
    """When (monotonic clock) ``metrics.jsonl`` first has the row of ``server_round``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line).get("round") == server_round:
                        return time.monotonic()
                except ValueError:
                    pass  # a line being written
        time.sleep(0.5)
    raise AssertionError(f"no row for round {server_round} in {path} after {timeout:.0f} s")


@pytest.mark.slow
def test_supernode_killed_mid_round_run_completes(deployment: LocalDeployment,
                                                  tmp_path: Path) -> None:
    out = tmp_path / "out"
    deployment.start_superlink()
    deployment.start_supernodes(NODES)
    deployment.wait_nodes(NODES)
    run_id = deployment.submit(merge_config(RUN_CONFIG, f"output-dir='{out}'"))

    # the first node that starts a ClientApp for round 1's training crashes before it can
    # reply (its first ClientApp answered the server's node-key query)
    nodes = {n: p for n, p in deployment.procs.items() if n.startswith("supernode")}
    victim = None
    deadline = time.monotonic() + 180
    while victim is None and time.monotonic() < deadline:
        for name, proc in nodes.items():
            if proc.log.read_text().count("Start `flwr-clientapp` process") >= 2:
                victim = name
                break
        time.sleep(0.2)
    assert victim is not None, "no SuperNode received a round-1 message"
    victim_id = _node_id(nodes[victim].log)
    deployment.kill_process(victim)
    killed_at = time.monotonic()
    round_1_done = _wait_for_row(out / "metrics.jsonl", 1, timeout=300)

    status = deployment.wait_run(run_id, timeout=300)
    deployment.save_run_log(run_id)
    assert status == "finished:completed"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, second = records[1], records[2]
    assert victim_id in first["clients"]
    assert len(first["failed_blocks"]) == 1, first
    lost = first["failed_blocks"][0]
    assert lost in first["blocks"]
    # the lost block is retried first, by live nodes, and succeeds
    assert second["blocks"][0] == lost, second
    assert second["failed_blocks"] == [], second
    assert victim_id not in second["clients"]
    # the dead node held round 1 up for at most the round timeout (plus evaluation and the
    # checkpoint); round_s also counts the round's start, here the one-time node-key queries
    assert round_1_done - killed_at <= ROUND_TIMEOUT_S + 30
    assert time.monotonic() - killed_at < 300


@pytest.mark.slow
def test_stopped_serverapp_resumes_from_checkpoint(deployment: LocalDeployment,
                                                   tmp_path: Path) -> None:
    out = tmp_path / "out"
    config = {**RUN_CONFIG, "num-server-rounds": 3}
    del config["round-timeout"]
    deployment.start_superlink()
    deployment.start_supernodes(NODES)
    deployment.wait_nodes(NODES)
    first = deployment.submit(merge_config(config, f"output-dir='{out}'"))
    state = out / "checkpoint" / "state.json"
    deadline = time.monotonic() + 240
    while not state.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert state.exists(), "no checkpoint after round 1"
    deployment.control.flwr("stop", str(first), deployment.control.name)
    assert deployment.wait_run(first, timeout=120).startswith("finished")
    deployment.save_run_log(first)
    done = json.loads(state.read_text())["round"]
    assert done < 3, "the run finished before it could be stopped"

    # The resumed run gets a round timeout. Once, on CI, it stalled past 300 s without one (cause
    # unknown; a lost reply is a candidate: a SuperNode works one message at a time and waits
    # for its reply); the round timeout is how a run gets past a lost reply (the block is
    # retried), and a timed-out wait now reports every process's log tail.
    resumed = f"output-dir='{out}' resume=true round-timeout={ROUND_TIMEOUT_S}"
    second = deployment.submit(merge_config(config, resumed))
    assert deployment.wait_run(second, timeout=600) == "finished:completed"
    log = deployment.save_run_log(second).read_text()
    assert f"after round {done}" in log  # "resuming from ... after round N"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 3
