"""``classification``: a text column and a label column, scored on one verbalizer token.

The model reads ``prompt-template`` with the row's ``text-field`` in place of ``{text}``
(default ``Review: {text}\\nSentiment:``) and is scored on the logit of each class's label word
(``label-words``, comma-separated in label order, each read with a leading space as it follows
the prompt) at the position right after the prompt: full-vocabulary cross-entropy of the true
word for the loss (logit-adjusted by a skewed client's own label prior, ``logit-adjust``), and
argmax over the label words for the accuracy. Labels are class indices (``0..C-1``, also as
digit strings) or the label words themselves. Only the text is truncated (its start kept).

Rotten Tomatoes (``dataset = "rotten-tomatoes"``) is this task with the defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from fedcybgd.data.kinds import builtin_task
from fedcybgd.data.prompts import Batch, EncodedExamples, PromptEncoder, collate
from fedcybgd.data.sources import DataError, where
from fedcybgd.tasks.base import Task
from fedcybgd.tasks.objective import EvalResult, adjusted, evaluate, label_nll

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fedcybgd.model.layerwise import LayerStack


def label_words(text: str) -> list[str]:
    """``label-words`` as a list (ValueError naming the key when fewer than two)."""
    words = [w.strip() for w in text.split(",")]
    if len(words) < 2 or any(not w for w in words):
        raise ValueError(f"label-words must be two or more comma-separated words, got {text!r}")
    if len(set(words)) != len(words):
        raise ValueError(f"label-words must be distinct, got {text!r}")
    return words


def check_text(frame: pd.DataFrame, field: str) -> pd.Series:
    """``frame[field]`` as strings; DataError naming the row for a missing or empty text."""
    if field not in frame.columns:
        raise DataError(f"{where(frame, 0)}: no field {field!r} (fields: "
                        f"{sorted(c for c in frame.columns if not c.startswith('_'))})")
    values = frame[field]
    bad = ~values.map(lambda v: isinstance(v, str) and bool(v.strip()))
    if bad.any():
        position = int(np.flatnonzero(bad.to_numpy())[0])
        value = values.iloc[position]
        missing = value is None or (isinstance(value, float) and np.isnan(value))
        what = ("empty" if isinstance(value, str) else "missing" if missing
                else f"not a text ({value!r})")
        raise DataError(f"{where(frame, position)}: field {field!r} is {what} "
                        f"({int(bad.sum())} such rows)")
    return values.astype(str)


@builtin_task("classification")
class ClassificationTask(Task):
    """See the module docstring."""

    name = "classification"

    def __init__(self, run: Any) -> None:
        super().__init__(run)
        self.words = label_words(run.label_words)
        # The leading space: the word follows the prompt's last character, as BPE attaches it.
        self.verbalizer = {i: " " + w for i, w in enumerate(self.words)}

    def check(self, frame: pd.DataFrame) -> pd.DataFrame:
        """``text`` (str) and ``label`` (int class index) columns from the configured fields."""
        if len(frame) == 0:
            return frame.assign(text=pd.Series(dtype=str), label=pd.Series(dtype="int64"))
        text = check_text(frame, self.run.text_field)
        field = self.run.label_field
        if field not in frame.columns:
            raise DataError(f"{where(frame, 0)}: no field {field!r} (label-field)")
        index = {w: i for i, w in enumerate(self.words)}
        labels = np.empty(len(frame), dtype=np.int64)
        for position, value in enumerate(frame[field].tolist()):
            label = _label_index(value, index)
            if label is None:
                raise DataError(
                    f"{where(frame, position)}: field {field!r} = {value!r} is not a class "
                    f"index 0..{len(self.words) - 1} nor one of label-words {self.words}")
            labels[position] = label
        return frame.assign(text=text.to_numpy(), label=labels)

    def partition_column(self, method: str) -> str | None:
        """``partition-by``, else ``label`` (dirichlet) or ``movie_name`` (movie)."""
        if self.run.partition_by:
            return str(self.run.partition_by)
        return "label" if method == "dirichlet" else "movie_name"

    def examples(self, frame: pd.DataFrame) -> list[Any]:
        """``(text, label)`` pairs."""
        return list(zip(frame["text"].tolist(), frame["label"].astype(int).tolist(),
                        strict=True))

    def encoder(self, tokenizer: PreTrainedTokenizerBase, max_seq_len: int) -> _PairEncoder:
        """A :class:`~fedcybgd.data.prompts.PromptEncoder` with the run's template and words."""
        return _PairEncoder(
            PromptEncoder(tokenizer, max_seq_len, self.run.prompt_template, self.verbalizer))

    def class_log_prior(self, frame: pd.DataFrame) -> torch.Tensor | None:
        """``log(C * p_c)`` of the frame's Laplace-smoothed label shares."""
        return local_log_prior(frame["label"].astype(int).tolist(), len(self.words))

    def num_classes(self) -> int:
        """The number of label words."""
        return len(self.words)

    def class_labels(self, frame: pd.DataFrame) -> tuple[list[int], int] | None:
        """The ``label`` column and the number of label words."""
        return frame["label"].astype(int).tolist(), len(self.words)

    def scores(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Logit-adjusted by the batch's class prior (:func:`fedcybgd.tasks.objective.adjusted`)."""
        return adjusted(logits, batch)

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Label-token cross-entropy, the class choice adjusted by the batch's prior
        (:func:`fedcybgd.tasks.objective.label_nll`)."""
        return label_nll(logits, batch)

    def loss_sum(self, logits: torch.Tensor, batch: Batch, part: slice) -> torch.Tensor:
        """Summed :meth:`loss` of the scored rows ``part``."""
        return label_nll(logits, batch, part, reduction="sum")

    def evaluate(self, stack: LayerStack, tokenizer: PreTrainedTokenizerBase,
                 frame: pd.DataFrame, batch_size: int, max_seq_len: int) -> EvalResult:
        """Label loss (no prior) and verbalizer accuracy."""
        encode = self.encoder(tokenizer, max_seq_len)
        items = self.examples(frame)
        batches = (collate(encode(items[i:i + batch_size]))
                   for i in range(0, len(items), batch_size))
        result = evaluate(stack, batches)
        self.warn_cut("evaluation", encode.cut, len(items), max_seq_len, "their texts were cut")
        return result


class _PairEncoder:
    """``(text, label)`` items through a prompt encoder; ``cut`` counts the texts cut."""

    def __init__(self, prompts: PromptEncoder) -> None:
        self._prompts = prompts

    @property
    def cut(self) -> int:
        """Texts cut so far."""
        return self._prompts.cut

    def __call__(self, items: Sequence[Any]) -> EncodedExamples:
        return self._prompts([t for t, _ in items], [y for _, y in items])


def _label_index(value: Any, index: dict[str, int]) -> int | None:
    """A class index from an int, an integral float or digit string, or a label word."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, np.integer)):
        number = int(value)
    elif isinstance(value, (float, np.floating)):
        if not float(value).is_integer():
            return None
        number = int(value)
    elif isinstance(value, str):
        text = value.strip()
        if text in index:
            return index[text]
        if not (text.isdigit() or (text.startswith("-") and text[1:].isdigit())):
            return None
        number = int(text)
    else:
        return None
    return number if 0 <= number < len(index) else None


def local_log_prior(labels: list[int], classes: int) -> torch.Tensor:
    """``[C]`` ``log(C * p_c)`` of ``labels``' shares, ``p_c = (n_c + 1) / (n + C)``: zeros
    for balanced labels."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=classes)[:classes]
    shares = (counts + 1.0) / (counts.sum() + classes)
    return torch.tensor(np.log(classes * shares), dtype=torch.float32)
