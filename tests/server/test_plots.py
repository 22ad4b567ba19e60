"""Each run writes ``plots.png`` next to ``metrics.jsonl``; a plotting failure never fails a run."""

from __future__ import annotations

import logging
import struct
from pathlib import Path
from typing import Any

import pytest

from fedcybgd.client.app import app as client_app
from fedcybgd.config import RunConfig
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.server import plots
from fedcybgd.server.app import run_server
from fedcybgd.server.baselines import run_fedavg

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG (from its IHDR chunk); fails on anything else."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", f"{path} is no PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def grid_for(config: dict[str, Any], tmp_path: Path) -> LoopbackGrid:
    return LoopbackGrid(client_app, 3, config,
                        node_config=lambda i: {"cache-dir": str(tmp_path / "cache")})


def test_fedcybgd_run_writes_plots_next_to_its_metrics(tiny_run_config, tmp_path):
    # Execute
    run_server(grid_for(tiny_run_config, tmp_path), RunConfig.from_run_config(tiny_run_config))
    # Assert: a real, non-trivial image beside metrics.jsonl
    out = tmp_path / "out"
    assert (out / "metrics.jsonl").exists()
    path = out / plots.PLOTS_FILE
    assert path.stat().st_size > 20_000
    width, height = png_size(path)
    assert width >= 1000 and height >= 600


def test_fedavg_run_writes_plots(tiny_run_config, tmp_path):
    config = dict(tiny_run_config, **{"strategy": "fedavg", "fedavg-params": "lora",
                                      "num-server-rounds": 1})
    run_fedavg(grid_for(config, tmp_path), RunConfig.from_run_config(config))
    assert png_size(tmp_path / "out" / plots.PLOTS_FILE)[0] >= 1000


def test_a_plotting_failure_is_a_named_warning_not_a_failed_run(tiny_run_config, tmp_path,
                                                                  monkeypatch, caplog):
    # Prepare: drawing fails
    def broken(*args: Any, **kwargs: Any) -> Path:
        raise RuntimeError("the canvas caught fire")

    monkeypatch.setattr(plots, "write_plots", broken)
    config = dict(tiny_run_config, **{"num-server-rounds": 1})
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedcybgd"):
        summary = run_server(grid_for(config, tmp_path), RunConfig.from_run_config(config))
    # Assert: the run finished and said why there are no plots
    assert summary["rounds"] == 1 and (tmp_path / "out" / "summary.json").exists()
    assert not (tmp_path / "out" / plots.PLOTS_FILE).exists()
    assert "could not write the plots" in caplog.text
    assert "RuntimeError: the canvas caught fire" in caplog.text


def test_plots_take_gaps_nulls_and_drops(tmp_path):
    # Records as metrics.jsonl has them: eval only now and then, a null loss, drops by reason
    records = [
        {"round": 0, "eval_loss": 5.0, "eval_accuracy": 0.5},
        {"round": 1, "bytes_down": 0, "bytes_up": 10**6, "train_loss": None,
         "client_peak_mem_mb": 700.0, "dropped": {}},
        {"round": 2, "bytes_down": 3 * 10**6, "bytes_up": 10**6, "train_loss": 4.0,
         "client_peak_mem_mb": 720.0, "dropped": {"outlier": 1, "no-reply": 1},
         "eval_loss": 4.5, "eval_accuracy": 0.6},
    ]
    path = plots.write_plots(tmp_path, records, "gaps")
    assert path == tmp_path / plots.PLOTS_FILE and png_size(path)[0] >= 1000


def test_plot_run_without_records_warns_and_returns_none(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="fedcybgd"):
        assert plots.plot_run(tmp_path, [], "empty") is None
    assert "ValueError: no round records to plot" in caplog.text
    assert not (tmp_path / plots.PLOTS_FILE).exists()


@pytest.mark.parametrize("records", [[{"round": "x"}], [{"eval_loss": 1.0}]])
def test_write_plots_refuses_records_without_rounds(tmp_path, records):
    with pytest.raises(ValueError, match="no round records"):
        plots.write_plots(tmp_path, records)
