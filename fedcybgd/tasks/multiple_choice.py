"""``multiple-choice``: a question, its options and the correct one, scored lm-eval style.

The model reads ``Question: {question}\\nAnswer:`` and each option is a continuation
`` {option}``. Training: the loss on the correct option's tokens (as ``sft`` on that answer).
Evaluation: the log-likelihood of every option's tokens given the prompt; the prediction is the
most likely option (summed log-likelihood, or its mean per token with ``length-normalize``);
``accuracy`` is the share predicted right, ``eval_loss`` the mean per-token loss of the correct
option. Options come as a list (JSON / Parquet), or in CSV as a JSON list text; the answer as
the option's index, a letter (``A``, ``B``, ...) or the option's text.
"""

from __future__ import annotations

import contextlib
import json
import string
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from fedcybgd.data.kinds import builtin_task
from fedcybgd.data.prompts import EncodedExamples, collate, leading_special_ids, pad_token_id
from fedcybgd.data.sources import DataError, where
from fedcybgd.tasks.base import Task
from fedcybgd.tasks.classification import check_text
from fedcybgd.tasks.objective import EvalResult
from fedcybgd.tasks.sequences import Joiner, sequence_nll

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fedcybgd.model.layerwise import LayerStack

TEMPLATE = "Question: {question}\nAnswer:"


def _options(value: Any, frame: pd.DataFrame, position: int, field: str) -> list[str]:
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, str):
        with contextlib.suppress(json.JSONDecodeError):
            value = json.loads(value)
    if not isinstance(value, list) or len(value) < 2 or not all(
            isinstance(v, str) and v.strip() for v in value):
        raise DataError(f"{where(frame, position)}: field {field!r} must be a list of two or "
                        f"more non-empty option texts, got {str(value)[:80]!r}")
    return [str(v) for v in value]


def _answer(value: Any, options: list[str], frame: pd.DataFrame, position: int,
            field: str) -> int:
    index: int | None = None
    integral = isinstance(value, (int, np.integer)) or (
        isinstance(value, (float, np.floating)) and float(value).is_integer())
    if integral and not isinstance(value, bool):
        index = int(value)
    elif isinstance(value, str):
        text = value.strip()
        if text in options:
            index = options.index(text)
        elif text.isdigit():
            index = int(text)
        elif len(text) == 1 and text.upper() in string.ascii_uppercase:
            index = string.ascii_uppercase.index(text.upper())
    if index is None or not 0 <= index < len(options):
        raise DataError(f"{where(frame, position)}: field {field!r} = {value!r} names none of "
                        f"the {len(options)} options (an index 0..{len(options) - 1}, a letter "
                        "or the option's text)")
    return index


class ChoiceEncoder:
    """``(question, options, answer)`` to prompt + the correct option; ``cut`` counts."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_seq_len: int) -> None:
        self.tokenizer = tokenizer
        self.join = Joiner(max_seq_len)
        self._lead = leading_special_ids(tokenizer)
        self.pad_token_id = pad_token_id(tokenizer)

    @property
    def cut(self) -> int:
        """Sequences shortened so far."""
        return self.join.cut

    def prompt(self, question: str) -> list[int]:
        """The question's prompt ids."""
        return self._lead + self.tokenizer.encode(TEMPLATE.format(question=question),
                                                  add_special_tokens=False)

    def option(self, text: str) -> list[int]:
        """An option's continuation ids (a leading space, as it follows ``Answer:``)."""
        return self.tokenizer.encode(" " + text.strip(), add_special_tokens=False)

    def encode(self, pairs: Sequence[tuple[str, str]], labels: list[int]) -> EncodedExamples:
        """``(question, option)`` pairs with the loss on each option."""
        joined = [self.join(self.prompt(q), self.option(o)) for q, o in pairs]
        return EncodedExamples(
            input_ids=[j.input_ids for j in joined], labels=labels, class_token_ids=(),
            pad_token_id=self.pad_token_id, score_positions=[j.positions for j in joined],
            targets=[j.targets for j in joined])

    def __call__(self, items: Sequence[Any]) -> EncodedExamples:
        return self.encode([(q, opts[a]) for q, opts, a in items], [a for _, _, a in items])


@builtin_task("multiple-choice")
class MultipleChoiceTask(Task):
    """See the module docstring."""

    name = "multiple-choice"

    def check(self, frame: pd.DataFrame) -> pd.DataFrame:
        """``question`` (str), ``options`` (list of str), ``answer`` (int) columns."""
        if len(frame) == 0:
            return frame.assign(question=pd.Series(dtype=str), options=pd.Series(dtype=object),
                                answer=pd.Series(dtype="int64"))
        questions = check_text(frame, self.run.question_field)
        for key, field in (("options-field", self.run.options_field),
                           ("answer-field", self.run.answer_field)):
            if field not in frame.columns:
                raise DataError(f"{where(frame, 0)}: no field {field!r} ({key})")
        options = [_options(v, frame, i, self.run.options_field)
                   for i, v in enumerate(frame[self.run.options_field].tolist())]
        answers = [_answer(v, options[i], frame, i, self.run.answer_field)
                   for i, v in enumerate(frame[self.run.answer_field].tolist())]
        out = frame.copy()
        out["question"] = questions.to_numpy()
        out["options"] = pd.Series(options, index=frame.index, dtype=object)
        out["answer"] = np.asarray(answers, dtype=np.int64)
        return out

    def partition_column(self, method: str) -> str | None:
        """``partition-by``, else the answer (dirichlet skews which option is right)."""
        return self.run.partition_by or ("answer" if method == "dirichlet" else None)

    def examples(self, frame: pd.DataFrame) -> list[Any]:
        """``(question, options, answer)`` triples."""
        return list(zip(frame["question"].tolist(), frame["options"].tolist(),
                        frame["answer"].astype(int).tolist(), strict=True))

    def max_scored_tokens(self, batch_size: int, max_seq_len: int) -> int:
        """Every correct option token is scored: at most all but a row's first token (an upper
        bound; short correct options score far fewer)."""
        return batch_size * (max_seq_len - 1)

    def encoder(self, tokenizer: PreTrainedTokenizerBase, max_seq_len: int) -> ChoiceEncoder:
        """A :class:`ChoiceEncoder` (training: the correct option only)."""
        return ChoiceEncoder(tokenizer, max_seq_len)

    def evaluate(self, stack: LayerStack, tokenizer: PreTrainedTokenizerBase,
                 frame: pd.DataFrame, batch_size: int, max_seq_len: int) -> EvalResult:
        """Option log-likelihood accuracy and the correct option's per-token loss."""
        encode = self.encoder(tokenizer, max_seq_len)
        items = self.examples(frame)
        # Every (question, option) pair is one sequence; batches of batch-size sequences.
        pairs = [(i, k) for i, (_, opts, _) in enumerate(items) for k in range(len(opts))]
        scores: list[list[float]] = [[0.0] * len(opts) for _, opts, _ in items]
        right_nll = right_tokens = 0.0
        for start in range(0, len(pairs), batch_size):
            part = pairs[start:start + batch_size]
            encoded = encode.encode([(items[i][0], items[i][1][k]) for i, k in part],
                                    [items[i][2] for i, _ in part])
            total, count = sequence_nll(stack, collate(encoded, task=self))
            for row, (i, k) in enumerate(part):
                nll = float(total[row])
                tokens = float(count[row])
                scores[i][k] = -nll / tokens if self.run.length_normalize else -nll
                if k == items[i][2]:
                    right_nll += nll
                    right_tokens += tokens
        self.warn_cut("evaluation", encode.cut, len(pairs), max_seq_len,
                      "questions cut from the left (options cut only when too long themselves)")
        hits = sum(int(np.argmax(s)) == answer for s, (_, _, answer) in zip(scores, items,
                                                                             strict=True))
        n = len(items)
        return EvalResult(right_nll / max(right_tokens, 1.0), hits / n, n)


def option_scores(task: MultipleChoiceTask, stack: LayerStack,
                  tokenizer: PreTrainedTokenizerBase, question: str,
                  options: list[str], max_seq_len: int) -> torch.Tensor:
    """``[K]`` summed log-likelihood of each option of one question (for checks)."""
    encode = task.encoder(tokenizer, max_seq_len)
    total, _ = sequence_nll(stack, collate(encode.encode([(question, o) for o in options],
                                                         [0] * len(options)), task=task))
    return -total
