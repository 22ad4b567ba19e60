"""The untrained model's evaluation kept on disk (``eval-cache``): shared by runs from the
same weights on the same rows, re-evaluated on any difference the evaluation can see."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from fedcybgd.config import RunConfig
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_model
from fedcybgd.server.common import Evaluator


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return load_model("tiny-llama")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # the evaluations alone go to a private folder (the converted model and tokenizer stay
    # where every test finds them)
    monkeypatch.setenv("FEDCYBGD_EVAL_CACHE", str(tmp_path / "evals"))
    return tmp_path / "evals"


def _evaluator(config: dict[str, Any], model: torch.nn.Module, **overrides: Any) -> Evaluator:
    return Evaluator(RunConfig.from_run_config(dict(config, **overrides)), LayerStack(model))


def test_a_second_run_from_the_same_weights_reads_round_0_from_the_cache(
        tiny_run_config, model, cache):
    # Prepare: a first run evaluates and stores
    first, cached = _evaluator(tiny_run_config, model).initial()
    assert not cached and len(list(cache.glob("*.json"))) == 1
    # Execute: another run of other training settings, from the same weights
    again, cached = _evaluator(tiny_run_config, model, lr=3e-2, seed=5, **{
        "update-rule": "lezo", "local-steps": 9, "upload-codec": "fp16"}).initial()
    # Assert: the same figures, not evaluated again
    assert cached and again == first


@pytest.mark.parametrize("overrides", [{"eval-examples": 8}, {"max-seq-len": 32},
                                       {"eval-split": "validation"}, {"eval-batch-size": 4},
                                       {"prompt-template": "Text: {text}\nSentiment:"}])
def test_any_setting_the_evaluation_reads_is_a_miss(tiny_run_config, model, cache, overrides):
    _evaluator(tiny_run_config, model).initial()
    fresh, cached = _evaluator(tiny_run_config, model, **overrides).initial()
    direct = _evaluator(tiny_run_config, model, **overrides)()
    assert not cached and fresh == direct


def test_other_weights_are_a_miss(tiny_run_config, model, cache):
    before, _ = _evaluator(tiny_run_config, model).initial()
    moved = copy.deepcopy(model)
    with torch.no_grad():
        next(iter(moved.parameters())).add_(0.5)
    after, cached = _evaluator(tiny_run_config, moved).initial()
    assert not cached and after.loss != before.loss


def test_eval_cache_false_evaluates_every_time_and_stores_nothing(tiny_run_config, model, cache):
    for _ in range(2):
        _, cached = _evaluator(tiny_run_config, model, **{"eval-cache": False}).initial()
        assert not cached
    assert not cache.exists()


@pytest.mark.parametrize("body", ["{not json", json.dumps({"loss": "NaN", "accuracy": 0.5,
                                                          "examples": 16}),
                                  json.dumps({"accuracy": 0.5})])
def test_a_damaged_entry_is_ignored_and_rewritten(tiny_run_config, model, cache, caplog, body):
    # Prepare: the entry of this evaluation, damaged
    good, _ = _evaluator(tiny_run_config, model).initial()
    (entry,) = cache.glob("*.json")
    entry.write_text(body)
    # Execute
    with caplog.at_level(logging.WARNING):
        result, cached = _evaluator(tiny_run_config, model).initial()
    # Assert: evaluated afresh, warned about, stored again
    assert not cached and result == good
    assert "evaluation cache: ignoring" in caplog.text
    assert json.loads(entry.read_text())["loss"] == good.loss


@pytest.mark.slow
def test_fedcybgd_and_fedavg_runs_share_round_0_and_say_so(tiny_run_config, model, cache,
                                                           tmp_path):
    # Prepare: a FedCyBGD run and a FedAvg-full run from the same pretrained weights
    from fedcybgd.client.app import app as client_app
    from fedcybgd.harness.loopback import LoopbackGrid
    from fedcybgd.server.app import run_server
    from fedcybgd.server.baselines import run_fedavg

    ours = dict(tiny_run_config, **{"num-server-rounds": 1, "output-dir": str(tmp_path / "a")})
    fedavg = dict(ours, **{"strategy": "fedavg", "output-dir": str(tmp_path / "b")})
    # Execute
    first = run_server(LoopbackGrid(client_app, 2, ours), RunConfig.from_run_config(ours),
                       node_wait_s=0.0)
    second = run_fedavg(LoopbackGrid(client_app, 2, fedavg), RunConfig.from_run_config(fedavg))
    # Assert: the second run's round 0 is the first's, and its row says it was not re-run
    rows = [[json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("a", "b")]
    assert "eval_cached" not in rows[0][0] and rows[1][0]["eval_cached"] == 1.0
    assert rows[1][0]["eval_loss"] == rows[0][0]["eval_loss"]
    assert second["initial_eval_loss"] == first["initial_eval_loss"]
    assert "eval_cached" not in rows[1][1]  # trained rounds are always evaluated


def test_the_eval_cache_folder_is_under_the_cache_folder_unless_overridden(
        monkeypatch, tmp_path):
    from fedcybgd.server.eval_cache import eval_cache_root

    monkeypatch.delenv("FEDCYBGD_EVAL_CACHE", raising=False)
    monkeypatch.setenv("FEDCYBGD_CACHE", str(tmp_path / "c"))
    assert eval_cache_root() == tmp_path / "c" / "evals"
    monkeypatch.setenv("FEDCYBGD_EVAL_CACHE", str(tmp_path / "e"))
    assert eval_cache_root() == tmp_path / "e"
