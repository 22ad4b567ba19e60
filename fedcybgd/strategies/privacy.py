"""The privacy ledger: what user-level DP has spent so far, and whether a round may start.

Each round the server samples ``clients-per-round`` nodes of the ``N`` it sees; a sampled node
trains one block, and its clipped delta enters that block's merge alone among its
contributions (distinct blocks are disjoint parameters, and a node trains one block a round).
So, for one node, a round is a Gaussian mechanism of noise multiplier ``z`` on a sensitivity-
``dp-clip-norm`` sum, run with probability ``q = clients-per-round / N``:

* ``dp = "central"``: the server adds the noise; the node's view of the sampling is the
  server's, so the round is a subsampled Gaussian (Poisson sampling at rate ``q``, the usual
  approximation of sampling a fixed number of nodes without replacement).
* ``dp = "local"``: the node adds the noise itself and does not trust the server to have
  sampled at random, so no amplification is claimed: every round the node takes part in is a
  full Gaussian mechanism. The ledger counts the rounds of the node that took part most.

Rounds compose under Rényi DP (``dp-accounting``'s RDP accountant at integer orders, an upper
bound on the exact epsilon), read at ``dp-delta``. With ``dp-target-epsilon`` set, a round whose
completion would take the epsilon above the target is not started.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedcybgd.protocol.dp import NoiseKey, add_noise, epsilon


@dataclass
class PrivacyLedger:
    """User-level DP's account of a run (see the module docstring).

    Parameters
    ----------
    mode : str
        ``"central"`` or ``"local"``.
    noise_multiplier, delta, target_epsilon : float
        ``dp-noise-multiplier``, ``dp-delta``, ``dp-target-epsilon`` (0: no budget).
    """

    mode: str
    noise_multiplier: float
    delta: float
    target_epsilon: float = 0.0
    rates: Counter[float] = field(default_factory=Counter)  # central: rate -> rounds
    taken: Counter[str] = field(default_factory=Counter)  # local: node -> rounds it took part

    def __post_init__(self) -> None:
        if self.mode not in ("central", "local"):
            raise ValueError(f"dp mode must be 'central' or 'local', got {self.mode!r}")

    def _rounds(self, rate: float | None = None,
                nodes: Iterable[str] = ()) -> list[tuple[float, int]]:
        if self.mode == "central":
            rates = Counter(self.rates)
            if rate is not None:
                rates[round(rate, 12)] += 1
            return list(rates.items())
        taken = Counter(self.taken)
        for node in nodes:
            taken[node] += 1
        return [(1.0, max(taken.values(), default=0))]

    def spent(self) -> float:
        """Epsilon spent by the rounds recorded so far (0 before any)."""
        rounds = self._rounds()
        if not any(count for _, count in rounds):
            return 0.0
        return epsilon(rounds, self.noise_multiplier, self.delta)

    def would_spend(self, rate: float, nodes: Iterable[str] = ()) -> float:
        """Epsilon after one more round at sampling ``rate`` (central) or taking ``nodes``
        (local)."""
        return epsilon(self._rounds(rate, nodes), self.noise_multiplier, self.delta)

    def allows(self, rate: float, nodes: Iterable[str] = ()) -> tuple[bool, float]:
        """Whether the next round fits ``dp-target-epsilon``, and the epsilon it would bring."""
        after = self.would_spend(rate, nodes)
        return (not self.target_epsilon or after <= self.target_epsilon), after

    def record(self, rate: float, nodes: Iterable[str] = ()) -> float:
        """Account one round that ran; returns the epsilon spent so far."""
        if self.mode == "central":
            self.rates[round(rate, 12)] += 1
        else:
            for node in nodes:
                self.taken[node] += 1
        return self.spent()

    def state(self) -> dict[str, Any]:
        """JSON-able, for checkpoints."""
        return {"rates": [[r, c] for r, c in sorted(self.rates.items())],
                "taken": dict(sorted(self.taken.items()))}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state`'s output."""
        rates = state.get("rates", [])
        taken = state.get("taken", {})
        if not isinstance(rates, list) or not isinstance(taken, dict):
            raise ValueError("privacy ledger state is malformed")
        self.rates = Counter({float(r): int(c) for r, c in rates})
        self.taken = Counter({str(n): int(c) for n, c in taken.items()})


class DpMean:
    """A block's uploads merged for user-level DP: their unweighted mean (each node's clipped
    delta counts alike, so one node moves the sum by at most ``dp-clip-norm``), plus, with
    ``noise_std`` > 0 (``dp = "central"``), Gaussian noise of ``noise_std / n`` on the mean of
    ``n`` uploads, that is ``noise_std`` on their sum.

    The noise of the ``k``-th merge of a run is the draw ``merge/k`` of the server's secret
    ``key`` (:attr:`merges` and the key are checkpointed, so a run and its resumption draw the
    same noise; nothing a node or a reader of the run config holds regenerates it).
    """

    def __init__(self, noise_std: float, key: NoiseKey) -> None:
        self.noise_std = noise_std
        self.key = key
        self.merges = 0

    def __call__(self, uploads: Sequence[tuple[float, dict[str, torch.Tensor]]]
                 ) -> dict[str, torch.Tensor]:
        if not uploads:
            raise ValueError("no upload to merge")
        tensors = [t for _, t in uploads]
        if len(tensors) == 1:
            mean = dict(tensors[0])
        else:
            mean = {name: torch.stack([t[name].double() for t in tensors]).mean(dim=0)
                    .to(tensors[0][name].dtype) for name in tensors[0]}
        self.merges += 1
        if not self.noise_std:
            return mean
        return add_noise(mean, self.noise_std / len(tensors), self.key, f"merge/{self.merges}")


@dataclass
class AdaptiveClip:
    """The clip norm of central user-level DP, moved each round toward the ``quantile`` of the
    nodes' delta norms (geometric update on a noised count, Andrew et al. 2021): after a round
    whose nodes said whether their delta's norm was within the clip (``bits``),
    ``clip *= exp(-lr * (noised share within - quantile))``. The count's noise has deviation
    ``count_stddev``, the draw ``clip-count/k`` of the server's secret ``key`` for the ``k``-th
    update (a resumed run draws the same; nobody else can). A node's bit is one vote of 0 or 1:
    a lying node moves the share by at most ``1 / n`` of a round's ``n`` votes."""

    clip: float
    quantile: float
    lr: float
    count_stddev: float
    key: NoiseKey
    updates: int = 0

    def update(self, bits: Sequence[bool]) -> float:
        """Move the clip after a round with ``bits`` (no bits: unchanged); returns the new clip."""
        if not bits:
            return self.clip
        self.updates += 1
        noise = float(self.key.normal(1, f"clip-count/{self.updates}")[0]) * self.count_stddev
        share = (sum(bool(b) for b in bits) + noise) / len(bits)
        self.clip *= math.exp(-self.lr * (share - self.quantile))
        return self.clip

    def state(self) -> dict[str, Any]:
        """JSON-able, for checkpoints."""
        return {"clip": self.clip, "updates": self.updates}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state`'s output."""
        clip, updates = float(state["clip"]), int(state["updates"])
        if not (math.isfinite(clip) and clip > 0 and updates >= 0):
            raise ValueError(f"adaptive clip state is malformed: {dict(state)}")
        self.clip, self.updates = clip, updates
