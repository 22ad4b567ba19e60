"""What every server runner does besides its rounds: find the output folder, wait for nodes,
evaluate the global model.

Shared by the FedCyBGD loop (:mod:`fedcybgd.server.app`) and the FedAvg baselines
(:mod:`fedcybgd.server.baselines`), so neither imports the other for them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from flwr.serverapp import Grid

from fedcybgd import data
from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_tokenizer
from fedcybgd.objective import EvalResult, evaluate


def resolve_output_dir(path: str) -> Path:
    """Relative output dirs are taken from ``FEDCYBGD_OUTPUT_ROOT`` (default: the cwd)."""
    out = Path(path).expanduser()
    if not out.is_absolute():
        out = Path(os.environ.get("FEDCYBGD_OUTPUT_ROOT", os.getcwd())) / out
    return out


class Evaluator:
    """Evaluate the global model on the first ``eval-examples`` rows of ``eval-split``."""

    def __init__(self, run: RunConfig, stack: LayerStack) -> None:
        self.stack = stack
        self.frame = data.load_split(run.dataset, run.eval_split).head(run.eval_examples)
        self.tokenizer = load_tokenizer(run.model)
        self.run = run

    def __call__(self) -> EvalResult:
        batches = data.eval_batches(
            self.frame, self.tokenizer, self.run.eval_batch_size, self.run.max_seq_len
        )
        return evaluate(self.stack, batches)


def require_nodes(grid: Grid, wanted: int, wait_s: float) -> int:
    """Wait until ``wanted`` nodes are connected; a clear error if they never are."""
    deadline = time.monotonic() + wait_s
    while True:
        count = len(list(grid.get_node_ids()))
        if count >= wanted:
            return count
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"clients-per-round = {wanted}, but only {count} nodes are connected after "
                f"{wait_s:.0f} s; lower clients-per-round or start more SuperNodes "
                "(simulation: --federation-config 'num-supernodes=N')"
            )
        time.sleep(1.0)
