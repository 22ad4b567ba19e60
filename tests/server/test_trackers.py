"""Experiment trackers: a run with trackers = "tensorboard,mlflow,wandb" leaves event files, an
MLflow run and an offline W&B run whose numbers are the rows of metrics.jsonl; a tracker that
cannot work is named."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.server.trackers import Trackers, item_key, scalars, wandb_history, wandb_records


def test_a_run_feeds_tensorboard_mlflow_and_wandb_the_rows_of_metrics_jsonl(tiny_run_config,
                                                                              tmp_path):
    import mlflow
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedcybgd.client.app import app as client_app
    from fedcybgd.harness.loopback import LoopbackGrid
    from fedcybgd.server.app import run_server

    config = {**tiny_run_config, "trackers": "tensorboard,mlflow,wandb"}
    grid = LoopbackGrid(client_app, 2, config,
                        node_config=lambda i: {"cache-dir": str(tmp_path / f"cache-{i}")})
    summary = run_server(grid, RunConfig.from_run_config(config), node_wait_s=5)
    out = Path(config["output-dir"])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    want = {key: {r["round"]: v for r in rows for k, v in scalars(r).items() if k == key}
            for key in {k for r in rows for k in scalars(r)}}
    assert {"eval_loss", "train_loss", "bytes_up"} <= set(want)

    # TensorBoard: every scalar of every row, at its round
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for key, by_round in want.items():
        got = {e.step: e.value for e in events.Scalars(key)}
        assert got == pytest.approx(by_round, rel=1e-6), key
    assert events.Scalars("summary/final_eval_loss")[0].value == \
        pytest.approx(summary["final_eval_loss"], rel=1e-6)

    # MLflow: one finished run with the same numbers, the run config and the files
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("fedcybgd")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["lr"] == str(config["lr"])
    for key, by_round in want.items():
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert got == pytest.approx(by_round, rel=1e-6), key
    files = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "metrics.jsonl", "plots.png"} <= files

    # W&B (offline, the default): one run file under <output-dir>/wandb whose history rows are
    # the rows, with the run config, the summary and the files
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    run_file = next(run_dir.glob("run-*.wandb"))
    records = wandb_records(run_file)
    kinds = [r.WhichOneof("record_type") for r in records]
    got_rows = wandb_history(run_file)
    assert set(got_rows) == set(want)
    for key, by_round in want.items():
        assert got_rows[key] == pytest.approx(by_round, rel=1e-6), key
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    params = {item_key(i): json.loads(i.value_json) for i in run_record.config.update}
    assert params["lr"] == config["lr"]
    final = {item_key(i): json.loads(i.value_json) for r in records
             if r.WhichOneof("record_type") == "summary" for i in r.summary.update}
    assert final["summary/final_eval_loss"] == pytest.approx(summary["final_eval_loss"], rel=1e-6)
    assert kinds[-1] == "exit" and records[-1].exit.exit_code == 0
    assert {"summary.json", "metrics.jsonl", "plots.png"} <= {
        p.name for p in (run_dir / "files").iterdir()}


def test_an_unknown_tracker_or_a_missing_package_is_named(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"trackers: \['neptune'\] not known"):
        Trackers(RunConfig(trackers="tensorboard,neptune"), tmp_path)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ConfigError, match=r'needs mlflow .*pip install "fedcybgd\[trackers\]"'):
        Trackers(RunConfig(trackers="mlflow"), tmp_path)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r'needs wandb .*pip install "fedcybgd\[trackers\]"'):
        Trackers(RunConfig(trackers="wandb"), tmp_path)


def test_a_failing_tracker_is_dropped_and_the_rest_go_on(tmp_path, caplog):
    trackers = Trackers(RunConfig(trackers="tensorboard"), tmp_path)

    class Broken:
        def log_row(self, row):
            raise OSError("disk full")

        def finish(self, summary, files):
            raise AssertionError("a dropped tracker is not called again")

    trackers.sinks["broken"] = Broken()
    trackers.log_row({"round": 1, "eval_loss": 2.0})
    trackers.finish({"status": "completed"}, [])
    assert "tracker broken failed (OSError: disk full)" in caplog.text
    assert list(trackers.sinks) == ["tensorboard"]
