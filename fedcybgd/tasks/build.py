"""Building a run's task: the built-in kinds registered, then the one ``task`` names.

Importing this module imports the built-in task modules, each of which registers its class
(:func:`fedcybgd.data.kinds.register_task`); a plug-in's is registered when the run config
loads ``plugin-modules``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedcybgd.data.kinds import TASKS, TaskFactory
from fedcybgd.tasks import classification, lm, multiple_choice, sft  # noqa: F401 (registers)
from fedcybgd.tasks.base import Task

if TYPE_CHECKING:
    from fedcybgd.config import RunConfig

__all__ = ["build_task", "make_task", "task_class"]


def task_class(name: str) -> TaskFactory:
    """The class (factory) of the task ``name``: a built-in or a registered plug-in's
    (ConfigError naming the ``task`` key if unknown)."""
    return TASKS.get(name)


def make_task(name: str, run: RunConfig) -> Task:
    """A new instance of the registered task ``name`` for the run config ``run``."""
    task = task_class(name)(run)
    if not isinstance(task, Task):
        raise TypeError(f"task = {name!r} made {type(task).__name__}, not a Task")
    return task


def build_task(run: RunConfig) -> Task:
    """A new task for ``run`` (``task``). A run builds it once and hands it on (the server's
    runner, a client process's :class:`~fedcybgd.client.run_state.RunState`): it holds the
    run's data as read and checked, the nodes' shares and the truncation counts."""
    return make_task(run.task_kind, run)
