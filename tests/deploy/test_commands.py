"""The commands a user types work twice, tell the truth, and stop what they started.

``make demo`` (``fedcybgd demo``, the module ``fedcybgd.cli.demo``) and ``make deploy-local``
(``fedcybgd deploy-local``, ``fedcybgd.deploy.local``) as a user runs them: back to back, with
data that cannot be read, and interrupted with Ctrl-C. The demo run twice into one folder is
tests/harness/test_reproducible.py's Simulation Engine test (the rerun replaces the outputs
and gives the same metrics).
"""

from __future__ import annotations

import csv
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fedcybgd.cli.demo import stop_local_superlink
from fedcybgd.deploy import local

ROOT = Path(__file__).resolve().parents[2]
TINY = ("model='tiny-llama' eval-examples=16 local-steps=2 batch-size=4 layers-per-block=1 "
        "clients-per-block=1 clients-per-round=2")
LABEL_ERROR = "is not a class index 0..1 nor one of label-words"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bad_csv(path: Path) -> Path:
    """A training file whose labels are all outside the classes."""
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for i in range(30):
            writer.writerow([f"a short review number {i}", "maybe"])
    return path


def demo_env(home: Path) -> dict[str, str]:
    """The user's environment with a private Flower home and managed-SuperLink ports."""
    return {**os.environ, "FLWR_HOME": str(home),
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
            "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port())}


def started_under(home: Path) -> list[str]:
    """The processes whose environment has ``FLWR_HOME=home``: what the demo started."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.environ().get("FLWR_HOME") == str(home):
                found.append(" ".join(proc.info["cmdline"] or [])[:120])
        except psutil.Error:
            continue
    return found


def cmdline(proc: psutil.Process) -> str:
    """``proc``'s command line; empty for one that has exited since it was listed."""
    try:
        return " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return ""


def stop_gracefully(proc: subprocess.Popen[str]) -> None:
    """A command a failed test leaves running: Ctrl-C first, so it stops what it started
    (SIGKILL would orphan its SuperLink and SuperNodes), SIGKILL only if that does not work."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def as_in_a_terminal(command: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """``command`` in a session of its own, SIGINT handled as in a terminal, output piped."""
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def read_until(proc: subprocess.Popen[str], marker: str) -> None:
    """Read ``proc``'s output up to the first line holding ``marker``; fail if it ends first."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            return
    pytest.fail(f"the command ended before {marker!r}: " + "".join(seen[-30:]))


@pytest.mark.slow
def test_the_demo_exits_1_for_a_run_whose_data_cannot_be_read(tmp_path):
    # Prepare
    home = tmp_path / "flwr-home"
    data = bad_csv(tmp_path / "bad.csv")
    # Execute
    try:
        done = subprocess.run(
            [sys.executable, "-m", "fedcybgd.cli.demo", "--nodes", "2", "--output-dir",
             str(tmp_path / "out"), "--run-config", f"{TINY} dataset='{data}'"],
            cwd=ROOT, env=demo_env(home), capture_output=True, text=True, timeout=600,
            check=False)
    finally:
        stop_local_superlink(home)
    # Assert: non-zero, with the file's error; no model, and no closing "outputs:" line
    # listing what the run wrote (the launcher's start line names the folder it would use)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert LABEL_ERROR in done.stderr and str(data) in done.stderr
    assert not [line for line in done.stdout.splitlines() if line.startswith("outputs:")]
    assert not (tmp_path / "out" / "final").exists()


@pytest.mark.slow
def test_ctrl_c_stops_the_demo_s_run_and_everything_it_started(tmp_path):
    # Prepare: a demo long enough to be interrupted mid-run, in a session of its own with
    # SIGINT handled as in a terminal
    home = tmp_path / "flwr-home"
    command = [sys.executable, "-m", "fedcybgd.cli.demo", "--nodes", "2", "--output-dir",
               str(tmp_path / "out"), "--run-config", f"{TINY} num-server-rounds=500"]
    proc = as_in_a_terminal(command, demo_env(home))
    try:
        read_until(proc, "round 3/500")
        running = started_under(home)
        # Execute: Ctrl-C, as the terminal sends it, to the demo's whole process group
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.communicate(timeout=120)[0]
        code = proc.returncode
        time.sleep(2.0)
        left = started_under(home)
    finally:
        stop_gracefully(proc)
        stop_local_superlink(home)
    # Assert: the SuperLink, SuperExec and simulation were running; now nothing is, the run
    # was stopped (not left to go on) and the demo says so with the interrupt's exit status
    assert any("flower-superlink" in c for c in running), running
    assert any("flwr-simulation" in c for c in running), running
    assert left == [], left
    assert code == 130, rest[-3000:]
    assert "stopped" in rest.splitlines()[-1], rest[-3000:]


@pytest.mark.slow
def test_deploy_local_twice_then_a_failing_run_says_why(tmp_path, monkeypatch, capsys):
    # Prepare: the default output folder, in a temporary place
    out = tmp_path / "deploy-local"
    monkeypatch.setattr(local, "DEFAULT_OUTPUT_DIR", out)
    data = bad_csv(tmp_path / "bad.csv")
    # Execute: `make deploy-local QUICK=1 NODES=2` twice (one round is enough to show the
    # second replaces the first), then with data nobody can read
    one_round = ["--run-config", "num-server-rounds=1"]
    first = local.main(["--quick", "--nodes", "2", *one_round])
    first_out = capsys.readouterr().out
    second = local.main(["--quick", "--nodes", "2", *one_round])
    second_out = capsys.readouterr().out
    rows = (out / "metrics.jsonl").read_text().splitlines()
    failed = local.main(["--quick", "--nodes", "2", "--run-config", f"dataset='{data}'"])
    failed_std = capsys.readouterr()
    # Assert: both runs completed, the second replaced the first's outputs; the failing run
    # exits 1 with the file's error and lists no model of an earlier run
    assert first == 0 and "status: finished:completed" in first_out
    assert second == 0 and "status: finished:completed" in second_out, second_out
    assert "final/" in second_out.splitlines()[-2]
    assert len(rows) == 2  # rounds 0-1 of the second run only: the first's were replaced
    assert failed == 1
    assert "status: finished:failed" in failed_std.out
    why = [x for x in failed_std.err.splitlines() if x.startswith("why: ")]
    assert why and LABEL_ERROR in why[0] and str(data) in why[0], failed_std.err
    listed = [x for x in failed_std.out.splitlines() if x.startswith("outputs: ")]
    assert listed and "final/" not in listed[0] and "checkpoint/" not in listed[0], listed


@pytest.mark.slow
def test_ctrl_c_stops_deploy_local_and_everything_it_started(tmp_path):
    # Prepare: a long quick run on 2 nodes, in a session of its own, SIGINT as in a terminal
    command = [sys.executable, "-m", "fedcybgd.deploy.local", "--quick", "--nodes", "2",
               "--output-dir", str(tmp_path / "out"), "--run-config", "num-server-rounds=500"]
    proc = as_in_a_terminal(command, dict(os.environ))
    try:
        read_until(proc, "submitted")
        deadline = time.monotonic() + 120
        while not (metrics := tmp_path / "out" / "metrics.jsonl").is_file() or \
                len(metrics.read_text().splitlines()) < 2:  # round 1 closed: all are at work
            assert time.monotonic() < deadline and proc.poll() is None, "no round closed"
            time.sleep(1.0)
        started = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(cmdline(p) for p in started)
        # the API ports of the SuperLink and the SuperNodes: a ClientApp (started per message,
        # so perhaps not running at this instant) dials its SuperNode's
        ports = set(re.findall(r"--port (\d+)", names))
        # Execute: Ctrl-C to the launcher's process group
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.communicate(timeout=120)[0]
        code = proc.returncode
        left = [p for p in started if cmdline(p)]  # still running (not even a zombie)
        left += [p for p in psutil.process_iter() if "flwr-clientapp" in cmdline(p) and any(
            f"127.0.0.1:{port} " in cmdline(p) for port in ports)]
    finally:
        stop_gracefully(proc)
    # Assert: SuperLink, SuperNodes and ServerApp had started; nothing they started is left,
    # ClientApps included
    assert len(ports) == 3, names
    for name in ("flower-superlink", "flower-supernode", "flwr-serverapp"):
        assert name in names, names
    assert left == [], [p.cmdline() for p in left]
    assert code == 130 and "interrupted" in rest, rest[-3000:]
