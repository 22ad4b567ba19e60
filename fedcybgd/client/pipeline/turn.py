"""A node's turn as a pipeline stage (``strategy = "pipeline"``): one ``train.pipeline`` message.

The server's instruction (``fedcybgd.protocol.activations.PIPELINE``) names the stage, the kind
of work and the step; the run config (the node reads its own) names the model, the cut, the
schedule, the micro-batches and AdamW's rate. One message is one mini-batch's work of the
stage (``micro-batches`` micro-batches):

* ``F``: the chunk's forward on each micro-batch (stage 0 from its own data, the others from
  the states the message carries), ZeroLock's local update and step right after; the reply
  carries the outputs for the next stage.
* ``B`` (``gpipe``/``1f1b``): the stage recomputes each micro-batch's forward from what it kept
  of the ``F`` message (stage 0: its data again), backpropagates the gradient the message
  carries (the last stage: its loss), steps, and replies with the gradients for the stage
  below. Flower runs a fresh ClientApp process for every message, so nothing of a forward's
  graph survives to its backward: this is GPipe with re-materialization.

Between messages the stage keeps its chunk, AdamW's state and the ``F`` inputs a backward
will need under the node's cache folder (``pipeline/run-<id>/stage-<k>``), removed after the
stage's last message (``final``), whose reply carries the trained chunk; a checkpoint
(``checkpoint``) reply carries the chunk and AdamW's state, an evaluation's (``chunk``) the
chunk as trained so far. Every reply reports the node's peak resident memory during the
message (``peak_mem_mb``). Every value the server sends is
checked, and every message passes the node's own limits (:mod:`fedcybgd.client.limits`: those
of a training round, the micro-batches, the tokens of a row and the activations' bytes),
whatever the run config asks: a bad value or one beyond a limit gets a ``refused`` reply naming
it and changes nothing.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from safetensors.torch import load_file, save_file

from fedcybgd.client import limits
from fedcybgd.client.limits import Refusal
from fedcybgd.client.pipeline.stage import BACKPROP, Stage, StageConfig
from fedcybgd.client.run_state import run_state
from fedcybgd.config import NodeConfig, RunConfig
from fedcybgd.core.atomic import make_dirs
from fedcybgd.core.measure import PeakMemory
from fedcybgd.data.prompts import Batch
from fedcybgd.model.loading import cache_root, load_model
from fedcybgd.protocol import activations as act
from fedcybgd.tasks.base import Task

log = logging.getLogger(__name__)

STATUS_OK = "ok"
STATUS_REFUSED = "refused"


@dataclass(frozen=True)
class StageInstruction:
    """A checked ``train.pipeline`` instruction."""

    stage: int
    kind: str  # "F", "B", or "R": take this stage over from the state the message carries
    step: int
    final: bool  # reply with the trained chunk
    checkpoint: bool = False  # reply with the stage's state (chunk and AdamW's)
    chunk: bool = False  # reply with the chunk as trained so far (the server evaluates it)


def read_instruction(record: ConfigRecord | None, run: RunConfig) -> StageInstruction:
    """The instruction, every field checked against the run config (:class:`Refusal`)."""
    if record is None:
        raise Refusal(f"no '{act.PIPELINE}' record in the message")
    values = dict(record)
    stage, kind, step, final = (values.get(k) for k in ("stage", "kind", "step", "final"))
    checkpoint = values.get("checkpoint", False)
    chunk = values.get("chunk", False)
    if not isinstance(stage, int) or isinstance(stage, bool) or not (
            0 <= stage < run.pipeline.stages):
        raise Refusal(f"instruction field 'stage' = {stage!r}: not in 0.."
                      f"{run.pipeline.stages - 1}")
    if kind not in ("F", "B", "R"):
        raise Refusal(f"instruction field 'kind' = {kind!r}: must be 'F', 'B' or 'R'")
    if kind == "B" and run.pipeline.schedule not in BACKPROP:
        raise Refusal(f"instruction field 'kind' = 'B': schedule {run.pipeline.schedule!r} "
                      "has no backward")
    if not isinstance(step, int) or isinstance(step, bool) or not (
            0 <= step < run.num_server_rounds):
        raise Refusal(f"instruction field 'step' = {step!r}: not in 0.."
                      f"{run.num_server_rounds - 1} (num-server-rounds)")
    for name, flag in (("final", final), ("checkpoint", checkpoint), ("chunk", chunk)):
        if not isinstance(flag, bool):
            raise Refusal(f"instruction field {name!r} = {flag!r}: must be true or false")
    assert isinstance(final, bool) and isinstance(checkpoint, bool) and isinstance(chunk, bool)
    return StageInstruction(stage, kind, step, final, checkpoint, chunk)


def stage_dir(node: NodeConfig, run_id: int, stage: int) -> Path:
    """Where this node keeps stage ``stage`` of run ``run_id`` between messages."""
    root = Path(node.cache_dir) if node.cache_dir else cache_root()
    return root / "pipeline" / f"run-{int(run_id)}" / f"stage-{int(stage)}"


def _reply(msg: Message, status: str, reason: str = "",
           outputs: dict[str, bytes] | None = None, metrics: dict[str, float] | None = None,
           chunk: dict[str, torch.Tensor] | None = None,
           state: dict[str, torch.Tensor] | None = None) -> Message:
    content = RecordDict({act.PIPELINE: ConfigRecord({"status": status, "reason": reason})})
    if outputs is not None:
        content[act.ACTIVATIONS] = ConfigRecord(dict(outputs))
    if metrics is not None:
        content[act.PIPELINE_METRICS] = MetricRecord(dict(metrics))
    if chunk is not None:
        content[act.CHUNK] = ArrayRecord(chunk)  # a torch state dict
    if state is not None:
        content[act.STAGE_STATE] = ArrayRecord(state)
    return Message(content, reply_to=msg)


def handle(msg: Message, context: Context) -> Message:
    """Do one stage message (module docstring); a ``refused`` reply names a bad input or a
    value beyond one of the node's limits."""
    run = RunConfig.from_run_config(context.run_config)
    node = NodeConfig.from_node_config(context.node_config)
    try:
        ins = read_instruction(msg.content.config_records.get(act.PIPELINE), run)
        check_limits(msg, run, node)
        with PeakMemory() as mem:
            return _work(msg, context, run, node, ins, mem)
    except (Refusal, act.ActivationError) as err:
        log.warning("pipeline: refused a message (%s)", err)
        return _reply(msg, STATUS_REFUSED, str(err))


def check_limits(msg: Message, run: RunConfig, node: NodeConfig) -> None:
    """The message's work against the node's own limits, before any is done: a training
    round's (:func:`fedcybgd.client.limits.check_training`: learning rate, batch size), the
    pipeline's (micro-batches, tokens of a row, weight decay) and the bytes of the activations
    and of a restored state it carries, read from their sizes alone."""
    limits.check_training(run, node)
    limits.check_pipeline(run, node)
    record = msg.content.config_records.get(act.ACTIVATIONS)
    if record is not None:
        sizes = [len(v) if isinstance(v, bytes) else -1 for v in record.values()]
        if -1 in sizes:
            raise Refusal(f"'{act.ACTIVATIONS}' holds a value that is not bytes")
        limits.check_activation_bytes(sum(sizes), node)
    state = msg.content.array_records.get(act.STAGE_STATE)
    if state is not None:
        limits.check_download_bytes({act.STAGE_STATE: state}, node)


def _work(msg: Message, context: Context, run: RunConfig, node: NodeConfig,
          ins: StageInstruction, mem: PeakMemory) -> Message:
    started = time.perf_counter()
    task = run_state(context, run).task
    model = load_model(run.model)
    hidden, vocab = int(model.config.hidden_size), int(model.config.vocab_size)
    stage = Stage(model, StageConfig(ins.stage, run.pipeline.stages, run.pipeline.schedule,
                                     run.lr, run.weight_decay, run.pipeline.aux_layers), task)
    folder = stage_dir(node, context.run_id, ins.stage)
    make_dirs(folder)
    state_file = folder / "stage.safetensors"
    if ins.kind == "R":
        return _restore(msg, stage, folder, state_file)
    if state_file.exists():
        stage.load_state(load_file(str(state_file)))
    loaded_s = time.perf_counter() - started
    m = run.pipeline.micro_batches
    mbs = list(range(ins.step * m, (ins.step + 1) * m))
    inputs = _inputs(msg, run, node, stage, ins, mbs, folder, hidden, vocab, task)
    outputs: dict[str, bytes] = {}
    work = time.perf_counter()
    if ins.kind == "F":
        for mb in mbs:
            batch, states = inputs[mb]
            out = stage.forward(mb, batch, states)
            if run.pipeline.schedule in BACKPROP:
                stage.drop(mb)  # recomputed for the backward (module docstring)
            else:
                stage.local_update(mb)
            if not stage.last:
                outputs[f"mb.{mb}"] = act.encode("F", mb, out, batch, run.pipeline.activations)
        if run.pipeline.schedule not in BACKPROP:
            stage.step()
    else:
        grads = {} if stage.last else _decoded(msg, "B", mbs, hidden, vocab, task, run)
        for mb in reversed(mbs):
            batch, states = inputs[mb]
            stage.forward(mb, batch, states)
            back = stage.backward(mb, None if stage.last else grads[mb][0])
            if back is not None:
                outputs[f"mb.{mb}"] = act.encode("B", mb, back, None, run.pipeline.activations)
        stage.step()
        for mb in mbs:
            (folder / f"input-{mb}.bin").unlink(missing_ok=True)
    work_s = time.perf_counter() - work
    if ins.final:  # the stage's last message: nothing of it stays on the node
        shutil.rmtree(folder, ignore_errors=True)
    else:
        tmp = folder / "stage.safetensors.tmp"
        save_file(stage.state(), str(tmp))
        tmp.replace(state_file)
    losses = [v for mb, v in stage.losses]
    metrics = {"loss": sum(losses) / len(losses) if losses else math.nan,
               "load_s": loaded_s, "work_s": work_s,
               "total_s": time.perf_counter() - started,
               "bytes_out": float(sum(len(v) for v in outputs.values())),
               "peak_mem_mb": mem.peak_mb}
    return _reply(msg, STATUS_OK, "", outputs, metrics,
                  stage.chunk_state() if ins.final or ins.chunk else None,
                  stage.state() if ins.checkpoint else None)


def _restore(msg: Message, stage: Stage, folder: Path, state_file: Path) -> Message:
    """``R``: this node becomes the stage, from the state the message carries (a checkpoint
    the server kept) or, without one, from the pretrained chunk with a fresh AdamW. What the
    node held of the stage before is dropped."""
    record = msg.content.array_records.get(act.STAGE_STATE)
    if record is not None:
        try:
            tensors = dict(record.to_torch_state_dict())
        except (ValueError, TypeError) as err:
            raise Refusal(f"'{act.STAGE_STATE}' is not a set of tensors: {err}") from err
        try:
            stage.load_state(tensors)
        except ValueError as err:
            raise Refusal(str(err)) from err
    for stale in folder.glob("input-*.bin"):
        stale.unlink()
    tmp = folder / "stage.safetensors.tmp"
    save_file(stage.state(), str(tmp))
    tmp.replace(state_file)
    return _reply(msg, STATUS_OK, "", {}, {"loss": math.nan})


def _decoded(msg: Message, kind: str, mbs: list[int], hidden: int, vocab: int, task: Task,
             run: RunConfig) -> dict[int, tuple[torch.Tensor, Batch | None]]:
    """The message's ``kind`` entries for ``mbs``, decoded and checked: at most ``batch-size``
    rows of ``max-seq-len`` tokens each (:func:`check_limits` has held both to the node's own
    limits), token ids in the model's vocabulary."""
    record = msg.content.config_records.get(act.ACTIVATIONS)
    if record is None:
        raise Refusal(f"no '{act.ACTIVATIONS}' record in a {kind} message")
    want = {f"mb.{mb}" for mb in mbs}
    if set(record) != want:
        raise Refusal(f"'{act.ACTIVATIONS}' holds {sorted(record)[:4]}, expected "
                      f"{sorted(want)[:4]}")
    out = {}
    for mb in mbs:
        data = record[f"mb.{mb}"]
        if not isinstance(data, bytes):
            raise Refusal(f"'{act.ACTIVATIONS}' entry mb.{mb} is not bytes")
        got_kind, got_mb, tensor, batch = act.decode(data, hidden, act_limit(run, hidden), task,
                                                     vocab)
        if (got_kind, got_mb) != (kind, mb):
            raise Refusal(f"entry mb.{mb} holds {got_kind}{got_mb}")
        if tensor.shape[0] > run.batch_size or tensor.shape[1] > run.max_seq_len:
            raise Refusal(f"entry mb.{mb} has shape {tuple(tensor.shape)}: more than "
                          f"batch-size = {run.batch_size} rows of max-seq-len = "
                          f"{run.max_seq_len} tokens")
        out[mb] = (tensor, batch)
    return out


def act_limit(run: RunConfig, hidden: int) -> int:
    """The most bytes one micro-batch's message may take (:func:`fedcybgd.protocol.activations
    .max_bytes`): ``batch-size x max-seq-len`` tokens of the model's ``hidden`` size."""
    return act.max_bytes(run.batch_size, run.max_seq_len, hidden)


def _inputs(msg: Message, run: RunConfig, node: NodeConfig, stage: Stage,
            ins: StageInstruction, mbs: list[int], folder: Path, hidden: int, vocab: int,
            task: Task) -> dict[int, tuple[Batch, torch.Tensor | None]]:
    """Each micro-batch's ``(batch, states)``: stage 0 from its own data (the same batches for
    a step's ``F`` and ``B``), the others from the ``F`` message, kept on disk for ``B``."""
    if stage.first:
        from fedcybgd.client.local_data import training_batches

        batches = training_batches(run, node, run.seed, task=task)
        batches.step = mbs[0]  # the n-th batch without drawing the n before it
        return {mb: (next(batches), None) for mb in mbs}
    if ins.kind == "F":
        record = msg.content.config_records.get(act.ACTIVATIONS)
        decoded = _decoded(msg, "F", mbs, hidden, vocab, task, run)
        if run.pipeline.schedule in BACKPROP:  # kept for the backward's recomputation
            assert record is not None
            for mb in mbs:
                data = record[f"mb.{mb}"]
                assert isinstance(data, bytes)
                (folder / f"input-{mb}.bin").write_bytes(data)
        out: dict[int, tuple[Batch, torch.Tensor | None]] = {}
        for mb, (states, batch) in decoded.items():
            assert batch is not None  # an F message's entries carry their batch
            out[mb] = (batch, states)
        return out
    kept: dict[int, tuple[Batch, torch.Tensor | None]] = {}
    for mb in mbs:
        path = folder / f"input-{mb}.bin"
        if not path.exists():
            raise Refusal(f"a backward of micro-batch {mb} before its forward on this node")
        _, _, states, batch = act.decode(path.read_bytes(), hidden, act_limit(run, hidden), task,
                                         vocab)
        assert batch is not None
        kept[mb] = (batch, states)
    return kept
