"""Admission of one node's block update: finite, bounded by the block, not an outlier,
optionally norm-clipped.

Sizes compare as RMS (L2 norm / sqrt(elements)), so blocks of different sizes compare. Two
bounds refuse an update, each by name (``outlier``):

- **Relative to the block** (``max_ratio``, always on unless 0): an update whose RMS exceeds
  ``max_ratio`` times the RMS of the block's own weights. No honest round rewrites a block, so
  a wipe (``-w``), a sign flip or a huge value is refused even in round 1, with no history.
- **Relative to what was installed** (``outlier_factor``): an update whose RMS exceeds
  ``outlier_factor`` times the median of the last ``window`` *installed* steps of that block
  (of all blocks pooled, while the block has fewer than ``min_history``). One entry per
  install: the merged step (the aggregate's output minus the start, before the server's own
  step), or the median of that install's admitted uploads if smaller. Raw uploads never enter
  it: nodes colluding to send uploads just under the threshold cannot raise it unless they
  are half or more of the block's nodes (they then move both the merge and the median; see
  :mod:`~fedcybgd.strategies.aggregate`). Zero-sized installs are not a reference.
  ``outlier_factor = 0`` turns this rule off.

``max_norm > 0`` then scales any larger update down to that L2 norm.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from fedcybgd.config import Robust
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
    """Check each update against its block and the block's recent installs (module docstring).

    Parameters
    ----------
    outlier_factor : float
        Refuse an update whose RMS exceeds this multiple of the installed reference; 0: off.
    max_norm : float
        Clip each update to this L2 norm; 0 turns it off.
    max_ratio : float
        Refuse an update whose RMS exceeds this share of the block's own weights' RMS; 0: off.
    window, min_history : int
        Installed step sizes remembered per block, and how many a block needs before its own
        are the reference.
    """

    def __init__(self, outlier_factor: float = 10.0, max_norm: float = 0.0,
                 max_ratio: float = 0.5, window: int = 8, min_history: int = 3) -> None:
        for key, value in (("outlier-factor", outlier_factor), ("max-update-norm", max_norm),
                           ("max-update-ratio", max_ratio)):
            if not 0 <= value < math.inf:
                raise ValueError(f"{key} must be finite and >= 0, got {value}")
        self.outlier_factor = outlier_factor
        self.max_norm = max_norm
        self.max_ratio = max_ratio
        self.window = window
        self.min_history = min_history
        self.history: dict[str, deque[float]] = {}

    @classmethod
    def from_config(cls, config: Robust, max_norm: float) -> UpdateScreen:
        """The screen of the run config's robust-aggregation keys, its norm bound ``max_norm``
        (``max-update-norm``, or the bound differential privacy sets)."""
        return cls(outlier_factor=config.outlier_factor, max_norm=max_norm,
                   max_ratio=config.max_update_ratio)

    def reference(self, block: str) -> float | None:
        """The RMS an update of ``block`` is compared with (``None``: no usable history)."""
        own = [x for x in self.history.get(block, ()) if x > 0]
        if len(own) >= self.min_history:
            return statistics.median(own)
        pooled = [x for sizes in self.history.values() for x in sizes if x > 0]
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
        if self.max_ratio:
            own = l2_norm(start) / math.sqrt(count)
            if rms > self.max_ratio * own:
                raise Dropped(OUTLIER, f"update RMS {rms:.3g} is above {self.max_ratio:g} x "
                                       f"the block's own weights' RMS {own:.3g}")
        if self.outlier_factor:
            ref = self.reference(block)
            if ref is not None and rms > self.outlier_factor * ref:
                raise Dropped(OUTLIER, f"update RMS {rms:.3g} is above {self.outlier_factor:g} "
                                       f"x the recent installed steps' {ref:.3g}")
        if self.max_norm and norm > self.max_norm:
            scale = self.max_norm / norm
            tensors = {
                name: (start[name].float() + (t.float() - start[name].float()) * scale).to(t.dtype)
                for name, t in tensors.items()
            }
            rms = self.max_norm / math.sqrt(count)
        return tensors, rms

    def installed(self, block: str, rms: float) -> None:
        """Remember the size of the step installed in ``block`` (the only sizes the reference
        is made of; see the module docstring)."""
        if math.isfinite(rms) and rms >= 0:
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
