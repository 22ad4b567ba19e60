"""The rule-facing objective: the logits a batch is scored on, and its loss.

Every update rule, local head and baseline computes its loss through here and never knows which
task runs: a batch names the positions that carry the loss (``Batch.score_rows`` /
``score_positions``; by default one per row, the last prompt token of a classification prompt)
and the task that made it (``Batch.task``), whose ``loss`` scores the logits. Only the scored
hidden rows go through the final norm and the LM head (:func:`scored_logits`), so the logits are
``N x V`` for ``N`` scored tokens, never ``B x T x V``.

A batch without a task (built by hand in tests) is scored as a classification prompt: the
full-vocabulary cross-entropy of the label token, logit-adjusted by the batch's class prior
(:func:`label_nll`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

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


def label_nll(logits: torch.Tensor, batch: Batch, part: slice = slice(None),
              reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of the label tokens of rows ``part`` of ``batch`` (``logits`` holds those
    rows), logit-adjusted when the batch carries a class prior.

    Adjusted, the loss is split as ``-log p(y) = -log P(C) - log P(y | C)`` (``C``: the class
    tokens) and only the choice among the classes, ``P(y | C)``, is adjusted by the prior. Adding
    the prior to the class logits of the full-vocabulary softmax instead would also drop the
    classes a skewed client lacks from ``P(C)``, so its loss would teach "answer with my own
    label word" to every input: a single-label client drags the model to its label.
    """
    logits = logits.float()
    targets = batch.target_ids[part]
    if batch.class_log_prior is None:
        return F.cross_entropy(logits, targets, reduction=reduction)
    class_logits = logits[:, batch.class_token_ids.to(logits.device)]
    answer = torch.logsumexp(logits, dim=-1) - torch.logsumexp(class_logits, dim=-1)
    choice = F.cross_entropy(class_logits + batch.class_log_prior.to(logits),
                             batch.labels[part].to(logits.device), reduction="none")
    per_row = answer + choice
    return per_row.mean() if reduction == "mean" else per_row.sum()


def score_index(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N], [N])`` row and position of every scored token of ``batch``."""
    if batch.score_rows is None or batch.score_positions is None:
        rows = torch.arange(batch.input_ids.shape[0], device=batch.last_index.device)
        return rows, batch.last_index
    return batch.score_rows, batch.score_positions


def scored_states(states: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``[N, H]``: the rows of ``states`` ``[B, T, H]`` that carry the loss."""
    rows, positions = score_index(batch)
    return states[rows.to(states.device), positions.to(states.device)]


def scored_logits(stack: LayerStack, states: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``[N, V]`` LM-head logits at the scored positions of the last layer's ``states``."""
    if batch.score_rows is None:
        return stack.logits_at(states, batch.last_index)
    return stack.head(stack.final_hidden(scored_states(states, batch)))


def batch_loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Mean loss of ``batch`` from its ``[N, V]`` scored logits, as its task defines it."""
    if batch.task is not None:
        loss: torch.Tensor = batch.task.loss(logits, batch)
        return loss
    return label_nll(logits, batch)


def loss_sum(logits: torch.Tensor, batch: Batch, part: slice) -> torch.Tensor:
    """Summed loss of the scored rows ``part`` (``logits`` holds just those rows): the sliced
    form of :func:`batch_loss` (which is ``loss_sum`` over all rows / ``num_scored``)."""
    if batch.task is not None:
        total: torch.Tensor = batch.task.loss_sum(logits, batch, part)
        return total
    return label_nll(logits, batch, part, reduction="sum")


def scores(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Float logits as the task's loss scores them (e.g. logit-adjusted)."""
    if batch.task is not None:
        out: torch.Tensor = batch.task.scores(logits, batch)
        return out
    return adjusted(logits, batch)


def label_loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The batch's task loss (:func:`batch_loss`; the name plug-in rules written before the
    task layer call)."""
    return batch_loss(logits, batch)


def correct(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Boolean ``[B]``: does the true label's verbalizer token beat the others?"""
    pair = logits[:, batch.class_token_ids]
    return pair.argmax(dim=-1) == batch.labels


@dataclass(frozen=True)
class EvalResult:
    """Mean loss and the task's main metric (``accuracy``) over a set of examples.

    ``metrics`` holds the task's other metrics (``sft``: ``exact_match``, ``token_f1``,
    ``perplexity``); they are written to ``metrics.jsonl`` as ``eval_<name>``. ``samples``: a
    few of a generative task's answers (``prompt``, ``reference``, ``answer``), saved per
    evaluation in ``samples/round-NNNN.json`` and shown at the end.
    """

    loss: float
    accuracy: float
    examples: int
    metrics: dict[str, float] = field(default_factory=dict)
    samples: tuple[dict[str, str], ...] = ()


def on_model_device(stack: LayerStack, batch: Batch) -> Batch:
    """``batch`` where the model's weights are (itself on the CPU, so CPU runs are unchanged);
    evaluation builds its batches on the CPU whatever the ``device``."""
    device = next(stack.model.parameters()).device
    return batch if device.type == "cpu" else batch.to(device)


@torch.no_grad()
def evaluate(stack: LayerStack, batches: Iterable[Batch]) -> EvalResult:
    """Label loss and verbalizer accuracy of classification ``batches`` (no grad)."""
    total_loss = 0.0
    hits = 0
    count = 0
    for batch in batches:
        batch = on_model_device(stack, batch)
        logits = stack.forward_logits(batch.input_ids, batch.attention_mask, batch.last_index)
        total_loss += float(
            F.cross_entropy(logits.float(), batch.target_ids, reduction="sum")
        )
        hits += int(correct(logits, batch).sum())
        count += int(batch.labels.shape[0])
    if count == 0:
        raise ValueError("evaluate() got no examples")
    return EvalResult(total_loss / count, hits / count, count)
