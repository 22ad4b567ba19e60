"""The task objective: cross-entropy on the label token, and verbalizer accuracy.

The prompt ends right before the label word, so one position per example carries the loss:
the logits there are scored against the verbalizer token of the true label (full-vocabulary
cross-entropy, the language-model loss on that token), and accuracy compares only the two
verbalizer logits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedcybgd.data.prompts import Batch
from fedcybgd.model.layerwise import LayerStack


def adjusted(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``logits`` (float) with ``batch.class_log_prior`` added to each class's verbalizer
    logit: the logit adjustment of a label-skewed client (balanced softmax, FedLC-style). The
    client's own label shares enter its loss, so its update need not learn them; the model
    itself stays prior-free. ``logits`` unchanged when the batch carries no prior."""
    logits = logits.float()
    if batch.class_log_prior is None:
        return logits
    shift = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
    shift[batch.class_token_ids] = batch.class_log_prior.to(logits)
    return logits + shift


def label_loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy of the label token; ``logits`` is ``[B, V]`` at ``last_index``
    (logit-adjusted when the batch carries a class prior, see :func:`adjusted`)."""
    return F.cross_entropy(adjusted(logits, batch), batch.target_ids)


def correct(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Boolean ``[B]``: does the true label's verbalizer token beat the other one?"""
    pair = logits[:, batch.class_token_ids]
    return pair.argmax(dim=-1) == batch.labels


@dataclass(frozen=True)
class EvalResult:
    """Mean label loss and accuracy over a set of examples."""

    loss: float
    accuracy: float
    examples: int


@torch.no_grad()
def evaluate(stack: LayerStack, batches: Iterable[Batch]) -> EvalResult:
    """Loss and accuracy of the model behind ``stack`` over ``batches`` (no grad)."""
    total_loss = 0.0
    hits = 0
    count = 0
    for batch in batches:
        logits = stack.forward_logits(batch.input_ids, batch.attention_mask, batch.last_index)
        total_loss += float(
            F.cross_entropy(logits.float(), batch.target_ids, reduction="sum")
        )
        hits += int(correct(logits, batch).sum())
        count += int(batch.labels.shape[0])
    if count == 0:
        raise ValueError("evaluate() got no examples")
    return EvalResult(total_loss / count, hits / count, count)
