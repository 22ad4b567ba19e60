"""One run's session, whatever its strategy: where it writes, its nodes, its records, its end.

Every runner (:data:`fedcybgd.server.app.RUNNERS`) opens one :class:`RunSession`. Opening it
checks ``output-dir`` against the output rule at once (:mod:`fedcybgd.server.outputs`), waits
up to ``node-wait`` seconds for the nodes the run needs, and only then creates the folder, so a
run that fails at its start leaves nothing behind. :meth:`RunSession.records` starts the
trackers and ``metrics.jsonl``; :meth:`RunSession.finish` takes the summary the runner wrote
and ends the run the same way for every strategy: the plots, the trackers' last records, then
the closing table, or :class:`~fedcybgd.server.verdict.RunFailed` naming why the run failed.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from flwr.serverapp import Grid

from fedcybgd.config import RunConfig
from fedcybgd.server.common import require_nodes, resolve_output_dir
from fedcybgd.server.metrics import MetricsWriter
from fedcybgd.server.outputs import check_output_dir, prepare_output_dir
from fedcybgd.server.plots import plot_run
from fedcybgd.server.report import print_summary_table
from fedcybgd.server.trackers import Trackers
from fedcybgd.server.verdict import RunFailed

log = logging.getLogger(__name__)


class RunSession:
    """A run's output folder, nodes, trackers and metrics writer (module docstring).

    Parameters
    ----------
    grid : Grid
        The run's grid.
    run : RunConfig
        The run.
    nodes : int
        How many connected nodes the run needs to start.
    can_resume : bool
        Whether the strategy keeps a checkpoint (``resume = true`` continues it).
    nodes_key : str
        The run-config key ``nodes`` comes from, for the error that names it.
    node_wait_s : float, optional
        Seconds to wait for the nodes (default: ``node-wait``).
    """

    def __init__(self, grid: Grid, run: RunConfig, nodes: int, *, can_resume: bool,
                 nodes_key: str = "clients-per-round", node_wait_s: float | None = None) -> None:
        self.started = time.perf_counter()
        self.run = run
        self.out: Path = resolve_output_dir(run.output_dir)
        check_output_dir(self.out, run.resume, run.overwrite, can_resume)
        wait = run.node_wait if node_wait_s is None else node_wait_s
        self.population = require_nodes(grid, nodes, wait, nodes_key)
        prepare_output_dir(self.out, run.resume, run.overwrite, can_resume)
        self.trackers: Trackers | None = None

    def records(self, keep_through: int | None = None) -> MetricsWriter:
        """Start the trackers (a missing tracker package stops the run here, by name) and the
        metrics writer (``keep_through``: see :class:`MetricsWriter`)."""
        self.trackers = Trackers(self.run, self.out)
        return MetricsWriter(self.out, keep_through, on_row=self.trackers.log_row)

    def finish(self, summary: dict[str, Any], failure: str | None, rows: list[dict[str, Any]],
               title: str) -> dict[str, Any]:
        """End the run whose ``summary.json`` is written: the plots of its ``rows`` under
        ``title``, the trackers' last records, then the closing table; :class:`RunFailed`
        when ``failure`` says why the run failed."""
        out = self.out
        plot_run(out, rows, title)
        if self.trackers is not None:
            self.trackers.finish(summary, [out / "summary.json", out / "metrics.jsonl",
                                           out / "plots.png"])
        if failure is not None:
            log.error("run failed: %s", failure)
            raise RunFailed(failure)
        print_summary_table(summary)
        return summary
