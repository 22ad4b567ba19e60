"""A Flower ServerApp of one's own: FedCyBGD with a block schedule and an aggregator of one's own.

* ``largest-updates``, a schedule: blocks whose recent updates were largest train more often.
* ``drop-farthest``, an aggregator: of three or more uploads of one block, the one farthest
  from the others is left out of the mean.

Both register by name, so the run config selects them (``block-schedule``, ``aggregate`` in
``pyproject.toml`` next to this file; ``--run-config "block-schedule='ascending'"`` switches
back). Flower's own ``Strategy.start`` runs the rounds; fedcybgd's ClientApp trains. Passing
objects works as well: ``FedCyBGD.from_config(run, blocks, weights,
schedule=LargestUpdatesFirst(blocks=...), aggregate=DropFarthest())``.
The same module named in ``plugin-modules`` would give fedcybgd's own ServerApp both names.

Run it as examples/README.md shows; ``history.json`` in ``output-dir`` holds
each round's record, the schedule's state and what the aggregator dropped.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from fedcybgd.config import RunConfig
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.loading import load_model
from fedcybgd.server.common import resolve_output_dir
from fedcybgd.strategies import (
    FedCyBGD,
    Upload,
    check_names,
    register_aggregator,
    register_schedule,
    weighted_mean,
)


@register_schedule("largest-updates")
class LargestUpdatesFirst:
    """Blocks never handed out first (model order); then by recent step size x rounds waited.

    FedCyBGD tells the schedule each installed block's step RMS (``observe``); a block's size is
    the running mean of its steps. Multiplying by the rounds since the block last trained lets
    a block that moves a lot come back sooner, while a quiet one still comes back.
    """

    def __init__(self, *, blocks: Sequence[str], seed: int = 0) -> None:
        self.blocks = list(blocks)
        self.size: dict[str, float] = {}  # block -> running mean of its step RMS
        self.last: dict[str, int] = {}  # block -> the take() that last handed it out
        self.clock = 0
        self.retry: list[str] = []

    def take(self, count: int) -> list[str]:
        """Up to ``count`` distinct blocks: retries, then untrained ones, then by priority."""
        self.clock += 1
        count = min(count, len(self.blocks))
        chosen = list(dict.fromkeys(self.retry))[:count]
        self.retry = [b for b in self.retry if b not in chosen]
        waiting = [b for b in self.blocks if b not in chosen]
        untrained = [b for b in waiting if b not in self.last]
        # sorted() is stable: equal priorities keep model order
        trained = sorted((b for b in waiting if b in self.last),
                         key=lambda b: -self.size.get(b, 0.0) * (self.clock - self.last[b]))
        chosen += (untrained + trained)[: count - len(chosen)]
        for block in chosen:
            self.last[block] = self.clock
        return chosen

    def requeue(self, block: str) -> None:
        """``block`` brought no update: it comes first next round."""
        self.retry.append(block)

    def observe(self, block: str, update_rms: float) -> None:
        """``block`` was installed after a step of RMS ``update_rms``."""
        old = self.size.get(block)
        self.size[block] = update_rms if old is None else (old + update_rms) / 2

    def state(self) -> dict[str, Any]:
        """JSON-able, for checkpoints."""
        return {"clock": self.clock, "size": dict(self.size), "last": dict(self.last),
                "retry": list(self.retry)}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state`'s output."""
        self.clock = int(state["clock"])
        self.size = {str(b): float(x) for b, x in state["size"].items()}
        self.last = {str(b): int(x) for b, x in state["last"].items()}
        self.retry = [str(b) for b in state["retry"]]


class DropFarthest:
    """Example-weighted mean of a block's uploads without the one farthest from the others.

    Distance: the sum of L2 distances to the other uploads. All uploads of a block started from
    the same tensors, so this compares their updates. With fewer than three there is no
    majority to compare against, and all are kept.
    """

    def __init__(self) -> None:
        self.dropped: list[int | None] = []  # per merge: the index left out, or None

    def __call__(self, uploads: Sequence[Upload]) -> dict[str, torch.Tensor]:
        if len(uploads) < 3:
            self.dropped.append(None)
            return weighted_mean(uploads)
        names = sorted(uploads[0][1])
        flat = [torch.cat([t[n].double().flatten() for n in names]) for _, t in uploads]
        spread = [sum(float(torch.linalg.vector_norm(a - b)) for b in flat) for a in flat]
        worst = max(range(len(flat)), key=spread.__getitem__)
        self.dropped.append(worst)
        return weighted_mean([u for i, u in enumerate(uploads) if i != worst])


@register_aggregator("drop-farthest")
def drop_farthest(**_: object) -> DropFarthest:
    """A fresh :class:`DropFarthest` per run (it takes no settings)."""
    return DropFarthest()


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """FedCyBGD under Flower's own round loop, from fedcybgd's run-config keys."""
    # The ClientApp reads the same keys (model, layers-per-block, ...), so both sides agree.
    run = RunConfig.from_run_config(context.run_config)
    check_names(run.block_schedule, run.aggregate)  # a typo stops here, with a suggestion
    model = load_model(run.model)
    blocks = BlockMap(model, run.layers_per_block)
    weights = dict(model.named_parameters())
    # Every setting from the run config (fedcybgd's defaults plus this app's pyproject keys):
    # the same algorithm fedcybgd's own ServerApp runs, with this file's schedule and merge.
    strategy = FedCyBGD.from_config(run, blocks, weights)
    initial = ArrayRecord({name: p.detach().clone() for name, p in weights.items()})
    strategy.start(grid, initial, num_rounds=run.num_server_rounds, timeout=run.round_timeout)

    out = resolve_output_dir(run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    merges = getattr(strategy.aggregate, "dropped", None)
    (out / "history.json").write_text(json.dumps({
        "rounds": [record.to_json() for record in strategy.history],
        "schedule": strategy.schedule.state(),
        "dropped": merges,
    }, indent=1))
