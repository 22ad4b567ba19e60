"""The update-rule registry: every rule, built-in or plug-in, is a :class:`RuleSpec` found by name.

A spec is what a rule declares: its typed options, its memory estimate, whether it keeps a step
log, and its implementation. The server reads the first three (validation at start,
memory-aware assignment); only a client ever touches the implementation.

**Getting a rule in.**

* ``@register_rule("name", options=..., memory=..., step_log=...)`` on the rule's class (or
  any zero-argument factory): the class is the implementation. This is how a plug-in rule is
  written: one file of the user's own, importing only neutral modules (:mod:`fedcybgd.rules`,
  :mod:`fedcybgd.core.fields`, torch), so the server can import it without the client package.
* :func:`declare_rule` with no implementation: the built-in rules are declared so
  (:mod:`fedcybgd.rules.builtin`); their code lives in the client package, which the server
  must not import, and the client binds it (:mod:`fedcybgd.client.updates.base`).

**Getting a plug-in module loaded.** The run-config key ``plugin-modules`` names importable
modules; :class:`fedcybgd.config.RunConfig` imports them
(:func:`fedcybgd.core.registry.load_modules`) before it checks ``update-rule`` and the rules'
options, on the server at start and on every client, so both sides see the same registry. Why a
decorator and a config key rather than an entry-point group: see :mod:`fedcybgd.core.registry`.

Import-light: nothing here imports torch or the client package.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, is_dataclass
from typing import Any, TypeVar

from fedcybgd.choices import BUILTIN_RULES
from fedcybgd.core.fields import ConfigError, Setting, settings, unknown_key
from fedcybgd.core.registry import NAME_PATTERN, TARGET_PATTERN, Registry
from fedcybgd.rules.contract import MemoryEstimate, UpdateRule

__all__ = [
    "RuleSpec",
    "declare_rule",
    "register_rule",
    "rule_names",
    "rule_spec",
    "rule_specs",
    "unregister_rule",
]

RESERVED = frozenset({"inference"})  # the memory model's forward-only baseline

T = TypeVar("T")


@dataclass(frozen=True)
class RuleSpec:
    """What an update rule declares.

    Attributes
    ----------
    name : str
        The ``update-rule`` value that selects it.
    options : type or None
        Its options: a frozen dataclass subclassing :class:`fedcybgd.rules.RuleOptions`, every
        field declared with :func:`fedcybgd.core.fields.setting` (key, default, range);
        ``None``: the rule has none (its options parse to ``fedcybgd.rules.NoOptions()``).
    memory : MemoryEstimate
        MiB the rule adds on top of runtime + weights for one client-round, from
        :class:`~fedcybgd.rules.contract.MemoryNeeds`.
    step_log : bool
        Whether ``train`` returns a step log (``TrainOutcome.step_log``) the server can replay.
    example_dp : bool
        Whether ``train`` honours ``TrainTask.privacy`` (example-level DP: every example's
        contribution to a step clipped, the step noised); ``dp = "example"`` runs only such
        rules.
    implementation : callable, str or None
        A zero-argument class or factory making an :class:`~fedcybgd.rules.contract.UpdateRule`,
        or ``"module:attr"`` naming one (imported by the client only); ``None`` for a built-in
        rule (:data:`fedcybgd.choices.BUILTIN_RULES`), whose code the client package binds.
    """

    name: str
    options: type[Any] | None
    memory: MemoryEstimate
    step_log: bool
    implementation: Callable[[], UpdateRule] | str | None
    example_dp: bool = False

    @property
    def source(self) -> str:
        """Where the implementation lives, for messages."""
        impl = self.implementation
        if impl is None:
            return "built in (fedcybgd.client.updates)"
        if isinstance(impl, str):
            return impl
        return f"{getattr(impl, '__module__', '?')}:{getattr(impl, '__qualname__', impl)}"


def _is_spec(name: str, entry: object) -> None:
    if not isinstance(entry, RuleSpec):
        raise ValueError(f"update rule {name!r}: {entry!r} is not a RuleSpec")


RULES: Registry[RuleSpec] = Registry("update rule", "update-rule", check=_is_spec)
_version = 0  # bumped on every change, so derived tables can be cached


def version() -> int:
    """A number that changes whenever a rule is registered or removed."""
    return _version


def declare_rule(
    name: str,
    *,
    options: type[Any] | None,
    memory: MemoryEstimate,
    implementation: Callable[[], UpdateRule] | str | None,
    step_log: bool = False,
    example_dp: bool = False,
) -> RuleSpec:
    """Add a rule to the registry; returns its spec.

    Raises
    ------
    ValueError
        ``name`` is malformed, reserved or taken; ``options`` is not a dataclass of config
        settings; an option key is declared differently by an already registered rule;
        ``memory`` is not callable; ``implementation`` is not callable nor ``"module:attr"``
        (``None`` only for a built-in rule's name).
    """
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name) or name in RESERVED:
        raise ValueError(f"update rule name {name!r} must match {NAME_PATTERN} and not be one of "
                         f"{sorted(RESERVED)}")
    taken = RULES.find(name)
    if taken is not None:
        raise ValueError(f"update rule {name!r} is already registered ({taken.source}); "
                         "unregister_rule() it first to replace it")
    if options is not None and not (isinstance(options, type) and is_dataclass(options)):
        raise ValueError(f"update rule {name!r}: options must be a dataclass or None, "
                         f"got {options!r}")
    if not callable(memory):
        raise ValueError(f"update rule {name!r}: memory must be a function of MemoryNeeds")
    if implementation is None:
        if name not in BUILTIN_RULES:
            raise ValueError(f"update rule {name!r}: implementation is required (a class, a "
                             "factory or 'module:attr'); only the built-in rules "
                             f"{list(BUILTIN_RULES)} are bound by the client package")
    elif isinstance(implementation, str):
        if not re.fullmatch(TARGET_PATTERN, implementation):
            raise ValueError(f"update rule {name!r}: implementation {implementation!r} is not "
                             "'module:attr'")
    elif not callable(implementation):
        raise ValueError(f"update rule {name!r}: implementation must be callable")
    for key, setting_ in option_keys(options).items():
        _check_same(name, key, setting_)
    spec = RuleSpec(name, options, memory, bool(step_log), implementation, bool(example_dp))
    _changed()
    RULES.add(name, spec)
    return spec


def _check_same(name: str, key: str, new: Setting) -> None:
    """An option key two rules share (``zo-eps``) must have one type, default and range."""
    for other in rule_specs():
        old = option_keys(other.options).get(key)
        if old is not None and (old.kind, old.default, old.bounds) != (
                new.kind, new.default, new.bounds):
            raise ValueError(f"update rule {name!r}: option {key!r} is declared differently by "
                             f"rule {other.name!r}; a shared key needs one type, default and range")


def option_keys(options: type[Any] | None) -> dict[str, Setting]:
    """The run-config keys of a rule's options class (none for ``None``)."""
    return {} if options is None else settings(options)


def register_rule(
    name: str,
    *,
    options: type[Any] | None = None,
    memory: MemoryEstimate,
    step_log: bool = False,
    example_dp: bool = False,
) -> Callable[[T], T]:
    """Class decorator: register the decorated class (or factory) as update rule ``name``.

    Parameters
    ----------
    name : str
        The ``update-rule`` value selecting the rule.
    options : type, optional
        Its options dataclass (see :class:`RuleSpec`); default: the rule has none.
    memory : MemoryEstimate
        Its memory estimate (see :class:`RuleSpec`); required, so budgets hold for every rule.
    step_log : bool
        Whether ``train`` returns a replayable step log.
    example_dp : bool
        Whether ``train`` honours ``TrainTask.privacy`` (see :class:`RuleSpec`).

    Raises
    ------
    ValueError
        See :func:`declare_rule`.
    """

    def add(implementation: T) -> T:
        declare_rule(name, options=options, memory=memory,
                     implementation=implementation, step_log=step_log,  # type: ignore[arg-type]
                     example_dp=example_dp)
        return implementation

    return add


def unregister_rule(name: str) -> RuleSpec:
    """Remove rule ``name`` (tests, interactive sessions); returns its spec.

    Raises
    ------
    KeyError
        No rule of that name is registered.
    """
    spec = RULES.unregister(name)
    _changed()
    assert isinstance(spec, RuleSpec)  # rules are registered as specs, never lazily
    return spec


def _changed() -> None:
    global _version
    _version += 1


def rule_spec(name: str) -> RuleSpec:
    """The spec of rule ``name``.

    Raises
    ------
    ConfigError
        No such rule; the message suggests the closest registered name and says how a
        plug-in rule is loaded.
    """
    spec = RULES.find(name)
    if spec is None:
        err = unknown_key(name, RULES.names(), what="update rule")
        raise ConfigError(f"{err} (a rule of your own: name its module in plugin-modules)")
    return spec


def rule_names() -> list[str]:
    """Names of the registered rules, in registration order (the built-ins first)."""
    return list(RULES.names())


def rule_specs() -> list[RuleSpec]:
    """Every registered rule's spec, in registration order."""
    return [RULES.get(name) for name in RULES.names()]
