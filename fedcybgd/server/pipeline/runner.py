"""The pipeline runner (``strategy = "pipeline"``): one model split over ``pipeline-stages`` nodes.

The model's decoder layers are cut into K contiguous chunks; the K connected nodes, in node-id
order, are stages 0..K-1 (stage 0 trains on its own data). One server round is one optimizer
step of every stage on one mini-batch of ``micro-batches`` micro-batches. The runner plays
:func:`fedcybgd.server.pipeline.schedules.plan` with the mini-batch as the unit: a stage's ``F`` or
``B`` of a step is one ``train.pipeline`` message (``fedcybgd.client.pipeline.turn``); its
reply carries the step's activations for the next stage (``F``, up) or their gradients for the
stage below (``B``, down), and the runner forwards them in the next message. Messages go out as
soon as their input is there, so under ``zerolock`` stage 0 works on step s + 1 while stage 1
works on step s; under ``gpipe``/``1f1b`` a step's backward must reach a stage before its next
forward (the stage steps on it), so the steps do not overlap.

Every row of ``metrics.jsonl`` is one step, written (with a progress line) once every stage is
done with it: the last stage's loss (under ``zerolock`` its local objective is the true loss),
each stage's seconds, the step's own seconds (``round_s``), the bytes each way, the stages'
peak memory as they report it. Every ``eval-every`` steps the last message of the step asks
each stage for its chunk as trained so far; the server puts them into its model and evaluates
it, as it does the untrained one (round 0) and the trained one: the last messages' replies
carry the trained chunks. The trained model is saved to ``final/`` (``save_pretrained``, with
a model card), like any run's; ``summary.json`` and the closing table follow.

Failure recovery: a stage whose message fails (the node's error, a refusal, or no reply within
``round-timeout``: a SuperLink answers a vanished node's message with an error once its
heartbeats stop) is taken over by a spare node (a connected node that is not a stage, lowest
id first). The server keeps, per stage, what it sent the stage since the stage's last
checkpoint (every ``pipeline-checkpoint-every`` steps the stage's reply carries its chunk and
AdamW state, kept under ``output-dir/pipeline-checkpoints``; before the first, the pretrained
chunk is the checkpoint). The spare gets the checkpoint (``R``), then those messages again
(their outputs were delivered already and are dropped), then the failed message, whose output
goes on as usual. The other stages go on meanwhile. ``summary.json`` lists every recovery:
the stage, the nodes, the step, the steps replayed (the lost work) and the seconds it took. A
stage 0 spare trains on its own data, so its replayed steps are not the lost ones exactly.
With no spare left, the run ends ``failed`` naming the stage and why.

Hostile stages: every reply passes :mod:`fedcybgd.server.pipeline.replies` before any of it is
used or relayed, so a malformed reply, or activations that are not what the receiving stage
must get, fail their sender (which a spare replaces; a spare that fails while taking over is
replaced by the next) and never reach an honest stage. Bounded memory: a stage is sent its next
forward (backward) only once its neighbour has taken the last one it relayed there, so the
server holds at most one step's relayed bytes per stage (``summary.json``'s
``relay_peak_bytes``), and the inputs kept for replays live on disk
(:mod:`fedcybgd.server.pipeline.replay`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from safetensors.torch import load_file, save_file

from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_model, load_tokenizer
from fedcybgd.protocol import activations as act
from fedcybgd.protocol.message_size import message_bytes
from fedcybgd.protocol.pipeline import stage_layers
from fedcybgd.server.common import (
    Evaluator,
    eval_extras,
    write_samples,
)
from fedcybgd.server.metrics import MetricsWriter, run_status, run_totals, write_summary
from fedcybgd.server.outputs import (
    remove_final,
    write_model_card,
)
from fedcybgd.server.pipeline.replay import ReplayLog
from fedcybgd.server.pipeline.replies import Asked, ReplyReader, StageFailed
from fedcybgd.server.pipeline.schedules import Op, plan
from fedcybgd.server.preflight import checked_task
from fedcybgd.server.report import print_progress
from fedcybgd.server.session import RunSession
from fedcybgd.server.stops import STOPS, UncheckpointedStop, stop_handling, stop_reason
from fedcybgd.tasks.objective import EvalResult

__all__ = ["StageFailed", "run_pipeline_server"]
log = logging.getLogger(__name__)
MESSAGE_TYPE = "train.pipeline"
POLL_S = 0.05


def run_pipeline_server(grid: Grid, run: RunConfig) -> dict[str, Any]:
    """Run pipeline mode (module docstring); returns the summary it writes. A run that fails
    (no spare left for a failed stage) writes its summary, then raises :class:`RunFailed`."""
    if run.resume:
        raise ConfigError("strategy = \"pipeline\" keeps no checkpoint to resume from")
    task = checked_task(run)  # the data before anything else
    count = run.pipeline.stages
    session = RunSession(grid, run, count, can_resume=False, nodes_key="pipeline-stages")
    out, started = session.out, session.started
    model = load_model(run.model)
    stack = LayerStack(model)
    if count > stack.num_layers:
        raise ConfigError(f"pipeline-stages = {count}: the model has {stack.num_layers} "
                          "decoder layers")
    evaluator = Evaluator(run, stack, task=task)
    writer = session.records()
    head = {"model": run.model, "strategy": "pipeline",
            "update_rule": f"pipeline-{run.pipeline.schedule}",
            "schedule": run.pipeline.schedule, "stages": count,
            "rounds": run.num_server_rounds, "run_config": run.to_run_config()}
    stop = UncheckpointedStop(out, head, writer, started)
    with stop_handling(stop.write):
        try:
            summary, failure = _play(grid, run, out, model, evaluator, writer, stop)
        except STOPS as err:
            stop.write(stop_reason(err))
            raise
    return session.finish(summary, failure, writer.records,
                          f"Pipeline-{run.pipeline.schedule}, {run.model}, {count} stages, "
                          f"seed {run.seed}")


def _play(grid: Grid, run: RunConfig, out: Path, model: Any, evaluator: Evaluator,
          writer: MetricsWriter, stop: UncheckpointedStop) -> tuple[dict[str, Any], str | None]:
    """The evaluations, the steps, the final model and the summary; returns the summary and
    the failure, if the run failed."""
    initial, cached = evaluator.initial()
    writer.write({"round": 0, **_eval_fields(initial, cached)})
    write_samples(out, 0, initial)
    latest: list[dict[str, str]] = []  # the latest evaluation's sample answers

    def evaluate(step: int, chunks: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The model with every stage's chunk as of ``step`` (1-based), evaluated."""
        began = time.perf_counter()
        model.load_state_dict(chunks, strict=False)
        result = evaluator()
        write_samples(out, step, result)
        latest[:] = result.samples
        return {**_eval_fields(result), "eval_s": time.perf_counter() - began}

    driver = Driver(grid, run, out, writer, model, evaluate)
    failure = None
    try:
        driver.play()
    except StageFailed as err:
        failure = str(err)
    finally:
        driver.replay.close()
    final_dir = out / "final"
    if failure is None:
        last = run.num_server_rounds
        state: dict[str, torch.Tensor] = {}
        for tensors in driver.chunks.values():
            state.update(tensors)
        row = {**driver.rows.get(last, {"round": last}), **evaluate(last, state), "final": True}
        row["round_s"] = time.perf_counter() - driver.last_close
        writer.write(row)
        print_progress(row, run.num_server_rounds)
        model.save_pretrained(final_dir)
        load_tokenizer(run.model).save_pretrained(final_dir)
    else:
        remove_final(final_dir)  # an earlier attempt's model is not this run's result
    summary = {
        **stop.head, "nodes": driver.first_nodes,
        "rounds_run": max((int(r["round"]) for r in writer.records), default=0),
        **run_totals(writer.records),
        "eval_examples": writer.records[-1].get("eval_examples"),
        "final_samples": list(latest) if failure is None else [],
        "recoveries": driver.recoveries,
        "relay_peak_bytes": driver.relay_peak,
        "wall_s": time.perf_counter() - stop.started, "output_dir": str(out),
        **run_status(failure, writer.records),
    }
    write_summary(out, summary)
    stop.finished = True
    if failure is None:
        write_model_card(final_dir, summary)
    return summary, failure


def _eval_fields(result: EvalResult, cached: bool = False) -> dict[str, Any]:
    """An evaluation as ``metrics.jsonl`` keys."""
    return {"eval_loss": result.loss, "eval_accuracy": result.accuracy,
            "eval_examples": result.examples, **eval_extras(result, cached)}


def own_tensors(model: torch.nn.Module, stages: int) -> list[dict[str, tuple[int, ...]]]:
    """Per stage: the name and shape of every tensor of its chunk, in the order of the stage's
    parameters (its AdamW state's ``adam.<i>`` index)."""
    stack = LayerStack(model)  # type: ignore[arg-type]
    names = {id(p): n for n, p in model.named_parameters()}
    return [{names[id(p)]: tuple(p.shape) for i in range(a, b)
             for p in stack.layers[i].parameters()}
            for a, b in stage_layers(stack.num_layers, stages)]


class Driver:
    """Plays the schedule over the grid (module docstring)."""

    def __init__(self, grid: Grid, run: RunConfig, out: Path, writer: MetricsWriter,
                 model: torch.nn.Module,
                 evaluate: Callable[[int, dict[str, torch.Tensor]], dict[str, Any]]) -> None:
        self.grid, self.run, self.writer, self.evaluate = grid, run, writer, evaluate
        self.last_close = time.perf_counter()  # when the latest step's row was written
        # the steps (0-based) after which the model is evaluated, besides the last
        every = run.evaluation.every
        self.eval_steps = {s for s in range(run.num_server_rounds - 1)
                           if every and (s + 1) % every == 0}
        self.eval_chunks: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # step -> stage
        self.count = run.pipeline.stages
        self.nodes = sorted(grid.get_node_ids())[:self.count]
        self.first_nodes = list(self.nodes)
        self.failed: set[int] = set()
        self.ops = [[op for op in stage if op.kind in ("F", "B")] for stage in
                    plan(run.pipeline.schedule, self.count, 1, run.num_server_rounds)]
        self.cursor = [0] * self.count
        self.busy: dict[str, tuple[int, Op, float]] = {}  # message id -> (stage, op, sent)
        # relayed bytes waiting for their stage: (stage, kind, step) -> checked activations
        self.inbox: dict[tuple[int, str, int], dict[str, bytes]] = {}
        self.relay_peak = 0  # the most bytes the inbox held at once
        self.replay = ReplayLog(out / "pipeline-relay", self.count)  # since the checkpoint
        self.checkpoint_step = [0] * self.count
        self.checkpoints = out / "pipeline-checkpoints"
        self.chunks: dict[int, dict[str, torch.Tensor]] = {}
        self.rows: dict[int, dict[str, Any]] = {}
        self.recoveries: list[dict[str, Any]] = []
        self.own = own_tensors(model, self.count)
        self.reader = ReplyReader(run, model, self.own)

    # -- the schedule ------------------------------------------------------------------------
    def _last_of_step(self, k: int, op: Op) -> bool:
        return not any(o.mb == op.mb for o in self.ops[k][self.ops[k].index(op) + 1:])

    def _asked(self, k: int, op: Op, replay: bool = False) -> Asked:
        """What ``op``'s message asks of stage ``k``'s reply (a replay's output is dropped)."""
        every = self.run.pipeline.checkpoint_every
        last = self._last_of_step(k, op)
        target = k + 1 if op.kind == "F" else k - 1
        return Asked(
            relay=target if 0 <= target < self.count and not replay else None,
            final=op == self.ops[k][-1] and not replay,
            checkpoint=bool(every) and last and (op.mb + 1) % every == 0 and not replay,
            chunk=last and op.mb in self.eval_steps and not replay)

    def _message(self, k: int, op: Op, inputs: dict[str, bytes] | None,
                 replay: bool = False) -> Message:
        asked = self._asked(k, op, replay)
        content = RecordDict({act.PIPELINE: ConfigRecord({
            "stage": k, "kind": op.kind, "step": op.mb, "final": asked.final,
            "checkpoint": asked.checkpoint, "chunk": asked.chunk})})
        if inputs is not None:
            content[act.ACTIVATIONS] = ConfigRecord(dict(inputs))
        return Message(content, dst_node_id=self.nodes[k], message_type=MESSAGE_TYPE)

    def _row(self, step: int) -> dict[str, Any]:
        return self.rows.setdefault(step + 1, {"round": step + 1, "bytes_down": 0,
                                               "bytes_up": 0, "stage_s": [0.0] * self.count,
                                               "client_peak_mem_mb": 0.0})

    def _send(self, k: int, op: Op, inputs: dict[str, bytes] | None) -> None:
        msg = self._message(k, op, inputs)
        self._row(op.mb)["bytes_down"] += message_bytes(msg)
        self.replay.add(k, op, inputs)
        (mid,) = self.grid.push_messages([msg])
        self.busy[mid] = (k, op, time.perf_counter())

    def _ready(self, k: int) -> Op | None:
        """Stage ``k``'s next operation if it can be sent now: the stage is free, its input is
        there, and the stage its output goes to has taken the last one relayed to it (so the
        server holds at most one step's relayed bytes per stage)."""
        if self.cursor[k] >= len(self.ops[k]) or any(s == k for s, _, _ in self.busy.values()):
            return None
        op = self.ops[k][self.cursor[k]]
        needs = k > 0 if op.kind == "F" else k < self.count - 1
        if needs and (k, op.kind, op.mb) not in self.inbox:
            return None
        target = k + 1 if op.kind == "F" else k - 1
        if any(t == target and kind == op.kind for t, kind, _ in self.inbox):
            return None
        return op

    def play(self) -> None:
        """Every stage's messages, each sent as soon as its input is there and its stage free."""
        while any(c < len(o) for c, o in zip(self.cursor, self.ops, strict=True)) or self.busy:
            for k in range(self.count):
                op = self._ready(k)
                if op is None:
                    continue
                needs = k > 0 if op.kind == "F" else k < self.count - 1
                self._send(k, op, self.inbox.pop((k, op.kind, op.mb)) if needs else None)
                self.cursor[k] += 1
            replies = list(self.grid.pull_messages(list(self.busy)))
            if not replies:
                self._check_timeouts()
                time.sleep(POLL_S)
                continue
            for reply in replies:
                entry = self.busy.pop(reply.metadata.reply_to_message_id, None)
                if entry is None:  # not a reply to a message in flight: nothing to take
                    log.warning("pipeline: ignored a reply to message %s, not in flight",
                                reply.metadata.reply_to_message_id)
                    continue
                k, op, sent = entry
                try:
                    self._take(reply, k, op, sent)
                except StageFailed as err:
                    self._recover(k, op, str(err))
                    continue
                self._close_step(op.mb)

    def _close_step(self, step: int) -> None:
        """Write the row of ``step`` once every stage is done with it (not the last: the
        runner writes it with the final evaluation)."""
        if step + 1 >= self.run.num_server_rounds or self.writer.has_round(step + 1):
            return
        for k in range(self.count):
            if any(op.mb == step for op in self.ops[k][self.cursor[k]:]) or any(
                    s == k and op.mb == step for s, op, _ in self.busy.values()):
                return
        row = self._row(step)
        if step in self.eval_steps:
            chunks = self.eval_chunks.pop(step)
            row.update(self.evaluate(step + 1, {n: t for k in sorted(chunks)
                                                for n, t in chunks[k].items()}))
        now = time.perf_counter()
        row["round_s"] = now - self.last_close  # this step's, its evaluation included
        self.last_close = now
        self.writer.write(row)
        print_progress(row, self.run.num_server_rounds)
        self.reader.forget(step)

    def _check_timeouts(self) -> None:
        now = time.perf_counter()
        for mid, (k, op, sent) in list(self.busy.items()):
            if now - sent > self.run.round_timeout:
                del self.busy[mid]
                self._recover(k, op, f"stage {k}: no reply to {op.kind} of step {op.mb + 1} "
                                     f"in {self.run.round_timeout:g} s (round-timeout)")

    # -- replies -----------------------------------------------------------------------------
    def _take(self, reply: Message, k: int, op: Op, sent: float) -> None:
        """Check a stage's reply (:mod:`fedcybgd.server.pipeline.replies`); route its outputs
        to the neighbour; keep what it carries."""
        asked = self._asked(k, op)
        got = self.reader.read(reply, k, self.nodes[k], op, asked)
        row = self._row(op.mb)
        row["bytes_up"] += message_bytes(reply)
        row["stage_s"][k] += time.perf_counter() - sent
        if got.peak_mem_mb is not None:
            row["client_peak_mem_mb"] = max(row["client_peak_mem_mb"], got.peak_mem_mb)
        if k == self.count - 1 and math.isfinite(got.loss):
            row["train_loss"] = got.loss
        if asked.relay is not None:
            assert got.outputs is not None
            self.inbox[(asked.relay, op.kind, op.mb)] = got.outputs
            held = sum(len(v) for entry in self.inbox.values() for v in entry.values())
            self.relay_peak = max(self.relay_peak, held)
        if got.chunk is not None and asked.final:
            self.chunks[k] = got.chunk
        elif got.chunk is not None:  # for the evaluation after this step
            self.eval_chunks.setdefault(op.mb, {})[k] = got.chunk
        if got.state is not None:
            self._keep_checkpoint(k, op, got.state)

    def _keep_checkpoint(self, k: int, op: Op, state: dict[str, torch.Tensor]) -> None:
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        path = self.checkpoints / f"stage-{k}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file(state, str(tmp), metadata={"step": str(op.mb + 1)})
        tmp.replace(path)
        self.checkpoint_step[k] = op.mb + 1
        self.replay.checkpoint(k, op.mb)

    # -- recovery ----------------------------------------------------------------------------
    def _spare(self) -> int | None:
        in_use = set(self.nodes) | self.failed
        free = sorted(n for n in self.grid.get_node_ids() if n not in in_use)
        return free[0] if free else None

    def _recover(self, k: int, op: Op, reason: str) -> None:
        """Move stage ``k`` to a spare node (module docstring), the next spare if one fails
        while taking over; ``StageFailed`` when none is left."""
        redo = self.replay.ops(k)
        assert redo and redo[-1] == op  # the failed message was the stage's latest
        while True:
            began = time.perf_counter()
            failed_node = self.nodes[k]
            self.failed.add(failed_node)
            spare = self._spare()
            if spare is None:
                raise StageFailed(f"{reason}; no spare node to take stage {k} over")
            log.warning("%s; stage %d moves to node %d from the checkpoint of step %d", reason,
                        k, spare, self.checkpoint_step[k])
            self.nodes[k] = spare
            record = {"stage": k, "failed_node": failed_node, "spare_node": spare,
                      "step": op.mb + 1, "checkpoint_step": self.checkpoint_step[k],
                      "replayed": len(redo) - 1, "reason": reason}
            try:
                self._take_over(k, redo[:-1])
            except StageFailed as err:  # the spare failed too: the next one takes over
                self.recoveries.append({**record, "recovery_s": time.perf_counter() - began,
                                        "spare_failed": str(err)})
                reason = str(err)
                continue
            _, inputs = self.replay.pop(k)
            self._send(k, op, inputs)  # this one's output goes on as usual
            self.recoveries.append({**record, "recovery_s": time.perf_counter() - began})
            return

    def _take_over(self, k: int, replays: list[Op]) -> None:
        """Restore stage ``k`` on its (new) node from its checkpoint, then replay ``replays``
        (their outputs went on already and are dropped)."""
        restore = RecordDict({act.PIPELINE: ConfigRecord(
            {"stage": k, "kind": "R", "step": self.checkpoint_step[k], "final": False,
             "checkpoint": False})})
        path = self.checkpoints / f"stage-{k}.safetensors"
        if self.checkpoint_step[k] and path.exists():
            restore[act.STAGE_STATE] = ArrayRecord(load_file(str(path)))
        self._call(k, Message(restore, dst_node_id=self.nodes[k], message_type=MESSAGE_TYPE),
                   Op("R", self.checkpoint_step[k]))
        for op in replays:
            inputs = self.replay.inputs(k, op)
            self._call(k, self._message(k, op, inputs, replay=True), op)

    def _call(self, k: int, msg: Message, op: Op) -> None:
        """Send ``msg`` and wait for its reply, checked (its outputs are dropped);
        ``StageFailed`` if it fails or none comes in time."""
        (mid,) = self.grid.push_messages([msg])
        deadline = time.perf_counter() + self.run.round_timeout
        while time.perf_counter() < deadline:
            for reply in self.grid.pull_messages([mid]):
                self.reader.read(reply, k, self.nodes[k], op,
                                 Asked(None, final=False, checkpoint=False, replay=True))
                return
            time.sleep(POLL_S)
        raise StageFailed(f"stage {k} (node {self.nodes[k]}): no reply to {op.kind} of step "
                          f"{op.mb + 1} while recovering, in {self.run.round_timeout:g} s")
