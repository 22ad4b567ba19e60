"""The update rules' own run-config keys (``zerolock-*``, ``zo-*``, ``lezo-*``) and their parser.

One frozen dataclass per rule declares the rule's keys, defaults and ranges; :func:`parse_options`
is the one parser: the server runs it for every rule at start (:func:`check_all`, from
:class:`fedcybgd.config.RunConfig`), so a misspelt or out-of-range option stops the run before
round 1 (a node may override ``update-rule``, so every rule's options must be valid), and each
client rule runs it again on the options it receives (:class:`~fedcybgd.client.updates.TrainTask`
``options``). A key shared by two rules (``zo-eps``) has one default and one range.

This module never imports the client package (the server imports it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from fedcybgd.choices import UPDATE_RULES, ZEROLOCK_HEADS, ZEROLOCK_OBJECTIVES
from fedcybgd.config_fields import Setting, coerce, normalize, setting, settings, unknown_key


class RuleOptions:
    """Base of the per-rule option dataclasses."""

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        """This rule's keys read from ``options`` (see :func:`parse_options`)."""
        return _parse(cls, options)


@dataclass(frozen=True)
class FoOptions(RuleOptions):
    """``fo`` (first-order AdamW on the block) has no options of its own."""


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


RULES: dict[str, type[RuleOptions]] = {
    "fo": FoOptions,
    "zerolock": ZeroLockOptions,
    "lezo": LezoOptions,
    "mezo": MezoOptions,
}


def _declared() -> dict[str, Setting]:
    """Every rule-option key once; a key two rules share must be declared alike."""
    if tuple(RULES) != UPDATE_RULES:
        raise RuntimeError(f"rule options cover {tuple(RULES)}, the rules are {UPDATE_RULES}")
    out: dict[str, Setting] = {}
    for cls in RULES.values():
        for key, s in settings(cls).items():
            seen = out.setdefault(key, s)
            if (seen.kind, seen.default, seen.bounds) != (s.kind, s.default, s.bounds):
                raise RuntimeError(f"rule option {key} is declared differently by two rules")
    return out


OPTIONS: dict[str, Setting] = _declared()
OPTION_DEFAULTS: dict[str, Any] = {key: s.default for key, s in OPTIONS.items()}


def parse_options(rule: str, options: Mapping[str, Any]) -> RuleOptions:
    """The options of ``rule`` from ``options`` (run-config keys), validated.

    Keys of the other rules are skipped (a rule ignores them); any key that is no rule option
    at all is refused with the closest known key suggested.

    Raises
    ------
    ConfigError
        ``rule`` is unknown, a key is unknown, or a value of the wrong type or out of range.
    """
    cls = RULES.get(rule)
    if cls is None:
        raise unknown_key(rule, RULES, what="update rule")
    return _parse(cls, options)


def _parse(cls: type[RuleOptions], options: Mapping[str, Any]) -> Any:
    own = settings(cls)
    kwargs: dict[str, Any] = {}
    for key, value in options.items():
        if key not in OPTIONS:
            raise unknown_key(key, OPTIONS, what="option")
        s = own.get(key)
        if s is not None:
            kwargs[s.name] = coerce(key, value, s.kind)
    return cls(**kwargs)


def check_all(options: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``options`` for every rule; returns every rule-option key with its value.

    Keys not given take their defaults; values come back in their declared types.

    Raises
    ------
    ConfigError
        A key is unknown, or a value of the wrong type or out of range.
    """
    values = dict(OPTION_DEFAULTS)
    for rule in RULES:
        parsed = parse_options(rule, options)
        for key, s in settings(type(parsed)).items():
            values[key] = getattr(parsed, s.name)
    return values
