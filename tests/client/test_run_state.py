"""A client process keeps one run's state: the task lives as long as its run's messages come."""

from __future__ import annotations

import gc
import logging
import weakref

from flwr.app import Context, RecordDict

from fedcybgd.client.run_state import run_state
from fedcybgd.config import RunConfig
from fedcybgd.tasks.build import build_task


def _context(run_id: int, run_config: dict[str, object]) -> Context:
    return Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(),
                   run_config=run_config)  # type: ignore[arg-type]


def test_a_runs_messages_share_its_task_and_another_run_replaces_it():
    # Prepare
    config: dict[str, object] = {"model": "tiny-llama", "seed": 0}
    run = RunConfig.from_run_config(config)
    # Execute: two messages of run 1, then one of run 2, then run 1's config under another seed
    first = run_state(_context(1, config), run)
    again = run_state(_context(1, dict(config)), run)
    held = weakref.ref(first.task)
    other_run = run_state(_context(2, config), run)
    del first, again
    gc.collect()
    reseeded = dict(config, seed=1)
    other_config = run_state(_context(2, reseeded), RunConfig.from_run_config(reseeded))
    # Assert: one task for run 1's messages; run 2 gets its own and run 1's is gone with it
    assert held() is None
    assert other_run.run_id == 2 and other_config.task is not other_run.task
    assert other_config.task.run.seed == 1


def test_the_same_messages_run_state_is_the_same_object():
    config: dict[str, object] = {"model": "tiny-llama"}
    run = RunConfig.from_run_config(config)
    assert run_state(_context(5, config), run) is run_state(_context(5, config), run)


def test_a_tasks_partitions_are_drawn_once_and_equal_across_runs():
    # Prepare
    run = RunConfig(partitioner="dirichlet", dirichlet_alpha=0.3, seed=4)
    task, other = build_task(run), build_task(run)
    # Execute
    drawn = task.partition("dirichlet", 4, 0.3, 4)
    # Assert: the same positions held by the task, the same draw in another run's task
    assert task.partition("dirichlet", 4, 0.3, 4) is drawn
    fresh = other.partition("dirichlet", 4, 0.3, 4)
    assert fresh is not drawn
    assert [list(p) for p in fresh] == [list(p) for p in drawn]
    assert sorted(i for p in drawn for i in p) == list(range(len(task.split("train"))))


def test_a_tasks_truncation_counts_are_its_own(caplog):
    # Prepare
    first, second = build_task(RunConfig()), build_task(RunConfig())
    # Execute: the first task cuts twice, the second once
    with caplog.at_level(logging.DEBUG, logger="fedcybgd.tasks.base"):
        first.warn_cut("training", 2, 8, 16, "cut")
        counts = first.warn_cut("training", 1, 8, 16, "cut")
        second.warn_cut("training", 3, 8, 16, "cut")
    # Assert: each task says its first cut as a warning; the first one counted both
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert counts is not None and (counts.calls, counts.cut, counts.total) == (2, 3, 16)
    assert second.warn_cut("training", 0, 8, 16, "cut").calls == 1  # type: ignore[union-attr]
