"""ZeroLock's chunks: a block's layers cut into chunks, each with its local head,
optimizer and update on its own output.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fedcybgd.client.updates.local_heads import LocalHead
from fedcybgd.data.prompts import Batch
from fedcybgd.model.layerwise import Hidden, LayerStack

log = logging.getLogger(__name__)


@dataclass
class Chunk:
    """A trainable piece of the block with its own local head, optimizer(s) and loss record.

    ``fused``: each parameter gets its own AdamW, stepped by a post-accumulate-grad hook as soon
    as its gradient is complete during the backward pass, and its gradient is then dropped; the
    block's gradients are never all alive at once (one parameter's worth at most), which lowers
    the peak when the activations are smaller than the gradients (module docstring). AdamW is
    elementwise, so this is the same update as one AdamW over all parameters. Used where the
    block's parameters receive their gradient in one backward call (layer and embed blocks);
    the ``head`` block, whose gradient arrives slice by slice, steps after the backward.
    """

    index: int
    kind: str  # "embed" | "layers" | "top"
    layers: tuple[int, int]  # decoder layers [a, b) run with grad (empty for embed/top)
    key: str  # where the head reads: names the translator in the heads file
    params: list[nn.Parameter]
    masters: list[torch.Tensor]
    shared: bool  # masters are the params themselves (fp32 weights)
    head: LocalHead
    optimizers: list[torch.optim.Optimizer]  # one per parameter when fused, else one for all
    head_optimizer: torch.optim.Optimizer | None
    fused: bool
    loss_sum: float = 0.0
    loss_count: int = 0
    _hooks: list[Any] = field(default_factory=list)

    def named_optimizers(self) -> list[tuple[str, torch.optim.Optimizer]]:
        """Every optimizer of the chunk, under a stable name (for checkpoints)."""
        named = [(f"b{i}", opt) for i, opt in enumerate(self.optimizers)]
        if self.head_optimizer is not None:
            named.append(("h", self.head_optimizer))
        return named

    def attach(self) -> None:
        """Fused mode: install the per-parameter step hooks (params must require grad)."""
        if not self.fused:
            return
        for p, master, opt in zip(self.params, self.masters, self.optimizers, strict=True):
            self._hooks.append(
                p.register_post_accumulate_grad_hook(
                    lambda p, master=master, opt=opt: self._step_one(p, master, opt)
                )
            )

    def detach_hooks(self) -> None:
        """Remove the hooks :meth:`attach` installed."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _step_one(self, p: torch.Tensor, master: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        if not self.shared:
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not self.shared:
            with torch.no_grad():
                p.copy_(master)

    def forward(self, stack: LayerStack, source: Hidden, batch: Batch) -> Hidden:
        """The chunk's output (with grad) for its input ``source`` (detached)."""
        if self.kind == "embed":
            return stack.embed(batch.input_ids, batch.attention_mask)
        if self.kind == "top":
            return source
        return stack.run(source, *self.layers)

    def update(self, out: Hidden, batch: Batch) -> float | None:
        """Local loss, backward inside the chunk, AdamW step(s); ``None`` if skipped.

        A non-finite loss is never propagated into the block (see ``LocalHead.backward``), so
        a fused chunk takes no step either.
        """
        loss = self.head.backward(out, batch)
        if not math.isfinite(loss):
            for _, opt in self.named_optimizers():
                opt.zero_grad(set_to_none=True)
            for p in self.params:
                p.grad = None
            return None
        if not self.fused:
            opt = self.optimizers[0]
            if not self.shared:
                for master, p in zip(self.masters, self.params, strict=True):
                    master.grad = None if p.grad is None else p.grad.float()
                    p.grad = None
            opt.step()
            opt.zero_grad(set_to_none=True)
            if not self.shared:
                with torch.no_grad():
                    for master, p in zip(self.masters, self.params, strict=True):
                        p.copy_(master)
        if self.head_optimizer is not None:
            self.head_optimizer.step()
            self.head_optimizer.zero_grad(set_to_none=True)
        self.loss_sum += loss
        self.loss_count += 1
        return loss


def split_layers(start: int, end: int, chunks: int) -> list[tuple[int, int]]:
    """Split layers ``start..end`` (inclusive) into ``chunks`` contiguous ``[a, b)`` ranges.

    As LoPT's ``build_block_ranges``: equal sizes, the remainder going to the earliest chunks;
    never more chunks than layers.
    """
    count = end - start + 1
    chunks = max(1, min(chunks, count))
    base, extra = divmod(count, chunks)
    ranges = []
    at = start
    for i in range(chunks):
        size = base + (1 if i < extra else 0)
        ranges.append((at, at + size))
        at += size
    return ranges


def live_hidden_size(stack: LayerStack) -> int:
    """Width of the hidden states entering the final norm (read from the norm's weight)."""
    weight = getattr(stack.norm, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError("cannot tell the hidden size: config.hidden_size and norm.weight absent")
    return int(weight.shape[0])


def layer_index(name: str, layers_name: str) -> int:
    return int(name[len(layers_name) + 1 :].split(".", 1)[0])
