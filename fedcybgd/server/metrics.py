"""The run's outputs other tools read: ``metrics.jsonl`` (one line per round), ``summary.json``."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedcybgd.core.atomic import append_line, make_dirs, write_bytes
from fedcybgd.strategies.record import run_totals

__all__ = ["MetricsWriter", "run_status", "run_totals", "write_summary"]

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


def run_status(failure: str | None, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's status keys: ``"status": "completed"``, or ``"failed"`` with the
    ``reason`` and ``last_round``, the last round that ran (see :mod:`fedcybgd.server.verdict`).
    """
    if failure is None:
        return {"status": "completed"}
    last = max((int(r["round"]) for r in rows), default=0)
    return {"status": "failed", "reason": failure, "last_round": last}


def write_summary(output_dir: Path, summary: dict[str, Any]) -> Path:
    """Write ``summary.json`` (atomically) and return its path."""
    path = output_dir / "summary.json"
    write_bytes(path, json.dumps({k: _clean(v) for k, v in summary.items()}, indent=1).encode())
    return path
