"""Local update rules, selected by name (``update-rule``)."""

from fedcybgd.client.updates import (
    fo,  # noqa: F401  (registers "fo")
    lezo,  # noqa: F401
    zerolock,  # noqa: F401  (registers "zerolock")
)
from fedcybgd.client.updates.base import (
    TrainOutcome,
    TrainTask,
    UpdateRule,
    available_rules,
    get_rule,
    register,
)

__all__ = ["TrainOutcome", "TrainTask", "UpdateRule", "available_rules", "get_rule", "register"]
