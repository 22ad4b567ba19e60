"""The server's step on a block: how far a round's merged client update moves the block.

``new = start + server_lr * damping(k) * (merged - start)``, where ``merged`` is what the
aggregator made of the block's uploads and ``k`` the number of blocks installed in the same
round. Blocks trained in parallel each saw the others at their old values (a Jacobi step), so
installing all of them at full size overshoots where they interact; ``damping`` shrinks the
step by ``1/k`` (``inverse``) or ``1/sqrt(k)`` (``inverse-sqrt``). With a step of exactly 1 the
merged block is installed as it is, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from fedcybgd.choices import DAMPINGS
from fedcybgd.strategies.replies import guarded
from fedcybgd.strategies.screen import all_finite

Tensors = dict[str, torch.Tensor]


def damping_factor(kind: str, parallel: int) -> float:
    """The factor for ``parallel`` blocks installed together (``kind`` in DAMPINGS)."""
    if kind not in DAMPINGS:
        raise ValueError(f"parallel-damping = {kind!r}; choose one of {list(DAMPINGS)}")
    k = max(parallel, 1)
    if kind == "inverse":
        return 1.0 / k
    if kind == "inverse-sqrt":
        return 1.0 / math.sqrt(k)
    return 1.0


class ServerStep:
    """Apply the server learning rate and the parallel damping to a merged block.

    Parameters
    ----------
    server_lr : float
        Scale of the merged update (1.0: install what the clients made).
    damping : str
        One of :data:`fedcybgd.choices.DAMPINGS`.
    """

    def __init__(self, server_lr: float = 1.0, damping: str = "none") -> None:
        if not 0 < server_lr < math.inf:
            raise ValueError(f"server-lr must be finite and > 0, got {server_lr}")
        damping_factor(damping, 1)
        self.server_lr = server_lr
        self.damping = damping

    def size(self, parallel: int) -> float:
        """The step for a round that installs ``parallel`` blocks."""
        return self.server_lr * damping_factor(self.damping, parallel)

    @torch.no_grad()
    def apply(self, start: Mapping[str, torch.Tensor], merged: dict[str, torch.Tensor],
              parallel: int) -> dict[str, torch.Tensor]:
        """The block to install: ``merged`` itself for a step of 1, else the scaled move."""
        step = self.size(parallel)
        if step == 1.0:
            return merged
        return {name: (start[name].float() + step * (t.float() - start[name].float())).to(t.dtype)
                for name, t in merged.items()}


def merge_block(aggregate: Callable[[Sequence[tuple[float, Tensors]]], Tensors], step: ServerStep,
                start: Mapping[str, torch.Tensor], uploads: Sequence[tuple[float, Tensors]],
                parallel: int) -> Tensors | None:
    """What a block becomes: its uploads merged by ``aggregate``, cast to the block's dtypes,
    moved by ``step`` (``parallel`` blocks move this round); ``None`` if that is not finite in
    the block's dtypes (e.g. finite fp32 values that overflow fp16/bf16)."""
    merged = guarded(lambda: aggregate(uploads))
    merged = step.apply(start, {name: merged[name].to(start[name].dtype) for name in start},
                        parallel)
    return merged if all_finite(merged) else None
