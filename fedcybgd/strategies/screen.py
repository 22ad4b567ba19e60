"""Admission of one node's block update: finite, not an outlier, optionally norm-clipped.

Each accepted update's size is remembered per block as its RMS (L2 norm / sqrt(elements), so
blocks of different sizes compare). A new update is refused as an outlier when its RMS exceeds
``outlier_factor`` times the median of the last ``window`` accepted RMS values of that block
(of all blocks pooled, while the block has fewer than ``min_history``). With no history at all
it is refused when it is larger than the block itself (RMS of the delta above the RMS of the
block's weights): no honest round rewrites a block. ``outlier_factor = 0`` turns the rule off.
``max_norm > 0`` then scales any larger update down to that L2 norm.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from fedcybgd.strategies.replies import NON_FINITE, OUTLIER, Dropped


def l2_norm(tensors: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor] | None = None
            ) -> float:
    """L2 norm of ``tensors`` (minus ``base``), in float64 so huge values do not overflow."""
    total = 0.0
    for name, tensor in tensors.items():
        value = tensor.detach().double()
        if base is not None:
            value = value - base[name].detach().double()
        total += float(value.square().sum())
    return math.sqrt(total)


def numel(tensors: Mapping[str, torch.Tensor]) -> int:
    """Elements in all tensors."""
    return sum(t.numel() for t in tensors.values())


def update_rms(tensors: Mapping[str, torch.Tensor], start: Mapping[str, torch.Tensor]) -> float:
    """RMS of the step from ``start`` to ``tensors``: L2 norm / sqrt(elements), so blocks of
    different sizes compare."""
    return l2_norm(tensors, start) / math.sqrt(max(numel(start), 1))


def all_finite(tensors: Mapping[str, torch.Tensor]) -> bool:
    """No NaN or Inf in any floating tensor."""
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


class UpdateScreen:
    """Check each update against the block's recent accepted ones (see the module docstring).

    Parameters
    ----------
    outlier_factor : float
        Refuse an update whose RMS exceeds this multiple of the reference; 0 turns it off.
    max_norm : float
        Clip each update to this L2 norm; 0 turns it off.
    window, min_history : int
        Accepted sizes remembered per block, and how many a block needs before its own are the
        reference.
    """

    def __init__(self, outlier_factor: float = 10.0, max_norm: float = 0.0, window: int = 8,
                 min_history: int = 3) -> None:
        if not outlier_factor >= 0 or not max_norm >= 0 or math.isinf(outlier_factor):
            raise ValueError("outlier-factor and max-update-norm must be finite and >= 0")
        self.outlier_factor = outlier_factor
        self.max_norm = max_norm
        self.window = window
        self.min_history = min_history
        self.history: dict[str, deque[float]] = {}

    def reference(self, block: str) -> float | None:
        """The RMS an update of ``block`` is compared with (``None``: no history yet)."""
        own = list(self.history.get(block, ()))
        if len(own) >= self.min_history:
            return statistics.median(own)
        pooled = [x for sizes in self.history.values() for x in sizes]
        return statistics.median(pooled) if len(pooled) >= self.min_history else None

    @torch.no_grad()
    def admit(self, block: str, start: Mapping[str, torch.Tensor],
              tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
        """The update as it may be merged (clipped if needed) and its RMS; or :class:`Dropped`.

        ``start`` is the block the node trained from; ``tensors`` what it sent back.
        """
        if not all_finite(tensors):
            raise Dropped(NON_FINITE, "the uploaded block holds NaN or Inf")
        count = max(numel(start), 1)
        norm = l2_norm(tensors, start)
        rms = norm / math.sqrt(count)
        if not math.isfinite(rms):
            raise Dropped(NON_FINITE, "the update's norm is not finite")
        if self.outlier_factor:
            ref = self.reference(block)
            if ref is not None and rms > self.outlier_factor * ref:
                raise Dropped(OUTLIER, f"update RMS {rms:.3g} is above {self.outlier_factor:g} "
                                       f"x the recent accepted {ref:.3g}")
            own = l2_norm(start) / math.sqrt(count)
            if ref is None and rms > own:
                raise Dropped(OUTLIER, f"update RMS {rms:.3g} is larger than the block's own "
                                       f"weights' {own:.3g} (no accepted history yet)")
        if self.max_norm and norm > self.max_norm:
            scale = self.max_norm / norm
            tensors = {
                name: (start[name].float() + (t.float() - start[name].float()) * scale).to(t.dtype)
                for name, t in tensors.items()
            }
            rms = self.max_norm / math.sqrt(count)
        return tensors, rms

    def accepted(self, block: str, rms: float) -> None:
        """Remember the size of an update that was installed."""
        self.history.setdefault(block, deque(maxlen=self.window)).append(rms)

    def state(self) -> dict[str, Any]:
        """JSON-able history (checkpointed, so a resumed server screens alike)."""
        return {block: list(sizes) for block, sizes in self.history.items()}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state`'s output."""
        self.history = {
            str(block): deque((float(x) for x in sizes), maxlen=self.window)
            for block, sizes in state.items()
        }
