"""Task data for clients and server: splits, federated shares and batches of prompts.

Prompts are tokenized lazily, one batch at a time: a client takes a few batches per round, and
tokenizing 8 rows costs ~0.3 ms against ~45 ms for a whole 1.3k-row share.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from fedcybgd.data import rotten_tomatoes
from fedcybgd.data.partition import PARTITIONERS, check_partition_args, partition_positions
from fedcybgd.data.prompts import (
    TEMPLATE,
    VERBALIZER,
    Batch,
    EncodedExamples,
    PromptEncoder,
    class_token_ids,
    collate,
    encode,
)

if TYPE_CHECKING:  # importing transformers costs ~2 s; only the type is needed here
    from transformers import PreTrainedTokenizerBase

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
    "class_token_ids",
    "client_examples",
    "collate",
    "encode",
    "eval_batches",
    "load_split",
]

DATASETS = ("rotten-tomatoes",)
SPLITS = rotten_tomatoes.SPLITS


def _check_dataset(dataset: str) -> None:
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset '{dataset}'; allowed: {', '.join(DATASETS)}")


def load_split(dataset: str, split: str) -> pd.DataFrame:
    """Columns ``text``, ``label``, ``movie_name`` of ``split`` (train/validation/test)."""
    _check_dataset(dataset)
    return rotten_tomatoes.load_split(split)


@lru_cache(maxsize=32)
def _shares(
    dataset: str, partitioner: str, num_partitions: int, alpha: float, seed: int
) -> tuple[np.ndarray, ...]:
    # Computed once per process for all clients: simulated clients share a process.
    train = rotten_tomatoes.shared_split("train")
    return tuple(partition_positions(train, partitioner, num_partitions, alpha, seed))


def client_examples(
    dataset: str,
    partitioner: str,
    partition_id: int,
    num_partitions: int,
    alpha: float,
    seed: int,
) -> pd.DataFrame:
    """Training rows of client ``partition_id`` out of ``num_partitions``.

    Parameters
    ----------
    partitioner : str
        One of ``PARTITIONERS``.
    alpha : float
        Dirichlet concentration (``dirichlet`` only; smaller = more label skew).
    seed : int
        Seeds the partitioning; the train/validation/test split itself is fixed.
    """
    _check_dataset(dataset)
    check_partition_args(partitioner, partition_id, num_partitions, alpha)
    positions = _shares(dataset, partitioner, int(num_partitions), float(alpha), int(seed))
    train = rotten_tomatoes.shared_split("train")
    return train.iloc[positions[partition_id]].reset_index(drop=True)


class BatchIterator(Iterator[Batch]):
    """Endless batches of ``batch_size`` prompts over seeded, reshuffled epochs.

    Rows are read as one stream, epoch after epoch, each epoch in its own order drawn from
    ``(seed, epoch)``; batches are cut from that stream, so every batch is full. The ``n``-th
    batch depends only on ``(frame, seed, n)``, and ``start_step`` skips ahead without
    tokenizing, so a client rebuilt each round can resume where it stopped. With
    ``logit_adjust`` every batch carries ``log(C * p_c)`` of the frame's own label shares
    (Laplace-smoothed: a class the client lacks is strongly suppressed, not ``-inf``), which the
    training loss adds to the class logits (:func:`fedcybgd.objective.adjusted`).
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
    ) -> None:
        if len(frame) == 0:
            raise ValueError("cannot draw batches from an empty frame")
        if batch_size < 1:
            raise ValueError(f"batch-size must be >= 1, got {batch_size}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self._texts = frame["text"].tolist()
        self._labels = frame["label"].astype(int).tolist()
        self._encoder = PromptEncoder(tokenizer, max_seq_len)
        self._log_prior = local_log_prior(self._labels, len(self._encoder.class_token_ids)) \
            if logit_adjust else None
        self._batch_size = batch_size
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = -1
        self._order = np.arange(len(self._texts))
        self.step = start_step

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            n = len(self._texts)
            self._order = (
                np.random.default_rng([self._seed, epoch]).permutation(n)
                if self._shuffle
                else np.arange(n)
            )
            self._epoch = epoch
        return self._order

    def __next__(self) -> Batch:
        n = len(self._texts)
        start = self.step * self._batch_size
        rows = []
        for position in range(start, start + self._batch_size):
            epoch, offset = divmod(position, n)
            rows.append(int(self._epoch_order(epoch)[offset]))
        self.step += 1
        return collate(
            self._encoder([self._texts[r] for r in rows], [self._labels[r] for r in rows]),
            self._log_prior,
        )


def local_log_prior(labels: list[int], classes: int) -> torch.Tensor:
    """``[C]`` ``log(C * p_c)`` of ``labels``' shares, ``p_c = (n_c + 1) / (n + C)``: zeros
    for balanced labels."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=classes)[:classes]
    shares = (counts + 1.0) / (counts.sum() + classes)
    return torch.tensor(np.log(classes * shares), dtype=torch.float32)


def batches(
    frame: pd.DataFrame,
    tokenizer: PreTrainedTokenizerBase,
    batch_size: int,
    max_seq_len: int,
    seed: int,
    shuffle: bool = True,
    start_step: int = 0,
    logit_adjust: bool = False,
) -> BatchIterator:
    """Endless training batches over ``frame`` (see :class:`BatchIterator`)."""
    return BatchIterator(frame, tokenizer, batch_size, max_seq_len, seed, shuffle, start_step,
                         logit_adjust)


def eval_batches(
    frame: pd.DataFrame,
    tokenizer: PreTrainedTokenizerBase,
    batch_size: int,
    max_seq_len: int,
    limit: int | None = None,
) -> Iterator[Batch]:
    """Batches over the first ``limit`` rows (all when ``None``) in order; the last may be short."""
    # Checked here, not in the generator, so bad arguments fail at the call.
    if batch_size < 1:
        raise ValueError(f"batch-size must be >= 1, got {batch_size}")
    rows = frame if limit is None else frame.iloc[: max(limit, 0)]
    texts = rows["text"].tolist()
    labels = rows["label"].astype(int).tolist()
    encoder = PromptEncoder(tokenizer, max_seq_len)

    def generate() -> Iterator[Batch]:
        for start in range(0, len(texts), batch_size):
            stop = start + batch_size
            yield collate(encoder(texts[start:stop], labels[start:stop]))

    return generate()
