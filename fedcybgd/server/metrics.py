"""The run's outputs other tools read: ``metrics.jsonl`` (one line per round), ``summary.json``,
and the run's segments that ``summary.json`` lists (:class:`Segments`)."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fedcybgd.core.atomic import append_line, make_dirs, write_bytes
from fedcybgd.strategies.record import run_totals

__all__ = ["SEGMENT_ENDS", "MetricsWriter", "Segments", "run_status", "run_totals",
           "stopped_status", "write_summary"]

# How a segment ended. "interrupted": it ended without recording how (SIGKILL, out of memory, a
# power cut); the resume after it says so, and its wall_s runs to its last checkpoint.
SEGMENT_ENDS = ("completed", "failed", "stopped", "interrupted")

log = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Round records in ``metrics.jsonl``, one line each, appended and fsync'd.

    Parameters
    ----------
    output_dir : Path
        The run's output folder.
    keep_through : int, optional
        ``None``: a fresh run; the file starts empty. An integer (resume): the rows of rounds
        up to it are kept and later ones dropped (the run redoes those rounds); torn or
        unreadable lines are skipped with a warning naming the line.
    """

    def __init__(self, output_dir: Path, keep_through: int | None = None,
                 on_row: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.path = output_dir / "metrics.jsonl"
        self.on_row = on_row  # e.g. the run's experiment trackers, fed every new row
        make_dirs(output_dir)
        self.records: list[dict[str, Any]] = []
        if keep_through is None:
            write_bytes(self.path, b"")
        else:
            self._resume(keep_through)

    def _resume(self, keep_through: int) -> None:
        if not self.path.exists():
            return
        rows: dict[int, dict[str, Any]] = {}
        lines = self.path.read_bytes().split(b"\n")
        changed = bool(lines[-1])  # the last line lacks its newline: a torn write
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                server_round = record["round"]
                if isinstance(server_round, bool) or not isinstance(server_round, int):
                    raise TypeError(f"round = {server_round!r}")
            except (ValueError, KeyError, TypeError) as err:
                log.warning("%s line %d is torn or unreadable (%s); skipping it: %.80r",
                            self.path, number, err, line)
                changed = True
                continue
            if server_round > keep_through:
                log.warning("%s line %d: dropping the row of round %d, after the checkpoint "
                            "(round %d); the round is run again", self.path, number,
                            server_round, keep_through)
                changed = True
                continue
            if server_round in rows:
                log.warning("%s line %d: round %d appears again; keeping this later row",
                            self.path, number, server_round)
                changed = True
            rows[server_round] = record
        self.records = [rows[r] for r in sorted(rows)]
        if changed:
            self._rewrite()

    def _rewrite(self) -> None:
        body = "".join(json.dumps(r) + "\n" for r in self.records)
        write_bytes(self.path, body.encode())

    def has_round(self, server_round: int) -> bool:
        """Is there a row for ``server_round``?"""
        return any(r.get("round") == server_round for r in self.records)

    def write(self, record: dict[str, Any]) -> None:
        """Append one round's record (non-finite numbers become ``null``)."""
        record = {k: _clean(v) for k, v in record.items()}
        if self.has_round(record.get("round", -1)):
            raise ValueError(f"{self.path} already has a row for round {record.get('round')}")
        self.records.append(record)
        append_line(self.path, json.dumps(record))
        if self.on_row is not None:
            self.on_row(record)


class Segments:
    """The run's segments: one per start of the server, fresh or resumed, each with the
    checkpoint round it resumed after (``None``: a fresh start), the rounds it completed
    (``first_round`` to ``last_round``; ``last_round = first_round - 1`` when none), its wall
    time, how it ended (:data:`SEGMENT_ENDS`, ``None`` while it runs) and when it started (UTC).

    Parameters
    ----------
    earlier : Sequence[Mapping]
        The segments before this one, as the checkpoint resumed keeps them (its last one's
        ``end`` is ``None`` when it ended without recording how: it becomes "interrupted").
    resumed_after : int or None
        The checkpoint's round this segment resumes after; ``None``: a fresh start.
    since : float, optional
        When this segment started, by ``time.perf_counter()`` (default: now).
    """

    def __init__(self, earlier: Sequence[Mapping[str, Any]] = (),
                 resumed_after: int | None = None, since: float | None = None) -> None:
        self.earlier = [{**s, "end": s["end"] or "interrupted"} for s in earlier]
        self.resumed_after = resumed_after
        self._clock = time.perf_counter() if since is None else since
        self._started = datetime.now(UTC).isoformat(timespec="seconds")

    def elapsed(self) -> float:
        """This segment's wall time so far, in seconds."""
        return time.perf_counter() - self._clock

    def listed(self, last_round: int, end: str | None = None) -> list[dict[str, Any]]:
        """Every segment, this one as far as ``last_round`` (the last round it completed) and,
        once it has ended, how (``end``)."""
        first = (self.resumed_after or 0) + 1
        return [*self.earlier, {"resumed_after": self.resumed_after, "first_round": first,
                                "last_round": max(last_round, first - 1),
                                "wall_s": self.elapsed(), "end": end,
                                "started": self._started}]

    @staticmethod
    def wall_s(listed: Sequence[Mapping[str, Any]]) -> float:
        """The run's wall time: the sum of the ``listed`` segments' (:meth:`listed`)."""
        return sum(float(s["wall_s"]) for s in listed)


def run_status(failure: str | None, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's status keys: ``"status": "completed"``, or ``"failed"`` with the
    ``reason`` and ``last_round``, the last round that ran (see :mod:`fedcybgd.server.verdict`).
    """
    if failure is None:
        return {"status": "completed"}
    last = max((int(r["round"]) for r in rows), default=0)
    return {"status": "failed", "reason": failure, "last_round": last}


def stopped_status(reason: str, last_round: int, in_round: int | None) -> dict[str, Any]:
    """The summary's status keys of a run that stopped before its end: ``"status": "stopped"``,
    why, ``last_round`` (the last round its checkpoint holds: what a resume goes on from),
    ``stopped_in_round`` (the round it was running, redone by a resume; ``None`` between
    rounds) and how to go on."""
    return {"status": "stopped", "reason": reason, "last_round": last_round,
            "stopped_in_round": in_round,
            "resume": f"start it again with resume = true and the same output-dir: it goes on "
                      f"from round {last_round + 1}"}


def write_summary(output_dir: Path, summary: dict[str, Any]) -> Path:
    """Write ``summary.json`` (atomically) and return its path."""
    path = output_dir / "summary.json"
    write_bytes(path, json.dumps({k: _clean(v) for k, v in summary.items()}, indent=1).encode())
    return path
