"""The gate for pipeline stages' replies: every field read before the runner uses or relays it.

A stage is another party's device, so its reply is untrusted. :meth:`ReplyReader.read` checks
the status, the loss, which records the reply carries (a trained chunk only when the message
was the stage's last, a checkpoint only when one was asked), and every record's content:

* **Relayed activations** (``F`` up, ``B`` down) are decoded here, before the server keeps or
  forwards them: exactly the step's micro-batches, each at most
  :func:`fedcybgd.protocol.activations.max_bytes` of the run's ``batch-size x max-seq-len``
  tokens of the model's hidden size, of the kind and micro-batch its key names, at most
  ``batch-size`` rows of ``max-seq-len`` tokens, finite, token ids in the vocabulary. A forward
  from stage k > 0 carries the very batch stage 0 sent up (same tensors, by digest) and states
  of its shape; a gradient the shape of the states it answers. So a bad payload fails its
  sender, and the stage that would have received it never sees it.
* **A trained chunk** is exactly the stage's own layers' tensors, in their dtype and shape
  (checked from the arrays' headers before any is decoded), finite.
* **A checkpoint** (chunk and AdamW state) is what a spare can load: the chunk's tensors, AdamW
  moments of the parameters' shapes (second moments not negative) and step counts between 1
  and the step, finite.

Anything wrong, whatever exception reading it raises, is a :class:`StageFailed` naming the
stage, its node, the message and what is wrong (the node's own text cut to
:data:`REASON_CHARS`); the runner moves the stage to a spare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message

from fedcybgd.config import RunConfig
from fedcybgd.protocol import activations as act
from fedcybgd.server.pipeline.schedules import Op

REASON_CHARS = 300  # of a node's own text (a refusal's reason, an error) in a failure's
LOSS_CEILING = 1e15  # a loss above this is nonsense
PEAK_MEM_CEILING_MB = float(2**30)  # MiB: a peak above a petabyte is nonsense
ADAM_FIELDS = ("step", "exp_avg", "exp_avg_sq")


class StageFailed(RuntimeError):
    """A stage refused or failed a message, or its reply is malformed: the text names the
    stage, the step and why."""


def clipped(text: object) -> str:
    """A node's text, as text, at most :data:`REASON_CHARS` characters."""
    text = text if isinstance(text, str) else repr(text)[:REASON_CHARS]
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS] + "..."


@dataclass(frozen=True)
class Asked:
    """What the message asked of the stage's reply."""

    relay: int | None  # the stage its activations go to (None: none travel on)
    final: bool  # the trained chunk
    checkpoint: bool  # the stage's state
    replay: bool = False  # a replay or restore on a spare: its outputs are dropped unread
    chunk: bool = False  # the chunk as trained so far, for an evaluation

    @property
    def wants_chunk(self) -> bool:
        """Whether the reply must carry the stage's chunk."""
        return self.final or self.chunk


@dataclass
class StageReply:
    """A checked reply."""

    loss: float  # the stage's mean loss of the message (NaN: none)
    outputs: dict[str, bytes] | None  # checked activations for ``Asked.relay``
    chunk: dict[str, torch.Tensor] | None
    state: dict[str, torch.Tensor] | None
    peak_mem_mb: float | None = None  # the node's peak RSS during the message, as it says


@dataclass(frozen=True)
class SentBatch:
    """What the server knows of a micro-batch from stage 0's forward: its batch's digest, its
    rows and tokens."""

    digest: str
    rows: int
    tokens: int


class ReplyReader:
    """Reads the stages' replies for one run (module docstring).

    Parameters
    ----------
    run : RunConfig
        The server's run config (``batch-size``, ``max-seq-len``, ``micro-batches``).
    model : torch.nn.Module
        The server's model: hidden size, vocabulary, the stages' tensors.
    own : list of dict
        Per stage, its chunk's tensors: name -> shape, in the stage's parameter order.
    """

    def __init__(self, run: RunConfig, model: torch.nn.Module,
                 own: list[dict[str, tuple[int, ...]]]) -> None:
        self.run = run
        config: Any = model.config
        self.hidden, self.vocab = int(config.hidden_size), int(config.vocab_size)
        self.own = own
        self.dtype = next(model.parameters()).dtype
        self.per_mb = act.max_bytes(run.batch_size, run.max_seq_len, self.hidden)
        self.batches: dict[int, SentBatch] = {}  # micro-batch -> stage 0's batch

    def forget(self, step: int) -> None:
        """Drop what is kept of ``step``'s micro-batches (every stage is done with it)."""
        m = self.run.pipeline.micro_batches
        for mb in range(step * m, (step + 1) * m):
            self.batches.pop(mb, None)

    def read(self, reply: Message, k: int, node: int, op: Op, asked: Asked) -> StageReply:
        """The checked reply of stage ``k`` (on ``node``) to ``op``; :class:`StageFailed`
        naming what is wrong."""
        what = (f"restore from the checkpoint of step {op.mb}" if op.kind == "R" else
                f"{op.kind} of step {op.mb + 1}")
        where = f"stage {k} (node {node}), {what}"
        try:
            return self._read(reply, k, node, op, asked, where)
        except StageFailed:
            raise
        except Exception as err:  # untrusted input: whatever reading it raises fails the stage
            raise StageFailed(f"{where}: unreadable reply ({type(err).__name__}: "
                              f"{clipped(str(err))})") from err

    def _read(self, reply: Message, k: int, node: int, op: Op, asked: Asked,
              where: str) -> StageReply:
        if reply.has_error():
            raise StageFailed(f"{where}: the node failed ({clipped(reply.error.reason)})")
        if reply.metadata.src_node_id != node:
            raise StageFailed(f"{where}: the reply comes from node {reply.metadata.src_node_id}")
        status = reply.content.config_records.get(act.PIPELINE)
        if status is None:
            raise StageFailed(f"{where}: the reply has no '{act.PIPELINE}' status")
        if status.get("status") != "ok":
            raise StageFailed(f"{where}: refused ({clipped(status.get('reason'))})")
        loss = self._loss(reply, where)
        outputs = self._outputs(reply, k, op, asked, where)
        chunk = state = None
        arrays = reply.content.array_records
        allowed = {name for name, wanted in ((act.CHUNK, asked.wants_chunk),
                                             (act.STAGE_STATE, asked.checkpoint)) if wanted}
        unasked = sorted(set(arrays) - allowed)
        if unasked:
            raise StageFailed(f"{where}: the reply carries {unasked}, not asked for")
        if asked.wants_chunk:
            chunk = self._chunk(arrays.get(act.CHUNK), k, where)
        if asked.checkpoint:
            state = self._state(arrays.get(act.STAGE_STATE), k, op, where)
        return StageReply(loss, outputs, chunk, state, self._peak(reply, where))

    # -- fields --------------------------------------------------------------------------------
    def _loss(self, reply: Message, where: str) -> float:
        metrics = reply.content.metric_records.get(act.PIPELINE_METRICS)
        loss = None if metrics is None else metrics.get("loss")
        if not isinstance(loss, (int, float)) or isinstance(loss, bool):
            raise StageFailed(f"{where}: the reply's loss is {clipped(loss)}, not a number")
        loss = float(loss)
        if not math.isnan(loss) and not abs(loss) <= LOSS_CEILING:
            raise StageFailed(f"{where}: the reply's loss {loss} is out of range")
        return loss

    @staticmethod
    def _peak(reply: Message, where: str) -> float | None:
        """The node's peak memory as it reports it (only shown: a node could not report
        one); a value that is not a plausible size of memory fails the stage."""
        metrics = reply.content.metric_records.get(act.PIPELINE_METRICS)
        peak = None if metrics is None else metrics.get("peak_mem_mb")
        if peak is None:
            return None
        if not isinstance(peak, (int, float)) or isinstance(peak, bool) or not (
                0 <= peak <= PEAK_MEM_CEILING_MB):
            raise StageFailed(f"{where}: the reply's peak_mem_mb is {clipped(peak)}, not a "
                              f"size of memory (0..{PEAK_MEM_CEILING_MB:g} MiB)")
        return float(peak)

    def _outputs(self, reply: Message, k: int, op: Op, asked: Asked,
                 where: str) -> dict[str, bytes] | None:
        record = reply.content.config_records.get(act.ACTIVATIONS)
        if asked.replay:
            return None
        if asked.relay is None:
            if record:
                raise StageFailed(f"{where}: the reply carries activations where none travel on")
            return None
        m = self.run.pipeline.micro_batches
        mbs = range(op.mb * m, (op.mb + 1) * m)
        want = {f"mb.{mb}" for mb in mbs}
        if record is None or set(record) != want:
            got = "none" if record is None else clipped(sorted(record)[:4])
            raise StageFailed(f"{where}: the reply's activations are {got}, expected "
                              f"{sorted(want)[:4]}")
        outputs: dict[str, bytes] = {}
        for mb in mbs:
            data = record[f"mb.{mb}"]
            if not isinstance(data, bytes):
                raise StageFailed(f"{where}: activations mb.{mb} are not bytes")
            try:
                self._check_payload(data, k, op, mb)
            except act.ActivationError as err:
                raise StageFailed(f"{where}: activations mb.{mb} refused: {err}") from err
            outputs[f"mb.{mb}"] = data
        return outputs

    def _check_payload(self, data: bytes, k: int, op: Op, mb: int) -> None:
        """One micro-batch's relayed bytes (module docstring); :class:`ActivationError`."""
        kind, got_mb, tensor, batch = act.decode(data, self.hidden, self.per_mb, None,
                                                 self.vocab)
        if (kind, got_mb) != (op.kind, mb):
            raise act.ActivationError(f"it holds {kind} of micro-batch {got_mb}")
        rows, tokens = int(tensor.shape[0]), int(tensor.shape[1])
        if rows > self.run.batch_size or tokens > self.run.max_seq_len:
            raise act.ActivationError(
                f"shape {tuple(tensor.shape)}: more than batch-size = {self.run.batch_size} "
                f"rows of max-seq-len = {self.run.max_seq_len} tokens")
        sent = self.batches.get(mb)
        if kind == "F":
            assert batch is not None
            digest = act.batch_digest(batch)
            if k == 0:  # stage 0 holds the data: its batch is the micro-batch's
                self.batches[mb] = SentBatch(digest, rows, tokens)
                return
            if sent is None or digest != sent.digest:
                raise act.ActivationError("its batch is not the one stage 0 sent (token ids, "
                                          "mask or targets changed)")
        if sent is not None and (rows, tokens) != (sent.rows, sent.tokens):
            raise act.ActivationError(f"shape {tuple(tensor.shape)}, the micro-batch is "
                                      f"[{sent.rows}, {sent.tokens}, {self.hidden}]")

    def _arrays(self, record: ArrayRecord | None, shapes: dict[str, tuple[int, ...]],
                what: str, where: str, required: set[str]) -> dict[str, torch.Tensor]:
        """``record``'s tensors: names among ``shapes`` (those in ``required`` all present),
        each in the model's dtype and its shape, checked from the arrays' headers before any is
        decoded, then decoded (never unpickled) and checked again, finite."""
        if record is None:
            raise StageFailed(f"{where}: the reply carries no {what}")
        names = set(record)
        if not names <= set(shapes) or not required <= names:
            extra = clipped(sorted(names - set(shapes))[:3])
            missing = sorted(required - names)[:3]
            raise StageFailed(f"{where}: the {what}'s tensors are not the stage's (unexpected "
                              f"{extra}, missing {missing})")
        dtype = str(self.dtype).removeprefix("torch.")
        out = {}
        for name in sorted(names):
            array, shape = record[name], shapes[name]
            if not isinstance(array, Array) or array.dtype != dtype or tuple(
                    array.shape) != shape or len(array.data) > _npy_bound(shape, self.dtype):
                raise StageFailed(f"{where}: {what} tensor {name!r} is not {dtype} of shape "
                                  f"{shape}")
            value = torch.from_numpy(np.array(array.numpy(), copy=True))
            if value.dtype != self.dtype or tuple(value.shape) != shape:
                raise StageFailed(f"{where}: {what} tensor {name!r} decodes to {value.dtype} "
                                  f"{tuple(value.shape)}, its header says {dtype} {shape}")
            if not bool(torch.isfinite(value).all()):
                raise StageFailed(f"{where}: {what} tensor {name!r} holds non-finite values")
            out[name] = value
        return out

    def _chunk(self, record: ArrayRecord | None, k: int, where: str) -> dict[str, torch.Tensor]:
        """The stage's trained chunk (a stage cannot write another stage's layers)."""
        own = self.own[k]
        return self._arrays(record, own, "chunk", where, set(own))

    def _state(self, record: ArrayRecord | None, k: int, op: Op,
               where: str) -> dict[str, torch.Tensor]:
        """A checkpoint: the chunk and AdamW's state, as a spare's ``load_state`` takes it."""
        own = self.own[k]
        shapes = dict(own)
        for i, shape in enumerate(own.values()):
            shapes.update({f"adam.{i}.step": (), f"adam.{i}.exp_avg": shape,
                           f"adam.{i}.exp_avg_sq": shape})
        state = self._arrays(record, shapes, "checkpoint", where, set(own))
        for name, value in state.items():
            if name.endswith(".step") and not (
                    1 <= float(value) <= op.mb + 1 and float(value).is_integer()):
                raise StageFailed(f"{where}: checkpoint tensor {name!r} = {float(value):g} is not "
                                  f"a step count in 1..{op.mb + 1}")
            if name.endswith(".exp_avg_sq") and bool((value < 0).any()):
                raise StageFailed(f"{where}: checkpoint tensor {name!r} holds negative second "
                                  "moments")
        return state


def _npy_bound(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The most bytes a ``.npy`` of ``shape`` in ``dtype`` takes: the values and a header."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size() + 4096

