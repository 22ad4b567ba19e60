"""The pipeline runner (``strategy = "pipeline"``): one model split over ``pipeline-stages`` nodes.

The model's decoder layers are cut into K contiguous chunks; the K connected nodes, in node-id
order, are stages 0..K-1 (stage 0 trains on its own data). One server round is one optimizer
step of every stage on one mini-batch of ``micro-batches`` micro-batches. The runner plays
:func:`fedcybgd.strategies.pipeline.plan` with the mini-batch as the unit: a stage's ``F`` or
``B`` of a step is one ``train.pipeline`` message (``fedcybgd.client.pipeline_round``); its
reply carries the step's activations for the next stage (``F``, up) or their gradients for the
stage below (``B``, down), and the runner forwards them in the next message. Messages go out as
soon as their input is there, so under ``zerolock`` stage 0 works on step s + 1 while stage 1
works on step s; under ``gpipe``/``1f1b`` a step's backward must reach a stage before its next
forward (the stage steps on it), so the steps do not overlap.

Every row of ``metrics.jsonl`` is one step: the last stage's loss (under ``zerolock`` its local
objective is the true loss), each stage's seconds, the bytes each way. The last messages'
replies carry the trained chunks; the server puts them into the model and evaluates it (and
the untrained one, round 0), and writes ``summary.json``. A refused or failed message ends
the run ``failed`` with the stage's reason.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_model
from fedcybgd.protocol import activations as act
from fedcybgd.protocol.message_size import message_bytes
from fedcybgd.server.common import Evaluator, require_nodes, resolve_output_dir
from fedcybgd.server.metrics import MetricsWriter, run_status, write_summary
from fedcybgd.server.outputs import prepare_output_dir
from fedcybgd.strategies.pipeline import Op, plan

log = logging.getLogger(__name__)
MESSAGE_TYPE = "train.pipeline"
POLL_S = 0.05


class StageFailed(RuntimeError):
    """A stage refused or failed a message: the text names the stage, the step and why."""


def run_pipeline_server(grid: Grid, run: RunConfig) -> dict[str, Any]:
    """Run pipeline mode (module docstring); returns the summary it writes."""
    started = time.perf_counter()
    out = resolve_output_dir(run.output_dir)
    prepare_output_dir(out, run.resume, run.overwrite, can_resume=False)
    if run.resume:
        raise ConfigError("strategy = \"pipeline\" keeps no checkpoint: resume is not possible")
    count = run.pipeline_stages
    require_nodes(grid, count, 120.0)
    nodes = sorted(grid.get_node_ids())[:count]
    model = load_model(run.model)
    stack = LayerStack(model)
    if count > stack.num_layers:
        raise ConfigError(f"pipeline-stages = {count}: the model has {stack.num_layers} "
                          "decoder layers")
    evaluator = Evaluator(run, stack)
    writer = MetricsWriter(out)
    initial = evaluator()
    writer.write({"round": 0, "eval_loss": initial.loss, "eval_accuracy": initial.accuracy})
    steps = run.num_server_rounds
    ops = [[op for op in stage if op.kind in ("F", "B")] for stage in
           plan(run.pipeline_schedule, count, 1, steps)]
    last_op = [stage[-1] for stage in ops]
    failure = None
    rows: dict[int, dict[str, Any]] = {}
    try:
        chunks = _play(grid, run, nodes, ops, last_op, rows, writer, started)
    except StageFailed as err:
        failure = str(err)
        chunks = {}
    record: dict[str, Any] = {"round": steps}
    if failure is None:
        state = {}
        for tensors in chunks.values():
            state.update(tensors)
        model.load_state_dict(state, strict=False)
        final = evaluator()
        record.update(eval_loss=final.loss, eval_accuracy=final.accuracy)
    summary = {
        "model": run.model, "strategy": "pipeline", "schedule": run.pipeline_schedule,
        "stages": count, "nodes": nodes, "rounds": steps,
        **run_status(failure, writer.records),
        "initial_eval_loss": initial.loss, "initial_eval_accuracy": initial.accuracy,
        "final_eval_loss": record.get("eval_loss"),
        "final_eval_accuracy": record.get("eval_accuracy"),
        "bytes_down": sum(r.get("bytes_down", 0) for r in rows.values()),
        "bytes_up": sum(r.get("bytes_up", 0) for r in rows.values()),
        "wall_s": time.perf_counter() - started, "output_dir": str(out),
        "run_config": run.to_run_config(),
    }
    if failure is None:
        writer.write({**rows.get(steps, {}), **record, "final": True})
    write_summary(out, summary)
    if failure is not None:
        log.error("pipeline run failed: %s", failure)
    return summary


def _play(grid: Grid, run: RunConfig, nodes: list[int], ops: list[list[Op]],
          last_op: list[Op], rows: dict[int, dict[str, Any]], writer: MetricsWriter,
          started: float) -> dict[int, dict[str, torch.Tensor]]:
    """Send every stage its messages as their inputs arrive; the stages' final chunks."""
    count = len(nodes)
    cursor = [0] * count
    busy: dict[str, tuple[int, Op, float]] = {}  # message id -> (stage, op, sent at)
    inbox: dict[tuple[int, str, int], dict[str, bytes]] = {}  # (stage, kind, step) -> input
    chunks: dict[int, dict[str, torch.Tensor]] = {}
    done_steps: dict[int, set[int]] = {}
    while any(cursor[k] < len(ops[k]) for k in range(count)) or busy:
        for k in range(count):
            if cursor[k] >= len(ops[k]) or any(s == k for s, _, _ in busy.values()):
                continue
            op = ops[k][cursor[k]]
            needs = (k > 0 if op.kind == "F" else k < count - 1)
            if needs and (k, op.kind, op.mb) not in inbox:
                continue
            content = RecordDict({act.PIPELINE: ConfigRecord(
                {"stage": k, "kind": op.kind, "step": op.mb, "final": op == last_op[k]})})
            if needs:
                content[act.ACTIVATIONS] = ConfigRecord(inbox.pop((k, op.kind, op.mb)))  # type: ignore[arg-type]
            msg = Message(content, dst_node_id=nodes[k], message_type=MESSAGE_TYPE)
            size = message_bytes(msg)
            (mid,) = grid.push_messages([msg])
            busy[mid] = (k, op, time.perf_counter())
            row = rows.setdefault(op.mb + 1, {"round": op.mb + 1, "bytes_down": 0,
                                              "bytes_up": 0, "stage_s": [0.0] * count})
            row["bytes_down"] += size
            cursor[k] += 1
        replies = list(grid.pull_messages(list(busy)))
        if not replies:
            _check_timeouts(busy, run.round_timeout)
            time.sleep(POLL_S)
            continue
        for reply in replies:
            k, op, sent = busy.pop(reply.metadata.reply_to_message_id)
            row = rows[op.mb + 1]
            row["bytes_up"] += message_bytes(reply)
            _take(reply, k, op, count, inbox, chunks, row, sent)
            done_steps.setdefault(op.mb, set()).add(k)
            if op.mb + 1 not in (r["round"] for r in writer.records) and _step_done(
                    op.mb, ops, cursor, busy, count):
                row["round_s"] = time.perf_counter() - started
                if op.mb + 1 < run.num_server_rounds:
                    writer.write(row)
    return chunks


def _step_done(step: int, ops: list[list[Op]], cursor: list[int],
               busy: dict[str, tuple[int, Op, float]], count: int) -> bool:
    """Whether every stage has finished all its messages of ``step``."""
    for k in range(count):
        pending = [op for op in ops[k][cursor[k]:] if op.mb == step]
        if pending or any(s == k and op.mb == step for s, op, _ in busy.values()):
            return False
    return True


def _check_timeouts(busy: dict[str, tuple[int, Op, float]], timeout: float) -> None:
    now = time.perf_counter()
    for k, op, sent in busy.values():
        if now - sent > timeout:
            raise StageFailed(f"stage {k}: no reply to {op.kind} of step {op.mb + 1} in "
                              f"{timeout:.0f} s (round-timeout)")


def _take(reply: Message, k: int, op: Op, count: int,
          inbox: dict[tuple[int, str, int], dict[str, bytes]],
          chunks: dict[int, dict[str, torch.Tensor]], row: dict[str, Any], sent: float) -> None:
    """Check a stage's reply; route its outputs to the neighbour; keep its metrics."""
    where = f"stage {k}, {op.kind} of step {op.mb + 1}"
    if reply.has_error():
        raise StageFailed(f"{where}: the node failed ({reply.error.reason})")
    status = reply.content.config_records.get(act.PIPELINE)
    if status is None or status.get("status") != "ok":
        reason = str(status.get("reason")) if status is not None else "no status"
        raise StageFailed(f"{where}: refused ({reason})")
    row["stage_s"][k] += time.perf_counter() - sent
    metrics = reply.content.metric_records.get(act.PIPELINE_METRICS)
    if metrics is not None and k == count - 1 and math.isfinite(float(metrics["loss"])):  # type: ignore[arg-type]
        row["train_loss"] = float(metrics["loss"])  # type: ignore[arg-type]
    outputs = reply.content.config_records.get(act.ACTIVATIONS)
    target = k + 1 if op.kind == "F" else k - 1
    if 0 <= target < count:
        if outputs is None:
            raise StageFailed(f"{where}: the reply carries no activations")
        inbox[(target, op.kind, op.mb)] = {key: v for key, v in outputs.items()}  # type: ignore[misc]
    record = reply.content.array_records.get(act.CHUNK)
    if record is not None:
        chunks[k] = dict(record.to_torch_state_dict())
