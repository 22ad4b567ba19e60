"""An arm64 SuperNode for real: one federated round on the node image built for linux/arm64.

The arm64 tier (``make test-arm64``; .ci/run runs it last). The node runs in a container of
``fedcybgd:0.1.0-arm64`` (qemu emulates it on an x86 machine), joins a SuperLink on 127.0.0.1
over TLS with node authentication and trains one round of ``fo`` on the tiny Llama, saved once
on this machine so both sides hold the same weights (``experiments/arm64_node.py``, case
``smoke``). The test checks that the node really ran as aarch64, finished the round and reported
its peak memory. Skipped, saying why, where no Docker engine runs or the arm64 image was not
built (``make test-arm64`` builds it first; its output says why a build failed).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "fedcybgd:0.1.0-arm64"

pytestmark = [pytest.mark.slow, pytest.mark.containers, pytest.mark.arm64,
              pytest.mark.timeout(3600)]


def _why_not() -> str | None:
    """Why the arm64 node cannot run here, or None."""
    if shutil.which("docker") is None:
        return "no `docker` command (.ci/run installs Debian's docker.io as root)"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60,
                      check=False).returncode != 0:
        return "the Docker engine is not running (scripts/prepare-docker-offline.sh --install)"
    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, timeout=60,
                      check=False).returncode != 0:
        return (f"no {IMAGE} image: `bash scripts/prepare-docker-offline.sh --install "
                "--platform linux/arm64` builds it (make test-arm64 runs it first)")
    return None


def test_arm64_node_completes_a_round(tmp_path: Path) -> None:
    reason = _why_not()
    if reason is not None:
        warnings.warn(f"arm64 node test skipped: {reason}", stacklevel=1)
        pytest.skip(reason)
    out = tmp_path / "arm64"
    proc = subprocess.run(
        [sys.executable, "experiments/arm64_node.py", "--only", "smoke",
         "--platforms", "linux/arm64", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=3300, check=False)
    log = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert (out / "results.json").is_file(), log
    (row,) = json.loads((out / "results.json").read_text())
    print(json.dumps(row))
    assert proc.returncode == 0, log
    assert row["status"] == "finished:completed", (row["reason"], log)
    assert row["node_machine"] == "aarch64", row
    assert row["rules"] == ["fo"] and row["rounds"] == 1, row
    assert row["client_peak_mem_mb"] > 100, row
    assert row["client_train_s"][0] > 0, row
