"""What every server runner does besides its rounds: find the output folder, wait for nodes,
evaluate the global model.

Shared by the FedCyBGD loop (:mod:`fedcybgd.server.app`) and the FedAvg baselines
(:mod:`fedcybgd.server.baselines`), so neither imports the other for them.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from pathlib import Path

import torch
from flwr.serverapp import Grid

from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.core.atomic import write_bytes
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.devices import to_cpu
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_tokenizer
from fedcybgd.model.precision import FrozenBlocks, Precision
from fedcybgd.protocol.prior import ClassPriorSpec
from fedcybgd.server.eval_cache import EvalCache, eval_cache_root, eval_key
from fedcybgd.server.output_dir import resolve_output_dir as resolve_output_dir  # the runners'
from fedcybgd.tasks.base import Task
from fedcybgd.tasks.build import build_task
from fedcybgd.tasks.objective import EvalResult

log = logging.getLogger(__name__)


class Evaluator:
    """Evaluate the global model through the run's task on the first ``eval-examples`` rows
    of ``eval-dataset`` (the server's own held-out file) or of the dataset's ``eval-split``.

    With ``blocks`` given, the evaluation follows the run's ``device`` and ``eval-precision``:
    on the CPU in fp32 it reads the global model itself; otherwise it runs on a copy of it on
    that device (``eval-precision = "frozen"``: every block held as the clients hold their
    frozen blocks, ``frozen-dtype``/``frozen-quant``), refreshed from the fp32 masters before
    each evaluation. The masters themselves never change form. ``task``: the run's (the one
    its data was checked through; default: a new one).
    """

    def __init__(self, run: RunConfig, stack: LayerStack, blocks: BlockMap | None = None,
                 device: torch.device | None = None, task: Task | None = None) -> None:
        self.stack = stack
        self._master = stack.model
        self.task = build_task(run) if task is None else task
        self.frame = self.task.eval_frame(run.evaluation.split, run.evaluation.examples)
        self.tokenizer = load_tokenizer(run.model)
        self.run = run
        self.device = device or torch.device("cpu")
        self.blocks = blocks
        self.copy: FrozenBlocks | None = None
        frozen = run.evaluation.precision == "frozen"
        if blocks is not None and (self.device.type != "cpu" or frozen):
            precision = Precision(run.frozen_dtype, run.frozen_quant) if frozen else Precision()
            twin = copy.deepcopy(stack.model)
            self.stack = LayerStack(twin)
            self.copy = FrozenBlocks(twin, blocks, precision)
            self.copy.place(self.device)

    def _refresh(self) -> None:
        """Every block of the copy rebuilt from the masters (fp32, exact)."""
        assert self.copy is not None and self.blocks is not None
        for block in self.blocks.names:
            self.copy.freeze(block, to_cpu(self.blocks.get(self._master, block)))

    def __call__(self) -> EvalResult:
        if self.copy is not None:
            self._refresh()
        # The task's scoring moves each batch to the model's device (fedcybgd.tasks.objective).
        return self.task.evaluate(self.stack, self.tokenizer, self.frame,
                                  self.run.evaluation.batch_size, self.run.max_seq_len)

    def initial(self) -> tuple[EvalResult, bool]:
        """The evaluation before any training, and whether it came from the cache
        (``eval-cache``: runs from the same weights on the same rows share it)."""
        if not self.run.evaluation.cache:
            return self(), False
        cache = EvalCache(eval_cache_root())
        key = eval_key(self.run, self.task, self.frame, self._master, self.device)
        cached = cache.get(key)
        if cached is not None:
            log.info("round 0: the evaluation of these weights on these rows is cached (%s)",
                     cache.path(key))
            return cached, True
        result = self()
        if math.isfinite(result.loss) and math.isfinite(result.accuracy):
            cache.put(key, result)
        return result, False


def class_prior_of(run: RunConfig, classes: int) -> tuple[ClassPriorSpec | None, int]:
    """The run's ``class-prior`` for a task of ``classes`` classes (``None`` for a task
    without classes), checked against them now: explicit shares of another length fail at
    start, naming the key."""
    if classes < 2:
        return None, classes
    spec = ClassPriorSpec.parse(run.class_prior)
    try:
        spec.resolve(classes, {})
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return spec, classes


def eval_extras(result: EvalResult, cached: bool = False) -> dict[str, float]:
    """The task's metrics besides loss and accuracy, as ``metrics.jsonl`` keys (and
    ``eval_cached = 1`` when the figures came from the evaluation cache)."""
    extras = {f"eval_{name}": value for name, value in result.metrics.items()}
    if cached:
        extras["eval_cached"] = 1.0
    return extras


def write_samples(out: Path, server_round: int, result: EvalResult) -> Path | None:
    """Save an evaluation's sample answers as ``samples/round-NNNN.json`` (a rerun of the
    round, after a resume, replaces its file); ``None`` when the task has none."""
    if not result.samples:
        return None
    path = out / "samples" / f"round-{server_round:04d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"round": server_round, "examples": result.examples, "samples": list(result.samples)}
    write_bytes(path, json.dumps(body, indent=1, ensure_ascii=False).encode())
    return path


def require_nodes(grid: Grid, wanted: int, wait_s: float, key: str = "clients-per-round") -> int:
    """Wait until ``wanted`` nodes (the run config's ``key``) are connected, at most ``wait_s``
    seconds (``node-wait``); a clear error if they never are."""
    deadline = time.monotonic() + wait_s
    while True:
        count = len(list(grid.get_node_ids()))
        if count >= wanted:
            return count
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"{key} = {wanted}, but only {count} nodes are connected after "
                f"{wait_s:g} s (node-wait); lower {key} or start more SuperNodes "
                "(simulation: --federation-config 'num-supernodes=N')"
            )
        time.sleep(1.0)
