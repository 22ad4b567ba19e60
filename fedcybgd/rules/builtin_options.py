"""The built-in update rules' options (``zerolock-*``, ``zo-*``, ``lezo-*``): a dataclass each.

Each dataclass declares its rule's run-config keys, defaults and ranges with
:func:`fedcybgd.core.fields.setting`; the rules are declared with them in
:mod:`fedcybgd.rules.builtin`. They are parsed by the one parser of every rule's options,
:mod:`fedcybgd.rules.options` (re-exported here: :func:`parse_options`, :func:`check_all`),
which the server runs for every registered rule at start and each rule runs again on the
options it receives. A key shared by two rules (``zo-eps``) has one default and one range.

This module never imports the client package (the server imports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedcybgd.choices import ZEROLOCK_HEADS, ZEROLOCK_OBJECTIVES
from fedcybgd.core.fields import normalize, setting, settings
from fedcybgd.rules.options import RuleOptions, check_all, parse_options

__all__ = [
    "OPTION_DEFAULTS",
    "RULES",
    "FoOptions",
    "LezoOptions",
    "MezoOptions",
    "RuleOptions",
    "ZeroLockOptions",
    "check_all",
    "parse_options",
]


@dataclass(frozen=True)
class FoOptions(RuleOptions):
    """``fo`` (first-order AdamW on the block)."""

    # Activation checkpointing of the layers above the block: only each layer's input is kept
    # and the layer is run again in backward, so the bottom block's peak nears the top's.
    recompute: bool = setting(False, key="fo-recompute")

    def __post_init__(self) -> None:
        normalize(self)


@dataclass(frozen=True)
class ZeroLockOptions(RuleOptions):
    """``zerolock``: a local objective at the block's output (see the rule's module)."""

    head: str = setting("frozen-lm", key="zerolock-head", choices=ZEROLOCK_HEADS)
    head_rank: int = setting(0, key="zerolock-head-rank", ge=0)  # 0: full d x d map
    head_lr: float = setting(0.0, key="zerolock-head-lr", ge=0)  # 0: the run's lr
    objective: str = setting("label", key="zerolock-objective", choices=ZEROLOCK_OBJECTIVES)
    slice: int = setting(256, key="zerolock-slice", ge=1)  # rows per head slice
    chunks: int = setting(1, key="zerolock-chunks", ge=1)  # chunks per layer block
    embed_layers: int = setting(1, key="zerolock-embed-layers", ge=0)
    checkpoint_every: int = setting(0, key="zerolock-checkpoint-every")  # 0: by time, < 0: off
    checkpoint_seconds: float = setting(60.0, key="zerolock-checkpoint-seconds", ge=0)
    cache_mb: float = setting(256.0, key="zerolock-cache-mb", ge=0)  # 0: no prefix cache
    fused_step: bool = setting(True, key="zerolock-fused-step")
    # Frozen layers above a layer block run inside its (last chunk's) local head, the gradient
    # flowing through their activations (AugLocal-style); 0: the head reads the block's output.
    aux_layers: int = setting(0, key="zerolock-aux-layers", ge=0)
    # head = calibrated: the node's own batches its translator is fitted on, forward-only
    calib_batches: int = setting(4, key="zerolock-calib-batches", ge=1)
    calib_ridge: float = setting(1e-2, key="zerolock-calib-ridge", gt=0)  # pull to identity
    # refit once the layers above the head moved by more than this relative norm; 0: always
    calib_refit: float = setting(0.02, key="zerolock-calib-refit", ge=0)

    def __post_init__(self) -> None:
        normalize(self)


@dataclass(frozen=True)
class LezoOptions(RuleOptions):
    """``lezo``: sparse zeroth-order steps (weight decay is the run's ``weight-decay``)."""

    eps: float = setting(1e-3, key="zo-eps", gt=0)  # perturbation scale
    density: float = setting(0.25, key="lezo-density", gt=0, le=1)  # share of units per step

    def __post_init__(self) -> None:
        normalize(self)


@dataclass(frozen=True)
class MezoOptions(RuleOptions):
    """``mezo``: LeZO with every unit perturbed (``lezo-density`` does not apply)."""

    eps: float = setting(1e-3, key="zo-eps", gt=0)

    def __post_init__(self) -> None:
        normalize(self)


# The built-in rules' options by rule name; the registry (fedcybgd.rules) holds every rule.
RULES: dict[str, type[RuleOptions]] = {
    "fo": FoOptions,
    "zerolock": ZeroLockOptions,
    "lezo": LezoOptions,
    "mezo": MezoOptions,
}
# The built-in rules' option keys with their defaults ([tool.flwr.app.config] lists them).
OPTION_DEFAULTS: dict[str, Any] = {
    key: s.default for cls in RULES.values() for key, s in settings(cls).items()
}
