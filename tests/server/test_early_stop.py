"""Early stopping: the rule on a sequence of evaluations, its state rebuilt from the metrics
rows, the settings it needs, and a run that ends early saying why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.server.early_stop import EarlyStop


def _stop(**keys) -> EarlyStop:
    stop = EarlyStop.of(RunConfig.from_run_config(keys))
    assert stop is not None
    return stop


def test_patience_counts_evaluations_without_an_improvement_beyond_min_delta():
    stop = _stop(**{"early-stop-patience": 2, "early-stop-min-delta": 0.05})
    assert stop.observe(3.0, 0.1) is None  # round 0: the first, the best
    assert stop.observe(2.9, 0.1) is None  # better by 0.1: an improvement
    assert stop.observe(2.87, 0.1) is None  # by 0.03 only: stale 1
    why = stop.observe(2.86, 0.1)  # stale 2: stop
    assert why is not None and "in 2 evaluations" in why and "best 2.9" in why


def test_the_metric_counts_upwards_and_a_target_ends_the_run():
    stop = _stop(**{"early-stop-metric": "metric", "early-stop-target": 0.8,
                    "early-stop-patience": 5})
    assert stop.observe(5.0, 0.5) is None
    assert stop.observe(9.0, 0.6) is None  # a worse loss does not matter here
    assert stop.stale == 0
    assert stop.observe(1.0, 0.55) is None and stop.stale == 1
    assert "metric 0.81 >= 0.8" in stop.observe(1.0, 0.81)


def test_a_broken_evaluation_is_no_improvement():
    stop = _stop(**{"early-stop-patience": 1})
    assert stop.observe(3.0, None) is None
    assert stop.observe(float("nan"), None) is not None


def test_the_state_is_rebuilt_from_the_rows_of_a_resumed_run():
    rows = [{"round": 0, "eval_loss": 3.0, "eval_accuracy": 0.1},
            {"round": 1},  # a round without an evaluation
            {"round": 2, "eval_loss": 3.2, "eval_accuracy": 0.1}]
    run = RunConfig.from_run_config({"early-stop-patience": 2})
    stop = EarlyStop.of(run, rows)
    assert stop is not None and (stop.best, stop.stale) == (3.0, 1)
    assert EarlyStop.of(RunConfig(), rows) is None  # off by default


@pytest.mark.parametrize(("keys", "fragment"), [
    ({"early-stop-patience": 2, "eval-every": 0}, "set eval-every > 0"),
    ({"early-stop-target": 0.9, "strategy": "fedavg"}, "covers FedCyBGD runs"),
    ({"early-stop-metric": "accuracy"}, "choose one of ['loss', 'metric']"),
])
def test_settings_early_stopping_cannot_use_are_refused(keys, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        RunConfig.from_run_config(keys)


@pytest.mark.slow
def test_a_run_that_stops_improving_ends_early_and_says_why(tiny_run_config, tmp_path):
    from fedcybgd.client.app import app as client_app
    from fedcybgd.harness.loopback import LoopbackGrid
    from fedcybgd.server.app import run_server

    # A rate too small to move the loss by the min-delta: every evaluation is stale
    config = {**tiny_run_config, "num-server-rounds": 6, "lr": 1e-9, "eval-every": 1,
              "early-stop-patience": 2, "early-stop-min-delta": 0.01}
    grid = LoopbackGrid(client_app, 2, config,
                        node_config=lambda i: {"cache-dir": str(tmp_path / f"cache-{i}")})
    summary = run_server(grid, RunConfig.from_run_config(config), node_wait_s=5)
    rows = [json.loads(x) for x in
            (Path(config["output-dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert summary["status"] == "completed" and summary["rounds_run"] == 2
    assert "in 2 evaluations (early-stop-patience = 2)" in summary["early_stop"]
    assert (Path(config["output-dir"]) / "final" / "config.json").exists()
