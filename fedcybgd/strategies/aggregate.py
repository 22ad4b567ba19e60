"""Aggregators: how the uploads of one block (``clients-per-block > 1``) become one block.

An aggregator takes ``[(weight, tensors), ...]`` (weights are example counts, already bounded
by the reply gate) and returns the merged tensors. All uploads of a block started from the same
tensors, so merging weights equals merging deltas.

What each built-in bounds, against ``f`` colluding nodes of the ``n`` that share a block (the
update screen, :mod:`~fedcybgd.strategies.screen`, bounds every single upload first):

- ``mean``: nothing beyond the screen; one node moves the block by ``1/n`` of its upload.
- ``median`` (coordinate-wise, unweighted): with ``f < n/2`` every coordinate stays inside the
  honest values' range; at ``f = n/2`` (2 of 4) the colluders set half of each middle pair.
- ``trimmed-mean``: drops ``max(1, floor(trim_fraction * n))`` values at each end (at least one
  from 3 uploads on, so a setting never trims nothing); bounds ``f`` up to that count.
- ``geometric-median`` (Weiszfeld, unweighted): the point nearest in sum of L2 distances; its
  breakdown point is 1/2, and unlike the coordinate-wise rules it keeps the update's direction.
- ``centered-clip``: starts from the coordinate-wise median and adds the mean of every
  upload's difference from it clipped to the median such distance, so each upload pulls at most
  as far as a typical honest one (centered clipping, Karimireddy et al. 2021); ``f < n/2``.

- ``auto`` (the default): ``median``. It keeps a colluding minority of a block's nodes within a
  small multiple of an honest run's drift, first visits included, at a cost to honest runs
  inside the seed spread (docs/results.md, "Colluding nodes"). Under ``dp`` every aggregate
  gives way to DP's mean of clipped deltas (:class:`~fedcybgd.strategies.privacy.DpMean`),
  whose clip bounds each node; ``auto`` is the one robust setting that lets it, so a DP run
  needs no ``aggregate`` of its own.

Flower's Krum and Bulyan need ``n >= 2f + 3`` (Bulyan ``4f + 3``) nodes on the same block, more
than a block is shared by in practice, so they are not offered; a plug-in can add them.

Aggregators are found by name (``aggregate`` in the run config) in a registry: the built-ins
(registered below) and any a plug-in adds with :func:`register_aggregator`
(a module named in ``plugin-modules``). ``FedCyBGD(aggregate=...)`` also takes any
:data:`Aggregator` callable directly.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from fedcybgd.core.registry import Registry
from fedcybgd.protocol.selfsync import weighted_mean as shared_weighted_mean

Upload = tuple[float, dict[str, torch.Tensor]]
Aggregator = Callable[[Sequence[Upload]], dict[str, torch.Tensor]]
# name -> factory called as factory(trim_fraction=float); it takes what it needs by keyword
# and should accept **kwargs, so settings added later do not break it.
AggregatorFactory = Callable[..., Aggregator]
_F = TypeVar("_F", bound=AggregatorFactory)
AGGREGATOR_REGISTRY: Registry[AggregatorFactory] = Registry("aggregator", "aggregate")


def register_aggregator(name: str, *, replace: bool = False) -> Callable[[_F], _F]:
    """Decorator: make ``factory(trim_fraction=..., **others)`` the aggregator called ``name``.

    The factory returns an :data:`Aggregator`. Registering a taken name raises unless
    ``replace``.
    """
    return AGGREGATOR_REGISTRY.register(name, replace=replace)  # type: ignore[return-value]


def unregister_aggregator(name: str) -> AggregatorFactory | str:
    """Remove the aggregator ``name`` (tests, interactive sessions); returns its factory (or
    its ``"module:attr"`` if never imported)."""
    return AGGREGATOR_REGISTRY.unregister(name)


def aggregator_names() -> tuple[str, ...]:
    """The registered aggregator names, built-in first."""
    return AGGREGATOR_REGISTRY.names()


def weighted_mean(uploads: Sequence[Upload]) -> dict[str, torch.Tensor]:
    """Mean weighted by examples, in float64; a single upload is returned as it is (exact).
    (:func:`fedcybgd.protocol.selfsync.weighted_mean`: a node rebuilding a merge runs the same
    code.)"""
    return shared_weighted_mean(uploads)


def _sorted_stack(uploads: Sequence[Upload], name: str) -> torch.Tensor:
    return torch.stack([t[name].double() for _, t in uploads]).sort(dim=0).values


def coordinate_median(uploads: Sequence[Upload]) -> dict[str, torch.Tensor]:
    """Coordinate-wise median (the mean of the two middle values for an even count)."""
    if len(uploads) == 1:
        return uploads[0][1]
    n = len(uploads)
    merged = {}
    for name, like in uploads[0][1].items():
        ranked = _sorted_stack(uploads, name)
        middle = ranked[(n - 1) // 2 : n // 2 + 1].mean(dim=0)
        merged[name] = middle.to(like.dtype)
    return merged


def trim_count(fraction: float, n: int) -> int:
    """Values cut at each end of ``n`` by ``trimmed-mean``: ``floor(fraction * n)``, and at
    least one once ``n >= 3`` (a trimmed mean that trims nothing is a mean)."""
    return max(math.floor(fraction * n), 1 if n >= 3 else 0)


def trimmed_mean(fraction: float) -> Aggregator:
    """Coordinate-wise mean after dropping :func:`trim_count` values at each end."""
    if not 0 <= fraction < 0.5:
        raise ValueError(f"trim-fraction must be in [0, 0.5), got {fraction}")

    def aggregate(uploads: Sequence[Upload]) -> dict[str, torch.Tensor]:
        if len(uploads) == 1:
            return uploads[0][1]
        n = len(uploads)
        cut = trim_count(fraction, n)
        merged = {}
        for name, like in uploads[0][1].items():
            kept = _sorted_stack(uploads, name)[cut : n - cut]
            merged[name] = kept.mean(dim=0).to(like.dtype)
        return merged

    return aggregate


def _distances(uploads: Sequence[Upload], center: dict[str, torch.Tensor]) -> list[float]:
    """L2 distance of each upload from ``center`` (float64), over all of the block's tensors."""
    return [math.sqrt(sum(float((t[name].double() - c).square().sum())
                          for name, c in center.items())) for _, t in uploads]


def geometric_median(uploads: Sequence[Upload], iterations: int = 16,
                     tolerance: float = 1e-12) -> dict[str, torch.Tensor]:
    """The geometric median of the uploads (Weiszfeld's iteration from the coordinate-wise
    median, distances floored at ``tolerance`` times the block's scale)."""
    if len(uploads) <= 2:
        return weighted_mean([(1.0, t) for _, t in uploads])
    first = uploads[0][1]
    center = {name: t.double() for name, t in coordinate_median(uploads).items()}
    scale = max(_distances(uploads, {n: torch.zeros_like(c) for n, c in center.items()}))
    for _ in range(iterations):
        floor = tolerance * max(scale, 1.0)
        weights = [1.0 / max(d, floor) for d in _distances(uploads, center)]
        total = sum(weights)
        pairs = list(zip(weights, uploads, strict=True))
        moved = {name: torch.stack([w * t[name].double() for w, (_, t) in pairs]).sum(0) / total
                 for name in center}
        shift = math.sqrt(sum(float((moved[n] - center[n]).square().sum()) for n in center))
        center = moved
        if shift <= floor:
            break
    return {name: center[name].to(like.dtype) for name, like in first.items()}


def centered_clip(uploads: Sequence[Upload], iterations: int = 3) -> dict[str, torch.Tensor]:
    """Centered clipping around the coordinate-wise median: ``v += mean_i clip(x_i - v, tau)``
    with ``tau`` the median distance of the uploads from the starting ``v``."""
    if len(uploads) <= 2:
        return weighted_mean([(1.0, t) for _, t in uploads])
    first = uploads[0][1]
    center = {name: t.double() for name, t in coordinate_median(uploads).items()}
    tau = statistics.median(_distances(uploads, center))
    for _ in range(iterations):
        distances = _distances(uploads, center)
        shares = [1.0 if d <= tau else tau / d for d in distances]
        pulls = list(zip(shares, uploads, strict=True))
        center = {name: c + torch.stack([s * (t[name].double() - c) for s, (_, t) in pulls]
                                        ).mean(0) for name, c in center.items()}
    return {name: center[name].to(like.dtype) for name, like in first.items()}


def build_aggregator(name: str, trim_fraction: float = 0.2) -> Aggregator:
    """The aggregator registered as ``name``.

    Raises
    ------
    ConfigError
        ``name`` is not registered (the message suggests the closest registered name).
    """
    return AGGREGATOR_REGISTRY.get(name)(trim_fraction=trim_fraction)


# The built-ins, registered first, in this order.
AUTO = "auto"
_BUILTINS: dict[str, AggregatorFactory] = {
    AUTO: lambda **_: coordinate_median,
    "mean": lambda **_: weighted_mean,
    "median": lambda **_: coordinate_median,
    "trimmed-mean": lambda *, trim_fraction, **_: trimmed_mean(trim_fraction),
    "geometric-median": lambda **_: geometric_median,
    "centered-clip": lambda **_: centered_clip,
}
for _name, _factory in _BUILTINS.items():
    register_aggregator(_name)(_factory)
