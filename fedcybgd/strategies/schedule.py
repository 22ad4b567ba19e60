"""Which blocks train next: the :class:`Schedule` protocol, the built-in cycles, a registry.

A schedule hands out distinct blocks for each round (``take``), takes back a block whose
training failed (``requeue``: it comes again before the cycle moves on, so no block is skipped
silently) and checkpoints itself as JSON (``state`` / ``load_state``). A schedule may also
define ``observe(block, update_rms)``: the strategy then tells it, for every block it installs,
the RMS of the step the block took (see :class:`ObservingSchedule`), so an order can follow
where the model moves. The built-in orders (:data:`ORDERS`) are registered
by name; a plug-in registers its own with :func:`register_schedule` (a module named in the
run-config key ``plugin-modules``, then ``block-schedule = "its-name"``), or passes any object
with these methods to ``FedCyBGD``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from fedcybgd.core.registry import Registry


@runtime_checkable
class Schedule(Protocol):
    """What ``FedCyBGD`` needs of a block schedule."""

    def take(self, count: int) -> list[str]:
        """Up to ``count`` distinct blocks to train this round."""
        ...

    def requeue(self, block: str) -> None:
        """Take back ``block``, whose training failed this round; hand it out again soon."""
        ...

    def state(self) -> dict[str, Any]:
        """JSON-able state for checkpoints."""
        ...

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state`'s output."""
        ...


@runtime_checkable
class ObservingSchedule(Schedule, Protocol):
    """A schedule that is also told how far each installed block moved."""

    def observe(self, block: str, update_rms: float) -> None:
        """``block`` was installed; its step's RMS (L2 norm / sqrt(elements)) was ``update_rms``."""
        ...


# name -> factory called as factory(blocks=[...], seed=int)
ScheduleFactory = Callable[..., Schedule]
_F = TypeVar("_F", bound=ScheduleFactory)
# The built-in orders of :class:`BlockSchedule`, registered under these names, in this order.
ORDERS: tuple[str, ...] = ("ascending", "descending", "random", "spread")
SCHEDULE_REGISTRY: Registry[ScheduleFactory] = Registry("block schedule", "block-schedule")


def register_schedule(name: str, *, replace: bool = False) -> Callable[[_F], _F]:
    """Decorator: make ``factory(blocks=..., seed=...)`` the schedule called ``name``.

    ``blocks`` are the blocks of one cycle in model order, ``seed`` the run's seed. Registering
    a taken name raises unless ``replace`` (a plug-in must not shadow a built-in order by
    accident).
    """
    return SCHEDULE_REGISTRY.register(name, replace=replace)  # type: ignore[return-value]


def unregister_schedule(name: str) -> ScheduleFactory | str:
    """Remove the schedule ``name`` (tests, interactive sessions); returns its factory (or its
    ``"module:attr"`` if never imported)."""
    return SCHEDULE_REGISTRY.unregister(name)


def schedule_names() -> tuple[str, ...]:
    """The registered schedule names, built-in first."""
    return SCHEDULE_REGISTRY.names()


def build_schedule(name: str, blocks: Sequence[str], seed: int = 0) -> Schedule:
    """The schedule registered as ``name`` over ``blocks`` (in model order).

    Raises
    ------
    ConfigError
        ``name`` is not registered (the message suggests the closest registered name).
    TypeError
        The factory made something without the :class:`Schedule` methods.
    """
    schedule = SCHEDULE_REGISTRY.get(name)(blocks=list(blocks), seed=seed)
    if not isinstance(schedule, Schedule):
        raise TypeError(f"block-schedule {name!r} made a {type(schedule).__name__}, which lacks "
                        "take/requeue/state/load_state")
    return schedule


class BlockSchedule:
    """Cycle through ``blocks``; a block handed back with :meth:`requeue` comes first.

    Parameters
    ----------
    blocks : list[str]
        The blocks of one cycle, in model order (bottom-up).
    order : str
        ``ascending`` (bottom-up), ``descending`` (top-down), ``random`` (a fresh
        permutation every cycle, derived from ``seed`` and the cycle number), or ``spread``
        (ascending, but the blocks of one round are taken evenly spaced through what is left
        of the cycle, so blocks trained in parallel are far apart in the model).
    seed : int
        Seed of the random order.
    """

    def __init__(self, blocks: list[str], order: str = "ascending", seed: int = 0) -> None:
        if order not in ORDERS:
            raise ValueError(f"block-schedule {order!r} is not allowed; choose one of {ORDERS}")
        if not blocks:
            raise ValueError("the block cycle is empty: nothing to train")
        self.blocks = list(blocks)
        self.order = order
        self.seed = seed
        self.cycle = 0  # number of cycles started
        self.pending: list[str] = []  # rest of the current cycle, next first
        self.retry: list[str] = []  # failed blocks, next first

    def _cycle_order(self, cycle: int) -> list[str]:
        if self.order in ("ascending", "spread"):
            return list(self.blocks)
        if self.order == "descending":
            return list(reversed(self.blocks))
        permuted = list(self.blocks)
        random.Random(f"{self.seed}:{cycle}").shuffle(permuted)
        return permuted

    def take(self, count: int) -> list[str]:
        """Up to ``count`` distinct blocks for this round (fewer only if the model has fewer)."""
        if self.order == "spread":
            return self._take_spread(count)
        chosen: list[str] = []
        count = min(count, len(self.blocks))
        while len(chosen) < count:
            if self.retry:
                source = self.retry
            else:
                if not self.pending:
                    self.pending = self._cycle_order(self.cycle)
                    self.cycle += 1
                source = self.pending
            index = next((i for i, b in enumerate(source) if b not in chosen), None)
            if index is None:
                # Every queued block is already in this round: start the next cycle early.
                if source is self.retry:
                    break
                self.pending.extend(b for b in self._cycle_order(self.cycle) if b not in chosen)
                self.cycle += 1
                continue
            chosen.append(source.pop(index))
        return chosen

    def _take_spread(self, count: int) -> list[str]:
        """Retries first, then ``count`` blocks evenly spaced through the pending cycle."""
        count = min(count, len(self.blocks))
        chosen: list[str] = []
        while self.retry and len(chosen) < count:
            block = self.retry.pop(0)
            if block not in chosen:
                chosen.append(block)
        need = count - len(chosen)
        self.pending = [b for b in self.pending if b not in chosen]
        if len(self.pending) < need:  # the cycle ends: the next one fills up
            self.pending += [b for b in self._cycle_order(self.cycle)
                             if b not in chosen and b not in self.pending]
            self.cycle += 1
        if need:
            picks = sorted({i * len(self.pending) // need for i in range(need)}, reverse=True)
            taken = [self.pending.pop(i) for i in picks]
            chosen += reversed(taken)
        return chosen

    def requeue(self, block: str) -> None:
        """Put a block whose training failed at the front, so the cycle never skips it."""
        if block not in self.retry:
            self.retry.append(block)

    def state(self) -> dict[str, Any]:
        """JSON-able state for checkpoints."""
        return {"cycle": self.cycle, "pending": list(self.pending), "retry": list(self.retry)}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state`'s output."""
        self.cycle = int(state["cycle"])
        self.pending = [str(b) for b in state["pending"]]
        self.retry = [str(b) for b in state["retry"]]


# The built-in orders: one class, registered under each order's name (block-schedule's values).
def _builtin(order: str) -> ScheduleFactory:
    def make(*, blocks: list[str], seed: int) -> Schedule:
        return BlockSchedule(blocks, order, seed)

    make.__name__ = f"{order}_schedule"
    return make


for _order in ORDERS:
    register_schedule(_order)(_builtin(_order))
