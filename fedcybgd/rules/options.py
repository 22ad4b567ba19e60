"""The one parser of update-rule options, used by the server at start and by every rule.

A rule's options are a frozen dataclass subclassing :class:`RuleOptions`, each field declared
with :func:`fedcybgd.core.fields.setting` (run-config key, default, range). The keys of every
registered rule are run-config keys. :func:`check_all` validates them for every registered rule
(:class:`fedcybgd.config.RunConfig` calls it on the server before round 1: a node may switch to
any rule, so every rule's options must be valid), and a rule reads its own with
``MyOptions.from_options(task.options)`` on the client: the same code, so what passed at start
parses the same on the node. Keys of other rules are skipped; a key that is no registered
rule's option is refused with the closest known key suggested.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from fedcybgd.core.fields import Setting, coerce, normalize, settings, unknown_key
from fedcybgd.rules import registry


class RuleOptions:
    """Base of the per-rule option dataclasses (declare them ``@dataclass(frozen=True)``).

    A subclass with range-checked fields calls :func:`fedcybgd.core.fields.normalize` in
    ``__post_init__``, so options built in code are checked like options from the run config.
    """

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        """This rule's keys read from ``options`` (see :func:`parse_options`)."""
        parsed: Self = _parse(cls, options)
        return parsed


@dataclass(frozen=True)
class NoOptions(RuleOptions):
    """The options of a rule that has none of its own."""

    def __post_init__(self) -> None:
        normalize(self)


_cache: tuple[int, dict[str, Setting]] = (-1, {})


def option_settings() -> dict[str, Setting]:
    """Every registered rule's option keys, each once (a shared key is declared alike by every
    rule using it: checked at registration)."""
    global _cache
    version = registry.version()
    if _cache[0] != version:
        out: dict[str, Setting] = {}
        for spec in registry.rule_specs():
            for key, s in registry.option_keys(spec.options).items():
                out.setdefault(key, s)
        _cache = (version, out)
    return dict(_cache[1])


def option_defaults() -> dict[str, Any]:
    """Every registered rule-option key with its default."""
    return {key: s.default for key, s in option_settings().items()}


def parse_options(rule: str, options: Mapping[str, Any]) -> RuleOptions:
    """The options of ``rule`` from ``options`` (run-config keys), validated.

    Keys of the other rules are skipped (a rule ignores them); any key that is no rule option
    at all is refused with the closest known key suggested.

    Raises
    ------
    ConfigError
        ``rule`` is not registered, a key is unknown, or a value is of the wrong type or out
        of range.
    """
    parsed: RuleOptions = _parse(registry.rule_spec(rule).options or NoOptions, options)
    return parsed


def _parse(cls: type[Any], options: Mapping[str, Any]) -> Any:
    own = settings(cls)
    known = option_settings()
    kwargs: dict[str, Any] = {}
    for key, value in options.items():
        s = own.get(key)
        if s is None:
            if key not in known:
                raise unknown_key(key, {*known, *own}, what="option")
            continue
        kwargs[s.name] = coerce(key, value, s.kind)
    return cls(**kwargs)


def check_all(options: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``options`` for every registered rule; returns every rule-option key with its
    value (keys not given take their defaults; values in their declared types).

    Raises
    ------
    ConfigError
        A key is unknown, or a value of the wrong type or out of range.
    """
    values = option_defaults()
    for spec in registry.rule_specs():
        if spec.options is None:
            _parse(NoOptions, options)  # still refuses keys no rule declares
            continue
        parsed = _parse(spec.options, options)
        for key, s in settings(spec.options).items():
            values[key] = getattr(parsed, s.name)
    return values
