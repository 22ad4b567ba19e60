"""The strategy's plug-in points checked at server start: ``block-schedule`` and ``aggregate``.

Both are names in registries that plug-in modules add to (:func:`register_schedule`,
:func:`register_aggregator`), so only the server, once the run's ``plugin-modules`` are
imported, can tell whether a name is known. The ServerApp calls :func:`check_names` before it
loads the model, so a misspelt name stops the run at start with the closest name suggested.
"""

from __future__ import annotations

from fedcybgd.strategies.aggregate import AGGREGATOR_REGISTRY, register_aggregator
from fedcybgd.strategies.schedule import SCHEDULE_REGISTRY, register_schedule

__all__ = ["check_names", "register_aggregator", "register_schedule"]


def check_names(block_schedule: str, aggregate: str) -> None:
    """Both names must be registered.

    Raises
    ------
    fedcybgd.core.fields.ConfigError
        A name is not registered; the message names the key and suggests the closest name.
    """
    SCHEDULE_REGISTRY.get(block_schedule)
    AGGREGATOR_REGISTRY.get(aggregate)
