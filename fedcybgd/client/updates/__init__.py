"""Local update rules, selected by name (``update-rule``).

The built-in rules (``fo``, ``zerolock``, ``lezo``, ``mezo``) are declared for both sides in
:mod:`fedcybgd.rules.builtin` and their modules here are imported when a rule is first made;
plug-in rules register themselves (:func:`fedcybgd.rules.register_rule`).
"""

from fedcybgd.client.updates.base import (
    TrainOutcome,
    TrainTask,
    UpdateRule,
    available_rules,
    get_rule,
    step_log_of,
)

__all__ = ["TrainOutcome", "TrainTask", "UpdateRule", "available_rules", "get_rule",
           "step_log_of"]
