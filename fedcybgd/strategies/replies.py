"""The reply gate: every field of a client's reply is checked before the server uses it.

Every client is treated as possibly hostile. Both strategies (FedCyBGD and the FedAvg
baselines) read replies only through this module: record names, types, ranges and finiteness
are checked, and anything that goes wrong while reading, decoding or replaying one reply,
whatever exception it raises, becomes a :class:`Dropped` with a short reason key. The round
goes on without that reply; :class:`DropLog` counts the round's drops by reason for its metrics.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# Reason keys (the round record's ``dropped`` counts them).
CLIENT_ERROR = "client-error"  # the runtime's error reply: the ClientApp raised or the node died
NO_REPLY = "no-reply"  # timed out or lost
MALFORMED = "malformed"  # records or fields of the wrong kind, name, type or range
BAD_METRICS = "bad-metrics"  # a metric that is not a finite scalar in range
BAD_PAYLOAD = "bad-payload"  # the upload does not decode (CodecError)
BAD_SEEDLOG = "bad-seedlog"  # a step log that does not parse, or was not asked for
REPLAY_FAILED = "replay-failed"  # a well-formed step log that cannot be replayed here
NON_FINITE = "non-finite"  # NaN/Inf in the update or in what it would install
OUTLIER = "outlier"  # an update far larger than the block's recent installed steps or itself
MISMATCH = "mismatch"  # an upload that is not what the round asked for (codec, versions, dtype)
INSTALL_FAILED = "install-failed"  # merging, stepping or rounding the block failed; re-queued
NOT_TRAINED = "not-trained"  # the node answered but trained nothing (resync, rejected)
UNEXPECTED = "error"  # any other exception while reading the reply

# A metric larger than this is nonsense whatever it measures (MB, seconds, bytes, losses).
METRIC_CEILING = 1e15


class Dropped(Exception):
    """A reply that brings no usable update; ``reason`` is one of this module's keys."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class DropLog:
    """The drops of one round, logged once each and counted by reason."""

    def __init__(self, server_round: int) -> None:
        self.server_round = server_round
        self.counts: Counter[str] = Counter()

    def add(self, node: int, what: str, drop: Dropped) -> None:
        """Count and log ``drop`` of ``node``'s reply about ``what`` (a block, or "update")."""
        self.counts[drop.reason] += 1
        log.warning("round %d: dropped node %d's %s (%s): %s", self.server_round, node, what,
                    drop.reason, drop.detail)

    def as_dict(self) -> dict[str, int]:
        """Reason -> count, in name order."""
        return dict(sorted(self.counts.items()))


def guarded(read: Callable[[], _T], reason: str = UNEXPECTED) -> _T:
    """Run ``read``; any exception but :class:`Dropped` becomes a ``Dropped(reason)``.

    Deliberately broad: a reply is untrusted input, and no bug or resource error it triggers
    (``RecursionError``, ``OverflowError``, ``MemoryError``, ...) may end the server's run.
    """
    try:
        return read()
    except Dropped:
        raise
    except Exception as err:  # see the docstring: deliberately broad
        raise Dropped(reason, f"{type(err).__name__}: {err}") from err


def only_records(content: Any, *, arrays: set[str], metrics: set[str], configs: set[str]) -> None:
    """The reply holds exactly the named records, no others."""
    for kind, got, want in (("array", content.array_records, arrays),
                            ("metric", content.metric_records, metrics),
                            ("config", content.config_records, configs)):
        if set(got) != want:
            raise Dropped(MALFORMED, f"{kind} records {sorted(got)}, expected {sorted(want)}")


def scalar_metrics(record: Mapping[str, Any],
                   capped: frozenset[str] = frozenset({"num-examples"})) -> dict[str, float]:
    """All metrics of a MetricRecord as floats; each must be a finite number in range.

    ``train_loss`` may be NaN (a client whose loss went undefined); nothing else may. Keys in
    ``capped`` skip the magnitude ceiling: the caller caps them (see :func:`examples_weight`).
    """
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise Dropped(BAD_METRICS, f"metric {key!r} = {value!r:.60} is not a number")
        number = float(value)
        if math.isnan(number) and key == "train_loss":
            out[key] = number
            continue
        if not math.isfinite(number) or (abs(number) > METRIC_CEILING and key not in capped):
            raise Dropped(BAD_METRICS, f"{key} = {number} is not finite or too large")
        out[key] = number
    return out


def bounded(metrics: Mapping[str, float], key: str, *, low: float = 0.0,
            high: float = METRIC_CEILING, default: float | None = None) -> float:
    """``metrics[key]`` within ``[low, high]`` (``default`` when absent, if given)."""
    if key not in metrics:
        if default is None:
            raise Dropped(BAD_METRICS, f"metric {key!r} is missing")
        return default
    value = metrics[key]
    if math.isnan(value):
        return value
    if not low <= value <= high:
        raise Dropped(BAD_METRICS, f"metric {key!r} = {value} is outside [{low}, {high}]")
    return value


def examples_weight(metrics: Mapping[str, float], key: str, cap: float) -> float:
    """The example count a reply is weighted by: positive, finite, at most ``cap``.

    The cap is what the server knows a node can have seen in a round (local steps x batch
    size), so no node owns an average by claiming more.
    """
    value = metrics.get(key)
    if value is None or not 0 < value < math.inf:
        raise Dropped(BAD_METRICS, f"{key} = {value!r} is not a positive number")
    if value > cap:
        log.info("%s = %g capped at %g", key, value, cap)
    return min(value, cap)


def text(record: Mapping[str, Any], key: str, *, default: str | None = None,
         max_len: int = 4096) -> str:
    """A string field of a ConfigRecord, of bounded length."""
    value = record.get(key, default)
    if not isinstance(value, str):
        raise Dropped(MALFORMED, f"field {key!r} must be a string, got {type(value).__name__}")
    if len(value) > max_len:
        raise Dropped(MALFORMED, f"field {key!r} is {len(value)} characters long (max {max_len})")
    return value


def number(record: Mapping[str, Any], key: str, *, low: float, high: float,
           default: float) -> float:
    """A numeric field of a ConfigRecord within ``[low, high]``."""
    value = record.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Dropped(MALFORMED, f"field {key!r} must be a number, got {type(value).__name__}")
    if not low <= float(value) <= high:  # NaN fails too
        raise Dropped(MALFORMED, f"field {key!r} = {value} is outside [{low}, {high}]")
    return float(value)
