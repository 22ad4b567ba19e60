"""Pipeline schedules: who does what, in which order, when a model is split over K stages.

A model's decoder layers are cut into K contiguous chunks, one per stage (device); stage 0 holds
the data and feeds a mini-batch as M micro-batches. Each stage runs a list of operations in
order; an operation waits for its inputs from the neighbouring stage:

* ``F`` (forward of micro-batch m): needs stage k-1's ``F`` of m (its output activations);
  stage 0 reads the data.
* ``B`` (backward of m, backprop schedules): needs stage k+1's ``B`` of m (the gradient of the
  activations it sent up); the last stage's ``B`` starts from its loss, after its own ``F``.
* ``L`` (ZeroLock's local update of m): the chunk's local objective on its own output,
  backprop inside the chunk only; needs nothing but the stage's own ``F`` of m.
* ``S`` (optimizer step): after the mini-batch's last ``B`` or ``L`` of the stage.

Three schedules on the same operations:

* ``gpipe``: every forward, then every backward (reverse order), then the step. A stage keeps
  the activations of all M micro-batches until their backward.
* ``1f1b`` (PipeDream-flush): stage k runs ``min(K - k - 1, M)`` warm-up forwards, then
  alternates one forward and one backward, then drains; at most ``K - k`` micro-batches'
  activations alive on stage k. Same gradients as GPipe.
* ``zerolock``: each ``F`` sends its output up at once (early forwarding), then ``L``; no ``B``
  and no message travels down. A stage keeps one micro-batch's activations.

:func:`simulate` plays the lists against operation times and a transfer time and returns the
makespan: what K devices, each with its own processor, would take. It is a projection from
measured times, not a measurement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fedcybgd.choices import PIPELINE_SCHEDULES

SCHEDULES = PIPELINE_SCHEDULES
KINDS = ("F", "B", "L", "S")


@dataclass(frozen=True)
class Op:
    """One operation of a stage: ``kind`` in :data:`KINDS` on micro-batch ``mb`` (``S``: -1)."""

    kind: str
    mb: int = -1

    def __str__(self) -> str:
        return self.kind if self.kind == "S" else f"{self.kind}{self.mb}"


def stage_ops(schedule: str, stage: int, stages: int, micro_batches: int,
              first_mb: int = 0) -> list[Op]:
    """The operations of ``stage`` (of ``stages``) for one mini-batch of ``micro_batches``,
    numbered from ``first_mb``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not in 0..{stages - 1}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    m = micro_batches
    if schedule == "gpipe":
        ops = [Op("F", i) for i in range(m)] + [Op("B", i) for i in reversed(range(m))]
    elif schedule == "1f1b":
        warm = min(stages - stage - 1, m)
        ops = [Op("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [Op("F", warm + i), Op("B", i)]
        ops += [Op("B", i) for i in range(m - warm, m)]
    else:
        ops = [op for i in range(m) for op in (Op("F", i), Op("L", i))]
    return [*(Op(op.kind, op.mb + first_mb) for op in ops), Op("S")]


def plan(schedule: str, stages: int, micro_batches: int, steps: int = 1) -> list[list[Op]]:
    """Every stage's operations (:func:`stage_ops`) for ``steps`` mini-batches one after
    another (micro-batches numbered on across them)."""
    return [[op for step in range(steps)
             for op in stage_ops(schedule, k, stages, micro_batches, step * micro_batches)]
            for k in range(stages)]


def in_flight(ops: list[Op]) -> int:
    """The most micro-batches whose activations a stage keeps at once (forward done, backward
    or local update not yet)."""
    alive = peak = 0
    for op in ops:
        if op.kind == "F":
            alive += 1
            peak = max(peak, alive)
        elif op.kind in ("B", "L"):
            alive -= 1
    return peak


@dataclass
class Projection:
    """What :func:`simulate` found: the makespan and each stage's busy and idle seconds."""

    makespan_s: float
    busy_s: list[float]
    starts: list[dict[str, float]]

    @property
    def idle_s(self) -> list[float]:
        return [self.makespan_s - b for b in self.busy_s]


def simulate(ops: list[list[Op]], seconds: Mapping[tuple[int, str], float],
             transfer_s: float | Mapping[tuple[int, str], float] = 0.0) -> Projection:
    """Play the stages' operation lists with the given durations.

    Parameters
    ----------
    ops : list of list of Op
        One list per stage (:func:`plan`).
    seconds : mapping
        ``(stage, kind) -> seconds`` of one operation (``S`` may be absent: 0).
    transfer_s : float or mapping
        Seconds a message takes from one stage to the next: one figure, or ``(stage, kind)``
        of the sender's operation (``F`` sends up, ``B`` sends down).

    Each stage runs its operations in order, one at a time; an operation starts when its stage
    is free and its input has arrived. Raises ``ValueError`` if the lists deadlock.
    """
    stages = len(ops)
    done: dict[tuple[int, str, int], float] = {}  # (stage, kind, mb) -> finish time
    free = [0.0] * stages
    busy = [0.0] * stages
    starts: list[dict[str, float]] = [{} for _ in range(stages)]
    cursor = [0] * stages

    def transfer(stage: int, kind: str) -> float:
        if isinstance(transfer_s, Mapping):
            return float(transfer_s.get((stage, kind), 0.0))
        return float(transfer_s)

    def ready(stage: int, op: Op) -> float | None:
        """When ``op``'s input is there (None: not yet known)."""
        if op.kind == "F":
            if stage == 0:
                return 0.0
            up = done.get((stage - 1, "F", op.mb))
            return None if up is None else up + transfer(stage - 1, "F")
        if op.kind == "B":
            own = done.get((stage, "F", op.mb))
            if own is None:
                return None
            if stage == stages - 1:
                return own
            down = done.get((stage + 1, "B", op.mb))
            return None if down is None else max(own, down + transfer(stage + 1, "B"))
        if op.kind == "L":
            return done.get((stage, "F", op.mb))
        return 0.0  # S: after the stage's previous op, which the cursor guarantees

    remaining = sum(len(o) for o in ops)
    while remaining:
        progressed = False
        for k in range(stages):
            while cursor[k] < len(ops[k]):
                op = ops[k][cursor[k]]
                at = ready(k, op)
                if at is None:
                    break
                start = max(free[k], at)
                took = float(seconds.get((k, op.kind), 0.0))
                free[k] = start + took
                busy[k] += took
                done[(k, op.kind, op.mb)] = free[k]
                starts[k][f"{cursor[k]}:{op}"] = start
                cursor[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {k: str(ops[k][cursor[k]]) for k in range(stages) if cursor[k] < len(ops[k])}
            raise ValueError(f"the schedule deadlocks: stages wait at {stuck}")
    return Projection(max(free), busy, starts)
