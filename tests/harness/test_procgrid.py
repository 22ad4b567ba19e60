"""The process grid's child process: it does not outlive the process that spawned it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    """Running (a zombie that nobody reaps counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
def test_a_busy_child_stops_soon_after_its_parent_is_killed(tmp_path):
    # Prepare: a ClientApp that is still handling its message a minute later, and a parent
    # that reports the child's pid and then waits for the reply
    busy = tmp_path / "busy"
    (tmp_path / "sleepy.py").write_text(
        "import pathlib, time\n\ndef app(message, context):\n"
        f"    pathlib.Path({str(busy)!r}).touch()\n    time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from flwr.app import Message, MessageType, RecordDict
        from fedcybgd.harness.procgrid import ProcessGrid
        grid = ProcessGrid("sleepy:app", 1, {{}})
        print(grid._process.pid, flush=True)
        node = next(iter(grid.get_node_ids()))
        message = Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
        grid.push_messages([message])
    """)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 60
    while not busy.exists() and time.monotonic() < deadline:  # the app is handling it
        time.sleep(0.1)
    assert busy.exists() and _alive(child)
    # Execute: the parent dies without closing the grid
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 15
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    # Assert: the child is gone long before its message would have ended
    still = _alive(child)
    if still:
        os.kill(child, signal.SIGKILL)
    assert not still, "the client process outlived its parent"
