"""The task layer: data sources, checks with file/row/field errors, encodings and losses of
``classification``, ``sft`` and ``multiple-choice``, and a node's own ``data-path``."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.data.sources import DataError
from fedcybgd.model.loading import load_tokenizer
from fedcybgd.tasks import make_task, shares
from fedcybgd.tasks.build import build_task
from fedcybgd.tasks.objective import batch_loss, scored_logits


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-llama")


def plain_template_tokenizer():
    """The tiny tokenizer without its chat template (the plain ``User:/Assistant:`` one)."""
    tok = load_tokenizer("tiny-llama")
    tok.chat_template = None
    return tok


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def sft_rows(n: int) -> list[dict[str, Any]]:
    return [{"prompt": f"What is {i} plus {i}?", "response": f"It is {2 * i}."} for i in range(n)]


def task_for(**keys: Any):
    return make_task(keys.get("task", "classification"),
                     RunConfig.from_run_config({k.replace("_", "-"): v for k, v in keys.items()}))


# ----------------------------------------------------------------------------- sources


def test_a_single_file_is_split_80_10_10_with_a_fixed_seed(tmp_path):
    # Prepare
    path = write_jsonl(tmp_path / "d.jsonl", sft_rows(50))
    # Execute
    first = task_for(task="sft", dataset=str(path))
    again = task_for(task="sft", dataset=str(path), seed=5)
    sizes = {s: len(first.split(s)) for s in shares.SPLITS}
    # Assert: the held-out rows do not move with the run seed, and no row is in two splits
    assert sizes == {"train": 40, "validation": 5, "test": 5}
    assert first.split("test")["_row"].tolist() == again.split("test")["_row"].tolist()
    rows = [r for s in shares.SPLITS for r in first.split(s)["_row"]]
    assert sorted(rows) == list(range(1, 51))


def test_a_folder_with_split_files_keeps_its_splits(tmp_path):
    # Prepare: train as CSV, test as Parquet, no validation (cut from train)
    folder = tmp_path / "set"
    folder.mkdir()
    with open(folder / "train.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for i in range(30):
            writer.writerow([f"row {i}", i % 2])
    pd.DataFrame({"text": ["a b", "c d"], "label": [1, 0]}).to_parquet(folder / "test.parquet")
    # Execute
    task = task_for(dataset=str(folder))
    # Assert
    assert task.split("test")["text"].tolist() == ["a b", "c d"]
    assert len(task.split("validation")) == 3 and len(task.split("train")) == 27
    assert task.split("train")["label"].dtype == "int64"


@pytest.mark.parametrize(
    ("content", "keys", "message"),
    [
        ('{"prompt": "p"}\n', {"task": "sft"}, r"d\.jsonl, row 1: no field 'response'"),
        ('{"prompt": "p", "response": "r"}\n{"prompt": " ", "response": "r"}\n', {"task": "sft"},
         r"d\.jsonl, row 2: field 'prompt' is empty"),
        ('{"text": "t", "label": "neutral"}\n', {},
         r"d\.jsonl, row 1: field 'label' = 'neutral' is not a class index"),
        ('{"text": "t", "label": 2}\n', {}, r"row 1: field 'label' = 2"),
        ('{"text": "t", "label": 1}\n{"text": "t", \n', {}, r"d\.jsonl, line 2: not valid JSON"),
        ('{"question": "q", "options": ["a"], "answer": 0}\n', {"task": "multiple-choice"},
         r"row 1: field 'options' must be a list of two or more"),
        ('{"question": "q", "options": ["a", "b"], "answer": "C"}\n',
         {"task": "multiple-choice"}, r"row 1: field 'answer' = 'C' names none"),
        ('{"messages": [{"role": "user", "content": "hi"}]}\n',
         {"task": "sft", "messages_field": "messages"}, r"the last message must be the assistant"),
    ],
)
def test_bad_rows_are_named_by_file_row_and_field(tmp_path, content, keys, message):
    # Prepare
    path = tmp_path / "d.jsonl"
    path.write_text(content, encoding="utf-8")
    task = task_for(dataset=str(path), **keys)
    # Execute / Assert: the node's own file goes through the same checks
    with pytest.raises(DataError, match=message):
        task.local_frame(str(path))


def test_non_utf8_and_empty_files_are_refused_by_name(tmp_path):
    # Prepare
    bad = tmp_path / "latin1.csv"
    bad.write_bytes(b"text,label\ncaf\xe9,1\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    task = task_for()
    # Execute / Assert
    with pytest.raises(DataError, match=r"latin1\.csv, line 2: not UTF-8"):
        task.local_frame(str(bad))
    with pytest.raises(DataError, match=r"empty\.jsonl: the file is empty \(whitespace only\)"):
        task.local_frame(str(empty))
    with pytest.raises(DataError, match="no such file"):
        task_for(dataset=str(tmp_path / "missing.jsonl")).split("train")


def test_bad_task_keys_name_key_and_value():
    with pytest.raises(ConfigError, match=r"task = 'sftt'.*'sft'"):
        RunConfig.from_run_config({"task": "sftt"})
    with pytest.raises(ConfigError, match="label-words"):
        RunConfig.from_run_config({"label-words": "yes"})
    with pytest.raises(ConfigError, match="prompt-template"):
        RunConfig.from_run_config({"prompt-template": "no placeholder"})


def test_label_words_must_be_one_token_each(tokenizer):
    task = task_for(label_words="negative,absolutely-not-one-token")
    with pytest.raises(ValueError, match="label-words: ' absolutely-not-one-token'"):
        task.encoder(tokenizer, 64)


# --------------------------------------------------------------------------- encodings


def test_rotten_tomatoes_is_the_default_classification_task(tokenizer):
    # Prepare
    task = build_task(RunConfig())
    frame = shares.load_split("rotten-tomatoes", "train").head(8)
    # Execute
    through_task = next(shares.batches(frame, tokenizer, 8, 64, seed=0, shuffle=False, task=task))
    expected = shares.collate(shares.encode(tokenizer, frame["text"].tolist(),
                                        frame["label"].tolist(), 64))
    # Assert: the same prompts, positions and targets as the encoder the task layer replaced
    assert torch.equal(through_task.input_ids, expected.input_ids)
    assert torch.equal(through_task.target_ids, expected.target_ids)
    assert through_task.score_rows is None and through_task.task is task


@pytest.mark.parametrize("chat", [True, False])
def test_sft_scores_only_the_response_tokens(tmp_path, tokenizer, chat):
    # Prepare: with the tokenizer's chat template, and a copy without one (plain template)
    tok = tokenizer if chat else plain_template_tokenizer()
    path = write_jsonl(tmp_path / "d.jsonl", sft_rows(20))
    task = task_for(task="sft", dataset=str(path))
    frame = task.split("train").head(3)
    # Execute
    batch = next(shares.batches(frame, tok, 3, 128, seed=0, shuffle=False, task=task))
    # Assert: each target is the next input token, and the targets spell the response
    assert batch.score_rows is not None and batch.score_positions is not None
    for row in range(3):
        where = batch.score_rows == row
        positions = batch.score_positions[where]
        targets = batch.target_ids[where]
        assert torch.equal(batch.input_ids[row, positions + 1], targets)
        text = tok.decode(targets.tolist())
        assert frame["messages"].iloc[row][-1]["content"] in text
        prompt = tok.decode(batch.input_ids[row, : int(positions[0]) + 1].tolist())
        assert frame["messages"].iloc[row][0]["content"] in prompt
        assert ("<|im_start|>assistant" in prompt) == chat


def test_sft_truncation_cuts_the_prompt_first_and_counts_response_cuts(tmp_path, tokenizer):
    # Prepare: a long prompt with a short answer, and a response longer than the window
    rows = [{"prompt": "word " * 200, "response": "short"},
            {"prompt": "q", "response": "long " * 200}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    task = task_for(task="sft", dataset=str(path))
    encode = task.encoder(tokenizer, 64)
    # Execute
    out = encode(task.examples(task.local_frame(str(path))))
    # Assert: both fit; the first keeps its whole response; the second's response is cut to
    # leave the prompt (its chat header is longer than that) a quarter of the window
    assert all(len(ids) <= 64 for ids in out.input_ids)
    assert out.targets is not None
    assert "short" in tokenizer.decode(out.targets[0])
    assert len(out.targets[1]) == 64 - 64 // 4
    assert encode.join.prompts_cut == 2 and encode.join.continuations_cut == 1
    assert encode.cut == 2


def test_logits_are_gathered_at_the_scored_tokens_only(tmp_path, tokenizer):
    # Prepare
    from fedcybgd.model.layerwise import LayerStack
    from fedcybgd.model.loading import load_model

    path = write_jsonl(tmp_path / "d.jsonl", sft_rows(20))
    task = task_for(task="sft", dataset=str(path))
    batch = next(shares.batches(task.split("train"), tokenizer, 4, 128, seed=0, task=task))
    model = load_model("tiny-llama")
    stack = LayerStack(model)
    # Execute
    with torch.no_grad():
        hidden = stack.run(stack.embed(batch.input_ids, batch.attention_mask), 0,
                           stack.num_layers)
        logits = scored_logits(stack, hidden.states, batch)
        full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    # Assert: N x V with N the response tokens, equal to the full forward's rows there
    assert logits.shape == (batch.num_scored, full.shape[-1])
    assert batch.num_scored < batch.input_ids.numel()
    assert batch.score_rows is not None and batch.score_positions is not None
    torch.testing.assert_close(logits, full[batch.score_rows, batch.score_positions],
                               rtol=1e-4, atol=1e-4)
    expected = torch.nn.functional.cross_entropy(
        full[batch.score_rows, batch.score_positions].float(), batch.target_ids)
    torch.testing.assert_close(batch_loss(logits, batch), expected, rtol=1e-4, atol=1e-4)


def test_multiple_choice_picks_the_most_likely_option(tmp_path, tokenizer):
    # Prepare
    from fedcybgd.model.layerwise import LayerStack
    from fedcybgd.model.loading import load_model
    from fedcybgd.tasks.multiple_choice import option_scores

    rows = [{"question": f"Pick {i}", "options": ["red", "green light", "blue"],
             "answer": i % 3} for i in range(12)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    stack = LayerStack(load_model("tiny-llama"))
    results = {}
    for norm in (False, True):
        task = task_for(task="multiple-choice", dataset=str(path), length_normalize=norm)
        frame = task.local_frame(str(path))
        # Execute
        result = task.evaluate(stack, tokenizer, frame, 5, 64)
        scores = option_scores(task, stack, tokenizer, "Pick 0", rows[0]["options"], 64)
        if norm:
            lengths = torch.tensor([len(tokenizer.encode(" " + o, add_special_tokens=False))
                                    for o in rows[0]["options"]], dtype=torch.float64)
            scores = scores / lengths
        # Assert: accuracy is the share of rows whose answer has the best option score (the
        # question text differs per row, so each row is scored on its own)
        hits = 0
        for row in rows:
            s = option_scores(task, stack, tokenizer, row["question"], row["options"], 64)
            if norm:
                s = s / lengths
            hits += int(torch.argmax(s)) == row["answer"]
        assert result.accuracy == pytest.approx(hits / len(rows))
        results[norm] = scores
    assert not torch.equal(results[False], results[True])


def test_node_data_path_replaces_the_partition(tmp_path, tokenizer, monkeypatch):
    # Prepare: the run's dataset and a node's own file, with rows the dataset lacks
    from fedcybgd.client import local_data
    from fedcybgd.config import NodeConfig

    shared = write_jsonl(tmp_path / "shared.jsonl", sft_rows(40))
    own = write_jsonl(tmp_path / "own.jsonl",
                      [{"prompt": f"local {i}", "response": "mine"} for i in range(9)])
    run = RunConfig.from_run_config({"task": "sft", "dataset": str(shared),
                                     "partitioner": "iid", "model": "tiny-llama"})
    # Execute
    mine = local_data.training_batches(run, NodeConfig(data_path=str(own)), seed=0)
    theirs = local_data.training_batches(run, NodeConfig(num_partitions=2), seed=0)
    # Assert
    assert {m[0]["content"] for m in mine._items} == {f"local {i}" for i in range(9)}
    assert all(m[0]["content"].startswith("What is") for m in theirs._items)


def test_the_server_evaluates_on_its_own_eval_dataset(tmp_path):
    # Prepare
    shared = write_jsonl(tmp_path / "shared.jsonl", sft_rows(40))
    held_out = write_jsonl(tmp_path / "held.jsonl",
                           [{"prompt": f"held {i}", "response": "out"} for i in range(7)])
    with_own = task_for(task="sft", dataset=str(shared), eval_dataset=str(held_out))
    without = task_for(task="sft", dataset=str(shared))
    # Execute
    own = with_own.eval_frame("test", 5)
    default = without.eval_frame("test", 5)
    # Assert: the first eval-examples rows of the server's file; else the dataset's test split
    assert [m[0]["content"] for m in own["messages"]] == [f"held {i}" for i in range(5)]
    assert default["_row"].tolist() == without.split("test")["_row"].tolist()[:5]


def test_zerolock_objectives_read_the_tasks_positions(tmp_path, tokenizer):
    # Prepare
    from fedcybgd.client.updates.local_heads import loss_rows

    path = write_jsonl(tmp_path / "d.jsonl", sft_rows(20))
    task = task_for(task="sft", dataset=str(path))
    batch = next(shares.batches(task.split("train"), tokenizer, 4, 96, seed=0, task=task))
    states = torch.randn(*batch.input_ids.shape, 8)
    # Execute
    label_rows, label_targets = loss_rows(states, batch, "label")
    lm_rows, lm_targets = loss_rows(states, batch, "next-token")
    # Assert: `label` = the response positions; `next-token` = every real position that has a
    # next real token (the last one of an sft example predicts nothing)
    assert batch.score_rows is not None and batch.score_positions is not None
    assert torch.equal(label_rows, states[batch.score_rows, batch.score_positions])
    assert torch.equal(label_targets, batch.target_ids)
    assert lm_rows.shape[0] == int(batch.attention_mask.sum()) - len(batch)
    mask = batch.attention_mask.bool().clone()
    mask[torch.arange(len(batch)), batch.last_index] = False
    assert torch.equal(lm_targets, torch.roll(batch.input_ids, -1, dims=1)[mask])


def sharp_attention_stack():
    """The tiny random model with its attention sharpened: a token's position then changes
    what it sees (with the stock init, attention is nearly uniform and hides position bugs)."""
    from fedcybgd.model.layerwise import LayerStack
    from fedcybgd.model.loading import load_model

    model = load_model("tiny-llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30.0)
            layer.self_attn.k_proj.weight.mul_(30.0)
    return LayerStack(model)


@pytest.mark.parametrize("chat", [True, False])
def test_sft_scores_and_answers_from_one_prompt_pass_as_two_passes_would(tmp_path, tokenizer, chat):
    # Prepare: prompts and responses of different lengths in one batch (left and right padding)
    from fedcybgd.tasks.sft import score_and_generate

    tok = tokenizer if chat else plain_template_tokenizer()
    rows = [{"prompt": "word " * (3 * i + 1), "response": "yes " * (i % 3 + 1)} for i in range(5)]
    task = task_for(task="sft", dataset=str(write_jsonl(tmp_path / "d.jsonl", rows)),
                    max_new_tokens=6)
    items = task.examples(task.local_frame(str(tmp_path / "d.jsonl")))
    stack = sharp_attention_stack()
    encode = task.encoder(tok, 128)
    # Execute
    scored = score_and_generate(stack, tok, encode.joined(items), max_new_tokens=6)
    total, count, texts = task.score_and_generate_apart(stack, tok, encode, encode.joined(items))
    # Assert: the same loss per row, the same tokens counted, the same greedy answers
    assert scored is not None
    got_total, got_count, got_texts = scored
    assert torch.equal(got_count, count)
    torch.testing.assert_close(got_total, total, rtol=1e-4, atol=1e-4)
    assert got_texts == texts
    if not chat:  # (the random model answers a chat prompt with special tokens only)
        assert len(set(texts)) > 1  # the rows' answers differ: not one answer copied to all


def test_sft_evaluation_in_batches_by_length_gives_each_row_its_own_answer(tmp_path):
    # Prepare: prompts longest first, so batches by length take the rows out of file order
    from fedcybgd.tasks.sft import SAMPLES, score_and_generate

    tok = plain_template_tokenizer()
    words = ["red", "blue", "cat", "house", "river", "seven"]
    rows = [{"prompt": f"{words[i]} " * (20 - 3 * i), "response": "yes"} for i in range(6)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    task = task_for(task="sft", dataset=str(path), max_new_tokens=6)
    frame = task.local_frame(str(path))
    stack = sharp_attention_stack()
    encode = task.encoder(tok, 128)
    alone = [score_and_generate(stack, tok, [j], max_new_tokens=6)
             for j in encode.joined(task.examples(frame))]
    # Execute
    result = task.evaluate(stack, tok, frame, batch_size=4, max_seq_len=128)
    # Assert: the kept answers are the first rows' own (each decoded alone), and the loss is
    # the token-weighted mean of the rows' own losses
    assert all(a is not None for a in alone)
    own = [a[2][0] for a in alone]
    assert len(set(own[:SAMPLES])) > 1  # the rows' answers differ: a mix-up would show
    assert [s["answer"] for s in result.samples] == own[:SAMPLES]
    total = sum(float(a[0].sum()) for a in alone)
    count = sum(float(a[1].sum()) for a in alone)
    assert result.loss == pytest.approx(total / count, rel=1e-4)


def test_a_plugin_that_replaces_a_built_in_task_keeps_it_whatever_imports_first(tmp_path):
    # Prepare: a fresh interpreter (no task module imported yet) and a plug-in module that
    # replaces the built-in classification task before the built-ins' modules are imported
    import subprocess
    import sys

    (tmp_path / "my_tasks.py").write_text(
        "from fedcybgd.tasks import register_task\n"
        "from fedcybgd.tasks.base import Task\n"
        "@register_task('classification', replace=True)\n"
        "class Mine(Task):\n"
        "    pass\n")
    script = (
        "from fedcybgd.config import RunConfig\n"
        "RunConfig.from_run_config({'plugin-modules': 'my_tasks'})\n"
        "from fedcybgd.tasks import task_class, task_names\n"
        "print(task_class('classification').__name__, task_class('lm').__name__,"
        " len(task_names()))\n")
    # Execute
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    # Assert: the plug-in's class stands, the other built-ins are there
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Mine", "LMTask", "4"]
