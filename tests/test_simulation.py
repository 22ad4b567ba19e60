"""The real app through `flwr run` on Flower's Simulation Engine (Ray), as `make demo` runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedcybgd.cli import demo

pytestmark = pytest.mark.slow


def test_flwr_run_simulation_completes(tmp_path: Path, private_flower: Path):
    # Prepare: a private Flower home and ports (the fixture), so the managed SuperLink is ours
    out = tmp_path / "out"
    overrides = ("model='tiny-llama' layers-per-block=1 num-server-rounds=2 clients-per-round=2 "
                 "local-steps=2 batch-size=4 max-seq-len=48 eval-examples=16")
    # Execute
    code = demo.main(["--nodes", "3", "--output-dir", str(out), "--run-config", overrides])
    # Assert
    assert code == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2]
    assert all(r["bytes_up"] > 0 and r["blocks"] for r in records[1:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and (out / "final" / "model.safetensors").exists()
