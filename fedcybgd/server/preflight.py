"""Checks before round 1: a run that cannot work stops at start with one line naming what is
wrong, instead of failing on every client round after round.

Before Flower starts anything, ``fedcybgd run`` checks the app's run config and its model
(:mod:`fedcybgd.cli.precheck`). The ServerApp checks the model again (:func:`check_model`) and
then the data: a run whose data no client could train on, or the server could not score, stops
naming the key, the file, the row and the field.

What is checked (:func:`check_data`), with no model and no tokenizer:

* ``dataset`` and ``eval-dataset`` paths are absolute. A relative path would be read from the
  working directory of each process that opens it (the SuperLink's for the ServerApp, each
  SuperNode's for its ClientApp), not from the folder ``flwr run`` was typed in, so it is
  refused, naming the folder the ServerApp would have searched.
* Every split of ``dataset`` (``train``, ``validation``, ``test``) is read and every row parsed
  by the run's task (:meth:`fedcybgd.tasks.base.Task.check`, the code the clients run), and so
  are the server's held-out rows (``eval-dataset``, or ``eval-split`` of ``dataset``). An empty
  file, a missing field, a label outside the classes: a
  :class:`~fedcybgd.data.sources.DataError` naming it.
* ``eval-examples`` against the held-out rows there are: fewer rows than asked is logged once,
  with the number every evaluation of the run will use.

A node's own ``data-path`` (node config) is read only on that node and is not checked here.
Each runner checks its run's task first (:func:`checked_task`) and evaluates through that same
task, so the server reads and parses the splits once a run; parsing costs well under a second
per 100k rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.data.builtin import builtin_dataset
from fedcybgd.data.sources import SPLITS, SUFFIXES
from fedcybgd.model import loading
from fedcybgd.tasks.base import Task
from fedcybgd.tasks.build import build_task

__all__ = ["DataCheck", "check_data", "check_model", "check_path", "checked_task"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataCheck:
    """What the start-up check found.

    Attributes
    ----------
    rows : dict[str, int]
        Checked rows of each split of ``dataset``.
    eval_rows : int
        Held-out rows the server evaluates on: ``eval-examples`` or fewer, when fewer exist.
    eval_asked : int
        ``eval-examples``.
    """

    rows: dict[str, int]
    eval_rows: int
    eval_asked: int


def check_path(key: str, spec: str) -> None:
    """Refuse a relative file or folder path for ``key``; built-in and hub names pass.

    Parameters
    ----------
    key : str
        The run-config key (``dataset``, ``eval-dataset``), named in the error.
    spec : str
        Its value.

    Raises
    ------
    ConfigError
        ``spec`` is a relative path (it exists relative to this process's working directory,
        starts with ``.``, or ends in a data-file suffix); the message names that directory.
    """
    if not spec or builtin_dataset(spec) is not None:
        return
    path = Path(spec).expanduser()
    if path.is_absolute():
        return
    looks_like_path = (spec.startswith(".") or path.suffix.lower() in SUFFIXES
                       or path.exists())
    if not looks_like_path:
        return  # a hub name such as "stanfordnlp/imdb"
    here = Path.cwd()
    found = "it exists there" if path.exists() else "nothing is there by that name"
    raise ConfigError(
        f"{key} = {spec!r} is a relative path: the ServerApp would read it from its working "
        f"directory {here} ({found}), which under a SuperLink is not the folder the run was "
        f"launched from, and each SuperNode from its own; give an absolute path, e.g. "
        f"{key}='{here / path}'")


def check_data(run: RunConfig, task: Task | None = None) -> DataCheck:
    """Check the run's data as the clients and the server's evaluator will read it.

    Parameters
    ----------
    run : RunConfig
        The run config (its ``task``, ``dataset``, ``eval-dataset``, fields and labels).
    task : Task, optional
        The run's task, whose splits the check reads and keeps (default: a new one).

    Returns
    -------
    DataCheck
        Rows per split and the held-out rows the evaluations will use.

    Raises
    ------
    ConfigError
        A relative ``dataset`` or ``eval-dataset`` path (:func:`check_path`).
    DataError
        An empty or unreadable file, a missing field, a row the task cannot use; the message
        names the file, the row and the field.
    """
    check_path("dataset", run.dataset)
    check_path("eval-dataset", run.eval_dataset)
    task = build_task(run) if task is None else task
    rows = {split: len(task.split(split)) for split in SPLITS}
    held_out = task.eval_frame(run.evaluation.split, run.evaluation.examples)
    result = DataCheck(rows=rows, eval_rows=len(held_out), eval_asked=run.evaluation.examples)
    if result.eval_rows < result.eval_asked:
        source = (f"eval-dataset = {run.eval_dataset!r}" if run.eval_dataset
                  else f"the {run.evaluation.split} split of dataset = {run.dataset!r}")
        log.warning("eval-examples = %d, but %s holds %d rows: every evaluation of this run "
                    "uses those %d", result.eval_asked, source, result.eval_rows,
                    result.eval_rows)
    log.info("data checked: %s rows (train / validation / test); the server evaluates on %d",
             " / ".join(f"{rows[s]:,}" for s in SPLITS), result.eval_rows)
    return result


def checked_task(run: RunConfig) -> Task:
    """The run's task with its data checked (:func:`check_data`): what a runner builds first
    and evaluates through."""
    task = build_task(run)
    check_data(run, task)
    return task


def check_model(run: RunConfig) -> str:
    """The run's ``model`` is one this machine can load (an alias, a model folder, a hub id
    in the cache or on the reachable hub): :func:`fedcybgd.model.loading.check_model`.

    Raises
    ------
    ModelNameError
        One line naming the model and the names and folders that would work.
    """
    return loading.check_model(run.model)

