"""Pipeline mode against a hostile server and hostile stages, with the real ClientApp on the
in-process loopback grid and tiny random models.

A hostile server: every stage message passes the node's own limits (the run config's `lr`,
`batch-size`, `micro-batches`, `max-seq-len`, `weight-decay`, and the activations a message
carries), or the node refuses it by name and keeps nothing.

A hostile stage: the server checks every reply before it uses or relays any of it (the
activations it forwards: decodable, the step's micro-batches, sizes, shapes, finite, the batch
stage 0 sent; the trained chunk; a checkpoint; the loss), so a bad reply is its sender's stage
failure: the sender is replaced by a spare, the honest stages keep their seats and never see
the bad bytes, and the run ends with the model a run without the attack trains. Each attack
runs over several steps: the hostile node answers honestly first, then attacks every reply.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedcybgd.client.app import app as client_app
from fedcybgd.client.pipeline.turn import handle
from fedcybgd.config import RunConfig
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.protocol import activations as act
from fedcybgd.server.pipeline.runner import run_pipeline_server
from fedcybgd.server.verdict import RunFailed

# Three stages of tiny-llama's four layers, three steps of two micro-batches; every node holds
# the whole data set, so runs with different spares train the same model.
RUN = {"model": "tiny-llama", "strategy": "pipeline", "pipeline-stages": 3,
       "pipeline-schedule": "zerolock", "micro-batches": 2, "batch-size": 4, "max-seq-len": 32,
       "num-server-rounds": 3, "lr": 1e-3, "eval-examples": 16, "partitioner": "iid",
       "round-timeout": 60.0}
HIDDEN = 64  # tiny-llama's
# one step's relayed bytes per stage, at most
RELAY_BOUND = RUN["pipeline-stages"] * RUN["micro-batches"] * act.max_bytes(
    RUN["batch-size"], RUN["max-seq-len"], HIDDEN)


Attack = Callable[[Message, Message], None]  # (the instruction, the honest reply) -> edits it


class HostileGrid(LoopbackGrid):
    """A loopback grid whose ``hostile`` nodes run the real ClientApp and then rewrite its
    replies from their ``after + 1``-th message on. Every refusal or error an honest node
    answers is logged in :attr:`honest_failures`."""

    def __init__(self, config: dict, nodes: int, root: Path, hostile: dict[int, Attack],
                 after: int = 1) -> None:
        super().__init__(client_app, nodes, {**config, "output-dir": str(root / "run")},
                         node_config=lambda i: {"cache-dir": str(root / f"cache-{i}"),
                                                "partition-id": 0, "num-partitions": 1})
        self.hostile, self.after = hostile, after
        self.seen: Counter[int] = Counter()
        self.attacked: Counter[int] = Counter()
        self.honest_failures: list[tuple[int, str]] = []

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(super().push_messages(messages))
        for message, mid in zip(messages, ids, strict=True):
            node, reply = message.metadata.dst_node_id, self._replies.get(mid)
            if reply is None:
                continue
            if node in self.hostile:
                self.seen[node] += 1
                if self.seen[node] > self.after:
                    self.attacked[node] += 1
                    self.hostile[node](message, reply)
            elif reply.has_error():
                self.honest_failures.append((node, reply.error.reason))
            elif reply.content.config_records[act.PIPELINE]["status"] != "ok":
                self.honest_failures.append(
                    (node, str(reply.content.config_records[act.PIPELINE]["reason"])))
        return ids


def _run(config: dict, nodes: int, root: Path, hostile: dict[int, Attack] | None = None,
         after: int = 1) -> tuple[dict, HostileGrid]:
    grid = HostileGrid(config, nodes, root, hostile or {}, after)
    try:
        summary = run_pipeline_server(grid,
                                      RunConfig.from_run_config(grid.contexts[1001].run_config))
    except RunFailed as err:  # a failed run writes its summary, then says why
        summary = json.loads((root / "run" / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["reason"] == str(err)
    written = json.loads((root / "run" / "summary.json").read_text())
    assert written["status"] == summary["status"]
    return summary, grid


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[str, dict]:
    """The model each schedule trains without an attack (three stages, one spare)."""
    root = tmp_path_factory.mktemp("clean")
    out = {}
    for schedule in ("zerolock", "gpipe"):
        summary, grid = _run({**RUN, "pipeline-schedule": schedule}, 4, root / schedule)
        assert summary["status"] == "completed" and summary["recoveries"] == []
        assert grid.honest_failures == []
        out[schedule] = summary
    return out


# ------------------------------------------------------------------ what a hostile stage sends
def _payloads(edit: Callable[[dict[str, bytes]], dict[str, bytes]]) -> Attack:
    """An attack on the activations (or gradients) a reply relays."""

    def attack(message: Message, reply: Message) -> None:
        record = reply.content.config_records.get(act.ACTIVATIONS)
        if record:
            reply.content[act.ACTIVATIONS] = ConfigRecord(edit(dict(record)))  # type: ignore[arg-type]

    return attack


def _each(edit: Callable[[str, int, torch.Tensor, object], bytes]) -> Attack:
    """An attack that re-encodes every relayed micro-batch: ``edit(kind, mb, tensor, batch)``."""

    def rewrite(entries: dict[str, bytes]) -> dict[str, bytes]:
        out = {}
        for key, data in entries.items():
            kind, mb, tensor, batch = act.decode(data, HIDDEN, 1 << 26)
            out[key] = edit(kind, mb, tensor, batch)
        return out

    return _payloads(rewrite)


def _swap(entries: dict[str, bytes]) -> dict[str, bytes]:
    keys = sorted(entries)
    return {keys[0]: entries[keys[1]], keys[1]: entries[keys[0]], **{
        k: entries[k] for k in keys[2:]}}


def _extra_row(kind, mb, tensor, batch):
    grown = {f.name: torch.cat([getattr(batch, f.name), getattr(batch, f.name)[:1]])
             for f in fields(batch) if f.name in ("input_ids", "attention_mask", "last_index",
                                                  "target_ids", "labels")}
    return act.encode(kind, mb, torch.cat([tensor, tensor[:1]]), replace(batch, **grown))


def _non_finite(kind, mb, tensor, batch):
    tensor = tensor.clone()
    tensor[0, 0, 0] = math.inf
    return act.encode(kind, mb, tensor, batch)


def _relabelled(kind, mb, tensor, batch):
    """Plausible states, but the upper stages are told to fit other targets."""
    labels = 1 - batch.labels
    return act.encode(kind, mb, tensor, replace(batch, labels=labels,
                                                target_ids=batch.class_token_ids[labels]))


def _wider(kind, mb, tensor, batch):
    return act.encode(kind, mb, torch.cat([tensor, tensor[..., :1]], dim=2), batch)


def _as_gradient(kind, mb, tensor, batch):
    return act.encode("B" if kind == "F" else "F", mb, tensor, batch)


RELAY_ATTACKS: dict[str, Attack] = {
    "wrong micro-batch": _payloads(_swap),
    "one row too many": _each(_extra_row),
    "oversized blob": _payloads(lambda e: {k: bytes(12 << 20) for k in e}),
    "undecodable": _payloads(lambda e: {k: b"\x08" + bytes(7) + b"{bad json" for k in e}),
    "non-finite states": _each(_non_finite),
    "wider states": _each(_wider),
    "a gradient sent up": _each(_as_gradient),
    "relabelled batch": _each(_relabelled),
}


@pytest.mark.parametrize("attack", sorted(RELAY_ATTACKS))
def test_a_stage_relaying_bad_activations_is_evicted_and_honest_stages_keep_their_seats(
        tmp_path, clean, attack):
    # stage 1 (node 1002) answers step 1 honestly, then sends bad activations up; node 1004 is
    # the spare
    summary, grid = _run(RUN, 4, tmp_path, {1002: RELAY_ATTACKS[attack]})
    assert summary["status"] == "completed", summary.get("reason")
    assert grid.attacked[1002] >= 1
    assert [(r["stage"], r["failed_node"], r["spare_node"]) for r in summary["recoveries"]] == [
        (1, 1002, 1004)]
    assert grid.honest_failures == []  # no honest stage ever received the bad bytes
    assert summary["final_eval_loss"] == pytest.approx(clean["zerolock"]["final_eval_loss"],
                                                       rel=1e-6)
    # nothing refused was kept: the server held at most one step's bytes per stage
    assert summary["relay_peak_bytes"] <= RELAY_BOUND


def test_a_hostile_spare_is_evicted_in_turn(tmp_path, clean):
    # stage 1 turns hostile at step 2, and so does the first spare on its first message
    attack = RELAY_ATTACKS["non-finite states"]
    summary, grid = _run(RUN, 5, tmp_path, {1002: attack, 1004: attack}, after=1)
    assert summary["status"] == "completed", summary.get("reason")
    assert [(r["stage"], r["failed_node"], r["spare_node"]) for r in summary["recoveries"]] == [
        (1, 1002, 1004), (1, 1004, 1005)]
    assert grid.honest_failures == []
    assert summary["final_eval_loss"] == pytest.approx(clean["zerolock"]["final_eval_loss"],
                                                       rel=1e-6)


def _short_gradient(kind, mb, tensor, batch):
    return act.encode(kind, mb, tensor[:, :-1], batch)


@pytest.mark.parametrize("attack", ["short gradient", "non-finite gradient", "wrong micro-batch"])
def test_a_last_stage_sending_bad_gradients_down_is_evicted(tmp_path, clean, attack):
    edits = {"short gradient": _each(_short_gradient), "non-finite gradient": _each(_non_finite),
             "wrong micro-batch": _payloads(_swap)}
    config = {**RUN, "pipeline-schedule": "gpipe"}
    # gpipe: the last stage's (node 1003) backward replies carry the gradients for stage 1
    summary, grid = _run(config, 4, tmp_path, {1003: edits[attack]}, after=2)
    assert summary["status"] == "completed", summary.get("reason")
    assert [(r["stage"], r["failed_node"], r["spare_node"]) for r in summary["recoveries"]] == [
        (2, 1003, 1004)]
    assert grid.honest_failures == []
    assert summary["final_eval_loss"] == pytest.approx(clean["gpipe"]["final_eval_loss"],
                                                       rel=1e-6)


# ------------------------------------------------------------------ malformed replies
def _loss_not_a_number(message: Message, reply: Message) -> None:
    reply.content[act.PIPELINE_METRICS] = MetricRecord({"loss": [1.0, 2.0]})


def _no_loss(message: Message, reply: Message) -> None:
    reply.content[act.PIPELINE_METRICS] = MetricRecord({"work_s": 1.0})


def _chunk_undecodable(message: Message, reply: Message) -> None:
    chunk = reply.content.array_records.get(act.CHUNK)
    if chunk is not None:
        reply.content[act.CHUNK] = ArrayRecord({
            name: Array("float32", tuple(array.shape), "numpy.ndarray", b"not an array")
            for name, array in chunk.items()})


def _chunk_missing(message: Message, reply: Message) -> None:
    if act.CHUNK in reply.content.array_records:
        del reply.content[act.CHUNK]


def _status_not_text(message: Message, reply: Message) -> None:
    reply.content[act.PIPELINE] = ConfigRecord({"status": 1, "reason": b"x" * 1_000_000})


MALFORMED: dict[str, Attack] = {
    "a loss that is not a number": _loss_not_a_number,
    "no loss": _no_loss,
    "undecodable chunk": _chunk_undecodable,
    "no chunk in the final reply": _chunk_missing,
    "a status that is not text": _status_not_text,
}


@pytest.mark.parametrize("attack", sorted(MALFORMED))
def test_a_malformed_last_stage_reply_is_a_stage_failure(tmp_path, clean, attack):
    # the last stage (node 1003) answers step 1 honestly, then every reply is malformed
    summary, grid = _run(RUN, 4, tmp_path / "spare", {1003: MALFORMED[attack]})
    assert summary["status"] == "completed", summary.get("reason")
    assert [(r["stage"], r["failed_node"], r["spare_node"]) for r in summary["recoveries"]] == [
        (2, 1003, 1004)]
    assert grid.honest_failures == []
    assert summary["final_eval_loss"] == pytest.approx(clean["zerolock"]["final_eval_loss"],
                                                       rel=1e-6)
    # with no spare the run fails naming the stage, and still writes its summary
    summary, _ = _run({**RUN, "pipeline-stages": 2}, 2, tmp_path / "alone",
                      {1002: MALFORMED[attack]})
    assert summary["status"] == "failed"
    assert "stage 1 (node 1002)" in summary["reason"] and "no spare node" in summary["reason"]
    assert len(summary["reason"]) < 2000


def _bad_checkpoint(message: Message, reply: Message) -> None:
    state = reply.content.array_records.get(act.STAGE_STATE)
    if state is not None:
        tensors = dict(state.to_torch_state_dict())
        name = next(n for n in tensors if n.endswith("exp_avg"))
        tensors[name] = torch.full_like(tensors[name], math.nan)
        reply.content[act.STAGE_STATE] = ArrayRecord(tensors)


def test_a_stage_sending_a_bad_checkpoint_is_evicted_not_the_spare_that_would_load_it(
        tmp_path, clean):
    config = {**RUN, "pipeline-checkpoint-every": 1}
    summary, grid = _run(config, 4, tmp_path, {1002: _bad_checkpoint})
    assert summary["status"] == "completed", summary.get("reason")
    (recovery,) = summary["recoveries"]
    assert (recovery["stage"], recovery["failed_node"], recovery["spare_node"]) == (1, 1002, 1004)
    assert "checkpoint" in recovery["reason"] and recovery["checkpoint_step"] == 1
    assert grid.honest_failures == []
    assert summary["final_eval_loss"] == pytest.approx(clean["zerolock"]["final_eval_loss"],
                                                       rel=1e-6)


# ------------------------------------------------------------------ what the server holds
def test_the_server_holds_at_most_one_step_of_relayed_bytes_per_stage(tmp_path):
    peaks = {}
    for steps in (2, 4):
        summary, _ = _run({**RUN, "num-server-rounds": steps}, 3, tmp_path / str(steps))
        assert summary["status"] == "completed"
        peaks[steps] = summary["relay_peak_bytes"]
        # the replay log (what a spare would need) lives on disk during the run, not after
        assert not (tmp_path / str(steps) / "run" / "pipeline-relay").exists()
    assert 0 < peaks[2] == peaks[4] <= RELAY_BOUND


# ------------------------------------------------------------------ a hostile server
def _stage_message(fields_: dict, records: dict | None = None) -> Message:
    content = RecordDict({act.PIPELINE: ConfigRecord(fields_), **(records or {})})
    return Message(content, dst_node_id=3, message_type="train.pipeline")


def _ask(tmp_path: Path, run: dict, node: dict, message: Message) -> ConfigRecord:
    context = Context(run_id=7, node_id=3, node_config={"cache-dir": str(tmp_path), **node},
                      state=RecordDict(), run_config={**RUN, **run})
    reply = handle(message, context)
    return reply.content.config_records[act.PIPELINE]


@pytest.mark.parametrize(("run", "node", "reason"), [
    ({"lr": 1e30}, {}, "run-config 'lr' = 1e+30 is beyond this node's limit max-lr = 1"),
    ({"batch-size": 8}, {"max-batch-size": 4}, "'batch-size' = 8 is beyond this node's limit "
                                               "max-batch-size = 4"),
    ({"micro-batches": 100_000}, {}, "'micro-batches' = 100000 is beyond this node's limit "
                                     "max-micro-batches"),
    ({"max-seq-len": 100_000}, {}, "'max-seq-len' = 100000 is beyond this node's limit "
                                   "max-row-tokens"),
    ({"weight-decay": 1e30}, {}, "'weight-decay'"),
])
def test_a_stage_refuses_a_run_beyond_the_nodes_limits(tmp_path, run, node, reason):
    status = _ask(tmp_path, run, node, _stage_message(
        {"stage": 0, "kind": "F", "step": 0, "final": False}))
    assert status["status"] == "refused" and reason in str(status["reason"]), status
    assert list(tmp_path.rglob("*.safetensors")) == []  # nothing done, nothing kept


def test_a_stage_refuses_activations_beyond_its_own_limits(tmp_path):
    # stage 0's honest outputs, then stage 1 on a node that takes at most 16 KB of activations
    # a message and 16 tokens a row (the run's max-seq-len is the server's word, not the node's)
    first = handle(_stage_message({"stage": 0, "kind": "F", "step": 0, "final": False}),
                   Context(run_id=7, node_id=2, node_config={"cache-dir": str(tmp_path / "0")},
                           state=RecordDict(), run_config=dict(RUN)))
    relayed = first.content.config_records[act.ACTIVATIONS]
    size = sum(len(v) for v in relayed.values())
    message = _stage_message({"stage": 1, "kind": "F", "step": 0, "final": False},
                             {act.ACTIVATIONS: ConfigRecord(dict(relayed))})
    status = _ask(tmp_path / "1", {}, {"max-activation-mb": 16 / 1024}, message)
    assert status["status"] == "refused", status
    assert f"{size / 2**20:.2f} MB is beyond this node's limit max-activation-mb" in str(
        status["reason"])
    status = _ask(tmp_path / "2", {}, {"max-row-tokens": 16}, message)
    assert status["status"] == "refused" and "max-row-tokens = 16" in str(status["reason"])
    assert list(tmp_path.glob("[12]/**/*.safetensors")) == []


def test_a_hostile_server_trains_nothing_beyond_the_nodes_limits_in_any_round(tmp_path):
    # every node is asked for lr = 1e30: stage 0 and each spare taking it over refuse in turn,
    # the run fails by name and writes its summary; no chunk trained at that rate comes back
    summary, grid = _run({**RUN, "pipeline-stages": 2, "lr": 1e30}, 4, tmp_path)
    assert summary["status"] == "failed"
    assert "max-lr = 1" in summary["reason"] and "no spare node" in summary["reason"]
    assert [node for node, _ in grid.honest_failures] == [1001, 1003, 1004]
    assert all("max-lr" in reason for _, reason in grid.honest_failures)
    # the only model evaluated is the untrained one, and none is saved
    assert summary["final_eval_loss"] == summary["initial_eval_loss"]
    assert summary["rounds_run"] == 0 and not (tmp_path / "run" / "final").exists()


def test_the_pipeline_limits_are_node_config_keys_with_their_defaults():
    from fedcybgd.config import ConfigError, NodeConfig

    node = NodeConfig()
    assert (node.max_micro_batches, node.max_row_tokens, node.max_activation_mb) == (
        256, 8192, 2048.0)
    for key in ("max-micro-batches", "max-row-tokens", "max-activation-mb"):
        with pytest.raises(ConfigError, match=key):
            NodeConfig.from_node_config({key: 0})
