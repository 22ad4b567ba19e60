"""The experiments harness end to end on the smoke profile (tiny random model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_harness(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "experiments/run_experiments.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_smoke_profile_writes_results_table_and_plots(tmp_path):
    # Prepare: two methods of the smoke profile, the seed check included
    common = ["--profile", "smoke", "--results", str(tmp_path / "results"),
              "--work", str(tmp_path / "work")]
    # Execute
    done = run_harness(*common, "--only", "fedavg-full,fedcybgd-fo")
    # Assert
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "results" / "smoke"
    saved = json.loads((out / "results.json").read_text())
    assert list(saved["runs"]) == ["fedavg-full@dirichlet", "fedcybgd-fo@dirichlet",
                                   "fedcybgd-fo@movie", "fedcybgd-fo@dirichlet@seed1"]
    full, ours = saved["runs"]["fedavg-full@dirichlet"], saved["runs"]["fedcybgd-fo@dirichlet"]
    # same client-rounds; FedAvg moves the whole model, FedCyBGD one block at a time
    assert full["client_rounds"] == ours["client_rounds"] == 4
    assert full["wire_bytes_up"] > 10 * ours["wire_bytes_up"]
    assert ours["config"]["partitioner"] == "dirichlet"
    assert saved["runs"]["fedcybgd-fo@movie"]["config"]["partitioner"] == "movie"
    assert saved["runs"]["fedcybgd-fo@dirichlet@seed1"]["config"]["seed"] == 1
    table = (out / "table.md").read_text()
    assert "## Targets" in table and "[dirichlet] FedCyBGD-fo >= 50x less total traffic" in table
    assert "seeds [0, 1]" in table
    for plot in ("accuracy_vs_round", "accuracy_vs_bytes", "client_memory"):
        assert (out / f"{plot}.png").stat().st_size > 1000
    assert not (tmp_path / "work" / "smoke" / "fedcybgd-fo@dirichlet").exists()  # weights gone
    # the report is rebuilt from results.json alone, identically
    (out / "table.md").unlink()
    again = run_harness(*common, "--report-only")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "table.md").read_text() == table


def test_unknown_method_in_a_profile_is_named(tmp_path):
    # Prepare
    profile = (ROOT / "experiments" / "configs" / "smoke.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(profile.replace('movie = ["fedcybgd-fo"]', 'movie = ["fedcybgd-nope"]'))
    # Execute
    done = run_harness("--profile", str(bad), "--results", str(tmp_path))
    # Assert
    assert done.returncode != 0 and "fedcybgd-nope" in done.stderr
