"""The rows of the built-in datasets (the table of them, with their task kinds and fields:
:mod:`fedcybgd.data.catalogue`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedcybgd.core.registry import resolve
from fedcybgd.data.catalogue import BUILTIN_DATASETS, BuiltinDataset, builtin_dataset

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["BUILTIN_DATASETS", "BuiltinDataset", "builtin_dataset", "builtin_splits"]


def builtin_splits(dataset: str) -> dict[str, pd.DataFrame] | None:
    """``train``/``validation``/``test`` of the built-in ``dataset`` (shared frames: do not
    modify), ``None`` when ``dataset`` is not a built-in name (a path or hub name)."""
    spec = builtin_dataset(dataset)
    if spec is None:
        return None
    shared_split = resolve(f"{spec.module}:shared_split")
    return {split: shared_split(split) for split in spec.splits}
