"""Update rules as both sides see them: the contract a rule meets and the registry finding it.

A rule declares (:class:`RuleSpec`):

* **options**: one frozen dataclass (:class:`RuleOptions`, fields from
  :func:`fedcybgd.core.fields.setting`); its keys become run-config keys, checked on the
  server at start by the one parser (:mod:`fedcybgd.rules.options`) that the rule itself uses;
* **memory**: a function of :class:`MemoryNeeds` giving the MiB it adds on top of runtime and
  weights; the server assigns rules by it to nodes that declare ``memory-budget-mb``, the
  client checks its assignment with it;
* **step_log**: whether ``train`` returns a replayable step log in
  :attr:`TrainOutcome.step_log` (used when ``upload-codec = "seedlog"``);
* **implementation**: a class with ``name`` and ``train(task) -> TrainOutcome``
  (:class:`UpdateRule`), made fresh by the client for every round.

A plug-in rule is one file: decorate its class with ``@register_rule("name", options=...,
memory=...)`` and name the module in the run-config key ``plugin-modules``; then
``update-rule = "name"`` selects it (see :mod:`fedcybgd.core.registry` for why a decorator and a
config key rather than entry points). Import only neutral modules in it (this package,
:mod:`fedcybgd.core.fields`, :mod:`fedcybgd.model.layerwise`, :mod:`fedcybgd.tasks.objective`,
torch): the server imports it too, and the server never imports the client package.

Nothing in this package imports torch or the client package.
"""

from fedcybgd.core.fields import setting
from fedcybgd.rules import builtin  # importing it declares the built-in rules
from fedcybgd.rules.contract import (
    ExampleDp,
    MemoryEstimate,
    MemoryNeeds,
    TrainOutcome,
    TrainTask,
    UpdateRule,
)
from fedcybgd.rules.options import (
    NoOptions,
    RuleOptions,
    check_all,
    option_defaults,
    option_settings,
    parse_options,
)
from fedcybgd.rules.registry import (
    RuleSpec,
    declare_rule,
    register_rule,
    rule_names,
    rule_spec,
    rule_specs,
    unregister_rule,
)

__all__ = [
    "ExampleDp",
    "MemoryEstimate",
    "MemoryNeeds",
    "NoOptions",
    "RuleOptions",
    "RuleSpec",
    "TrainOutcome",
    "TrainTask",
    "UpdateRule",
    "builtin",
    "check_all",
    "declare_rule",
    "option_defaults",
    "option_settings",
    "parse_options",
    "register_rule",
    "rule_names",
    "rule_spec",
    "rule_specs",
    "setting",
    "unregister_rule",
]
