"""A run that stops before its end says so: SIGTERM, Ctrl-C, Flower's own stop, an exception.

The server's rounds run under :func:`stop_handling`, which hands the run's ``on_stop`` (it
writes ``summary.json`` with ``"status": "stopped"``) every way a stop reaches this process:

- an exception or ``KeyboardInterrupt`` (Ctrl-C) in the rounds: the runner catches it
  (:data:`STOPS`), calls ``on_stop`` and raises it again;
- SIGTERM where no runtime has taken it (a run in this process: the harness, a script, the
  tests): it raises :class:`Terminated` in the main thread, caught the same way;
- Flower's runtimes, which turn SIGINT, SIGTERM and ``flwr stop`` into their own exit: they
  call their exit handlers (``on_stop`` among them, for a ServerApp on a thread of its own, as
  in Flower's simulation, where the exit never reaches the rounds) and then raise
  ``SystemExit`` in the main thread (caught as above when the rounds run there).

SIGKILL cannot be caught: the process ends where it is, its ``summary.json`` is not written,
and the resume after it records the segment it was (:class:`~fedcybgd.server.metrics.Segments`).

A FedCyBGD run's stopped summary tells how to resume it (``fedcybgd.server.app.StopRecord``);
the runs that keep no checkpoint (the FedAvg baselines, pipeline mode) write theirs with
:class:`UncheckpointedStop`.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from flwr.supercore.exit import add_exit_handler

from fedcybgd.server.metrics import MetricsWriter, run_totals, write_summary

log = logging.getLogger(__name__)


class Terminated(BaseException):
    """SIGTERM arrived, where this process had no other handler for it: the run stops where it
    is, as Ctrl-C stops it (a ``BaseException``, so that no ``except Exception`` swallows it)."""


# What a runner catches to write its stopped summary before raising it again.
STOPS = (Exception, KeyboardInterrupt, SystemExit, Terminated)

# The stop callback of the run in progress in this process, for Flower's exit handler.
_current: list[Callable[[str], None]] = []
_registered = threading.Lock()
_handler_added = False


def stop_reason(err: BaseException) -> str:
    """Why the run stopped, in words, for ``summary.json``'s ``reason``."""
    if isinstance(err, Terminated):
        return "stopped by SIGTERM"
    if isinstance(err, KeyboardInterrupt):
        return "stopped by SIGINT (Ctrl-C)"
    if isinstance(err, SystemExit):
        return (f"stopped by the Flower runtime (exit code {err.code}: SIGTERM, SIGINT or "
                "flwr stop)")
    return f"stopped by an error: {type(err).__name__}: {err}"[:1000]


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def _on_flower_exit() -> None:
    """Flower's exit handler: the run in progress, if any, writes its stopped summary."""
    for on_stop in list(_current):
        on_stop("stopped by the Flower runtime (SIGTERM, SIGINT or flwr stop)")


@contextlib.contextmanager
def stop_handling(on_stop: Callable[[str], None]) -> Iterator[None]:
    """Within: SIGTERM raises :class:`Terminated` (in the main thread, where its handler is
    still the default), and Flower's exit calls ``on_stop`` with the reason (see the module
    docstring). The runner catches :data:`STOPS` itself."""
    global _handler_added
    with _registered:
        if not _handler_added:  # Flower keeps its exit handlers for the process's life
            add_exit_handler(_on_flower_exit, run_before_force_exit=True)
            _handler_added = True
    previous = None
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    _current.append(on_stop)
    try:
        yield
    finally:
        _current.remove(on_stop)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class UncheckpointedStop:
    """The stopped summary of a run that keeps no checkpoint: ``"status": "stopped"``, why,
    its figures so far, and that a new run starts from round 1 (``resume = true`` is refused
    for these strategies).

    Parameters
    ----------
    out : Path
        The run's output folder.
    head : dict
        The summary's keys that do not change as the run goes (model, strategy, rule, ...).
    writer : MetricsWriter
        The run's rows so far.
    started : float
        When the run started (``time.perf_counter()``).
    """

    def __init__(self, out: Path, head: dict[str, Any], writer: MetricsWriter,
                 started: float) -> None:
        self.out, self.head, self.writer, self.started = out, head, writer, started
        self.finished = False  # the run wrote its own summary: nothing to add

    def write(self, reason: str) -> None:
        """Write the stopped summary, until the run has written its own."""
        if self.finished:
            return
        rows = self.writer.records
        rounds_run = max((int(r["round"]) for r in rows), default=0)
        write_summary(self.out, {
            **self.head, "rounds_run": rounds_run, **run_totals(rows),
            "wall_s": time.perf_counter() - self.started, "output_dir": str(self.out),
            "status": "stopped", "reason": reason, "last_round": rounds_run,
            "resume": f"strategy = \"{self.head.get('strategy')}\" keeps no checkpoint: a new "
                      "run starts again from round 1"})
        log.error("run %s after round %d; %s wrote why", reason, rounds_run,
                  self.out / "summary.json")
