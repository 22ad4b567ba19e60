"""The kinds of task, by name (``task``): the registry of task classes, built-in and the user's.

It sits with the datasets' catalogue, below the run config, which checks ``task`` against it;
the task classes themselves (:mod:`fedcybgd.tasks`) take a run config and sit above it. Each
registers itself here when its module is imported (:func:`register_task`): the built-in kinds
(:data:`fedcybgd.choices.BUILTIN_TASKS`) when :mod:`fedcybgd.tasks.build` builds a task, the
user's when the run config loads ``plugin-modules``. So this module (which the run config
imports on the server to check ``task``) stays free of torch and of the task modules.

A task of one's own is one file (a plug-in module, named in ``plugin-modules``) with a subclass
of :class:`fedcybgd.tasks.base.Task` decorated with :func:`register_task`; ``task = "<name>"``
selects it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fedcybgd.choices import BUILTIN_TASKS
from fedcybgd.core.fields import ConfigError, unknown_key
from fedcybgd.core.registry import PLUGIN_KEY, Registry

__all__ = ["TASKS", "builtin_task", "check_task", "register_task", "task_names"]

TaskFactory = Callable[..., Any]
T = TypeVar("T")
TASKS: Registry[TaskFactory] = Registry("task", "task")


def register_task(name: str, *, replace: bool = False) -> Callable[[type[T]], type[T]]:
    """Class decorator: make the decorated :class:`~fedcybgd.tasks.base.Task` subclass the
    task called ``name`` (``task = "<name>"`` in the run config)."""
    add = TASKS.register(name, replace=replace)

    def decorate(cls: type[T]) -> type[T]:
        add(cls)
        return cls

    return decorate


def builtin_task(name: str) -> Callable[[type[T]], type[T]]:
    """Class decorator of a built-in task: registers it unless a plug-in loaded earlier already
    took the name (``register_task(name, replace=True)``: the plug-in's class stays)."""
    if name not in BUILTIN_TASKS:
        raise ValueError(f"{name!r} is not one of the built-in tasks {list(BUILTIN_TASKS)}")

    def decorate(cls: type[T]) -> type[T]:
        if name not in TASKS.names():
            TASKS.add(name, cls)
        return cls

    return decorate


def task_names() -> tuple[str, ...]:
    """The task names a run config may give: the built-ins, then the registered plug-ins."""
    return BUILTIN_TASKS + tuple(n for n in TASKS.names() if n not in BUILTIN_TASKS)


def check_task(name: str) -> None:
    """``task = name`` is one of :func:`task_names` (ConfigError naming the key if not)."""
    if name not in task_names():
        err = unknown_key(name, dict.fromkeys(task_names()), what="task")
        raise ConfigError(f"task = {name!r}: {err} (one of your own: name its module in "
                          f"{PLUGIN_KEY})")

