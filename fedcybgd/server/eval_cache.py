"""The evaluation of the untrained model, kept on disk (run-config ``eval-cache``).

Every run that starts from the same weights evaluates them on the same held-out rows before
its first round: an experiment profile of nine methods and three seeds would spend the same
minute 27 times. The result is stored under the cache folder, keyed by everything the
evaluation reads: the model's whole state (parameters and buffers, by content), the rows
themselves (by content), the task's kind and source, every run-config key not in
:data:`TRAINING_ONLY`, the library versions, the device and the torch threads. Any
difference is a miss, evaluated afresh.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import transformers

from fedcybgd.config import RunConfig
from fedcybgd.core.atomic import write_bytes
from fedcybgd.core.checksum import content_checksum
from fedcybgd.model.loading import cache_root
from fedcybgd.tasks.objective import EvalResult

log = logging.getLogger(__name__)

# Bump when the evaluation itself changes in a way the keys below cannot see.
FORMAT = 1

# Run-config keys that only steer training, the wire or the run's bookkeeping: the evaluation
# of a given model state on given rows cannot depend on them. Every other key (and every
# unknown one) is part of the key, so a key missing here costs a re-evaluation, never a
# wrong figure. Update-rule options (``run.options``) are training-only by construction.
TRAINING_ONLY = frozenset({
    "strategy", "fedavg-params", "partitioner", "dirichlet-alpha",
    "num-server-rounds", "clients-per-round", "clients-per-block", "block-schedule",
    "train-embeddings", "train-head", "update-rule", "local-steps", "batch-size", "lr",
    "weight-decay", "eval-every", "eval-cache", "output-dir", "resume", "overwrite", "seed",
    "round-timeout", "upload-codec", "seedlog-fallback", "download-codec",
    "seedlog-max-replay", "download-fraction", "max-staleness", "traffic-budget-mb",
    "install-codec", "version-history", "install-chain", "self-sync", "error-feedback",
    "max-payload-mb", "max-update-norm", "outlier-factor", "aggregate", "trim-fraction",
    "server-lr", "parallel-damping", "server-optimizer", "server-beta1", "server-beta2",
    "server-eps", "lr-schedule", "warmup-rounds",
})


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "source"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def eval_key(run: RunConfig, task: object, frame: pd.DataFrame, model: torch.nn.Module,
             device: torch.device) -> str:
    """The cache key of evaluating ``model`` on ``frame`` through ``task`` as ``run`` says,
    on ``device`` with this process's torch threads (they set the order of float sums)."""
    settings = {k: v for k, v in run.to_run_config().items()
                if k not in TRAINING_ONLY and k not in run.options}
    try:
        task_source = _sha256(inspect.getsource(type(task)).encode())
    except (OSError, TypeError):  # a class without a source file: its name alone
        task_source = ""
    parts = {
        "format": FORMAT,
        "versions": [_version("fedcybgd"), torch.__version__, transformers.__version__],
        "where": [str(device), torch.get_num_threads()],
        "task": [f"{type(task).__module__}.{type(task).__qualname__}", task_source],
        "settings": settings,
        "rows": _sha256(frame.to_json(orient="split", default_handler=str).encode()),
        "model": content_checksum(dict(model.state_dict())),
    }
    return _sha256(json.dumps(parts, sort_keys=True, default=str).encode())


def eval_cache_root() -> Path:
    """Where evaluations are kept: ``FEDCYBGD_EVAL_CACHE``, else ``evals`` under the cache
    folder (``FEDCYBGD_CACHE`` or ``~/.cache/fedcybgd``). The tests point it at a temporary
    folder, so they neither read nor leave a user's entries."""
    override = os.environ.get("FEDCYBGD_EVAL_CACHE")
    return Path(override) if override else cache_root() / "evals"


class EvalCache:
    """Evaluation results by key, one small JSON file each under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def get(self, key: str) -> EvalResult | None:
        """The stored result, or ``None`` (missing, or unreadable: then re-evaluated)."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
            result = EvalResult(
                loss=float(raw["loss"]), accuracy=float(raw["accuracy"]),
                examples=int(raw["examples"]),
                metrics={str(k): float(v) for k, v in dict(raw.get("metrics", {})).items()},
                samples=tuple({str(k): str(v) for k, v in dict(sample).items()}
                              for sample in raw.get("samples", [])),
            )
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("evaluation cache: ignoring %s (%s)", path, err)
            return None
        if not all(math.isfinite(v) for v in (result.loss, result.accuracy)):
            log.warning("evaluation cache: ignoring %s (a non-finite figure)", path)
            return None
        return result

    def put(self, key: str, result: EvalResult) -> None:
        """Store ``result`` (atomically: a crash leaves no half-written entry)."""
        body: dict[str, Any] = {"loss": result.loss, "accuracy": result.accuracy,
                                "examples": result.examples, "metrics": result.metrics,
                                "samples": list(result.samples)}
        write_bytes(self.path(key), json.dumps(body).encode())
