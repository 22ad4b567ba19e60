"""A pipeline on this machine: one OS process per stage, activations over pipes.

Each stage is its own process (its own Python, its own copy of the model, ``threads`` torch
threads) that runs :class:`fedcybgd.client.pipeline.stage.Stage` through its operation list
(``fedcybgd.server.pipeline.schedules.plan``). Stage 0 reads the data; messages between
neighbours are :mod:`fedcybgd.protocol.activations` bytes over one-way pipes, sent by a thread
per pipe so a stage never blocks on a busy neighbour (a forward going up and a gradient coming
down would otherwise wait on each other). Nothing is pickled between stages.

Per stage it measures: each operation's CPU seconds (process time: with one torch thread that
is the work a device with its own core does) and wall seconds, the seconds spent waiting for a
message, the bytes sent each way, the resident memory after loading (model, stage) and its
peak while training (sampled every 5 ms). The stages share this machine's cores, so the wall
time is that of K stages on its cores; :func:`project` replays the CPU times on K devices.

The trained chunks come back to the parent, which puts them into one model and evaluates it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedcybgd.client.pipeline.stage import Stage
    from fedcybgd.data.prompts import Batch
    from fedcybgd.server.pipeline.schedules import Op
    from fedcybgd.tasks.base import Task
    from fedcybgd.tasks.shares import BatchIterator

SAMPLE_S = 0.005
MAX_MESSAGE_BYTES = 1 << 30


class PipelineError(RuntimeError):
    """A stage failed: the text names it and says why."""


@dataclass(frozen=True)
class PipelineSpec:
    """What to run: model, cut, schedule, data and optimizer (see the module docstring)."""

    model: str
    stages: int
    schedule: str
    micro_batches: int = 4  # per optimizer step (GPipe's mini-batch)
    steps: int = 2
    batch_size: int = 4  # examples per micro-batch
    max_seq_len: int = 64
    lr: float = 1e-4
    weight_decay: float = 0.0
    aux_layers: int = 0
    dataset: str = "rotten-tomatoes"
    seed: int = 0
    activation_dtype: str = "float32"
    threads: int = 1
    eval_examples: int = 0  # 0: no evaluation


@dataclass
class StageReport:
    """What one stage measured."""

    stage: int
    layers: tuple[int, int]
    ops: dict[str, dict[str, float]]  # kind -> {"count", "cpu_s", "wall_s"}
    wait_s: float
    bytes_up: int
    bytes_down: int
    messages_up: int
    messages_down: int
    rss_loaded_mb: float
    peak_rss_mb: float
    max_kept: int
    losses: list[tuple[int, float]]
    started: float
    ended: float

    @property
    def training_mb(self) -> float:
        """Peak resident memory while training above what loading took."""
        return self.peak_rss_mb - self.rss_loaded_mb


@dataclass
class PipelineResult:
    """The stages' reports, the wall time of training, and the trained model's evaluation."""

    spec: PipelineSpec
    stages: list[StageReport]
    wall_s: float
    eval_loss: float | None = None
    eval_accuracy: float | None = None

    @property
    def micro_batches(self) -> int:
        return self.spec.micro_batches * self.spec.steps


def _rss_mb() -> float:
    import psutil

    return float(psutil.Process().memory_info().rss) / 2**20


class _Peak:
    """Samples this process's RSS every :data:`SAMPLE_S` seconds while running."""

    def __init__(self) -> None:
        self.peak = _rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak = max(self.peak, _rss_mb())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())
        return self.peak


class _Sender:
    """Sends bytes on ``conn`` from a thread, in order, counting them."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.bytes = 0
        self.messages = 0
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            self.conn.send_bytes(data)

    def send(self, data: bytes) -> None:
        self.bytes += len(data)
        self.messages += 1
        self._queue.put(data)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.conn.close()


def _stage_main(spec_json: str, k: int, from_below: Connection | None,
                to_above: Connection | None, from_above: Connection | None,
                to_below: Connection | None, result: Connection) -> None:
    """One stage's process: build the stage, run its operations, report (module docstring)."""
    try:
        report, chunk = _run_stage(PipelineSpec(**json.loads(spec_json)), k, from_below,
                                   to_above, from_above, to_below)
        result.send_bytes(json.dumps(report).encode())
        result.send_bytes(chunk)
    except BaseException as err:  # the parent reports it; nothing else would see it
        result.send_bytes(json.dumps({"error": f"{type(err).__name__}: {err}"}).encode())
        raise
    finally:
        result.close()


def _run_stage(spec: PipelineSpec, k: int, from_below: Connection | None,
               to_above: Connection | None, from_above: Connection | None,
               to_below: Connection | None) -> tuple[dict[str, Any], bytes]:
    """Stage ``k`` of ``spec`` in this process: build it, run its operations (measuring them),
    and return its :class:`StageReport` as a dict and its trained chunk as safetensors bytes."""
    from safetensors.torch import save

    from fedcybgd.server.pipeline.schedules import plan

    stage, task, hidden, batches = _build_stage(spec, k)
    up = _Sender(to_above) if to_above is not None else None
    down = _Sender(to_below) if to_below is not None else None
    inbox = _Inbox(k, [c for c in (from_below, from_above) if c is not None])
    loop = _StageLoop(spec, stage, task, hidden, batches, inbox, up, down)
    rss_loaded = _rss_mb()
    peak = _Peak()
    started = time.time()
    loop.run(plan(spec.schedule, spec.stages, spec.micro_batches, spec.steps)[k])
    ended = time.time()
    peak_mb = peak.stop()
    for sender in (up, down):
        if sender is not None:
            sender.close()
    report = StageReport(
        k, stage.layers, loop.ops_done, inbox.wait_s, up.bytes if up else 0,
        down.bytes if down else 0, up.messages if up else 0, down.messages if down else 0,
        rss_loaded, peak_mb, loop.max_kept, stage.losses, started, ended)
    return asdict(report), save(stage.chunk_state())


def _build_stage(spec: PipelineSpec, k: int) -> tuple[Stage, Task, int, BatchIterator | None]:
    """Set this process's torch threads and seed, then build stage ``k`` of ``spec``: the stage
    over a freshly loaded model, its task, the model's hidden size and, for stage 0 (which reads
    the data), its training batches."""
    import torch

    from fedcybgd.client.pipeline.stage import Stage, StageConfig
    from fedcybgd.config import RunConfig
    from fedcybgd.model.loading import load_model, load_tokenizer
    from fedcybgd.tasks import shares
    from fedcybgd.tasks.build import build_task

    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    task = build_task(RunConfig(dataset=spec.dataset))
    model = load_model(spec.model)
    stage = Stage(model, StageConfig(k, spec.stages, spec.schedule, spec.lr,
                                     spec.weight_decay, spec.aux_layers), task)
    hidden = int(model.config.hidden_size)
    batches = None
    if k == 0:
        tokenizer = load_tokenizer(spec.model)
        batches = shares.batches(shares.load_split(spec.dataset, "train"), tokenizer,
                                 spec.batch_size, spec.max_seq_len, seed=spec.seed, task=task)
    return stage, task, hidden, batches


class _Inbox:
    """Messages from stage ``k``'s neighbours, handed out by ``(kind, micro-batch)`` whatever
    order they arrive in; counts the seconds spent waiting for them."""

    def __init__(self, k: int, inbound: list[Connection]) -> None:
        from fedcybgd.protocol import activations

        self._peek = activations.peek
        self.k = k
        self.inbound = inbound
        self.messages: dict[tuple[str, int], bytes] = {}
        self.wait_s = 0.0

    def receive(self, kind: str, mb: int) -> bytes:
        """The message ``kind`` for micro-batch ``mb``, waiting up to 900 s for each arrival."""
        began = time.perf_counter()
        while (kind, mb) not in self.messages:
            ready = wait(self.inbound, timeout=900)
            if not ready:
                raise PipelineError(f"stage {self.k}: no message for {kind}{mb} in 900 s")
            for conn in ready:
                assert isinstance(conn, Connection)
                try:
                    data = conn.recv_bytes(MAX_MESSAGE_BYTES)
                except EOFError as err:
                    raise PipelineError(f"stage {self.k}: a neighbour closed its pipe before "
                                        f"{kind}{mb} arrived") from err
                self.messages[self._peek(data)] = data
        self.wait_s += time.perf_counter() - began
        return self.messages.pop((kind, mb))


class _StageLoop:
    """Runs a stage's operations in order: takes each one's input (stage 0's next batch or a
    neighbour's message), runs it, sends its output on, and records its CPU and wall seconds
    (``ops_done``) and the most micro-batches the stage kept (``max_kept``)."""

    def __init__(self, spec: PipelineSpec, stage: Stage, task: Task, hidden: int,
                 batches: BatchIterator | None, inbox: _Inbox, up: _Sender | None,
                 down: _Sender | None) -> None:
        from fedcybgd.protocol import activations

        self._encode = activations.encode
        self._decode = activations.decode
        self.spec = spec
        self.stage = stage
        self.task = task
        self.hidden = hidden
        self.batches = batches
        self.inbox = inbox
        self.up = up
        self.down = down
        self.ops_done: dict[str, dict[str, float]] = {}
        self.max_kept = 0

    def run(self, ops: list[Op]) -> None:
        for op in ops:
            data, batch = self._inputs(op)
            cpu, wall = time.process_time(), time.perf_counter()
            self._execute(op, data, batch)
            self.max_kept = max(self.max_kept, self.stage.kept + (op.kind in ("B", "L")))
            row = self.ops_done.setdefault(op.kind, {"count": 0, "cpu_s": 0.0, "wall_s": 0.0})
            row["count"] += 1
            row["cpu_s"] += time.process_time() - cpu
            row["wall_s"] += time.perf_counter() - wall

    def _inputs(self, op: Op) -> tuple[bytes | None, Batch | None]:
        """``(message, batch)`` that ``op`` starts from: a forward's next batch on stage 0, else
        the message a forward or (below the last stage) a backward waits for."""
        if op.kind == "F":
            if self.batches is not None:
                return None, next(self.batches)
            return self.inbox.receive("F", op.mb), None
        if op.kind == "B" and not self.stage.last:
            return self.inbox.receive("B", op.mb), None
        return None, None

    def _execute(self, op: Op, data: bytes | None, batch: Batch | None) -> None:
        dtype = self.spec.activation_dtype
        if op.kind == "F":
            states = None
            if data is not None:
                _, _, states, batch = self._decode(data, self.hidden, MAX_MESSAGE_BYTES,
                                                   self.task)
            assert batch is not None
            out = self.stage.forward(op.mb, batch, states)
            if self.up is not None:
                self.up.send(self._encode("F", op.mb, out, batch, dtype))
        elif op.kind == "B":
            grad = None
            if data is not None:
                grad = self._decode(data, self.hidden, MAX_MESSAGE_BYTES)[2]
            back = self.stage.backward(op.mb, grad)
            if self.down is not None:
                assert back is not None
                self.down.send(self._encode("B", op.mb, back, None, dtype))
        elif op.kind == "L":
            self.stage.local_update(op.mb)
        else:
            self.stage.step()


def run_pipeline(spec: PipelineSpec) -> PipelineResult:
    """Run ``spec`` with one process per stage; the stages' reports and the trained model's
    evaluation (when ``spec.eval_examples``). Raises :class:`PipelineError` naming a stage
    that failed."""
    from fedcybgd.server.pipeline.schedules import SCHEDULES

    if spec.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {spec.schedule!r}")
    ctx = mp.get_context("spawn")
    count = spec.stages
    ups = [ctx.Pipe(duplex=False) for _ in range(count - 1)]  # (recv, send): k -> k + 1
    downs = [ctx.Pipe(duplex=False) for _ in range(count - 1)]  # k + 1 -> k
    results = [ctx.Pipe(duplex=False) for _ in range(count)]
    spec_json = json.dumps(asdict(spec))
    procs = []
    for k in range(count):
        args = (spec_json, k,
                ups[k - 1][0] if k > 0 else None, ups[k][1] if k < count - 1 else None,
                downs[k][0] if k < count - 1 else None, downs[k - 1][1] if k > 0 else None,
                results[k][1])
        procs.append(ctx.Process(target=_stage_main, args=args, name=f"stage-{k}",
                                 daemon=True))
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(spec.threads)
    try:
        for proc in procs:
            proc.start()
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    for pipes in (*ups, *downs, *results):
        pipes[1].close()  # the parent keeps no writing end: EOF reaches a reader when a stage dies
    reports, chunks = [], {}
    try:
        for k, (conn, _) in enumerate(results):
            try:
                head = json.loads(conn.recv_bytes())
            except EOFError as err:
                procs[k].join(timeout=10)
                raise PipelineError(f"stage {k} ended without a report "
                                    f"(exit code {procs[k].exitcode})") from err
            if "error" in head:
                raise PipelineError(f"stage {k} failed: {head['error']}")
            reports.append(StageReport(**{**head, "layers": tuple(head["layers"]),
                                          "losses": [tuple(x) for x in head["losses"]]}))
            chunks[k] = conn.recv_bytes()
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    wall = max(r.ended for r in reports) - min(r.started for r in reports)
    result = PipelineResult(spec, reports, wall)
    if spec.eval_examples:
        result.eval_loss, result.eval_accuracy = evaluate_chunks(spec, list(chunks.values()))
    return result


def evaluate_chunks(spec: PipelineSpec, chunks: list[bytes]) -> tuple[float, float]:
    """Loss and accuracy, on ``spec.eval_examples`` validation examples, of the model with the
    trained chunks put in."""
    import torch
    from safetensors.torch import load

    from fedcybgd.config import RunConfig
    from fedcybgd.model.layerwise import LayerStack
    from fedcybgd.model.loading import load_model, load_tokenizer
    from fedcybgd.tasks import shares
    from fedcybgd.tasks.build import build_task
    from fedcybgd.tasks.objective import evaluate

    model = load_model(spec.model)
    state = {}
    for data in chunks:
        state.update(load(data))
    missing = set(state) - {n for n, _ in model.named_parameters()}
    if missing:
        raise PipelineError(f"trained chunks name unknown parameters {sorted(missing)[:3]}")
    model.load_state_dict(state, strict=False)
    task = build_task(RunConfig(dataset=spec.dataset))
    frame = shares.load_split(spec.dataset, "validation")
    with torch.no_grad():
        res = evaluate(LayerStack(model), shares.eval_batches(
            frame, load_tokenizer(spec.model), 16, spec.max_seq_len, spec.eval_examples, task))
    return res.loss, res.accuracy


def op_seconds(result: PipelineResult) -> dict[tuple[int, str], float]:
    """Mean CPU seconds of one operation per ``(stage, kind)``."""
    return {(r.stage, kind): row["cpu_s"] / row["count"]
            for r in result.stages for kind, row in r.ops.items() if row["count"]}


def project(result: PipelineResult, link_mbit_s: float) -> dict[str, float]:
    """The makespan K devices with their own core would take (a projection from the measured
    CPU times, ``fedcybgd.server.pipeline.schedules.simulate``), each message taking its measured
    size over a ``link_mbit_s`` link; and the micro-batches a second that gives."""
    from fedcybgd.server.pipeline.schedules import plan, simulate

    spec = result.spec
    transfer: dict[tuple[int, str], float] = {}
    for r in result.stages:
        if r.messages_up:
            transfer[(r.stage, "F")] = r.bytes_up / r.messages_up * 8 / (link_mbit_s * 1e6)
        if r.messages_down:
            transfer[(r.stage, "B")] = r.bytes_down / r.messages_down * 8 / (link_mbit_s * 1e6)
    ops = plan(spec.schedule, spec.stages, spec.micro_batches, spec.steps)
    projection = simulate(ops, op_seconds(result), transfer)
    return {"makespan_s": projection.makespan_s,
            "micro_batches_per_s": result.micro_batches / projection.makespan_s,
            "busiest_stage_idle_share": min(projection.idle_s) / projection.makespan_s}


def run_in_process(stages: list[Any], batches: list[Any], micro_batches: int,
                   steps: int = 1, dtype: str = "float32", step: bool = True) -> int:
    """Run ``stages`` (``fedcybgd.client.pipeline.stage.Stage``, one per stage, in order) in this
    process through their schedule's operations, one ready operation at a time, every message
    through :mod:`fedcybgd.protocol.activations` as bytes. ``batches[m]`` is micro-batch m.
    ``step = False`` leaves out the ``S`` operations (the mean gradients stay for reading).
    Returns the bytes that crossed between stages."""
    from fedcybgd.protocol import activations
    from fedcybgd.server.pipeline.schedules import plan

    count = len(stages)
    schedule = stages[0].config.schedule
    ops = plan(schedule, count, micro_batches, steps)
    hidden = int(stages[0].stack.model.config.hidden_size)
    mailbox: dict[tuple[int, str, int], bytes] = {}
    cursor = [0] * count
    moved = 0
    while any(cursor[k] < len(ops[k]) for k in range(count)):
        progressed = False
        for k, stage in enumerate(stages):
            while cursor[k] < len(ops[k]):
                op = ops[k][cursor[k]]
                if op.kind == "F":
                    if k == 0:
                        out = stage.forward(op.mb, batches[op.mb])
                    elif (k, "F", op.mb) in mailbox:
                        _, _, states, batch = activations.decode(
                            mailbox.pop((k, "F", op.mb)), hidden, MAX_MESSAGE_BYTES,
                            stage.task)
                        out = stage.forward(op.mb, batch, states)
                    else:
                        break
                    if k < count - 1:
                        data = activations.encode("F", op.mb, out, batches[op.mb], dtype)
                        mailbox[(k + 1, "F", op.mb)] = data
                        moved += len(data)
                elif op.kind == "B":
                    if k == count - 1:
                        back = stage.backward(op.mb)
                    elif (k, "B", op.mb) in mailbox:
                        grad = activations.decode(mailbox.pop((k, "B", op.mb)), hidden,
                                                  MAX_MESSAGE_BYTES)[2]
                        back = stage.backward(op.mb, grad)
                    else:
                        break
                    if k > 0:
                        data = activations.encode("B", op.mb, back, None, dtype)
                        mailbox[(k - 1, "B", op.mb)] = data
                        moved += len(data)
                elif op.kind == "L":
                    stage.local_update(op.mb)
                elif step:
                    stage.step()
                cursor[k] += 1
                progressed = True
        if not progressed:
            raise PipelineError("the stages wait on each other: the schedule deadlocks")
    return moved
