"""A node's own account of the differential privacy its own noise gives (``dp = "local"`` or
``"example"``).

With example-level DP every local step of a node is DP-SGD: a Poisson sample of its rows at rate
``q = batch-size / rows``, each row's contribution clipped to ``dp-clip-norm``, Gaussian noise of
``dp-noise-multiplier x dp-clip-norm`` on the sum. One step is a Poisson-subsampled Gaussian
mechanism on the node's data. With local DP each round's upload is one Gaussian mechanism on
all the node's data (rate 1: the node does not trust the server's sampling). Both compose under
Rényi DP (:func:`fedcybgd.protocol.dp.epsilon`, read at the run's ``dp-delta``); a node's
user-level rounds bound its example-level privacy too, so one ledger counts both.

The node keeps that account itself, because it trusts no server: the ledger is a JSON file in
its cache folder, named by its node key (so nodes sharing a cache folder keep theirs apart),
holding every round's ``(rate, noise multiplier, mechanisms)`` under the lineage of the run it
trained for. Before training, a round is declined (``rejected``, naming the budget) when it
would take the run's epsilon above ``dp-target-epsilon`` or the epsilon of every run the node
has trained for above its own ``max-dp-epsilon`` (node config: a server cannot reset that one by
naming a new lineage). The round's steps are recorded once training has finished, before the
upload leaves. A ledger that cannot be read stops training: the node cannot know what it spent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from fedcybgd.core.atomic import write_bytes
from fedcybgd.protocol import PRIVACY_BUDGET
from fedcybgd.protocol.dp import epsilon_of

Entry = tuple[float, float, int]  # (sampling rate, noise multiplier, mechanisms)


class LedgerError(RuntimeError):
    """The node's privacy ledger is unreadable or malformed."""


@dataclass
class NodeLedger:
    """The mechanisms a node has run on its data, by run lineage (see the module docstring)."""

    path: Path
    runs: dict[str, list[Entry]] = field(default_factory=dict)

    @classmethod
    def open(cls, folder: Path, node_key: str) -> NodeLedger:
        """The ledger of ``node_key`` in ``folder`` (empty when there is none yet).

        Raises
        ------
        LedgerError
            The file exists but is not a ledger.
        """
        path = folder / f"dp-ledger-{node_key}.json"
        if not path.exists():
            return cls(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            runs = {str(lineage): [(float(r), float(z), int(n)) for r, z, n in entries]
                    for lineage, entries in raw["runs"].items()}
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise LedgerError(f"privacy ledger {path} is unreadable ({err}); the node cannot "
                              "know what it has spent, so it trains nothing") from None
        for entries in runs.values():
            for rate, multiplier, steps in entries:
                if not (0 < rate <= 1 and multiplier > 0 and steps >= 0):
                    raise LedgerError(f"privacy ledger {path} holds an impossible entry "
                                      f"{(rate, multiplier, steps)}")
        return cls(path, runs)

    def spent(self, delta: float, lineage: str | None = None,
              extra: Iterable[Entry] = ()) -> float:
        """Epsilon at ``delta`` of the run ``lineage`` (``None``: of every run), plus ``extra``."""
        entries = [e for run, es in self.runs.items() if lineage in (None, run) for e in es]
        entries += list(extra)
        if not any(steps for _, _, steps in entries):
            return 0.0
        return epsilon_of(entries, delta)

    def check(self, lineage: str, round_: Entry, delta: float, run_budget: float,
              node_budget: float) -> tuple[str | None, float]:
        """Whether one more round fits both budgets (0: none): ``(None, run epsilon after)``
        when it does, else ``(why, ...)``."""
        after = self.spent(delta, lineage, [round_])
        if run_budget and after > run_budget:
            return (f"{PRIVACY_BUDGET}: this round would take the run's node-side epsilon "
                    f"from {self.spent(delta, lineage):.3g} to {after:.3g}, above "
                    f"dp-target-epsilon = {run_budget:g} (dp-delta = {delta:g})"), after
        if node_budget:
            total = self.spent(delta, None, [round_])
            if total > node_budget:
                return (f"{PRIVACY_BUDGET}: this round would take the epsilon spent on this "
                        f"node's data to {total:.3g}, above its max-dp-epsilon = "
                        f"{node_budget:g} (node config; dp-delta = {delta:g})"), after
        return None, after

    def record(self, lineage: str, round_: Entry) -> None:
        """Add a round and write the ledger atomically."""
        self.runs.setdefault(lineage, []).append(round_)
        body = {"runs": {run: [list(e) for e in entries] for run, entries in self.runs.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(self.path, json.dumps(body, indent=1).encode())


def round_entry(rate: float, noise_multiplier: float, steps: int) -> Entry:
    """One round's entry, checked: ``steps`` Gaussian mechanisms at sampling ``rate`` (a
    local-DP round is ``(1.0, multiplier, 1)``)."""
    if not (0 < rate <= 1 and math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ValueError(f"a node-side DP round needs a rate in (0, 1] and a multiplier > 0, "
                         f"got {rate}, {noise_multiplier}")
    return (float(rate), float(noise_multiplier), int(steps))
