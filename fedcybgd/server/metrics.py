"""The run's outputs other tools read: ``metrics.jsonl`` (one line per round), ``summary.json``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Append round records to ``metrics.jsonl``; a fresh run starts the file anew."""

    def __init__(self, output_dir: Path, resume: bool) -> None:
        self.path = output_dir / "metrics.jsonl"
        output_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            self.path.write_text("")
        self.records: list[dict[str, Any]] = []
        if resume and self.path.exists():
            self.records = [json.loads(line) for line in self.path.read_text().splitlines()
                            if line.strip()]

    def write(self, record: dict[str, Any]) -> None:
        """Append one round's record (and drop records of rounds it supersedes)."""
        record = {k: _clean(v) for k, v in record.items()}
        self.records = [r for r in self.records if r.get("round") != record.get("round")]
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def write_summary(output_dir: Path, summary: dict[str, Any]) -> Path:
    """Write ``summary.json`` and return its path."""
    path = output_dir / "summary.json"
    path.write_text(json.dumps({k: _clean(v) for k, v in summary.items()}, indent=1))
    return path


def run_totals(records: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's summary figures from its round records (round 0 = the evaluation before
    training): first/last/best evaluation, bytes, client peak memory, mean round time."""
    evals = [r for r in records if r.get("eval_accuracy") is not None] or [{}]
    trained = [r for r in records if r.get("round", 0) > 0]
    return {
        "initial_eval_loss": evals[0].get("eval_loss"),
        "initial_eval_accuracy": evals[0].get("eval_accuracy"),
        "final_eval_loss": evals[-1].get("eval_loss"),
        "final_eval_accuracy": evals[-1].get("eval_accuracy"),
        "best_eval_accuracy": max((r.get("eval_accuracy") or 0.0) for r in evals),
        **{key: sum(r.get(key) or 0 for r in trained)
           for key in ("bytes_down", "bytes_up", "bytes_down_raw", "bytes_up_raw")},
        "client_peak_mem_mb": max([r.get("client_peak_mem_mb") or 0.0 for r in trained] or [0]),
        "mean_round_s": (sum(r["round_s"] for r in trained) / len(trained)) if trained else None,
    }
