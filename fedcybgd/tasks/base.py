"""The :class:`Task` interface: data splits, encoding, loss and evaluation of one kind of task.

What a task decides, and who asks:

* **data** (:meth:`Task.split`, :meth:`Task.local_frame`, :meth:`Task.eval_frame`): the rows of
  ``dataset`` (a built-in name, a file, a folder), checked and normalised by :meth:`Task.check`
  (which names the file, the row and the field of a bad row); clients take their partition of
  the train split, or their own ``data-path`` file; the server evaluates on ``eval-dataset`` or
  the dataset's ``eval-split``.
* **encoding** (:meth:`Task.examples`, :meth:`Task.encoder`): a row becomes token ids plus the
  positions that carry the loss and the token each must predict
  (:class:`~fedcybgd.data.prompts.EncodedExamples`); batches carry the task
  (``Batch.task``), so a rule scores any task through :mod:`fedcybgd.tasks.objective`.
* **loss** (:meth:`Task.scores`, :meth:`Task.loss`, :meth:`Task.loss_sum`): by default the
  mean full-vocabulary cross-entropy of the scored tokens; ``loss_sum`` is its sliced form (the
  ZeroLock local heads take the head's loss in slices of rows).
* **evaluation** (:meth:`Task.evaluate`): loss and the task's metric on held-out rows.

A subclass registered with :func:`fedcybgd.tasks.register_task` in a plug-in module is selected
with ``task = "<name>"``. A task is per-run state: a run builds one
(:func:`fedcybgd.tasks.build.build_task`; the server's runner, a client process's
:class:`~fedcybgd.client.run_state.RunState`) and hands it on, so its splits, the nodes' shares
and its truncation counts are read, drawn and counted once a run, and go with it.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from fedcybgd.data.builtin import builtin_dataset, builtin_splits
from fedcybgd.data.partition import partition_positions
from fedcybgd.data.prompts import Batch, EncodedExamples
from fedcybgd.data.sources import DataError, make_splits, read_source
from fedcybgd.tasks.objective import EvalResult

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fedcybgd.config import RunConfig
    from fedcybgd.model.layerwise import LayerStack

log = logging.getLogger(__name__)



class Encoder(Protocol):
    """Turns a list of examples (as :meth:`Task.examples` lists them) into token ids."""

    @property
    def cut(self) -> int:
        """Examples shortened so far to fit max-seq-len."""
        ...

    def __call__(self, items: Sequence[Any]) -> EncodedExamples:
        """Encode ``items``."""
        ...



class Task(ABC):
    """One kind of task; see the module docstring.

    Parameters
    ----------
    run : RunConfig
        The run config; a task reads its own keys from it (``dataset``, ``text-field``, ...).
    """

    name: ClassVar[str] = ""

    def __init__(self, run: RunConfig) -> None:
        self.run = run
        self._splits: dict[str, pd.DataFrame] | None = None
        self._checked: dict[str, pd.DataFrame] = {}
        self._shares: dict[tuple[str, int, float, int], tuple[np.ndarray, ...]] = {}
        self._cuts: dict[tuple[Hashable, int], CutCount] = {}

    # ---------------------------------------------------------------------------------- data

    def source_splits(self) -> dict[str, pd.DataFrame]:
        """``train``/``validation``/``test`` of ``dataset`` as read (unchecked, shared)."""
        if self._splits is None:
            builtin = builtin_splits(self.run.dataset)
            self._splits = builtin if builtin is not None else make_splits(
                self.read(self.run.dataset), self.run.dataset)
        return self._splits

    def read(self, spec: str) -> dict[str, pd.DataFrame]:
        """The frames of a file or folder by split name, as the source has them
        (:func:`~fedcybgd.data.sources.read_source`; a task may read other kinds of file)."""
        return read_source(spec)

    def split(self, name: str) -> pd.DataFrame:
        """The checked rows of split ``name`` of ``dataset`` (cached: do not modify)."""
        if name not in self._checked:
            splits = self.source_splits()
            if name not in splits:
                raise ValueError(f"unknown split {name!r}; allowed: {', '.join(splits)}")
            self._checked[name] = self._require(self.check(splits[name]),
                                                f"dataset = {self.run.dataset!r} [{name}]")
        return self._checked[name]

    def local_frame(self, path: str) -> pd.DataFrame:
        """A node's own training rows (node config ``data-path``): the ``train`` split of a
        folder that has one, else every row. They are read on the node and never sent."""
        found = self.read(path)
        frame = found["train"] if "train" in found else pd.concat(list(found.values()),
                                                                    ignore_index=True)
        return self._require(self.check(frame), f"data-path = {path!r}")

    def eval_frame(self, split: str, limit: int) -> pd.DataFrame:
        """The server's held-out rows: all of ``eval-dataset`` (its ``split`` when it has
        splits) when set, else ``split`` of ``dataset``; the first ``limit`` of them."""
        if not self.run.eval_dataset:
            return self.split(split).head(limit)
        found = self.read(self.run.eval_dataset)
        frame = found[split] if split in found else pd.concat(list(found.values()),
                                                              ignore_index=True)
        checked = self.check(frame)
        return self._require(checked, f"eval-dataset = {self.run.eval_dataset!r}").head(limit)

    @staticmethod
    def _require(frame: pd.DataFrame, what: str) -> pd.DataFrame:
        if len(frame) == 0:
            raise DataError(f"{what}: no examples")
        return frame

    @abstractmethod
    def check(self, frame: pd.DataFrame) -> pd.DataFrame:
        """Rows checked and normalised to the task's own columns (a new frame).

        Raises
        ------
        DataError
            A missing field, an empty text, a value the task cannot use; the message names
            the file, the row and the field (:func:`fedcybgd.data.sources.where`).
        """

    def partition_column(self, method: str) -> str | None:
        """The column a ``dirichlet`` (label skew) or ``movie`` (whole groups) partition reads;
        ``partition-by`` when set, else a built-in dataset's own. ``None``: the task has none
        (use ``iid``)."""
        if self.run.partition_by:
            return str(self.run.partition_by)
        builtin = builtin_dataset(self.run.dataset)
        return builtin.partition_columns.get(method) if builtin is not None else None

    def partition(self, partitioner: str, num_partitions: int, alpha: float,
                  seed: int) -> tuple[np.ndarray, ...]:
        """Each partition's row positions in the train split (drawn once a run: the clients
        a process simulates share them; :func:`fedcybgd.data.partition.partition_positions`)."""
        key = (partitioner, int(num_partitions), float(alpha), int(seed))
        if key not in self._shares:
            self._shares[key] = tuple(partition_positions(
                self.split("train"), partitioner, key[1], key[2], key[3],
                column=self.partition_column(partitioner)))
        return self._shares[key]

    # ------------------------------------------------------------------------------ encoding

    @abstractmethod
    def examples(self, frame: pd.DataFrame) -> list[Any]:
        """The rows of a checked frame as the encoder takes them (one item per row)."""

    @abstractmethod
    def encoder(self, tokenizer: PreTrainedTokenizerBase, max_seq_len: int) -> Encoder:
        """A callable turning a list of :meth:`examples` items into token ids and targets."""

    def max_scored_tokens(self, batch_size: int, max_seq_len: int) -> int:
        """The most positions of a training batch that reach the LM head: the rows of the
        logits the memory estimate counts (:mod:`fedcybgd.memory.estimate`). One a row by
        default (a label token)."""
        return batch_size

    def class_log_prior(self, frame: pd.DataFrame) -> torch.Tensor | None:
        """``[C]`` prior a label-skewed client's loss adds to its class logits
        (``logit-adjust``); ``None``: the task has no classes."""
        return None

    def num_classes(self) -> int:
        """How many classes the task's labels have (0: none; ``class-prior`` applies from 2)."""
        return 0

    def class_labels(self, frame: pd.DataFrame) -> tuple[list[int], int] | None:
        """Each row's class index and the number of classes (``class-balance`` draws
        batches by class); ``None``: the task has no classes."""
        return None

    # --------------------------------------------------------------------------------- loss

    def scores(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """``[n, V]`` float logits as the loss scores them (a hook: e.g. logit adjustment)."""
        return logits.float()

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Mean loss over the ``N`` scored tokens of ``batch`` from their ``[N, V]`` logits."""
        return F.cross_entropy(self.scores(logits, batch), batch.target_ids)

    def loss_sum(self, logits: torch.Tensor, batch: Batch, part: slice) -> torch.Tensor:
        """Summed loss of the scored rows ``part`` (``logits`` holds only those rows)."""
        return F.cross_entropy(self.scores(logits, batch), batch.target_ids[part],
                               reduction="sum")

    # --------------------------------------------------------------------------- evaluation

    @abstractmethod
    def evaluate(self, stack: LayerStack, tokenizer: PreTrainedTokenizerBase,
                 frame: pd.DataFrame, batch_size: int, max_seq_len: int) -> EvalResult:
        """Loss and the task's metric of the model behind ``stack`` on ``frame`` (no grad)."""

    # ---------------------------------------------------------------------------- truncation

    def warn_cut(self, what: str, cut: int, total: int, max_seq_len: int, how: str,
                 key: Hashable = None) -> CutCount | None:
        """Say once a run and ``key`` that examples were shortened to fit; count the rest.

        The first call that cut anything logs a warning with its count; later calls for the
        same ``key`` (every node and round of a simulation, every evaluation) only add to the
        count, logged at DEBUG level with the running totals, so a log does not repeat the same
        warning. The counts are the task's, so a new run (a new task) says its warnings again.

        Parameters
        ----------
        what : str
            Where the examples were cut, for the message (e.g. ``"round 3, block layer.4-7"``).
        cut, total : int
            Examples shortened, out of examples encoded.
        max_seq_len : int
            The run's ``max-seq-len``.
        how : str
            How they were shortened, for the message.
        key : Hashable, optional
            What makes a warning new (default: ``what``).

        Returns
        -------
        CutCount or None
            The running counts for ``key``; None when nothing was cut and nothing was before.
        """
        where = (what if key is None else key, max_seq_len)
        if not cut:
            return self._cuts.get(where)
        counts = self._cuts.setdefault(where, CutCount())
        counts.calls += 1
        counts.cut += cut
        counts.total += total
        if counts.calls == 1:
            log.warning("%s: %d of %d examples were longer than max-seq-len = %d: %s "
                        "(raise max-seq-len to keep them whole; said once, later cuts are "
                        "counted at DEBUG level)", what, cut, total, max_seq_len, how)
        else:
            log.debug("%s: %d of %d examples cut to max-seq-len = %d (so far: %d of %d, %d "
                      "times)", what, cut, total, max_seq_len, counts.cut, counts.total,
                      counts.calls)
        return counts


@dataclass
class CutCount:
    """What :meth:`Task.warn_cut` has counted for one key: calls, examples cut, examples seen."""

    calls: int = 0
    cut: int = 0
    total: int = 0
