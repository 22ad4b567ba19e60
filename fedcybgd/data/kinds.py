"""The kinds of task, by name (``task``): the registry of task classes, built-in and the user's.

It sits with the datasets' catalogue, below the run config, which checks ``task`` against it;
the task classes themselves (:mod:`fedcybgd.tasks`) take a run config and sit above it.

A task of one's own is one file (a plug-in module, named in ``plugin-modules``) with a subclass
of :class:`fedcybgd.tasks.base.Task` decorated with :func:`register_task`; ``task = "<name>"``
selects it. Built-in kinds are registered by ``"module:attr"`` and imported on first use, so
this module (which the run config imports on the server to check ``task``) stays free of torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fedcybgd.core.registry import Registry

if TYPE_CHECKING:
    from fedcybgd.tasks.base import Task

__all__ = ["TASKS", "register_task", "task_class", "task_names"]

TaskFactory = Callable[..., Any]
T = TypeVar("T")
TASKS: Registry[TaskFactory] = Registry("task", "task")


def _lazy(target: str) -> TaskFactory:
    """A factory importing ``module:attr`` when first called (built-ins import torch)."""

    def make(*args: Any, **kwargs: Any) -> Any:
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    make.__qualname__ = make.__name__ = target
    return make


for _name, _target in (("classification", "fedcybgd.tasks.classification:ClassificationTask"),
                       ("sft", "fedcybgd.tasks.sft:SFTTask"),
                       ("multiple-choice", "fedcybgd.tasks.multiple_choice:MultipleChoiceTask"),
                       ("lm", "fedcybgd.tasks.lm:LMTask")):
    TASKS.register(_name)(_lazy(_target))


def register_task(name: str, *, replace: bool = False) -> Callable[[type[T]], type[T]]:
    """Class decorator: make the decorated :class:`~fedcybgd.tasks.base.Task` subclass the
    task called ``name`` (``task = "<name>"`` in the run config)."""
    add = TASKS.register(name, replace=replace)

    def decorate(cls: type[T]) -> type[T]:
        add(cls)
        return cls

    return decorate


def task_class(name: str) -> TaskFactory:
    """The factory of task ``name`` (ConfigError naming the ``task`` key if unknown)."""
    return TASKS.get(name)


def task_names() -> tuple[str, ...]:
    """The registered task names, built-ins first."""
    return TASKS.names()


def make_task(name: str, run: Any) -> Task:
    """A new instance of task ``name`` for the run config ``run``."""
    task: Task = task_class(name)(run)
    return task
