"""Early stopping: end a run when its evaluation stops improving or reaches a target.

The server evaluates every ``eval-every`` rounds; each evaluation is compared with the best so
far on ``early-stop-metric`` (``loss``: the held-out loss, lower is better; ``metric``: the
task's metric, accuracy or exact match, higher is better). An evaluation improves when it beats
the best by more than ``early-stop-min-delta``. After ``early-stop-patience`` evaluations in a
row without improvement, or once the metric reaches ``early-stop-target``, the run ends at that
round (its model, evaluated there, is the final one) and the summary says why
(``early_stop``). Round 0 (the untrained model) is the first evaluation. The state is a function
of the evaluations in ``metrics.jsonl``, so a resumed run rebuilds it from those rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fedcybgd.config import RunConfig


@dataclass
class EarlyStop:
    """The rule and its state (see the module docstring)."""

    patience: int
    metric: str  # "loss" or "metric"
    min_delta: float
    target: float  # 0: none
    best: float | None = None
    stale: int = 0  # evaluations since the last improvement

    @classmethod
    def of(cls, run: RunConfig, rows: Iterable[Mapping[str, Any]] = ()) -> EarlyStop | None:
        """The run's rule (``None`` when off), replaying the evaluations in ``rows``."""
        if not run.early_stop_patience and not run.early_stop_target:
            return None
        stop = cls(run.early_stop_patience, run.early_stop_metric, run.early_stop_min_delta,
                   run.early_stop_target)
        for row in rows:
            if row.get("eval_loss") is not None:
                stop.observe(row.get("eval_loss"), row.get("eval_accuracy"))
        return stop

    def observe(self, loss: float | None, metric: float | None) -> str | None:
        """Take one evaluation; the reason to stop now, or ``None``."""
        value = loss if self.metric == "loss" else metric
        if value is None or not math.isfinite(value):
            self.stale += 1  # a broken evaluation is no improvement
        else:
            sign = -1.0 if self.metric == "loss" else 1.0
            if self.best is None or sign * (value - self.best) > self.min_delta:
                self.best, self.stale = value, 0
            else:
                self.stale += 1
            if self.target and sign * (value - self.target) >= 0:
                return (f"early-stop-target reached: {self.metric} {value:.4g} "
                        f"{'<=' if sign < 0 else '>='} {self.target:g}")
        if self.patience and self.stale >= self.patience:
            return (f"no improvement of {self.metric} by more than {self.min_delta:g} in "
                    f"{self.stale} evaluations (early-stop-patience = {self.patience}); "
                    f"best {self.best if self.best is None else round(self.best, 6)}")
        return None
