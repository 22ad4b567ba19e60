"""First-order rule: AdamW on the assigned block, backprop from the task loss.

Layers below the block run without grad (so none of their activations are kept); the layers
above run with grad on activations only, their weights frozen. With ``fo-recompute`` they are
checkpointed one by one (``torch.utils.checkpoint``, non-reentrant): each keeps only its input
and runs again during backward, so training a low block costs about what the top one does, for
one more forward of the layers above. Weights that are not fp32 get an
fp32 master copy for the optimizer, as in BAdam: low-precision Adam updates round to nothing.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from fedcybgd.data.prompts import Batch
from fedcybgd.model.blocks import EMBED, HEAD
from fedcybgd.model.layerwise import Hidden, LayerStack
from fedcybgd.rules import TrainOutcome, TrainTask
from fedcybgd.rules.builtin import FoOptions
from fedcybgd.tasks.objective import batch_loss, scored_logits


def recompute_start(task: TrainTask) -> int | None:
    """The first layer above ``task.block`` (checkpointed from there), or ``None`` when
    ``fo-recompute`` is off."""
    if not FoOptions.from_options(task.options).recompute:
        return None
    info = task.blocks.info(task.block)
    if info.name == EMBED:
        return 0
    if info.name == HEAD or info.layers is None:
        return task.blocks.num_layers
    return info.layers[1] + 1


def block_loss(stack: LayerStack, batch: Batch, lowest: int,
               recompute_from: int | None = None) -> torch.Tensor:
    """Task loss with grad flowing only from layer ``lowest`` up (-1: from the embeddings).

    ``recompute_from``: layers from this one up are checkpointed (``fo-recompute``): autograd
    keeps only each one's input and runs the layer again in backward.
    """
    with torch.set_grad_enabled(lowest < 0 and torch.is_grad_enabled()):
        hidden = stack.embed(batch.input_ids, batch.attention_mask)
    start = max(lowest, 0)
    with torch.no_grad():
        hidden = stack.run(hidden, 0, min(start, stack.num_layers))
    if recompute_from is None:
        hidden = stack.run(hidden, start, stack.num_layers)
    else:
        split = min(max(recompute_from, start), stack.num_layers)
        hidden = stack.run(hidden, start, split)
        for index in range(split, stack.num_layers):
            states = checkpoint(_one_layer, stack, hidden, index, hidden.states,
                                use_reentrant=False)
            hidden = hidden.with_states(states)
    return batch_loss(scored_logits(stack, hidden.states, batch), batch)


def _one_layer(stack: LayerStack, hidden: Hidden, index: int, states: torch.Tensor
               ) -> torch.Tensor:
    """Decoder layer ``index`` on ``states`` with its recorded extra inputs."""
    return stack.run(hidden.with_states(states), index, index + 1).states


class FirstOrder:
    """AdamW on one block; see the module docstring."""

    name = "fo"

    def train(self, task: TrainTask) -> TrainOutcome:
        """Run ``task.steps`` AdamW steps on ``task.block``."""
        model = task.model
        params = task.blocks.parameters(model, task.block)
        lowest = task.blocks.lowest_layer([task.block])
        recompute_from = recompute_start(task)
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
                loss = block_loss(task.stack, batch, lowest, recompute_from)
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
