"""Raw text as a data source: ``.txt`` files, one row each, for the ``lm`` task.

A ``.txt`` file is one row whose ``text`` is the whole file (``_file`` names it, ``_row`` is 1).
A folder is read through all its ``.txt`` files (sub-folders included, in name order); a file
named after a split (``train.txt``, ``test-2.txt``) or inside a folder named after one
(``train/``, ``validation/``, ``dev/``, ``test/``) is that split, the others are read together.
A folder without ``.txt`` files, and every other kind of file, is read as any task's data
(:func:`fedcybgd.data.sources.read_source`: JSONL / JSON / CSV / Parquet rows with a text field).

When a source has no held-out splits, :func:`split_texts` cuts them: from the documents when
there are ten or more (as :func:`~fedcybgd.data.sources.make_splits` does), else from inside
each document: its lines in ten contiguous parts, one drawn for validation and one for test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from fedcybgd.data.sources import (
    _SPLIT_ALIASES,
    FILE_COLUMN,
    ROW_COLUMN,
    SPLIT_SEED,
    SPLITS,
    SUFFIXES,
    DataError,
    make_splits,
    read_source,
)

TEXT_SUFFIX = ".txt"
PARTS = 10  # a short source's documents are cut into this many contiguous parts of lines
TEXT_COLUMN = "text"


def read_text_file(path: Path) -> pd.DataFrame:
    """One ``.txt`` file as a one-row frame (DataError naming the file when it is empty, all
    whitespace or not UTF-8)."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise DataError(f"{path}, line {line}: not UTF-8 (byte {raw[err.start]:#04x} at offset "
                        f"{err.start}); re-save the file as UTF-8") from None
    if not text.strip():
        raise DataError(f"{path}: the file is empty" + (" (whitespace only)" if text else ""))
    return pd.DataFrame({TEXT_COLUMN: [text], ROW_COLUMN: [1], FILE_COLUMN: [str(path)]})


def _split_of(path: Path, root: Path) -> str | None:
    """The split a file names by its own name or a folder between it and ``root``."""
    names = [path.name.split(".")[0].split("-")[0], *path.relative_to(root).parts[:-1]]
    for name in names:
        split = _SPLIT_ALIASES.get(name.lower())
        if split is not None:
            return split
    return None


def read_texts(spec: str) -> dict[str, pd.DataFrame]:
    """The frames of a text source by split name (see the module docstring).

    Raises
    ------
    DataError
        A folder holding both ``.txt`` and other data files (say which to read by giving one
        kind), an unreadable file; and whatever :func:`read_source` raises for other sources.
    """
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == TEXT_SUFFIX:
        return {"all": read_text_file(path)}
    if path.is_dir():
        texts = sorted(p for p in path.rglob(f"*{TEXT_SUFFIX}") if p.is_file())
        if texts:
            others = sorted(p for p in path.rglob("*")
                            if p.is_file() and p.suffix.lower() in SUFFIXES)
            if others:
                raise DataError(f"dataset = {spec!r}: the folder holds both .txt files and "
                                f"data files ({others[0].name}, ...); keep one kind in it")
            named: dict[str, list[pd.DataFrame]] = {}
            for file in texts:
                named.setdefault(_split_of(file, path) or "all", []).append(read_text_file(file))
            return {split: pd.concat(parts, ignore_index=True) for split, parts in named.items()}
    return read_source(spec)


def split_texts(found: dict[str, pd.DataFrame], spec: str, field: str) -> dict[str, pd.DataFrame]:
    """``train``, ``validation`` and ``test`` of a text source (see the module docstring).

    ``field`` is the text column; rows stay in source order (a document's parts too).
    """
    known = {k: v for k, v in found.items() if k in SPLITS}
    rows = sum(len(v) for k, v in found.items() if k not in SPLITS or k == "train")
    if ("validation" in known and "test" in known) or rows >= PARTS:
        return make_splits(found, spec)
    if "train" in known and len(found) > len(known):
        return make_splits(found, spec)  # names the stray files
    frame = pd.concat([v for k, v in found.items() if k not in ("validation", "test")],
                      ignore_index=True)
    if field not in frame.columns:
        raise DataError(f"dataset = {spec!r}: no field {field!r} (text-field)")
    rng = np.random.default_rng(SPLIT_SEED)
    out: dict[str, list[dict[str, object]]] = {split: [] for split in SPLITS}
    for position, record in enumerate(frame.to_dict("records")):
        text = record[field]
        lines = text.splitlines(keepends=True) if isinstance(text, str) else []
        if len(lines) < PARTS:
            where = record.get(FILE_COLUMN) or f"row {position + 1}"
            raise DataError(f"{where}: {len(lines)} lines are too few to hold out validation and "
                            f"test passages ({PARTS} or more lines, or ten or more documents, "
                            "or give the splits as files: train.txt, validation.txt, test.txt)")
        held = rng.choice(PARTS, size=2, replace=False)
        for number, part in enumerate(np.array_split(np.arange(len(lines)), PARTS)):
            split = ("validation" if number == held[0] else "test" if number == held[1]
                     else "train")
            out[split].append({**record, field: "".join(lines[i] for i in part)})
    splits = {split: pd.DataFrame.from_records(out[split]) for split in SPLITS}
    for split in ("validation", "test"):
        if split in known:
            splits[split] = known[split].reset_index(drop=True)
    return splits
