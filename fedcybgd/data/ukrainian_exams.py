"""Ukrainian state-exam questions with their answers, as Ukrainian text, read from ``evals``.

The ``evals`` wheel (OpenAI's eval registry, already installed for ToMi) ships
``ukraine_eit/samples.jsonl``: 9,470 questions of Ukraine's external independent evaluation
(ZNO) in Ukrainian language and literature, history of Ukraine, law, biology, geography,
chemistry and other subjects, each a chat row (a system line naming the exam, the question with
its lettered options, the ``ideal`` answer). About 5.3 M characters of Cyrillic text, which
SmolLM2's mostly English tokenizer cuts into about 4.4 M tokens: a new language for the model.
The package is MIT-licensed and its licence file names no other licence for this set. We read
the file and never import the package.

A row is one question, its options and its answer (``Відповідь: ...``), ending with a newline.
Columns: ``text``, ``subject`` (the exam, from the system line: ``історії України``,
``біології`` ...; the natural federated partition, each node one or a few subjects) and
``question`` (its line in the file, from 0). Splits: 80 / 10 / 10 % of the questions, seeded,
each split in file order (the ``lm`` task packs a subject's questions into windows, then
shuffles the windows).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from fedcybgd.data.packaged import packaged_file

DIST_NAME = "evals"
DATA_FILE = "evals/registry/data/ukraine_eit/samples.jsonl"
INSTALL_HINT = "pip install --no-deps evals==3.0.1.post1"
LICENSE = "MIT (the evals package; its licence file names no other licence for this set)"
SPLITS = ("train", "validation", "test")
SPLIT_SEED = 20240611  # fixed: runs with different seeds are scored on the same questions
VALIDATION_FRACTION = 0.1
TEST_FRACTION = 0.1
ANSWER = "Відповідь: "
# "Ви розв'язуєте державний екзамен з <subject>. <instruction>"
SUBJECT = re.compile(r"державний екзамен з (.+?)\.(?:\s|$)")


def data_path() -> Path:
    """The questions' file inside the installed ``evals`` distribution (FileNotFoundError,
    with the install command, when it is missing)."""
    return packaged_file("ukrainian-exams", DIST_NAME, DATA_FILE, INSTALL_HINT)


def parse_row(line: str, number: int) -> dict[str, object]:
    """One line of the file (ValueError naming the line when it is not a system line naming
    an exam, a user question and a non-empty answer)."""
    row = json.loads(line)
    messages, answer = row.get("input"), row.get("ideal")
    if (not isinstance(messages, list) or len(messages) != 2
            or [m.get("role") for m in messages] != ["system", "user"]
            or not isinstance(answer, str) or not answer.strip()):
        raise ValueError(f"{DATA_FILE}, line {number}: not an exam row (a system and a user "
                         f"message and an 'ideal' answer): {line[:120]!r}")
    found = SUBJECT.search(str(messages[0]["content"]))
    if found is None:
        raise ValueError(f"{DATA_FILE}, line {number}: no exam named in the system line "
                         f"{str(messages[0]['content'])[:120]!r}")
    question = str(messages[1]["content"]).strip()
    return {"text": f"{question}\n{ANSWER}{answer.strip()}\n", "subject": found.group(1),
            "question": number - 1}


@lru_cache(maxsize=1)
def load_corpus() -> pd.DataFrame:
    """Every question, in file order."""
    path = data_path()
    rows = [parse_row(line, number) for number, line in
            enumerate(path.read_text(encoding="utf-8").splitlines(), start=1) if line.strip()]
    return pd.DataFrame.from_records(rows)


@lru_cache(maxsize=1)
def split_positions() -> dict[str, np.ndarray]:
    """Row positions of :func:`load_corpus` for each split, each in file order."""
    n = len(load_corpus())
    order = np.random.default_rng(SPLIT_SEED).permutation(n)  # PCG64: the same everywhere
    n_test, n_validation = round(TEST_FRACTION * n), round(VALIDATION_FRACTION * n)
    return {"test": np.sort(order[:n_test]),
            "validation": np.sort(order[n_test:n_test + n_validation]),
            "train": np.sort(order[n_test + n_validation:])}


@lru_cache(maxsize=len(SPLITS))
def shared_split(split: str) -> pd.DataFrame:
    """One split (cached and shared by every caller in the process: do not modify)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split '{split}'; allowed: {', '.join(SPLITS)}")
    return load_corpus().iloc[split_positions()[split]].reset_index(drop=True)
