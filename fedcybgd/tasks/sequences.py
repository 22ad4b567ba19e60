"""Prompt + continuation token sequences with the loss on the continuation, for ``sft`` and
``multiple-choice``; and the scoring of such batches (summed log-likelihood per sequence).

Truncation never cuts the continuation (the response, the option) silently: a sequence longer
than ``max-seq-len`` first loses prompt tokens from the left (the system text and the start of
a long prompt go; the end of the prompt, next to the response, stays); only a continuation
longer than three quarters of ``max-seq-len`` is cut at its end, and both are counted
(:class:`Joiner`), the client and the evaluator say how many.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedcybgd.data.prompts import Batch
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.tasks.objective import on_model_device, scored_logits


@dataclass
class Joined:
    """One sequence: ids, the positions whose logits predict the continuation, and targets."""

    input_ids: list[int]
    positions: list[int]
    targets: list[int]


class Joiner:
    """Join prompt and continuation ids to fit ``max_seq_len``, counting what was cut."""

    def __init__(self, max_seq_len: int) -> None:
        if max_seq_len < 2:
            raise ValueError(f"max-seq-len must be >= 2, got {max_seq_len}")
        self.max_seq_len = max_seq_len
        self.prompts_cut = 0
        self.continuations_cut = 0
        self.cut = 0  # sequences shortened so far (prompt, continuation or both)

    def __call__(self, prompt: list[int], continuation: list[int]) -> Joined:
        """``prompt + continuation``, cut to fit; the loss positions of the continuation."""
        if not prompt or not continuation:
            raise ValueError("a sequence needs at least one prompt and one continuation token")
        limit = self.max_seq_len
        if len(prompt) + len(continuation) > limit:
            self.cut += 1
            # The prompt keeps at least a quarter of the window (its end), the rest is the
            # continuation's; only a continuation longer than that is cut.
            floor = min(len(prompt), max(1, limit // 4))
            if len(continuation) > limit - floor:
                continuation = continuation[: limit - floor]
                self.continuations_cut += 1
            keep = limit - len(continuation)
            if len(prompt) > keep:
                prompt = prompt[len(prompt) - keep:]
                self.prompts_cut += 1
        ids = prompt + continuation
        start = len(prompt)
        return Joined(ids, list(range(start - 1, len(ids) - 1)), list(continuation))


@torch.no_grad()
def sequence_nll(stack: LayerStack, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B], [B])``: summed negative log-likelihood of each row's scored tokens, and how many
    tokens each row has scored."""
    batch = on_model_device(stack, batch)
    hidden = stack.run(stack.embed(batch.input_ids, batch.attention_mask), 0, stack.num_layers)
    logits = scored_logits(stack, hidden.states, batch).float()
    nll = F.cross_entropy(logits, batch.target_ids, reduction="none")
    assert batch.score_rows is not None
    rows = len(batch)
    total = torch.zeros(rows, dtype=torch.float64, device=nll.device).index_add_(
        0, batch.score_rows, nll.double())
    count = torch.zeros(rows, dtype=torch.float64, device=nll.device).index_add_(
        0, batch.score_rows, torch.ones_like(nll, dtype=torch.float64))
    return total, count


def chunks(items: list[object], size: int) -> Iterable[list[object]]:
    """``items`` in consecutive lists of ``size`` (the last may be shorter)."""
    for start in range(0, len(items), size):
        yield items[start:start + size]
