"""``lm``: language modelling on raw text, every token scored on predicting the next.

Data: rows with a text column (``text-field``): a folder of ``.txt`` files (one row a file), a
JSONL / CSV / Parquet file of texts, a node's own ``data-path`` of either, or the built-in
``shakespeare`` corpus (one row a speech; :mod:`fedcybgd.data.shakespeare`). Rows are cut into
**windows** of ``max-seq-len`` tokens: the rows of one document are tokenized, joined in order
(a row not ending in a newline gets one) and cut into consecutive windows, none crossing from one
document into the next; the last, shorter window of a document is kept (two tokens or more).
A document is a file (``_file``) or, for a built-in corpus, its document column (a play). The
training split of a run partitioned by a column (``partitioner = "movie"`` or ``"dirichlet"``,
``partition-by``) is cut by that column instead, so a window never mixes two partitions' text
(``partition-by = "role"``: a speaking role's speeches, joined). The windows are then shuffled
with a fixed seed, so the first ``eval-examples`` held-out windows are a random sample of them.

Held-out splits: the source's own (files or folders named ``train``, ``validation``, ``test``),
else cut from it (:func:`fedcybgd.data.text_files.split_texts`).

Loss: the mean cross-entropy of every scored token (a window's first token is not scored: no
context). Evaluation: the held-out loss per token, its ``perplexity``, the next-token top-1
``accuracy`` (the run's accuracy column) and the number of ``tokens`` scored; and the
**forgetting** measure, the loss per token on ``reference-dataset`` (a text the untrained model
already knows, default the Rotten Tomatoes test reviews: ``reference_loss`` and
``reference_perplexity``), whose rise from round 0 is what training cost the model elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from fedcybgd.data.builtin import builtin_dataset, builtin_splits
from fedcybgd.data.kinds import builtin_task
from fedcybgd.data.prompts import EncodedExamples, collate, leading_special_ids, pad_token_id
from fedcybgd.data.sources import FILE_COLUMN, SPLIT_SEED, DataError
from fedcybgd.data.text_files import read_texts, split_texts
from fedcybgd.tasks.base import Task
from fedcybgd.tasks.classification import check_text
from fedcybgd.tasks.objective import EvalResult, on_model_device, scored_states

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fedcybgd.model.layerwise import LayerStack

IDS = "input_ids"
TOKENS = "tokens"
HEAD_ROWS = 1024  # scored positions per slice through the LM head at evaluation


class LMEncoder:
    """Windows (token id lists) to examples scored on every next token; ``cut`` counts the
    windows longer than ``max_seq_len`` (cut at the end)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_seq_len: int) -> None:
        if max_seq_len < 2:
            raise ValueError(f"max-seq-len must be >= 2, got {max_seq_len}")
        self.max_seq_len = max_seq_len
        self.pad_token_id = pad_token_id(tokenizer)
        self.cut = 0

    def __call__(self, items: Sequence[Any]) -> EncodedExamples:
        windows = []
        for ids in items:
            ids = [int(i) for i in ids]
            if len(ids) > self.max_seq_len:
                self.cut += 1
                ids = ids[: self.max_seq_len]
            if len(ids) < 2:
                raise ValueError(f"a window needs two tokens or more, got {len(ids)}")
            windows.append(ids)
        return EncodedExamples(
            input_ids=windows, labels=[-1] * len(windows), class_token_ids=(),
            pad_token_id=self.pad_token_id,
            score_positions=[list(range(len(w) - 1)) for w in windows],
            targets=[w[1:] for w in windows])


def cut_windows(ids: list[int], size: int, lead: list[int]) -> list[list[int]]:
    """``ids`` in consecutive windows of ``size`` tokens, each starting with ``lead`` (the
    tokenizer's leading special tokens); a last window of fewer than two tokens is dropped."""
    step = size - len(lead)
    if step < 1:
        raise ValueError(f"max-seq-len = {size} leaves no room after {len(lead)} leading tokens")
    out = [lead + ids[start:start + step] for start in range(0, len(ids), step)]
    return [w for w in out if len(w) >= 2]


@builtin_task("lm")
class LMTask(Task):
    """See the module docstring."""

    name = "lm"

    def __init__(self, run: Any) -> None:
        super().__init__(run)
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._reference: pd.DataFrame | None = None

    # ---------------------------------------------------------------------------------- data

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The run's tokenizer (windows are cut in its tokens)."""
        if self._tokenizer is None:
            from fedcybgd.model.loading import load_tokenizer

            self._tokenizer = load_tokenizer(self.run.model)
        return self._tokenizer

    def read(self, spec: str) -> dict[str, pd.DataFrame]:
        """``.txt`` files besides the data files every task reads
        (:func:`fedcybgd.data.text_files.read_texts`)."""
        return read_texts(spec)

    def source_splits(self) -> dict[str, pd.DataFrame]:
        """A built-in corpus's splits, else the source's, held-out ones cut as
        :func:`~fedcybgd.data.text_files.split_texts` says."""
        if self._splits is None:
            builtin = builtin_splits(self.run.dataset)
            self._splits = builtin if builtin is not None else split_texts(
                self.read(self.run.dataset), self.run.dataset, self.run.text_field)
        return self._splits

    def document_column(self, frame: pd.DataFrame) -> str | None:
        """The column whose runs of equal values are one document: a built-in corpus's own
        (its ``movie`` partition column), else ``_file``; ``None``: the frame is one text."""
        builtin = builtin_dataset(self.run.dataset)
        column = builtin.partition_columns.get("movie") if builtin is not None else FILE_COLUMN
        return column if column in frame.columns else None

    def partition_column(self, method: str) -> str | None:
        """``partition-by``, else a built-in corpus's own column, else ``_file`` (each file a
        document)."""
        if self.run.partition_by:
            return str(self.run.partition_by)
        builtin = builtin_dataset(self.run.dataset)
        if builtin is not None:
            return builtin.partition_columns.get(method)
        return FILE_COLUMN

    def split(self, name: str) -> pd.DataFrame:
        """The windows of split ``name``; the training split's are cut by the partition column
        when the run's partitioner groups by one (see the module docstring)."""
        if name != "train" or self.run.partitioner == "iid" or name in self._checked:
            return super().split(name)
        splits = self.source_splits()
        frame = splits["train"]
        column = self.partition_column(self.run.partitioner)
        group = column if column in frame.columns else self.document_column(frame)
        self._checked[name] = self._require(self.windows(frame, group),
                                            f"dataset = {self.run.dataset!r} [{name}]")
        return self._checked[name]

    def check(self, frame: pd.DataFrame) -> pd.DataFrame:
        """The frame's windows, cut by document."""
        return self.windows(frame, self.document_column(frame))

    def windows(self, frame: pd.DataFrame, group: str | None,
                field: str | None = None) -> pd.DataFrame:
        """One row per window of ``max-seq-len`` tokens: ``input_ids``, ``tokens`` and the
        other columns of the window's first row (not its text, ``field``, default
        ``text-field``); shuffled with a fixed seed.

        Raises
        ------
        DataError
            A missing or empty text (naming the file and row).
        """
        field = field or self.run.text_field
        columns = [c for c in frame.columns if c not in (IDS, TOKENS, field)]
        if len(frame) == 0:
            return pd.DataFrame({**{c: pd.Series(dtype=object) for c in columns},
                                 IDS: pd.Series(dtype=object), TOKENS: pd.Series(dtype="int64")})
        texts = check_text(frame, field).tolist()
        texts = [t if t.endswith("\n") else t + "\n" for t in texts]
        tokenizer = self.tokenizer()
        # verbose=False: a whole file is longer than the model's context; it is cut below
        ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        lead = leading_special_ids(tokenizer)
        keys = frame[group].tolist() if group is not None else [0] * len(frame)
        records = frame[columns].to_dict("records")
        documents: dict[Any, list[int]] = {}  # key -> row positions, in frame order
        for position, key in enumerate(keys):
            documents.setdefault(key, []).append(position)
        out: list[dict[str, Any]] = []
        for rows in documents.values():
            stream: list[int] = []
            starts: list[int] = []  # where each row's tokens start in the stream
            for position in rows:
                starts.append(len(stream))
                stream.extend(ids[position])
            step = self.run.max_seq_len - len(lead)
            for number, window in enumerate(cut_windows(stream, self.run.max_seq_len, lead)):
                first = int(np.searchsorted(starts, number * step, side="right")) - 1
                out.append({**records[rows[max(first, 0)]], IDS: window, TOKENS: len(window)})
        windows = pd.DataFrame.from_records(out)
        order = np.random.default_rng(SPLIT_SEED).permutation(len(windows))
        return windows.iloc[order].reset_index(drop=True)

    def reference_frame(self) -> pd.DataFrame | None:
        """The first ``eval-examples`` windows of ``reference-dataset`` (a built-in dataset's
        test split, or every row of a file or folder); ``None`` when it is empty."""
        spec = self.run.reference_dataset
        if not spec:
            return None
        if self._reference is None:
            builtin = builtin_dataset(spec)
            if builtin is not None:
                field = builtin.fields.get("text-field")
                if not field:
                    raise DataError(f"reference-dataset = {spec!r} has no text column (it is "
                                    f"a {builtin.task} dataset); name a dataset with texts")
                splits = builtin_splits(spec)
                assert splits is not None
                frame, group = splits["test"], None
                if builtin.task == "lm":
                    group = builtin.partition_columns.get("movie")
            else:
                found = read_texts(spec)
                frame = found["test"] if "test" in found else pd.concat(list(found.values()),
                                                                        ignore_index=True)
                field, group = self.run.text_field, FILE_COLUMN
            group = group if group in frame.columns else None
            windows = self._require(self.windows(frame, group, field),
                                    f"reference-dataset = {spec!r}")
            self._reference = windows.head(self.run.evaluation.examples)
        return self._reference

    # ------------------------------------------------------------------------------ encoding

    def examples(self, frame: pd.DataFrame) -> list[Any]:
        """The windows' token ids."""
        return list(frame[IDS])

    def encoder(self, tokenizer: PreTrainedTokenizerBase, max_seq_len: int) -> LMEncoder:
        """An :class:`LMEncoder`."""
        return LMEncoder(tokenizer, max_seq_len)

    def max_scored_tokens(self, batch_size: int, max_seq_len: int) -> int:
        """Every token but a window's first is scored."""
        return batch_size * (max_seq_len - 1)

    # --------------------------------------------------------------------------- evaluation

    @torch.no_grad()
    def score(self, stack: LayerStack, tokenizer: PreTrainedTokenizerBase,
              frame: pd.DataFrame, batch_size: int, max_seq_len: int) -> tuple[float, float, int]:
        """``(summed loss, correct next-token guesses, scored tokens)`` over ``frame``."""
        encode = self.encoder(tokenizer, max_seq_len)
        items = self.examples(frame)
        nll = hits = 0.0
        tokens = 0
        for start in range(0, len(items), batch_size):
            batch = on_model_device(stack, collate(encode(items[start:start + batch_size]),
                                                   task=self))
            hidden = stack.run(stack.embed(batch.input_ids, batch.attention_mask), 0,
                               stack.num_layers)
            states = scored_states(hidden.states, batch)
            for part in range(0, states.shape[0], HEAD_ROWS):
                rows = slice(part, part + HEAD_ROWS)
                logits = stack.head(stack.final_hidden(states[rows])).float()
                targets = batch.target_ids[rows]
                nll += float(F.cross_entropy(logits, targets, reduction="sum"))
                hits += float((logits.argmax(-1) == targets).sum())
            tokens += batch.num_scored
        self.warn_cut("evaluation", encode.cut, len(items), max_seq_len, "windows cut at the end")
        return nll, hits, tokens

    def evaluate(self, stack: LayerStack, tokenizer: PreTrainedTokenizerBase,
                 frame: pd.DataFrame, batch_size: int, max_seq_len: int) -> EvalResult:
        """Held-out loss per token, perplexity, next-token accuracy; the reference text's loss
        per token (the forgetting measure)."""
        nll, hits, tokens = self.score(stack, tokenizer, frame, batch_size, max_seq_len)
        if tokens == 0:
            raise ValueError("evaluate() got no scored tokens")
        loss = nll / tokens
        metrics = {"perplexity": math.exp(min(loss, 700.0)), "tokens": float(tokens)}
        reference = self.reference_frame()
        if reference is not None:
            ref_nll, _, ref_tokens = self.score(stack, tokenizer, reference, batch_size,
                                                max_seq_len)
            metrics["reference_loss"] = ref_nll / ref_tokens
            metrics["reference_perplexity"] = math.exp(min(ref_nll / ref_tokens, 700.0))
        return EvalResult(loss, hits / tokens, len(frame), metrics)
