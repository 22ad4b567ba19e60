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

from fedcybgd.config import Privacy
from fedcybgd.protocol.dp import NoiseKey, adaptive_noise, add_noise, count_stddev, epsilon


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


class PrivacyPolicy:
    """A FedCyBGD run's differential privacy, at the points the strategy calls it.

    ``dp = "central"`` or ``"local"``: user-level DP; the server clips every upload again
    (central), a block's clipped deltas merge as :class:`DpMean` whatever ``aggregate`` says,
    and :class:`PrivacyLedger` accounts each round before it starts. ``dp = "example"``:
    each node's own DP-SGD, ledger and budget; the server only reports the largest epsilon a
    node says it has spent, and ends the run when nodes decline on their budgets. Central DP's
    draws (noise, clip count, node sample) come from :attr:`noise_key`, a secret of this server,
    never from the run's seed, which every node and every reader of ``summary.json`` holds. With
    adaptive clipping (central) the clip follows a quantile of the nodes' delta norms; the
    update noise's multiplier rises so that it and the noised count are accounted together at
    ``noise_multiplier``.
    """

    DP_KINDS = ("off", "central", "local", "example")

    def __init__(self, config: Privacy) -> None:
        dp, noise_multiplier, clip_norm = config.mode, config.noise_multiplier, config.clip_norm
        if dp not in self.DP_KINDS:
            raise ValueError(f"dp must be 'off', 'central', 'local' or 'example', got {dp!r}")
        self.dp, self.clip_norm = dp, clip_norm
        self.ledger = (PrivacyLedger(dp, noise_multiplier, config.delta, config.target_epsilon)
                       if dp in ("central", "local") else None)
        self.example_epsilon = 0.0  # dp = "example": the largest a node has reported
        self.stop: str | None = None  # why the budget ended the run, once it has
        self._round: tuple[float, list[str]] = (0.0, [])  # the round's sampling rate and nodes
        self.noise_key = NoiseKey() if dp == "central" else None
        self.adaptive_clip: AdaptiveClip | None = None
        self.update_multiplier = noise_multiplier
        if config.adaptive_clip:
            if dp != "central":
                raise ValueError(f"dp-adaptive-clip needs dp = 'central', got {dp!r}")
            stddev = count_stddev(config.clip_count_stddev, config.clients_per_round,
                                  noise_multiplier)
            self.update_multiplier = adaptive_noise(noise_multiplier, stddev)
            assert self.noise_key is not None
            self.adaptive_clip = AdaptiveClip(clip_norm, config.clip_quantile, config.clip_lr,
                                              stddev, self.noise_key)

    def settings(self, merge: object) -> dict[str, Any]:
        """The privacy settings in effect, by run-config key (``merge``: the block merge)."""
        ledger, clip = self.ledger, self.adaptive_clip
        return {
            "dp": self.dp,
            "dp-ledger": None if ledger is None else (
                ledger.noise_multiplier, ledger.delta, ledger.target_epsilon),
            "dp-noise": getattr(merge, "noise_std", None),
            "dp-adaptive-clip": None if clip is None else (
                clip.clip, clip.quantile, clip.lr, clip.count_stddev),
        }

    def merge(self) -> DpMean | None:
        """The merge user-level DP imposes on every block (None: the run's ``aggregate``)."""
        if self.ledger is None:
            return None
        return DpMean(self.update_multiplier * self.clip_norm if self.dp == "central" else 0.0,
                      self.noise_key or NoiseKey())

    def screen_bound(self, max_update_norm: float) -> float:
        """The server screen's norm bound: under central DP at most the clip."""
        if self.dp != "central":
            return max_update_norm
        return min(max_update_norm, self.clip_norm) if max_update_norm else self.clip_norm

    def declined(self, short: str, excluded: Mapping[int, str], marker: str) -> bool:
        """Sampling came ``short``: whether that is nodes declining on their own example-level
        budgets (``excluded`` reasons starting with ``marker``), which ends the run."""
        spent = [n for n, why in excluded.items() if why.startswith(marker)]
        if self.dp != "example" or not spent:
            return False
        self.stop = (f"{short}: {len(spent)} node(s) declined, their example-level privacy "
                     "budget spent")
        return True

    def allows(self, server_round: int, nodes: Sequence[int], population: int) -> bool:
        """Whether the round sampling ``nodes`` of ``population`` fits ``dp-target-epsilon``;
        keeps its rate and nodes for :meth:`account`. Beyond the budget, :attr:`stop` says
        why."""
        if self.ledger is None:
            return True
        rate = len(nodes) / max(population, len(nodes), 1)
        asked = [str(n) for n in nodes]
        ok, after = self.ledger.allows(rate, asked)
        if not ok:
            self.stop = (f"round {server_round} would take epsilon from "
                         f"{self.ledger.spent():.3g} to {after:.3g}, above dp-target-epsilon = "
                         f"{self.ledger.target_epsilon:g} (at dp-delta = {self.ledger.delta:g})")
            return False
        self._round = (rate, asked)
        return True

    def round_clip(self, merge: Any) -> float | None:
        """The adaptive clip of this round (None: a fixed one), set in the merge's noise."""
        if self.adaptive_clip is None:
            return None
        clip = self.adaptive_clip.clip
        if isinstance(merge, DpMean):
            merge.noise_std = self.update_multiplier * clip
        return clip

    def account(self, extra: dict[str, Any], metrics: Sequence[Mapping[str, Any]],
                unclipped_key: str, sent: bool) -> None:
        """After a round (``sent``: it sent instructions): the epsilon spent (the ledger's, or
        the largest a node reports under ``example``) and the adaptive clip's update from the
        admitted nodes' votes (``metrics``; a value other than 0 or 1 is no vote), into the
        round record's ``extra``."""
        if self.ledger is not None:
            if sent:
                rate, nodes = self._round
                extra["dp_epsilon"] = self.ledger.record(rate, nodes)
        elif self.dp == "example":
            reported = [m.get("dp_epsilon", math.nan) for m in metrics]
            self.example_epsilon = max([self.example_epsilon,
                                        *(e for e in reported if math.isfinite(e))])
            extra["dp_epsilon"] = self.example_epsilon
        if self.adaptive_clip is not None and sent:
            votes = [m.get(unclipped_key) for m in metrics]
            extra["dp_clip_norm"] = self.adaptive_clip.clip
            extra["dp_clip_next"] = self.adaptive_clip.update(
                [v == 1.0 for v in votes if v in (0.0, 1.0)])

    def state(self, merge: Any) -> dict[str, Any]:
        """JSON-able state (``merge``: the run's aggregate, whose merge count DP's noise
        draws follow)."""
        if self.ledger is None:
            return {"example_epsilon": self.example_epsilon}
        return {**self.ledger.state(), "merges": getattr(merge, "merges", 0),
                **({} if self.noise_key is None else {"noise_key": self.noise_key.hex()}),
                **({} if self.adaptive_clip is None
                   else {"adaptive_clip": self.adaptive_clip.state()})}

    def load_state(self, state: Mapping[str, Any], merge: Any) -> None:
        """Restore :meth:`state`'s output; the noise key in place, so the merge, the adaptive
        clip and the sampler (which hold this key) draw what the uninterrupted run would
        have drawn."""
        self.example_epsilon = float(state.get("example_epsilon", 0.0))
        if self.ledger is None:
            return
        self.ledger.load_state(state)
        if self.noise_key is not None:
            text = state.get("noise_key")
            try:
                if not isinstance(text, str):
                    raise ValueError(text)
                self.noise_key.restore(text)
            except ValueError:
                raise ValueError("the checkpoint's central-DP noise key (privacy.noise_key) is "
                                 "missing or malformed; a resumed run cannot draw its "
                                 "noise") from None
        if isinstance(merge, DpMean):
            merge.merges = int(state.get("merges", 0))
        if self.adaptive_clip is not None and "adaptive_clip" in state:
            self.adaptive_clip.load_state(state["adaptive_clip"])
