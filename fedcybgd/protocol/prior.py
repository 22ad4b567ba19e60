"""The class prior training aims the model at (``class-prior``), for tasks with classes.

Logit adjustment and class-balanced batches (:class:`fedcybgd.tasks.shares.BatchIterator`)
take a label-skewed node's own class shares out of its update. What they put in their place
is this prior:

* ``uniform``: equal shares. The model is left with no prior at all, which costs accuracy
  whenever the classes are not equally common where it is used (Rotten Tomatoes' splits are 58%
  positive: a prior-free model shifted its decision threshold by ~0.3 logits and lost ~4 points
  of accuracy, every node IID).
* ``global`` (the app's default): the class shares of all nodes' data pooled. Each node states
  its class counts once, in its answer to the node-key query (its label histogram reaches the
  server; ``uniform`` or explicit shares keep it on the node). The server pools them and sends
  the shares with every instruction. A node's counts are untrusted: each vector must have one
  non-negative integer per class, and a node's total counts for at most four times the median
  node's, so one node cannot set the prior by claiming a huge dataset.
* explicit shares, e.g. ``0.42,0.58`` (one per class, in class order; normalised): a prior the
  operator knows.

Neither the strategy nor the client imports the other: both use this module.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flwr.app import ConfigRecord

from fedcybgd import protocol

GLOBAL = "global"
UNIFORM = "uniform"
MAX_COUNT = 10**9  # per class, per node: more is refused as malformed
MAX_CLASSES = 4096
WEIGHT_CAP = 4.0  # a node's total counts for at most this many times the median node's


@dataclass(frozen=True)
class ClassPriorSpec:
    """A parsed ``class-prior``: ``mode`` is ``global``, ``uniform`` or ``explicit``
    (``shares`` then holds the normalised shares)."""

    mode: str
    shares: tuple[float, ...] = ()

    @classmethod
    def parse(cls, text: str) -> ClassPriorSpec:
        """``global``, ``uniform`` or comma-separated positive shares.

        Raises
        ------
        ValueError
            Anything else, saying what is allowed.
        """
        value = text.strip().lower()
        if value in (GLOBAL, UNIFORM):
            return cls(value)
        try:
            shares = [float(x) for x in value.split(",")]
        except ValueError:
            shares = []
        if len(shares) < 2 or not all(math.isfinite(x) and x > 0 for x in shares):
            raise ValueError(f"class-prior must be 'global', 'uniform' or two or more positive "
                             f"shares separated by commas (e.g. '0.42,0.58'), got {text[:80]!r}")
        total = sum(shares)
        return cls("explicit", tuple(x / total for x in shares))

    def resolve(self, classes: int, counts: Mapping[Any, Sequence[int]]) -> list[float] | None:
        """The shares to aim at for a task of ``classes`` classes, given the nodes' stated
        ``counts`` (node -> one count per class); ``None``: equal shares (``uniform``, or no
        usable counts yet).

        Raises
        ------
        ValueError
            Explicit shares of another length than ``classes``.
        """
        if self.mode == UNIFORM or classes < 2:
            return None
        if self.mode == "explicit":
            if len(self.shares) != classes:
                raise ValueError(f"class-prior gives {len(self.shares)} shares, the task has "
                                 f"{classes} classes")
            return list(self.shares)
        return pooled_shares(classes, counts)


def with_class_prior(config: ConfigRecord, spec: ClassPriorSpec, classes: int,
                     counts: Mapping[Any, Sequence[int]]) -> ConfigRecord:
    """``config`` with the resolved shares under :data:`fedcybgd.protocol.CLASS_PRIOR` (a new
    record; unchanged when they are equal shares)."""
    shares = spec.resolve(classes, counts)
    if shares is None:
        return config
    return ConfigRecord({**dict(config), protocol.CLASS_PRIOR: shares})


def check_counts(value: object) -> list[int]:
    """A node's stated class counts, or ``ValueError`` saying why they are unusable."""
    if not isinstance(value, list) or not 2 <= len(value) <= MAX_CLASSES:
        raise ValueError(f"class counts must be a list of 2 to {MAX_CLASSES} integers")
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_COUNT
               for x in value):
        raise ValueError(f"class counts must be integers in [0, {MAX_COUNT}]")
    if sum(value) == 0:
        raise ValueError("class counts are all zero")
    return list(value)


def pooled_shares(classes: int, counts: Mapping[Any, Sequence[int]]) -> list[float] | None:
    """The nodes' counts pooled into Laplace-smoothed shares (each node weighted by its total,
    capped at :data:`WEIGHT_CAP` x the median total); ``None`` when no node stated counts for
    ``classes`` classes."""
    usable = [list(c) for c in counts.values() if len(c) == classes and sum(c) > 0]
    if not usable:
        return None
    cap = WEIGHT_CAP * statistics.median(sum(c) for c in usable)
    pooled = [0.0] * classes
    for c in usable:
        scale = min(1.0, cap / sum(c))
        for i, x in enumerate(c):
            pooled[i] += scale * x
    total = sum(pooled)
    return [(x + 1.0) / (total + classes) for x in pooled]
