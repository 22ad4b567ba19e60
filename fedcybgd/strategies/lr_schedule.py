"""The clients' learning rate per round: warm-up, then constant, cosine or linear decay.

The server sends each round's rate in the instruction, so every node of a round trains at the
same rate and a resumed run continues the schedule where it stopped.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from fedcybgd.choices import LR_SCHEDULES

FLOOR = 0.1  # decays end at this share of the base rate, not at zero


def build_lr_schedule(kind: str, base: float, num_rounds: int,
                      warmup_rounds: int = 0) -> Callable[[int], float]:
    """``round -> learning rate`` (rounds count from 1).

    Warm-up rises linearly over ``warmup_rounds`` rounds to ``base``; then ``constant`` stays,
    ``cosine`` and ``linear`` fall to ``FLOOR * base`` at the last round.
    """
    if kind not in LR_SCHEDULES:
        raise ValueError(f"lr-schedule = {kind!r}; choose one of {list(LR_SCHEDULES)}")
    if not 0 < base < math.inf or num_rounds < 1 or warmup_rounds < 0:
        raise ValueError("a schedule needs a finite base > 0, rounds >= 1 and warm-up >= 0")

    def rate(server_round: int) -> float:
        if server_round <= warmup_rounds:
            return base * server_round / (warmup_rounds + 1)
        span = max(num_rounds - warmup_rounds - 1, 1)
        progress = min(max(server_round - warmup_rounds - 1, 0) / span, 1.0)
        if kind == "cosine":
            return base * (FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))
        if kind == "linear":
            return base * (1 - (1 - FLOOR) * progress)
        return base

    return rate
