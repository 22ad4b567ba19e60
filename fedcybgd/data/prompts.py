"""Sentiment classification as a prompt plus a one-token verbalizer.

The model reads ``Review: {text}\\nSentiment:`` and is scored on the logit of the verbalizer
token of each class at the position right after the last prompt token. No label token is
appended to the input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # importing transformers costs ~2 s; only the type is needed here
    from transformers import PreTrainedTokenizerBase

TEMPLATE = "Review: {text}\nSentiment:"
VERBALIZER: dict[int, str] = {0: " negative", 1: " positive"}


@dataclass(frozen=True)
class EncodedExamples:
    """Tokenized examples of variable length, not yet padded.

    ``score_positions[i]`` are the positions of example ``i`` whose logits carry the loss and
    ``targets[i]`` the token each must predict; ``None`` (a classification prompt): one position,
    the last token, predicting the verbalizer token of ``labels[i]``. ``labels`` is the class or
    correct option of each example, ``-1`` when the task has none (``sft``).
    """

    input_ids: list[list[int]]
    labels: list[int]
    class_token_ids: tuple[int, ...]
    pad_token_id: int
    score_positions: list[list[int]] | None = None
    targets: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class Batch:
    """A right-padded batch of prompts and their targets.

    Attributes
    ----------
    input_ids, attention_mask : torch.Tensor
        ``[B, T]`` int64; padding uses the tokenizer's pad id and mask 0.
    last_index : torch.Tensor
        ``[B]`` position of each example's last real token (where a class label is predicted).
    target_ids : torch.Tensor
        ``[N]`` the token each scored position must predict (classification: ``N = B``, the
        verbalizer token of the true label).
    labels : torch.Tensor
        ``[B]`` class index or correct option; ``-1`` where the task has none.
    class_token_ids : torch.Tensor
        ``[C]`` verbalizer token id of each class, indexed by class (empty: not classification).
    class_log_prior : torch.Tensor
        ``[C]`` added to the class logits by the training loss (logit adjustment, see
        :func:`fedcybgd.tasks.objective.adjusted`); ``None``: no adjustment (evaluation).
    score_rows, score_positions : torch.Tensor or None
        ``[N]`` (row, position) of every scored position, in row then position order; ``None``:
        one per row at ``last_index`` (a classification prompt). Only these hidden rows reach
        the LM head (:func:`fedcybgd.tasks.objective.scored_logits`), so logits are ``N x V``.
    task : Task or None
        The task that made the batch: its ``loss`` scores the logits
        (:func:`fedcybgd.tasks.objective.batch_loss`); ``None``: the classification loss.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    last_index: torch.Tensor
    target_ids: torch.Tensor
    labels: torch.Tensor
    class_token_ids: torch.Tensor
    class_log_prior: torch.Tensor | None = None
    score_rows: torch.Tensor | None = None
    score_positions: torch.Tensor | None = None
    task: Any = field(default=None, compare=False, repr=False)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_scored(self) -> int:
        """``N``: positions that carry the loss."""
        return int(self.target_ids.shape[0])

    def row(self, index: int) -> Batch:
        """The batch of row ``index`` alone (its padding kept): the same example, scored at
        the same positions, so its loss is what that row contributes to this batch's."""
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of a batch of {len(self)}")
        rows, positions, targets = None, None, self.target_ids[index:index + 1]
        if self.score_rows is not None and self.score_positions is not None:
            mine = self.score_rows == index
            rows = torch.zeros_like(self.score_rows[mine])
            positions = self.score_positions[mine]
            targets = self.target_ids[mine]
        return Batch(self.input_ids[index:index + 1], self.attention_mask[index:index + 1],
                     self.last_index[index:index + 1], targets, self.labels[index:index + 1],
                     self.class_token_ids, self.class_log_prior, rows, positions, self.task)

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with every tensor on ``device``."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        moved: dict[str, Any] = {
            k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in values.items()
        }
        return Batch(**moved)


def class_token_ids(
    tokenizer: PreTrainedTokenizerBase, verbalizer: Mapping[int, str] | None = None
) -> tuple[int, ...]:
    """Token id of each class's verbalizer (default :data:`VERBALIZER`), indexed by class.

    Raises
    ------
    ValueError
        If a verbalizer is not exactly one token for ``tokenizer``.
    """
    verbalizer = VERBALIZER if verbalizer is None else verbalizer
    ids = []
    for label in sorted(verbalizer):
        word = verbalizer[label]
        tokens = tokenizer.encode(word, add_special_tokens=False)
        if len(tokens) != 1:
            raise ValueError(
                f"label-words: {word!r} (class {label}) must be exactly one token for this "
                f"tokenizer, got {len(tokens)}: {tokens}"
            )
        ids.append(int(tokens[0]))
    if len(set(ids)) != len(ids):
        raise ValueError(f"label-words: the verbalizer tokens are not distinct: {ids}")
    return tuple(ids)


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id batches are padded with: the pad token, else the end-of-sequence token."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad token nor an eos token")
    return int(pad)


def leading_special_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Special tokens the tokenizer puts before a text (e.g. BOS); trailing ones (EOS) are
    dropped, since the label must be predicted right after the prompt's last token."""
    plain = tokenizer.encode("x", add_special_tokens=False)
    full = tokenizer.encode("x", add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


class PromptEncoder:
    """Turns texts into prompt token ids that fit ``max_seq_len``.

    The template (default :data:`TEMPLATE`) is tokenized in pieces (head, text, tail) so that
    only the text is truncated; its start is kept, and :attr:`cut` counts the texts cut. The
    separator whitespace belongs to the text piece, as a byte-level BPE would attach it there:
    for the SmolLM2 tokenizer the pieces give exactly the ids of the whole prompt (checked on
    all 12,808 reviews).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_seq_len: int,
        template: str = TEMPLATE,
        verbalizer: Mapping[int, str] | None = None,
    ) -> None:
        if template.count("{text}") != 1:
            raise ValueError(f"prompt-template must contain '{{text}}' once, got {template!r}")
        head, tail = template.split("{text}")
        head_core = head.rstrip()
        self._gap = head[len(head_core) :]
        self._tokenizer = tokenizer
        self.class_token_ids = class_token_ids(tokenizer, verbalizer)
        self.cut = 0
        self.pad_token_id = pad_token_id(tokenizer)
        self._head = leading_special_ids(tokenizer) + tokenizer.encode(
            head_core, add_special_tokens=False
        )
        self._tail = tokenizer.encode(tail, add_special_tokens=False)
        self.max_review_tokens = max_seq_len - len(self._head) - len(self._tail)
        if self.max_review_tokens < 1:
            need = len(self._head) + len(self._tail) + 1
            raise ValueError(
                f"max-seq-len={max_seq_len} is too small: the prompt template needs "
                f"{need} tokens with a one-token review"
            )

    def __call__(self, texts: Sequence[str], labels: Sequence[int]) -> EncodedExamples:
        """Encode ``texts`` with their class ``labels``."""
        if len(texts) != len(labels):
            raise ValueError(f"{len(texts)} texts but {len(labels)} labels")
        bad = sorted({int(y) for y in labels} - set(range(len(self.class_token_ids))))
        if bad:
            raise ValueError(f"labels must be in 0..{len(self.class_token_ids) - 1}: {bad}")
        if not texts:
            bodies: list[list[int]] = []
        else:
            bodies = self._tokenizer(
                [self._gap + text for text in texts], add_special_tokens=False
            )["input_ids"]
        cut = self.max_review_tokens
        self.cut += sum(len(body) > cut for body in bodies)
        return EncodedExamples(
            input_ids=[self._head + list(body[:cut]) + self._tail for body in bodies],
            labels=[int(y) for y in labels],
            class_token_ids=self.class_token_ids,
            pad_token_id=self.pad_token_id,
        )


def encode(
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    labels: Sequence[int],
    max_seq_len: int,
) -> EncodedExamples:
    """Tokenize prompts for ``texts``, truncating each review so its prompt fits ``max_seq_len``."""
    return PromptEncoder(tokenizer, max_seq_len)(texts, labels)


def collate(
    examples: EncodedExamples, class_log_prior: torch.Tensor | None = None, task: Any = None
) -> Batch:
    """Right-pad ``examples`` to the longest one and build the target tensors."""
    if len(examples) == 0:
        raise ValueError("cannot collate an empty set of examples")
    lengths = torch.tensor([len(ids) for ids in examples.input_ids], dtype=torch.long)
    width = int(lengths.max())
    input_ids = torch.full((len(examples), width), examples.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, ids in enumerate(examples.input_ids):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
    classes = torch.tensor(examples.class_token_ids, dtype=torch.long)
    labels = torch.tensor(examples.labels, dtype=torch.long)
    if examples.score_positions is None:
        return Batch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            last_index=lengths - 1,
            target_ids=classes[labels],
            labels=labels,
            class_token_ids=classes,
            class_log_prior=class_log_prior,
            task=task,
        )
    if examples.targets is None:
        raise ValueError("encoded examples with score positions need their targets")
    rows: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    for row, (where, what) in enumerate(zip(examples.score_positions, examples.targets,
                                            strict=True)):
        if len(where) != len(what):
            raise ValueError(f"example {row}: {len(where)} score positions, {len(what)} targets")
        rows.extend([row] * len(where))
        positions.extend(where)
        targets.extend(what)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        last_index=lengths - 1,
        target_ids=torch.tensor(targets, dtype=torch.long),
        labels=labels,
        class_token_ids=classes,
        class_log_prior=class_log_prior,
        score_rows=torch.tensor(rows, dtype=torch.long),
        score_positions=torch.tensor(positions, dtype=torch.long),
        task=task,
    )
