"""First-order rule: AdamW on the assigned block, backprop from the task loss.

Layers below the block run without grad (so none of their activations are kept); the layers
above run with grad on activations only, their weights frozen. With ``fo-recompute`` they are
checkpointed one by one (``torch.utils.checkpoint``, non-reentrant): each keeps only its input
and runs again during backward, so training a low block costs about what the top one does, for
one more forward of the layers above. Weights that are not fp32 get an
fp32 master copy for the optimizer, as in BAdam: low-precision Adam updates round to nothing.

Example-level DP (``task.privacy``, ``dp = "example"``): each step is DP-SGD on the block. The
batch is a Poisson sample of the node's rows; every row's gradient of the block is computed on
its own (a backward pass per row, through the layers from the block up: exact, and the memory
of one row), clipped to ``dp-clip-norm`` in L2 over the whole block, the clipped gradients are
summed, Gaussian noise of ``dp-noise-multiplier x dp-clip-norm`` is added to every coordinate,
and the sum is divided by the expected batch size; AdamW then steps on that. A row whose loss
or gradient is not finite contributes nothing (which the clip bound allows).
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from fedcybgd.data.prompts import Batch
from fedcybgd.model.blocks import EMBED, HEAD
from fedcybgd.model.layerwise import Hidden, LayerStack
from fedcybgd.rules import ExampleDp, TrainOutcome, TrainTask
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


def private_gradients(
    stack: LayerStack,
    batch: Batch,
    lowest: int,
    recompute_from: int | None,
    params: list[torch.nn.Parameter],
    privacy: ExampleDp,
    generator: torch.Generator,
) -> tuple[list[torch.Tensor], list[float]]:
    """DP-SGD's gradient of ``params`` on one Poisson-sampled ``batch`` (fp32, on the
    parameters' devices), and the losses of the rows that contributed.

    Each row's gradient is clipped to ``privacy.clip`` (L2 over all of ``params``); the sum gets
    Gaussian noise of ``privacy.noise_multiplier x privacy.clip`` per coordinate, drawn on the
    CPU from ``generator``, and is divided by ``privacy.expected_batch``.
    """
    sums = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]
    losses: list[float] = []
    for index in range(len(batch)):
        loss = block_loss(stack, batch.row(index), lowest, recompute_from)
        if not math.isfinite(float(loss.detach())):
            continue
        grads = torch.autograd.grad(loss, params)
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        if not math.isfinite(norm):
            continue
        scale = min(1.0, privacy.clip / norm) if norm > 0 else 1.0
        for total, grad in zip(sums, grads, strict=True):
            total.add_(grad.float(), alpha=scale)
        losses.append(float(loss.detach()))
    std = privacy.noise_multiplier * privacy.clip
    for total in sums:
        noise = torch.randn(total.shape, generator=generator, dtype=torch.float32) * std
        total.add_(noise.to(total.device)).div_(privacy.expected_batch)
    return sums, losses


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
        applied = 0  # steps taken (a DP step on an empty sample is noise alone, no loss)
        generator = (torch.Generator().manual_seed(task.privacy.seed)
                     if task.privacy is not None else None)
        try:
            for _ in range(task.steps):
                batch = next(task.batches)
                if task.privacy is not None and generator is not None:
                    grads, row_losses = private_gradients(
                        task.stack, batch, lowest, recompute_from, params, task.privacy,
                        generator)
                    for master, grad in zip(masters, grads, strict=True):
                        master.grad = grad
                    self._step(optimizer, masters, params, shared)
                    applied += 1
                    examples += len(batch)
                    if row_losses:
                        losses.append(sum(row_losses) / len(row_losses))
                    continue
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
                self._step(optimizer, masters, params, shared)
                applied += 1
                losses.append(float(loss.detach()))
        finally:
            for p in params:
                p.requires_grad_(False)
                p.grad = None
        mean = sum(losses) / len(losses) if losses else float("nan")
        return TrainOutcome(mean, applied, examples, skipped)

    @staticmethod
    def _step(optimizer: torch.optim.Optimizer, masters: list[torch.Tensor],
              params: list[torch.nn.Parameter], shared: bool) -> None:
        """AdamW on the masters' gradients; low-precision weights take the masters' values."""
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not shared:
            with torch.no_grad():
                for master, p in zip(masters, params, strict=True):
                    p.copy_(master)
