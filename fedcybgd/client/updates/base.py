"""The client's half of the update-rule contract: make the registered rule that trains a block.

The contract itself, what a rule declares (options, memory estimate, step log) and what it is
given and returns (:class:`TrainTask`, :class:`TrainOutcome`), is neutral: it lives in
:mod:`fedcybgd.rules`, because the server reads the declarations at start (validation,
memory-aware assignment) and must not import this package. Here the client turns a rule's name
into an object with ``train``: a plug-in's registered class, or for a built-in rule (declared
with no implementation) the class of this package that :data:`BUILTIN_IMPLEMENTATIONS` binds to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedcybgd.client.updates.fo import FirstOrder
from fedcybgd.client.updates.lezo import LeZO, MeZO
from fedcybgd.client.updates.zerolock import ZeroLock
from fedcybgd.core.registry import resolve
from fedcybgd.rules import (
    RuleSpec,
    TrainOutcome,
    TrainTask,
    UpdateRule,
    rule_names,
    rule_spec,
)

__all__ = ["TrainOutcome", "TrainTask", "UpdateRule", "available_rules", "get_rule",
           "step_log_of"]


# The built-in rules' code, by the names fedcybgd.rules.builtin declares them under.
BUILTIN_IMPLEMENTATIONS: dict[str, Callable[[], Any]] = {
    "fo": FirstOrder, "zerolock": ZeroLock, "lezo": LeZO, "mezo": MeZO}


def _implementation(spec: RuleSpec) -> Callable[[], Any]:
    """The class or factory of ``spec``: a built-in's from :data:`BUILTIN_IMPLEMENTATIONS`, a
    ``"module:attr"`` imported here."""
    impl = spec.implementation or BUILTIN_IMPLEMENTATIONS.get(spec.name)
    if impl is None:
        raise TypeError(f"update rule {spec.name!r} declares no implementation and is not "
                        f"built in ({sorted(BUILTIN_IMPLEMENTATIONS)})")
    if isinstance(impl, str):
        impl = resolve(impl)
        if not callable(impl):
            raise TypeError(f"update rule {spec.name!r}: {spec.implementation} is not a class "
                            "or factory")
    return impl


def get_rule(name: str) -> UpdateRule:
    """A fresh instance of the registered update rule ``name``.

    Raises
    ------
    ConfigError
        ``name`` is not registered (the closest name is suggested).
    TypeError
        The registered implementation makes no object with a ``train`` method.
    """
    spec = rule_spec(name)
    rule = _implementation(spec)()
    if not callable(getattr(rule, "train", None)):
        raise TypeError(f"update rule {name!r} ({spec.source}) made {type(rule).__name__}, "
                        "which has no train(task) method")
    return rule


def step_log_of(name: str, outcome: TrainOutcome) -> Any:
    """The step log of a round trained by rule ``name``, or ``None`` when the rule keeps none.

    Raises
    ------
    RuntimeError
        The rule declares ``step_log=True`` but returned no step log: a broken contract,
        reported rather than silently uploading weights instead.
    """
    if not rule_spec(name).step_log:
        return None
    if outcome.step_log is None:
        raise RuntimeError(f"update rule {name!r} declares a step log but its train() "
                           "returned TrainOutcome.step_log = None")
    return outcome.step_log


def available_rules() -> list[str]:
    """Names of the registered update rules."""
    return rule_names()
