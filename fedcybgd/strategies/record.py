"""The round: its record (the ``metrics.jsonl`` row, Flower MetricRecord, run totals), and the
round in flight.

The strategy fills the training half of a :class:`RoundRecord` (blocks, nodes, traffic, client
metrics, drops); the server adds the evaluation and the round's time. :meth:`RoundRecord.to_json`
is the row in ``metrics.jsonl`` (docs/outputs.md: the contract other tools read),
:meth:`RoundRecord.to_metric_record` what ``aggregate_train`` returns to Flower, and
:func:`run_totals` the summary figures of a run's records. Rows read back from ``metrics.jsonl``
become records again with :meth:`RoundRecord.from_json`. :class:`RoundInFlight` is what the
strategy holds between sending a round's instructions and reading its replies.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord, Message, MetricRecord

from fedcybgd.strategies.matching import Assignment

# The row's keys in order. Round 0 (the evaluation before training) has only ``round`` and the
# evaluation's keys. A training round has every key but the optional ones that are ``None``;
# ``train_loss`` is always there (``null`` when no loss was defined).
_KEYS = ("round", "blocks", "clients", "update_rule", "failed_blocks", "dropped_uploads",
         "bytes_down", "bytes_up", "bytes_down_raw", "bytes_up_raw", "wire_bytes_down",
         "wire_bytes_up", "train_loss",
         "client_peak_mem_mb", "client_train_s", "examples", "dropped", "accepted",
         "traffic", "traffic_over_budget")
_OPTIONAL = {"blocks", "failed_blocks", "dropped_uploads", "accepted", "traffic",
             "traffic_over_budget"}
_EVAL_KEYS = ("eval_loss", "eval_accuracy", "eval_examples", "eval_s", "round_s")


@dataclass
class RoundRecord:
    """What happened in one round.

    Node ids are ints here and strings in the row (JSON keys and big ids stay exact).
    ``update_rules`` lists the rule of each accepted upload; the row's ``update_rule`` is their
    sorted set, or ``[rule]`` (the run's) when nothing was accepted. ``blocks``,
    ``failed_blocks`` and ``accepted`` are FedCyBGD's, ``dropped_uploads`` the FedAvg
    baselines'; ``None`` leaves a key out of the row.
    """

    round: int
    rule: str = ""
    blocks: list[str] | None = None
    clients: list[int] = field(default_factory=list)
    update_rules: list[str] = field(default_factory=list)
    failed_blocks: list[str] | None = None
    dropped_uploads: int | None = None
    bytes_down: int = 0
    bytes_up: int = 0
    bytes_down_raw: int = 0
    bytes_up_raw: int = 0
    # what crossed the wire: the serialised messages, metadata and config included
    # (fedcybgd.protocol.message_size), instructions down and replies up
    wire_bytes_down: int = 0
    wire_bytes_up: int = 0
    train_loss: float | None = None
    client_peak_mem_mb: float = 0.0
    client_train_s: float = 0.0
    examples: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> assignments dropped
    accepted: dict[str, list[int]] | None = None  # installed block -> its nodes
    # with traffic-budget-mb: node -> its traffic level, and how many nodes went over it
    traffic: dict[int, str] | None = None
    traffic_over_budget: int | None = None
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    eval_examples: int | None = None
    eval_s: float | None = None
    round_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # row keys of other tools, kept

    @classmethod
    def training(cls, server_round: int, rule: str) -> RoundRecord:
        """An empty FedCyBGD training round (its blocks, failures and acceptances as lists)."""
        return cls(server_round, rule=rule, blocks=[], failed_blocks=[], accepted={})

    def count_upload(self, examples: float, raw_bytes: int, rule: str, peak_mem_mb: float,
                     train_s: float) -> None:
        """Count an accepted upload: its examples, fp32 size, rule, the node's peak and time."""
        self.examples += int(examples)
        self.bytes_up_raw += raw_bytes
        self.update_rules.append(rule)
        self.client_peak_mem_mb = max(self.client_peak_mem_mb, peak_mem_mb)
        self.client_train_s = max(self.client_train_s, train_s)

    def count_traffic_level(self, node: int, level: str, fits: bool) -> None:
        """Record the traffic level chosen for ``node`` and whether it fits the budget."""
        self.traffic = {**(self.traffic or {}), node: level}
        self.traffic_over_budget = (self.traffic_over_budget or 0) + (not fits)

    def to_json(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` row (non-finite floats are the writer's to turn into null)."""
        row: dict[str, Any] = {"round": self.round}
        if self.round > 0:
            for key in _KEYS[1:]:
                value = self._json_value(key)
                if value is not None or key not in _OPTIONAL:
                    row[key] = value
        row.update({k: getattr(self, k) for k in _EVAL_KEYS if getattr(self, k) is not None})
        return {**row, **self.extra}

    def _json_value(self, key: str) -> Any:
        if key == "clients":
            return [str(n) for n in self.clients]
        if key == "update_rule":
            return sorted(set(self.update_rules)) or [self.rule]
        if key == "accepted":
            return None if self.accepted is None else {
                b: [str(n) for n in nodes] for b, nodes in self.accepted.items()}
        if key == "traffic":
            return None if self.traffic is None else {str(n): v for n, v in self.traffic.items()}
        return getattr(self, key)

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> RoundRecord:
        """A row of ``metrics.jsonl`` as a record (``from_json(r).to_json() == r`` up to key
        order); keys this type does not know are kept in ``extra``."""
        names = {f.name for f in dataclasses.fields(cls)} - {"rule", "update_rules", "extra"}
        values: dict[str, Any] = {k: v for k, v in row.items() if k in names}
        if "clients" in values:
            values["clients"] = [int(n) for n in values["clients"]]
        if values.get("traffic") is not None:
            values["traffic"] = {int(n): str(v) for n, v in values["traffic"].items()}
        if values.get("accepted") is not None:
            values["accepted"] = {b: [int(n) for n in nodes]
                                  for b, nodes in values["accepted"].items()}
        rules = list(row.get("update_rule") or [])
        extra = {k: v for k, v in row.items() if k not in names and k != "update_rule"}
        return cls(**values, update_rules=rules, rule=rules[0] if rules else "", extra=extra)

    def to_metric_record(self) -> MetricRecord:
        """What ``aggregate_train`` returns to Flower: counts, traffic, memory, drops, loss."""
        metrics = MetricRecord({
            "blocks_trained": len(self.accepted or {}),
            "blocks_failed": len(self.failed_blocks or []),
            "bytes_down": self.bytes_down,
            "bytes_up": self.bytes_up,
            "bytes_down_raw": self.bytes_down_raw,
            "bytes_up_raw": self.bytes_up_raw,
            "wire_bytes_down": self.wire_bytes_down,
            "wire_bytes_up": self.wire_bytes_up,
            "client_peak_mem_mb": self.client_peak_mem_mb,
            "dropped": sum(self.dropped.values()),
        })
        if self.train_loss is not None:
            metrics["train_loss"] = self.train_loss
        return metrics


@dataclass
class RoundInFlight:
    """The round between ``configure_train`` and ``aggregate_train`` (and what it returned)."""

    record: RoundRecord
    pairs: list[Assignment] = field(default_factory=list)
    seeds: dict[int, int] = field(default_factory=dict)  # node -> its seed this round
    awaiting: dict[int, str] = field(default_factory=dict)  # node -> block, unanswered
    sent: list[Message] = field(default_factory=list)  # instructions (ids set on push)
    returned: ArrayRecord | None = None  # aggregate_train's arrays, not to be reloaded
    upload_codecs: dict[int, str] = field(default_factory=dict)  # node -> its, under a budget


def run_totals(records: Iterable[RoundRecord | Mapping[str, Any]]) -> dict[str, Any]:
    """A run's summary figures from its round records or rows (round 0 = the evaluation
    before training): first/last/best evaluation, bytes, client peak memory, mean round time,
    drops by reason."""
    rounds = [r if isinstance(r, RoundRecord) else RoundRecord.from_json(r) for r in records]
    evals = [r for r in rounds if r.eval_accuracy is not None] or [RoundRecord(0)]
    trained = [r for r in rounds if r.round > 0]
    return {
        "initial_eval_loss": evals[0].eval_loss,
        "initial_eval_accuracy": evals[0].eval_accuracy,
        "final_eval_loss": evals[-1].eval_loss,
        "final_eval_accuracy": evals[-1].eval_accuracy,
        "best_eval_accuracy": max((r.eval_accuracy or 0.0) for r in evals),
        **{key: sum(getattr(r, key) or 0 for r in trained)
           for key in ("bytes_down", "bytes_up", "bytes_down_raw", "bytes_up_raw",
                       "wire_bytes_down", "wire_bytes_up")},
        "client_peak_mem_mb": max([r.client_peak_mem_mb or 0.0 for r in trained] or [0]),
        "mean_round_s": (sum(r.round_s for r in trained)  # type: ignore[misc]
                         / len(trained)) if trained else None,
        "dropped": dict(sorted(sum((Counter(r.dropped or {}) for r in trained),
                                   Counter()).items())),
    }
