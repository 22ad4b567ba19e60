"""Task data for clients and server: splits, federated shares and batches.

What a row is and how it is tokenized belongs to the run's task (:mod:`fedcybgd.tasks`); here
are the shares of its train split and the batches over a frame. Without a task, the functions
serve the default one: Rotten Tomatoes classification. Examples are tokenized lazily, one batch
at a time: a client takes a few batches per round, and tokenizing 8 rows costs ~0.3 ms against
~45 ms for a whole 1.3k-row share.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from fedcybgd.data import rotten_tomatoes
from fedcybgd.data.builtin import BUILTIN_DATASETS, builtin_splits
from fedcybgd.data.partition import PARTITIONERS, check_partition_args
from fedcybgd.data.prompts import (
    TEMPLATE,
    VERBALIZER,
    Batch,
    EncodedExamples,
    class_token_ids,
    collate,
    encode,
)
from fedcybgd.tasks.classification import local_log_prior

if TYPE_CHECKING:  # importing transformers costs ~2 s; only the type is needed here
    from transformers import PreTrainedTokenizerBase

    from fedcybgd.tasks.base import Task

__all__ = [
    "DATASETS",
    "PARTITIONERS",
    "SPLITS",
    "TEMPLATE",
    "VERBALIZER",
    "Batch",
    "BatchIterator",
    "EncodedExamples",
    "batches",
    "builtin_splits",
    "class_counts",
    "class_token_ids",
    "client_examples",
    "collate",
    "default_task",
    "encode",
    "eval_batches",
    "load_split",
    "local_log_prior",
    "target_shares",
]

DATASETS = tuple(BUILTIN_DATASETS)  # built-in datasets; `dataset` also takes a path
SPLITS = rotten_tomatoes.SPLITS


def _check_dataset(dataset: str) -> None:
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset '{dataset}'; allowed: {', '.join(DATASETS)}")


def load_split(dataset: str, split: str) -> pd.DataFrame:
    """A private copy of a built-in dataset's ``split`` (Rotten Tomatoes: columns ``text``,
    ``label``, ``movie_name``; the others: :mod:`fedcybgd.data.catalogue`)."""
    _check_dataset(dataset)
    splits = builtin_splits(dataset)
    assert splits is not None  # a built-in name
    if split not in splits:
        raise ValueError(f"unknown split '{split}'; allowed: {', '.join(splits)}")
    return splits[split].copy()


def default_task() -> Task:
    """The task of the default run config: Rotten Tomatoes classification."""
    from fedcybgd.config import RunConfig
    from fedcybgd.tasks.build import build_task

    return build_task(RunConfig())


def _task_of(task: Task | str | None) -> Task:
    """A task object for callers that name a built-in dataset (its own task, defaults)."""
    if task is None:
        return default_task()
    if isinstance(task, str):
        _check_dataset(task)
        from fedcybgd.config import RunConfig
        from fedcybgd.tasks.build import build_task

        return build_task(RunConfig(dataset=task))  # the dataset's own kind (task = auto)
    return task


def client_examples(
    dataset: Task | str | None,
    partitioner: str,
    partition_id: int,
    num_partitions: int,
    alpha: float,
    seed: int,
) -> pd.DataFrame:
    """Training rows of client ``partition_id`` out of ``num_partitions``.

    Parameters
    ----------
    dataset : Task or str
        The run's task (:func:`fedcybgd.tasks.build_task`), whose train split is shared out;
        a built-in dataset's name stands for the default task.
    partitioner : str
        One of ``PARTITIONERS``.
    alpha : float
        Dirichlet concentration (``dirichlet`` only; smaller = more label skew).
    seed : int
        Seeds the partitioning; the train/validation/test split itself is fixed.
    """
    resolved = _task_of(dataset)
    check_partition_args(partitioner, partition_id, num_partitions, alpha)
    positions = resolved.partition(partitioner, num_partitions, alpha, seed)
    train = resolved.split("train")
    return train.iloc[positions[partition_id]].reset_index(drop=True)


class BatchIterator(Iterator[Batch]):
    """Endless batches of ``batch_size`` prompts over seeded, reshuffled epochs.

    Rows are read as one stream, epoch after epoch, each epoch in its own order drawn from
    ``(seed, epoch)``; batches are cut from that stream, so every batch is full. The ``n``-th
    batch depends only on ``(frame, seed, n)``, and ``start_step`` skips ahead without
    tokenizing, so a client rebuilt each round can resume where it stopped. With
    ``logit_adjust`` every batch carries ``log(C * p_c)`` of the frame's own label shares
    (Laplace-smoothed: a class the client lacks is strongly suppressed, not ``-inf``), which the
    training loss adds to the class logits (:func:`fedcybgd.tasks.objective.adjusted`); tasks
    without classes carry none. ``task`` (default: :func:`default_task`) encodes the rows.

    ``target_prior`` (shares over the task's classes, default equal): the class mix training
    aims the model at. Logit adjustment then adds ``log(p_c / target_c)`` (the frame's shares
    against the target) instead of ``log(C * p_c)``, so a model trained on skewed shares keeps
    the target's prior rather than none (``class-prior``: the nodes' pooled shares).

    ``class_balance`` (a task with classes, a frame holding two or more of them): the stream's
    positions take the classes the frame holds in the target's proportions (stride scheduling:
    each position goes to the class furthest behind its share; equal shares alternate), each
    class its own seeded epochs, so every batch holds the classes as the target mixes them (a
    rare class's rows recur). Label skew then cannot tilt a step's gradient towards the client's
    common class: logit adjustment balances the classes only in expectation over many batches,
    and Adam, which sizes each step by the recent gradients, turns the small but consistent push
    of a batch without the rare class into a full step. The prior the batches carry is then
    their own mix against the target: equal for the present classes.
    """

    def __init__(
        self,
        frame: pd.DataFrame,
        tokenizer: PreTrainedTokenizerBase,
        batch_size: int,
        max_seq_len: int,
        seed: int,
        shuffle: bool = True,
        start_step: int = 0,
        logit_adjust: bool = False,
        task: Task | None = None,
        class_balance: bool = False,
        target_prior: Sequence[float] | None = None,
    ) -> None:
        if len(frame) == 0:
            raise ValueError("cannot draw batches from an empty frame")
        if batch_size < 1:
            raise ValueError(f"batch-size must be >= 1, got {batch_size}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.task = _task_of(task)
        self._items: list[Any] = self.task.examples(frame)
        self.encoder = self.task.encoder(tokenizer, max_seq_len)
        self._log_prior = self.task.class_log_prior(frame) if logit_adjust else None
        self._by_class = class_groups(self.task, frame) if class_balance else None
        self._mix = np.zeros(0)
        if self._by_class is not None:
            present = np.array([len(g) > 0 for g in self._by_class])
            target = target_shares(target_prior, len(present))
            self._mix = np.where(present, target, 0.0) / target[present].sum()
            if logit_adjust:
                # the batches' own class shares: the target's among the present classes, the
                # absent ones Laplace-small (one row each, as in the frame's prior)
                absent = ~present
                shares = (len(frame) * self._mix + absent) / (len(frame) + absent.sum())
                self._log_prior = torch.tensor(np.log(len(shares) * shares),
                                               dtype=torch.float32)
        if self._log_prior is not None and target_prior is not None:
            target = target_shares(target_prior, len(self._log_prior))
            self._log_prior = self._log_prior - torch.tensor(
                np.log(len(target) * target), dtype=torch.float32)
        self._turns: list[int] = []  # class of each stream position (class_balance)
        self._ranks: list[int] = []  # how many earlier positions that class had
        self._taken = np.zeros(len(self._mix))  # positions each class has so far
        self._class_orders: dict[tuple[int, int], np.ndarray] = {}
        self._batch_size = batch_size
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = -1
        self._order = np.arange(len(self._items))
        self.step = start_step

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            n = len(self._items)
            self._order = (
                np.random.default_rng([self._seed, epoch]).permutation(n)
                if self._shuffle
                else np.arange(n)
            )
            self._epoch = epoch
        return self._order

    def _balanced_row(self, position: int) -> int:
        """Row of stream ``position`` when batches follow the class mix (``class_balance``)."""
        assert self._by_class is not None
        taken = self._taken
        while len(self._turns) <= position:
            # stride scheduling: the class furthest behind its share (ties: the lowest)
            turn = int(np.argmax(self._mix * (len(self._turns) + 1) - taken))
            self._ranks.append(int(taken[turn]))
            self._turns.append(turn)
            taken[turn] += 1
        turn, k = self._turns[position], self._ranks[position]
        group = self._by_class[turn]
        epoch, offset = divmod(k, len(group))
        key = (turn, epoch)
        order = self._class_orders.get(key)
        if order is None:
            if len(self._class_orders) > 4 * len(self._by_class):
                self._class_orders.clear()
            order = np.random.default_rng([self._seed, turn, epoch]).permutation(len(group))
            self._class_orders[key] = order
        return int(group[order[offset]])

    def __next__(self) -> Batch:
        n = len(self._items)
        start = self.step * self._batch_size
        rows = []
        for position in range(start, start + self._batch_size):
            if self._by_class is not None:
                rows.append(self._balanced_row(position))
                continue
            epoch, offset = divmod(position, n)
            rows.append(int(self._epoch_order(epoch)[offset]))
        self.step += 1
        return collate(self.encoder([self._items[r] for r in rows]), self._log_prior, self.task)


class PoissonBatches(Iterator[Batch]):
    """Training batches for example-level DP (DP-SGD): every step takes each row of the frame
    independently with probability ``rate = min(1, batch_size / rows)``.

    This is the sampling the accounting assumes (Poisson subsampling), so the batch's size
    varies from step to step and may be 0 (an empty :class:`Batch`: the step is noise alone);
    there is no class balancing and no logit adjustment (both would make one example's
    gradient depend on the others). The draws come from a generator seeded with
    ``[seed, step]``; the node passes its own secret seed, since amplification by sampling
    holds only while the sample stays hidden.
    """

    def __init__(self, frame: pd.DataFrame, tokenizer: PreTrainedTokenizerBase,
                 batch_size: int, max_seq_len: int, seed: int, task: Task | None = None) -> None:
        if len(frame) == 0:
            raise ValueError("cannot draw batches from an empty frame")
        if batch_size < 1:
            raise ValueError(f"batch-size must be >= 1, got {batch_size}")
        self.task = _task_of(task)
        self._items: list[Any] = self.task.examples(frame)
        self.encoder = self.task.encoder(tokenizer, max_seq_len)
        self.rate = min(1.0, batch_size / len(self._items))
        self._seed = seed
        self.step = 0

    def __next__(self) -> Batch:
        rng = np.random.default_rng([self._seed, self.step])
        rows = np.flatnonzero(rng.random(len(self._items)) < self.rate)
        self.step += 1
        if len(rows) == 0:
            return empty_batch(self.task)
        return collate(self.encoder([self._items[r] for r in rows]), None, self.task)


def empty_batch(task: Any = None) -> Batch:
    """A batch of no rows (a Poisson-sampled step that drew none)."""
    none = torch.zeros(0, dtype=torch.long)
    return Batch(torch.zeros((0, 1), dtype=torch.long), torch.zeros((0, 1), dtype=torch.long),
                 none, none, none, none, None, None, None, task)


def target_shares(prior: Sequence[float] | None, classes: int) -> np.ndarray:
    """``prior`` as ``classes`` positive shares summing to 1 (``None``: equal shares).

    Raises
    ------
    ValueError
        A prior of another length, or with a share that is not finite and positive.
    """
    if prior is None:
        return np.full(classes, 1.0 / classes)
    shares = np.asarray(list(prior), dtype=np.float64)
    if shares.shape != (classes,) or not np.all(np.isfinite(shares)) or np.any(shares <= 0):
        raise ValueError(f"class-prior needs {classes} finite positive shares, got "
                         f"{list(prior)[:16]}")
    return shares / shares.sum()


def class_counts(task: Task, frame: pd.DataFrame) -> list[int] | None:
    """How many rows of ``frame`` each of the task's classes has; ``None``: no classes."""
    found = task.class_labels(frame)
    if found is None:
        return None
    labels, classes = found
    return np.bincount(np.asarray(labels, dtype=np.int64), minlength=classes)[:classes].tolist()


def class_groups(task: Task, frame: pd.DataFrame) -> list[np.ndarray] | None:
    """Row positions of each class of ``frame`` (empty for a class it lacks); ``None`` when
    the task has no classes or the frame holds only one (nothing to balance)."""
    found = task.class_labels(frame)
    if found is None:
        return None
    labels, classes = np.asarray(found[0], dtype=np.int64), found[1]
    groups = [np.flatnonzero(labels == c) for c in range(classes)]
    return groups if sum(len(g) > 0 for g in groups) > 1 else None


def batches(
    frame: pd.DataFrame,
    tokenizer: PreTrainedTokenizerBase,
    batch_size: int,
    max_seq_len: int,
    seed: int,
    shuffle: bool = True,
    start_step: int = 0,
    logit_adjust: bool = False,
    task: Task | None = None,
    class_balance: bool = False,
    target_prior: Sequence[float] | None = None,
) -> BatchIterator:
    """Endless training batches over ``frame`` (see :class:`BatchIterator`)."""
    return BatchIterator(frame, tokenizer, batch_size, max_seq_len, seed, shuffle, start_step,
                         logit_adjust, task, class_balance, target_prior)


def eval_batches(
    frame: pd.DataFrame,
    tokenizer: PreTrainedTokenizerBase,
    batch_size: int,
    max_seq_len: int,
    limit: int | None = None,
    task: Task | None = None,
) -> Iterator[Batch]:
    """Batches over the first ``limit`` rows (all when ``None``) in order; the last may be short."""
    # Checked here, not in the generator, so bad arguments fail at the call.
    if batch_size < 1:
        raise ValueError(f"batch-size must be >= 1, got {batch_size}")
    rows = frame if limit is None else frame.iloc[: max(limit, 0)]
    resolved = _task_of(task)
    items = resolved.examples(rows)
    encoder = resolved.encoder(tokenizer, max_seq_len)

    def generate() -> Iterator[Batch]:
        for start in range(0, len(items), batch_size):
            yield collate(encoder(items[start:start + batch_size]), task=resolved)

    return generate()
