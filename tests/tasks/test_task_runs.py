"""Every update rule and both FedAvg baselines train each task kind end to end (loopback grid
of the real ServerApp and ClientApp), and ``sft`` runs through ``flwr run``."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from fedcybgd.cli import demo


def write_sets(folder: Path) -> dict[str, dict[str, Any]]:
    """One small file per task kind, and the run-config keys that read it."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "sft.jsonl", "w", encoding="utf-8") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": f"What is {i} plus {i}?", "response": f"{2 * i}"})
                    + "\n")
    with open(folder / "chat.jsonl", "w", encoding="utf-8") as f:
        for i in range(40):
            chat = [{"role": "user", "content": f"Repeat {i}"},
                    {"role": "assistant", "content": f"{i}"}]
            f.write(json.dumps({"conversation": chat}) + "\n")
    with open(folder / "mc.jsonl", "w", encoding="utf-8") as f:
        for i in range(40):
            f.write(json.dumps({"q": f"Is {i} even?", "choices": ["yes", "no"],
                                "gold": "yes" if i % 2 == 0 else "no"}) + "\n")
    with open(folder / "topics.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["sentence", "topic"])
        for i in range(40):
            writer.writerow([f"text number {i}", ["sports", "politics", "science"][i % 3]])
    return {
        "sft": {"task": "sft", "dataset": str(folder / "sft.jsonl"), "max-new-tokens": 3},
        "chat": {"task": "sft", "dataset": str(folder / "chat.jsonl"),
                 "messages-field": "conversation", "max-new-tokens": 3},
        "multiple-choice": {"task": "multiple-choice", "dataset": str(folder / "mc.jsonl"),
                            "question-field": "q", "options-field": "choices",
                            "answer-field": "gold", "length-normalize": True},
        "classification": {"task": "classification", "dataset": str(folder / "topics.csv"),
                           "text-field": "sentence", "label-field": "topic",
                           "label-words": "sports,politics,science",
                           "prompt-template": "Text: {text}\nTopic:"},
    }


RULES = [{"update-rule": r} for r in ("fo", "zerolock", "lezo", "mezo")] + [
    {"strategy": "fedavg", "fedavg-params": p} for p in ("full", "lora")]


# Chat lists differ from prompt/response only in the encoding: one rule suffices for them.
GRID = [(kind, rule) for kind in ("sft", "multiple-choice", "classification") for rule in RULES]
GRID.append(("chat", RULES[0]))


def loopback_run(config: dict[str, Any], tmp_path: Path
                 ) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
    """``config`` run to its end on a 2-node loopback grid: its RunConfig, summary and rows."""
    from fedcybgd.client.app import app as client_app
    from fedcybgd.config import RunConfig
    from fedcybgd.harness.loopback import LoopbackGrid
    from fedcybgd.server.app import RUNNERS

    run = RunConfig.from_run_config(config)
    grid = LoopbackGrid(client_app, 2, config,
                        node_config=lambda i: {"cache-dir": str(tmp_path / "cache")})
    summary = RUNNERS[run.strategy](grid, run)
    rows = [json.loads(x) for x in (Path(config["output-dir"]) / "metrics.jsonl")
            .read_text().splitlines()]
    return run, summary, rows


@pytest.mark.parametrize(("kind", "rule"), GRID,
                         ids=[f"{k}-{'-'.join(map(str, r.values()))}" for k, r in GRID])
def test_every_rule_and_baseline_trains_every_task(kind, rule, tiny_run_config, tmp_path):
    # Prepare
    # zeroth-order steps need a larger lr to move the loss in one round, but not so large that
    # the server's screen drops the step as larger than the block's own weights (mezo's
    # dense z at 1e-2 is at that edge on the tiny model: its update RMS 0.073 vs 0.062)
    zo_lr = {"lezo": 1e-2, "mezo": 3e-3}.get(str(rule.get("update-rule")), 1e-3)
    config = {**tiny_run_config, **write_sets(tmp_path / "data")[kind], **rule,
              "num-server-rounds": 1, "eval-examples": 4, "lr": zo_lr}
    # Execute
    _, summary, rows = loopback_run(config, tmp_path)
    # Assert: the round trained (finite loss, an upload) and moved the held-out loss
    assert [r["round"] for r in rows] == [0, 1]
    assert rows[1]["train_loss"] is not None and rows[1]["bytes_up"] > 0
    assert rows[1]["examples"] > 0
    assert summary["final_eval_loss"] != summary["initial_eval_loss"]
    if kind in ("sft", "chat"):
        assert {"eval_exact_match", "eval_token_f1", "eval_perplexity"} <= set(rows[1])
    else:
        assert "eval_exact_match" not in rows[1]


@pytest.mark.parametrize("rule", [RULES[0], RULES[4]], ids=["fedcybgd", "fedavg"])
def test_sft_saves_sample_answers_per_evaluation_and_shows_the_last(rule, tiny_run_config,
                                                                    tmp_path, capsys):
    # Prepare: arithmetic chat data of one's own, evaluated before, after round 1 and at the end
    config = {**tiny_run_config, **write_sets(tmp_path / "data")["sft"], **rule,
              "num-server-rounds": 2, "eval-every": 1, "eval-examples": 5}
    # Execute
    _, summary, _ = loopback_run(config, tmp_path)
    printed = capsys.readouterr().out
    # Assert: one file per evaluation with the first rows' prompt, reference and answer; the
    # summary keeps the final ones and the closing table shows them
    out = Path(config["output-dir"])
    files = sorted(p.name for p in (out / "samples").iterdir())
    assert files == ["round-0000.json", "round-0001.json", "round-0002.json"]
    final = json.loads((out / "samples" / "round-0002.json").read_text())
    assert final["round"] == 2 and len(final["samples"]) == 3
    first = final["samples"][0]
    assert set(first) == {"prompt", "reference", "answer"}
    assert first["prompt"].startswith("What is ") and first["reference"].isdigit()
    assert summary["final_samples"] == final["samples"]
    assert "Sample answers after training" in printed and "What is " in printed


def test_classification_saves_no_samples(tiny_run_config, tmp_path):
    # Execute
    config = {**tiny_run_config, "num-server-rounds": 1, "eval-examples": 4}
    _, summary, _ = loopback_run(config, tmp_path)
    # Assert
    assert summary["final_samples"] == []
    assert not (Path(config["output-dir"]) / "samples").exists()


def test_the_builtin_tomi_dataset_alone_trains_sft_on_dirichlet_shares(tiny_run_config,
                                                                       tmp_path):
    # Prepare: dataset = "tomi" and nothing else of the task (task = auto -> sft, its fields,
    # dirichlet over its question types)
    import importlib.metadata

    try:
        importlib.metadata.distribution("evals")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the 'evals' package (tomi's data) is not installed: make install")
    config = {**tiny_run_config, "dataset": "tomi", "partitioner": "dirichlet",
              "num-server-rounds": 1, "eval-examples": 4, "max-new-tokens": 3,
              "max-seq-len": 160}
    # Execute
    run, summary, rows = loopback_run(config, tmp_path)
    # Assert
    assert run.task_kind == "sft" and [r["round"] for r in rows] == [0, 1]
    assert rows[1]["train_loss"] is not None and rows[1]["bytes_up"] > 0
    assert {"eval_exact_match", "eval_token_f1", "eval_perplexity"} <= set(rows[1])
    assert summary["final_eval_loss"] != summary["initial_eval_loss"]


@pytest.mark.slow
def test_flwr_run_trains_sft_from_a_file(tmp_path: Path, private_flower: Path):
    # Prepare: a private Flower home and ports (the fixture), so the managed SuperLink is ours
    sets = write_sets(tmp_path / "data")
    out = tmp_path / "out"
    overrides = ("model='tiny-llama' layers-per-block=1 num-server-rounds=2 clients-per-round=2 "
                 "local-steps=2 batch-size=4 max-seq-len=48 eval-examples=4 partitioner='iid' "
                 f"task='sft' dataset='{sets['chat']['dataset']}' "
                 "messages-field='conversation' max-new-tokens=3")
    # Execute
    code = demo.main(["--nodes", "2", "--output-dir", str(out), "--run-config", overrides])
    # Assert
    assert code == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2]
    # the demo evaluates before the first round and after the last only
    evaluated = [r["round"] for r in records if "eval_loss" in r]
    assert evaluated == [0, 2]
    assert all("eval_token_f1" in r for r in records if "eval_loss" in r)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run_config"]["task"] == "sft"
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


def test_a_node_with_its_own_data_path_trains_on_it(tiny_run_config, tmp_path, monkeypatch):
    # Prepare: node 0 reads its own file; node 1 its partition of the run's dataset
    from fedcybgd.client import local_data
    from fedcybgd.client.app import app as client_app
    from fedcybgd.config import RunConfig
    from fedcybgd.harness.loopback import LoopbackGrid
    from fedcybgd.server.app import run_server

    sets = write_sets(tmp_path / "data")
    own = tmp_path / "node0.jsonl"
    own.write_text("".join(json.dumps({"prompt": f"local question {i}", "response": "mine"})
                           + "\n" for i in range(12)), encoding="utf-8")
    config = {**tiny_run_config, **sets["sft"], "num-server-rounds": 2, "eval-examples": 4}
    seen: dict[str, set[str]] = {}
    real = local_data.shares.batches

    def spy(frame, *args, **kwargs):
        key = "own" if frame["_file"].iloc[0] == str(own) else "shared"
        seen.setdefault(key, set()).update(m[0]["content"] for m in frame["messages"])
        return real(frame, *args, **kwargs)

    monkeypatch.setattr(local_data.shares, "batches", spy)

    def node_config(i: int) -> dict[str, Any]:
        extra: dict[str, Any] = {"cache-dir": str(tmp_path / "cache")}
        if i == 0:
            extra["data-path"] = str(own)
        return extra

    # Execute
    summary = run_server(LoopbackGrid(client_app, 2, config, node_config=node_config),
                         RunConfig.from_run_config(config), node_wait_s=0.0)
    # Assert: node 0 trained on exactly its file's rows, node 1 on the shared dataset
    assert seen["own"] == {f"local question {i}" for i in range(12)}
    assert seen["shared"] and all(p.startswith("What is") for p in seen["shared"])
    assert summary["rounds"] == 2
