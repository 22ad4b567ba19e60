"""Aggregators: how the uploads of one block (``clients-per-block > 1``) become one block.

An aggregator takes ``[(weight, tensors), ...]`` (weights are example counts, already bounded
by the reply gate) and returns the merged tensors. All uploads of a block started from the same
tensors, so merging weights equals merging deltas. ``median`` and ``trimmed-mean`` are
coordinate-wise and unweighted: they bound what a minority of hostile nodes can move, which a
weighted mean cannot.

Aggregators are found by name (``aggregate`` in the run config) in a registry: the built-ins
(:data:`fedcybgd.choices.AGGREGATES`) and any a plug-in adds with :func:`register_aggregator`
(a module named in ``plugin-modules``). ``FedCyBGD(aggregate=...)`` also takes any
:data:`Aggregator` callable directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from fedcybgd.choices import AGGREGATES
from fedcybgd.plugins import Registry
from fedcybgd.selfsync import weighted_mean as shared_weighted_mean

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


def unregister_aggregator(name: str) -> AggregatorFactory:
    """Remove the aggregator ``name`` (tests, interactive sessions); returns its factory."""
    return AGGREGATOR_REGISTRY.unregister(name)


def aggregator_names() -> tuple[str, ...]:
    """The registered aggregator names, built-in first."""
    return AGGREGATOR_REGISTRY.names()


def weighted_mean(uploads: Sequence[Upload]) -> dict[str, torch.Tensor]:
    """Mean weighted by examples, in float64; a single upload is returned as it is (exact).
    (:func:`fedcybgd.selfsync.weighted_mean`: a node rebuilding a merge runs the same code.)"""
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


def trimmed_mean(fraction: float) -> Aggregator:
    """Coordinate-wise mean after dropping ``floor(fraction * n)`` values at each end."""
    if not 0 <= fraction < 0.5:
        raise ValueError(f"trim-fraction must be in [0, 0.5), got {fraction}")

    def aggregate(uploads: Sequence[Upload]) -> dict[str, torch.Tensor]:
        if len(uploads) == 1:
            return uploads[0][1]
        n = len(uploads)
        cut = math.floor(fraction * n)
        merged = {}
        for name, like in uploads[0][1].items():
            kept = _sorted_stack(uploads, name)[cut : n - cut]
            merged[name] = kept.mean(dim=0).to(like.dtype)
        return merged

    return aggregate


def build_aggregator(name: str, trim_fraction: float = 0.2) -> Aggregator:
    """The aggregator registered as ``name``.

    Raises
    ------
    ConfigError
        ``name`` is not registered (the message suggests the closest registered name).
    """
    return AGGREGATOR_REGISTRY.get(name)(trim_fraction=trim_fraction)


# The built-ins, registered under aggregate's values (AGGREGATES, in that order).
_BUILTINS: dict[str, AggregatorFactory] = {
    "mean": lambda **_: weighted_mean,
    "median": lambda **_: coordinate_median,
    "trimmed-mean": lambda *, trim_fraction, **_: trimmed_mean(trim_fraction),
}
assert tuple(_BUILTINS) == AGGREGATES
for _name, _factory in _BUILTINS.items():
    register_aggregator(_name)(_factory)
