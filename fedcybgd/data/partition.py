"""Federated partitions of a labelled frame: ``iid``, ``dirichlet`` (label skew), ``movie``.

Each method returns disjoint row positions that together cover the frame, the same for the
same seed. ``iid`` and ``dirichlet`` are Flower Datasets partitioners; ``movie`` is our own
:class:`~flwr_datasets.partitioner.Partitioner`, because flwr-datasets' grouped natural-id
partitioner groups a fixed number of ids per client, neither hitting an exact client count nor
balancing rows.

``datasets`` and ``flwr_datasets`` are imported when a frame is partitioned, not with this
module: together with pyarrow they are ~60 MB of a client's resident memory, and a node that
trains on its own ``data-path`` file never partitions.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fedcybgd.choices import PARTITIONERS

if TYPE_CHECKING:
    from flwr_datasets.partitioner import Partitioner

# A client needs at least one batch's worth of data to train on; below this the split is
# refused instead of handing a client a nearly empty (or empty) share.
MIN_PARTITION_SIZE = 8
_ROW = "_row"


def check_partition_args(method: str, partition_id: int, num_partitions: int, alpha: float) -> None:
    """Reject arguments no partitioning can serve (ValueError naming the run-config key)."""
    if method not in PARTITIONERS:
        raise ValueError(f"unknown partitioner '{method}'; allowed: {', '.join(PARTITIONERS)}")
    if num_partitions < 1:
        raise ValueError(f"num-partitions must be >= 1, got {num_partitions}")
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition-id={partition_id} is out of range for num-partitions={num_partitions}"
        )
    # alpha only matters for dirichlet; other methods ignore whatever the config holds.
    if method == "dirichlet" and not alpha > 0:
        raise ValueError(f"dirichlet-alpha must be > 0, got {alpha}")


def _make_partitioner(method: str, num_partitions: int, alpha: float, seed: int,
                      column: str) -> Partitioner:
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    from fedcybgd.data.movie_partitioner import MoviePartitioner

    if method == "iid":
        return IidPartitioner(num_partitions=num_partitions)
    if method == "dirichlet":
        return DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by=column,
            alpha=float(alpha),
            min_partition_size=MIN_PARTITION_SIZE,
            seed=seed,
        )
    return MoviePartitioner(num_partitions=num_partitions, partition_by=column, seed=seed)


DEFAULT_COLUMNS = {"dirichlet": "label", "movie": "movie_name"}


def partition_positions(
    frame: pd.DataFrame, method: str, num_partitions: int, alpha: float, seed: int,
    column: str | None = "",
) -> list[np.ndarray]:
    """Row positions of ``frame`` for every client, index = partition id.

    ``column`` is what ``dirichlet`` skews (a label) and ``movie`` groups by (any id column);
    ``""``: ``label`` and ``movie_name``; ``None``: the task has no such column.

    Raises
    ------
    ValueError
        On an unknown method, bad ``num-partitions``/``dirichlet-alpha``, a missing column, or
        when some client would get fewer than ``MIN_PARTITION_SIZE`` rows.
    """
    check_partition_args(method, 0, num_partitions, alpha)
    if len(frame) < num_partitions * MIN_PARTITION_SIZE:
        raise ValueError(
            f"num-partitions={num_partitions} is too many for {len(frame)} training examples: "
            f"each client needs at least {MIN_PARTITION_SIZE}"
        )
    used: list[str] = []
    by = ""
    if method != "iid":
        by = column if column else DEFAULT_COLUMNS[method]
        if column is None or by not in frame.columns:
            fields = sorted(c for c in frame.columns if not str(c).startswith("_"))
            raise ValueError(
                f"partitioner = {method!r} needs a column to "
                f"{'skew labels by' if method == 'dirichlet' else 'group by'}"
                f"{'' if column is None else f'; {by!r} is not one of {fields}'}: set "
                "partition-by to one, or partitioner = 'iid'")
        used = [by]
    columns = frame[used].assign(**{_ROW: np.arange(len(frame))})
    if by and columns[by].dtype == object:  # flwr-datasets needs scalars: lists become text
        columns[by] = columns[by].map(lambda v: v if isinstance(v, (str, int, float)) else str(v))
    if method == "iid":
        # IidPartitioner shards contiguously; permute first so the run seed picks the shares.
        columns = columns.iloc[np.random.default_rng(seed).permutation(len(frame))]
    try:  # an extra: a node training on its own data-path never partitions
        import datasets
        import flwr_datasets  # noqa: F401
    except ImportError as err:
        raise ImportError(f"cutting a shared dataset into partitions needs flwr-datasets "
                          f"({err}); install it with pip install 'fedcybgd[data]', or give "
                          "this node its own data-path") from None

    partitioner = _make_partitioner(method, num_partitions, alpha, seed, by)
    partitioner.dataset = datasets.Dataset.from_pandas(columns, preserve_index=False)
    try:
        with warnings.catch_warnings():
            # Dirichlet warns on each resampling; a final failure is reported below instead.
            warnings.simplefilter("ignore", UserWarning)
            shares = [
                np.asarray(partitioner.load_partition(pid)[_ROW], dtype=np.int64)
                for pid in range(num_partitions)
            ]
    except ValueError as err:
        if method != "dirichlet" or "attempts" not in str(err):
            raise
        raise ValueError(
            f"dirichlet-alpha={alpha} with num-partitions={num_partitions} left some client "
            f"with fewer than {MIN_PARTITION_SIZE} examples in 10 draws: raise dirichlet-alpha "
            "or lower num-partitions"
        ) from err
    smallest = min(len(share) for share in shares)
    if smallest < MIN_PARTITION_SIZE:
        raise ValueError(
            f"num-partitions={num_partitions} with partitioner '{method}' gives a client only "
            f"{smallest} examples (minimum {MIN_PARTITION_SIZE}): lower num-partitions"
        )
    return shares
