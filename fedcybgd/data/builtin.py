"""The built-in datasets: names ``dataset`` accepts besides paths and hub names."""

from __future__ import annotations

import pandas as pd

from fedcybgd.data import rotten_tomatoes


def builtin_splits(dataset: str) -> dict[str, pd.DataFrame] | None:
    """``train``/``validation``/``test`` of the built-in ``dataset`` (shared frames: do not
    modify), ``None`` when ``dataset`` is not a built-in name (a path or hub name)."""
    if dataset == "rotten-tomatoes":
        return {split: rotten_tomatoes.shared_split(split) for split in rotten_tomatoes.SPLITS}
    return None
