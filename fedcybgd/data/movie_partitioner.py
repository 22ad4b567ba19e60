"""Our own natural-id partitioner: whole groups (e.g. movies) per client, sizes balanced.

Imported only when a frame is partitioned by a column (see :mod:`fedcybgd.data.partition`).
"""

from __future__ import annotations

import heapq

import datasets
import numpy as np
from flwr_datasets.partitioner import Partitioner


class MoviePartitioner(Partitioner):
    """Whole groups (movies) per client, groups dealt so client sizes are close.

    Groups are shuffled by ``seed``, then dealt largest first to the client with the fewest
    rows so far (longest-processing-time rule): sizes differ by at most one group.

    Parameters
    ----------
    num_partitions : int
        Number of clients.
    partition_by : str
        Column naming each row's group.
    seed : int
        Seeds the order in which equal-sized groups are dealt.
    """

    def __init__(self, num_partitions: int, partition_by: str = "movie_name", seed: int = 0):
        super().__init__()
        if num_partitions < 1:
            raise ValueError(f"num-partitions must be >= 1, got {num_partitions}")
        self._num_partitions = num_partitions
        self._partition_by = partition_by
        self._seed = seed
        self._indices: list[np.ndarray] | None = None

    @property
    def num_partitions(self) -> int:
        """Total number of partitions."""
        return self._num_partitions

    def load_partition(self, partition_id: int) -> datasets.Dataset:
        """Rows of every group dealt to ``partition_id``."""
        if self._indices is None:
            self._indices = self._deal()
        return self.dataset.select(self._indices[partition_id])

    def _deal(self) -> list[np.ndarray]:
        groups = np.asarray(self.dataset[self._partition_by])
        # Sorted unique names: the deal does not depend on the row order of the data.
        names, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
        if len(names) < self._num_partitions:
            raise ValueError(
                f"num-partitions={self._num_partitions} exceeds the {len(names)} distinct "
                f"'{self._partition_by}' values; every client needs a whole group"
            )
        order = np.random.default_rng(self._seed).permutation(len(names))
        order = order[np.argsort(-counts[order], kind="stable")]
        loads = [(0, pid) for pid in range(self._num_partitions)]
        owner = np.empty(len(names), dtype=np.int64)
        for group in order:
            load, pid = heapq.heappop(loads)
            owner[group] = pid
            heapq.heappush(loads, (load + int(counts[group]), pid))
        row_owner = owner[inverse]
        return [np.flatnonzero(row_owner == pid) for pid in range(self._num_partitions)]
