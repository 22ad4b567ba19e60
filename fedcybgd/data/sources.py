"""Where a task's rows come from: local JSONL / JSON / CSV / Parquet files or folders of them, a
saved Hugging Face dataset folder, or a hub name (online only), split into train / validation /
test.

Every frame read here carries two bookkeeping columns, so a bad row can be reported by where it
is: ``_file`` (the file it was read from) and ``_row`` (its 1-based line in a JSONL file, its
1-based data row otherwise). Splits come from the source when it has them (files or dataset
splits named ``train``, ``validation``/``valid``/``dev``, ``test``); a missing held-out split is
cut from the training rows with a fixed seed (:data:`SPLIT_SEED`, not the run seed: runs with
different seeds must be scored on the same held-out rows).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd

FILE_COLUMN = "_file"
ROW_COLUMN = "_row"
SPLITS = ("train", "validation", "test")
SPLIT_SEED = 20240611
HELD_OUT_FRACTION = 0.1  # of the training rows, for each split the source lacks
SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet")
_SPLIT_ALIASES = {"train": "train", "training": "train", "validation": "validation",
                  "valid": "validation", "val": "validation", "dev": "validation",
                  "test": "test", "testing": "test"}


class DataError(ValueError):
    """A data file or row is unusable; the message names the file, the row and the field."""


def where(frame: pd.DataFrame, position: int) -> str:
    """``file, row N`` of the row at ``position`` of a frame read here (``row N`` otherwise)."""
    row = frame.iloc[position]
    name = row.get(FILE_COLUMN, "") if FILE_COLUMN in frame.columns else ""
    number = int(row[ROW_COLUMN]) if ROW_COLUMN in frame.columns else position + 1
    return f"{name}, row {number}" if name else f"row {number}"


def _decode(path: Path) -> str:
    """The file's text; a non-UTF-8 byte is reported with its line."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise DataError(f"{path}, line {line}: not UTF-8 (byte {raw[err.start]:#04x} at offset "
                        f"{err.start}); re-save the file as UTF-8") from None


def _read_jsonl(path: Path, text: str) -> pd.DataFrame:
    records: list[dict[str, object]] = []
    lines: list[int] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}, line {number}: not valid JSON ({err.msg} at column "
                            f"{err.colno})") from None
        if not isinstance(value, dict):
            raise DataError(f"{path}, line {number}: a row must be a JSON object, got "
                            f"{type(value).__name__}")
        records.append(value)
        lines.append(number)
    frame = pd.DataFrame.from_records(records) if records else pd.DataFrame()
    frame[ROW_COLUMN] = lines
    return frame


def read_file(path: Path) -> pd.DataFrame:
    """One data file as a frame with ``_file`` and ``_row`` columns.

    Raises
    ------
    DataError
        Unknown suffix, an empty file or one without rows (a CSV header alone), not UTF-8,
        not valid JSON / CSV / Parquet.
    """
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise DataError(f"{path}: unknown data file type {suffix!r}; use one of {SUFFIXES}")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty")
    if suffix == ".parquet":
        try:
            frame = pd.read_parquet(path)
        except Exception as err:  # pyarrow raises many kinds; all mean "not a parquet file"
            raise DataError(f"{path}: not a readable Parquet file ({err})") from None
        frame[ROW_COLUMN] = np.arange(1, len(frame) + 1)
    else:
        text = _decode(path)
        if not text.strip():
            raise DataError(f"{path}: the file is empty (whitespace only)")
        if suffix == ".jsonl" or (suffix == ".json" and not text.lstrip().startswith("[")):
            frame = _read_jsonl(path, text)
        elif suffix == ".json":
            try:
                values = json.loads(text)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}, line {err.lineno}: not valid JSON ({err.msg})") from None
            if not all(isinstance(v, dict) for v in values):
                raise DataError(f"{path}: a JSON array of rows must hold only objects")
            frame = pd.DataFrame.from_records(values)
            frame[ROW_COLUMN] = np.arange(1, len(frame) + 1)
        else:
            try:
                # Strings as they are ("NA" is a word, not a missing value).
                frame = pd.read_csv(io.StringIO(text), sep="\t" if suffix == ".tsv" else ",",
                                    dtype=str, keep_default_na=False)
            except (pd.errors.ParserError, ValueError) as err:
                raise DataError(f"{path}: not a readable CSV file ({err})") from None
            frame[ROW_COLUMN] = np.arange(1, len(frame) + 1)
    if len(frame) == 0:
        raise DataError(f"{path}: the file holds no rows")
    frame[FILE_COLUMN] = str(path)
    return frame


def _split_of(path: Path) -> str | None:
    return _SPLIT_ALIASES.get(path.name.split(".")[0].split("-")[0].lower())


def _from_hf(splits: object, name: str) -> dict[str, pd.DataFrame]:
    """A ``datasets`` Dataset or DatasetDict as frames by split."""
    import datasets  # heavy; only for Hugging Face sources

    if isinstance(splits, datasets.Dataset):
        splits = {"train": splits}
    out: dict[str, pd.DataFrame] = {}
    for split, dataset in dict(splits).items():  # type: ignore[call-overload]
        frame = dataset.to_pandas()
        frame[ROW_COLUMN] = np.arange(1, len(frame) + 1)
        frame[FILE_COLUMN] = f"{name}[{split}]"
        out[_SPLIT_ALIASES.get(str(split).lower(), str(split))] = frame
    return out


def read_source(spec: str) -> dict[str, pd.DataFrame]:
    """The frames of a data source by split name, as the source has them (not yet split).

    ``spec`` is a file, a folder of data files (files named after a split are that split; the
    others are read together as one), a saved Hugging Face dataset folder
    (``save_to_disk``), or a hub dataset name (needs network access).

    Raises
    ------
    DataError
        Nothing at ``spec``, a folder without data files, an unreadable file.
    """
    path = Path(spec).expanduser()
    if path.is_file():
        return {"all": read_file(path)}
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "dataset_info.json").is_file():
            import datasets

            return _from_hf(datasets.load_from_disk(str(path)), str(path))
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES)
        if not files:
            raise DataError(f"dataset = {spec!r}: the folder holds no data files {SUFFIXES}")
        named: dict[str, list[pd.DataFrame]] = {}
        for file in files:
            named.setdefault(_split_of(file) or "all", []).append(read_file(file))
        return {split: pd.concat(parts, ignore_index=True) for split, parts in named.items()}
    if spec.startswith((".", "/", "~")) or path.suffix.lower() in SUFFIXES:
        searched = "" if path.is_absolute() else f" (relative: looked in {Path.cwd()})"
        raise DataError(f"dataset = {spec!r}: no such file or folder{searched}")
    try:
        import datasets

        return _from_hf(datasets.load_dataset(spec), spec)
    except Exception as err:  # offline, unknown name, ...: one message for all
        raise DataError(f"dataset = {spec!r} is not a built-in dataset, a file or a folder, and "
                        f"loading it from the Hugging Face hub failed ({type(err).__name__}: "
                        f"{str(err)[:200]})") from None


def make_splits(found: dict[str, pd.DataFrame], spec: str) -> dict[str, pd.DataFrame]:
    """``train``, ``validation`` and ``test`` from what a source holds.

    One unnamed set (or just ``train``) is split 80/10/10; a source with ``train`` and one
    held-out split gets the other cut from ``train``. Row order within a split is shuffled by
    :data:`SPLIT_SEED` when it is cut here (a prefix is then a random sample), kept otherwise.
    """
    known = {k: v for k, v in found.items() if k in SPLITS}
    rest = [v for k, v in found.items() if k not in SPLITS]
    if rest:
        if "train" in known:
            raise DataError(f"dataset = {spec!r}: has a train split and other files/splits "
                            f"({sorted(set(found) - set(SPLITS))}); name them train, "
                            "validation or test")
        known["train"] = pd.concat(rest, ignore_index=True)
    if "train" not in known:
        raise DataError(f"dataset = {spec!r}: no training rows (splits found: {sorted(found)})")
    train = known["train"]
    missing = [s for s in ("validation", "test") if s not in known]
    if missing:
        order = np.random.default_rng(SPLIT_SEED).permutation(len(train))
        cut = max(1, round(HELD_OUT_FRACTION * len(train))) if len(train) >= 10 else 0
        if cut == 0:
            raise DataError(f"dataset = {spec!r}: {len(train)} rows are too few to hold out "
                            f"{' and '.join(missing)} rows (need 10 or more, or give the "
                            "splits as files)")
        start = 0
        for split in missing:
            known[split] = train.iloc[order[start:start + cut]].reset_index(drop=True)
            start += cut
        known["train"] = train.iloc[order[start:]].reset_index(drop=True)
    return {s: known[s].reset_index(drop=True) for s in SPLITS}
