"""The task layer: what a run fine-tunes on, and how it is scored.

A :class:`~fedcybgd.tasks.base.Task` owns the data splits, how an example becomes token ids and
loss positions, the loss over a batch, and the evaluation; the update rules, the local heads,
the server's evaluator and the FedAvg baselines all go through it (via the batches it makes,
see :mod:`fedcybgd.tasks.objective`). Built-in kinds (``task``): ``classification``, ``sft``,
``multiple-choice``, ``lm``; one's own: :func:`register_task` in a plug-in module.

Importing this package is light (no torch); :class:`Task`, :func:`build_task`,
:func:`make_task` and :func:`task_class` are loaded on first access.
"""

from __future__ import annotations

from typing import Any

from fedcybgd.data.kinds import TASKS, register_task, task_names

__all__ = ["TASKS", "Task", "build_task", "make_task", "register_task", "task_class",
           "task_names"]


def __getattr__(name: str) -> Any:
    if name == "Task":
        from fedcybgd.tasks.base import Task

        return Task
    if name in ("build_task", "make_task", "task_class"):
        from fedcybgd.tasks import build

        return getattr(build, name)
    raise AttributeError(name)
