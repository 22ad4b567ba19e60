"""Local heads for ZeroLock: a loss at a block's output without running the layers above it.

A local head maps hidden states to the task's cross-entropy through the model's own FROZEN final
norm and LM head ("logit lens"), optionally after a small learned map (``tuned``, as in the tuned
lens: a residual affine map, identity at initialisation, so a new head starts as ``frozen-lm``).

Objectives (the targets never depend on anything the client does not already hold):

* ``label``: the task's own loss at its scored positions
  (:func:`fedcybgd.tasks.objective.batch_loss`: the label's verbalizer token for
  classification, the response tokens for ``sft``). Only the
  ``N`` scored rows reach the head, so the logits are ``N x V``; on the last decoder block with
  ``frozen-lm`` this IS the model's true loss.
* ``next-token``: the language-model loss of the whole example: every real position predicts
  the next token; for a classification prompt the last one predicts the label word
  (``sum(mask)`` rows), otherwise the last real token predicts nothing.

Rows go through the head in slices of ``slice_rows``, each slice's loss backpropagated before the
next slice is formed, so at most ``slice_rows x V`` logits (and their grad) are alive at once; the
slices' gradients meet in one ``backward`` into the block.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fedcybgd.choices import ZEROLOCK_OBJECTIVES
from fedcybgd.data.prompts import Batch
from fedcybgd.model.layerwise import Hidden, LayerStack
from fedcybgd.tasks.objective import batch_loss, loss_sum, scored_states

Objective = Literal["label", "next-token"]
OBJECTIVES = ZEROLOCK_OBJECTIVES  # zerolock-objective


class Translator(nn.Module):
    """``x -> x + x @ delta + bias`` (full) or ``x + (x @ down) @ up + bias`` (rank ``r``).

    ``delta``/``up`` start at zero, so the map starts as the identity (exactly: ``x + 0``), and
    weight decay on them would pull towards the identity, not towards zero. Parameters are fp32
    whatever the model's dtype.
    """

    def __init__(self, hidden: int, rank: int = 0, seed: int = 0) -> None:
        super().__init__()
        if rank < 0:
            raise ValueError(f"zerolock-head-rank must be >= 0, got {rank}")
        self.hidden = hidden
        self.rank = rank
        self.bias = nn.Parameter(torch.zeros(hidden))
        if rank == 0 or rank >= hidden:
            self.rank = 0
            self.delta = nn.Parameter(torch.zeros(hidden, hidden))
        else:
            gen = torch.Generator().manual_seed(seed)
            self.down = nn.Parameter(torch.randn(hidden, rank, generator=gen) / math.sqrt(hidden))
            self.up = nn.Parameter(torch.zeros(rank, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the map in fp32 and return ``x``'s dtype."""
        h = x.float()
        update = h @ self.delta if self.rank == 0 else (h @ self.down) @ self.up
        return (h + update + self.bias).to(x.dtype)


def loss_rows(
    states: torch.Tensor, batch: Batch, objective: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``states`` [B, T, H] that carry a loss, and their target token ids."""
    if objective == "label":
        return scored_states(states, batch), batch.target_ids
    if objective == "next-token":
        mask = batch.attention_mask.bool()
        nxt = torch.roll(batch.input_ids, -1, dims=1)
        if batch.score_rows is None:  # a classification prompt: the label word comes next
            nxt[torch.arange(nxt.shape[0]), batch.last_index] = batch.target_ids
        else:  # the example is all in the input: its last token has nothing to predict
            mask = mask.clone()
            mask[torch.arange(mask.shape[0]), batch.last_index] = False
        # Rows in (row, position) order; for right padding positions after last_index are masked.
        return states[mask], nxt[mask]
    raise ValueError(f"zerolock-objective must be one of {OBJECTIVES}, got {objective!r}")


class LocalHead:
    """Frozen final norm + LM head (optionally behind a :class:`Translator`) as a local loss.

    Parameters
    ----------
    stack : LayerStack
        The model's pieces; its final norm (and ``project_out``) and LM head are used live.
    translator : Translator or None
        The tuned map applied before the norm (``None``: plain ``frozen-lm``).
    head_weight : torch.Tensor or None
        A frozen copy of the LM head's weight to use instead of the live one. Needed when the
        trained block owns the head's tensor (tied embeddings): see ``zerolock.py``.
    aux_layers : int
        Frozen decoder layers ``aux_start..aux_start+aux_layers-1`` run (weights frozen, grad
        through the activations) before the head: the ``embed`` block's local head (see
        ``zerolock.py``), or a layer block's ``zerolock-aux-layers``.
    aux_start : int
        The first of those layers (0 for the ``embed`` block; the layer after a chunk's last).
    objective : str
        ``label`` or ``next-token`` (module docstring).
    slice_rows : int
        Rows per head slice.
    """

    def __init__(
        self,
        stack: LayerStack,
        translator: Translator | None = None,
        head_weight: torch.Tensor | None = None,
        aux_layers: int = 0,
        objective: str = "label",
        slice_rows: int = 256,
        aux_start: int = 0,
    ) -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"zerolock-objective must be one of {OBJECTIVES}, got {objective!r}")
        if slice_rows < 1:
            raise ValueError(f"zerolock-slice must be >= 1, got {slice_rows}")
        self.stack = stack
        self.translator = translator
        self.head_weight = head_weight
        self.aux_layers = aux_layers
        self.aux_start = aux_start
        self.objective = objective
        self.slice_rows = slice_rows

    def parameters(self) -> Iterator[nn.Parameter]:
        """The head's own trainable parameters (a tuned translator's; a calibrated one is
        frozen)."""
        if self.translator is not None:
            yield from (p for p in self.translator.parameters() if p.requires_grad)

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` hidden rows to ``[N, V]`` logits."""
        if self.translator is not None:
            rows = self.translator(rows)
        # head_logits keeps the family's logit scaling/softcap, also with a frozen weight copy
        return self.stack.head_logits(self.stack.final_hidden(rows), self.head_weight)

    def _loss_sum(self, logits: torch.Tensor, batch: Batch, targets: torch.Tensor,
                  part: slice) -> torch.Tensor:
        """Summed loss of rows ``part``: the task's for ``label``, plain cross-entropy else."""
        if self.objective == "label":
            return loss_sum(logits, batch, part)
        return F.cross_entropy(logits.float(), targets[part], reduction="sum")

    def loss(self, hidden: Hidden, batch: Batch) -> torch.Tensor:
        """The local loss as one graph (no slicing): for checks and small batches."""
        if self.aux_layers:
            hidden = self.stack.run(hidden, self.aux_start, self.aux_start + self.aux_layers)
        rows, targets = loss_rows(hidden.states, batch, self.objective)
        logits = self.logits(rows)
        if self.objective == "label":
            return batch_loss(logits, batch)
        return F.cross_entropy(logits.float(), targets)

    def backward(self, hidden: Hidden, batch: Batch) -> float:
        """Compute the local loss slice by slice, backpropagate it, return its value.

        Gradients reach whatever in ``hidden``'s graph and in the head requires grad (the
        block, the translator, or, for the ``head`` block, the live norm and LM head). On a
        non-finite loss nothing is propagated into ``hidden`` (the caller skips the step and
        drops the head's gradients).
        """
        if self.aux_layers:
            hidden = self.stack.run(hidden, self.aux_start, self.aux_start + self.aux_layers)
        rows, targets = loss_rows(hidden.states, batch, self.objective)
        cut = rows.detach().requires_grad_(rows.requires_grad)
        count = rows.shape[0]
        total = 0.0
        for begin in range(0, count, self.slice_rows):
            part = slice(begin, begin + self.slice_rows)
            logits = self.logits(cut[part])
            loss = self._loss_sum(logits, batch, targets, part) / count
            if loss.requires_grad:
                loss.backward()
            total += float(loss.detach())
            del logits, loss
        if rows.requires_grad and math.isfinite(total) and cut.grad is not None:
            rows.backward(cut.grad)
        return total
