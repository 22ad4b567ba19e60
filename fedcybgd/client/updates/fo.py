"""First-order rule: AdamW on the assigned block, backprop from the task loss.

Layers below the block run without grad (so none of their activations are kept); the layers
above run with grad on activations only, their weights frozen. Weights that are not fp32 get an
fp32 master copy for the optimizer, as in BAdam: low-precision Adam updates round to nothing.
"""

from __future__ import annotations

import math

import torch

from fedcybgd.data.prompts import Batch
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.objective import batch_loss, scored_logits
from fedcybgd.rules import TrainOutcome, TrainTask


def block_loss(stack: LayerStack, batch: Batch, lowest: int) -> torch.Tensor:
    """Task loss with grad flowing only from layer ``lowest`` up (-1: from the embeddings)."""
    with torch.set_grad_enabled(lowest < 0 and torch.is_grad_enabled()):
        hidden = stack.embed(batch.input_ids, batch.attention_mask)
    start = max(lowest, 0)
    with torch.no_grad():
        hidden = stack.run(hidden, 0, min(start, stack.num_layers))
    hidden = stack.run(hidden, start, stack.num_layers)
    return batch_loss(scored_logits(stack, hidden.states, batch), batch)


class FirstOrder:
    """AdamW on one block; see the module docstring."""

    name = "fo"

    def train(self, task: TrainTask) -> TrainOutcome:
        """Run ``task.steps`` AdamW steps on ``task.block``."""
        model = task.model
        params = task.blocks.parameters(model, task.block)
        lowest = task.blocks.lowest_layer([task.block])
        for p in model.parameters():
            p.requires_grad_(False)
        shared = all(p.dtype == torch.float32 for p in params)
        masters: list[torch.Tensor] = (
            list(params)
            if shared
            else [p.detach().float().clone().requires_grad_(True) for p in params]
        )
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.AdamW(masters, lr=task.lr, weight_decay=task.weight_decay)
        losses: list[float] = []
        examples = 0
        skipped = 0
        try:
            for _ in range(task.steps):
                batch = next(task.batches)
                loss = block_loss(task.stack, batch, lowest)
                examples += len(batch)
                if not math.isfinite(float(loss.detach())):
                    skipped += 1
                    for p in params:
                        p.grad = None
                    continue
                loss.backward()
                if not shared:
                    for master, p in zip(masters, params, strict=True):
                        assert p.grad is not None
                        master.grad = p.grad.float()
                        p.grad = None
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if not shared:
                    with torch.no_grad():
                        for master, p in zip(masters, params, strict=True):
                            p.copy_(master)
                losses.append(float(loss.detach()))
        finally:
            for p in params:
                p.requires_grad_(False)
                p.grad = None
        mean = sum(losses) / len(losses) if losses else float("nan")
        return TrainOutcome(mean, len(losses), examples, skipped)
