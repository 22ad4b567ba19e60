"""The server's step on a block: how far a round's merged client update moves the block.

The merged update of a block, ``delta = merged - start``, is a pseudo-gradient (FedOpt): the
server's optimizer turns it into the step it installs, per block.

- ``sgd``: ``new = start + size * delta``. With a step of exactly 1 the merged block is
  installed as it is, bit for bit (plain FedCyBGD).
- ``momentum``: heavy ball across the block's visits, ``m = beta1 * m + delta``,
  ``new = start + size * m`` (FedAvgM, per block).
- ``adam``: ``m``, ``v`` moments of ``delta`` with bias correction,
  ``new = start + size * m_hat / (sqrt(v_hat) + eps)`` (FedAdam, per block); here ``size`` is
  in weight units per coordinate, not a multiple of the clients' update.

``size = server_lr * damping(k)``, where ``k`` is the number of blocks installed in the same
round. Blocks trained in parallel each saw the others at their old values (a Jacobi step), so
installing all of them at full size overshoots where they interact; ``damping`` shrinks the
step by ``1/k`` (``inverse``) or ``1/sqrt(k)`` (``inverse-sqrt``).

A block's optimizer state changes only when the block is installed (a step whose result is not
finite leaves both alone), so it is checkpointed with the block's version.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from fedcybgd.choices import DAMPINGS, SERVER_OPTIMIZERS
from fedcybgd.config import ServerStepConfig
from fedcybgd.protocol.selfsync import sgd_step
from fedcybgd.strategies.replies import guarded
from fedcybgd.strategies.screen import all_finite, update_rms

Tensors = dict[str, torch.Tensor]


def damping_factor(kind: str, parallel: int) -> float:
    """The factor for ``parallel`` blocks installed together (``kind`` in DAMPINGS)."""
    if kind not in DAMPINGS:
        raise ValueError(f"parallel-damping = {kind!r}; choose one of {list(DAMPINGS)}")
    k = max(parallel, 1)
    if kind == "inverse":
        return 1.0 / k
    if kind == "inverse-sqrt":
        return 1.0 / math.sqrt(k)
    return 1.0


@dataclass
class Proposal:
    """A block's new tensors and the optimizer state that goes with them, not yet committed."""

    tensors: Tensors
    moments: dict[str, Tensors] = field(default_factory=dict)  # "m"/"v" -> name -> tensor
    steps: int = 0
    merged_rms: float = 0.0  # RMS of the merged client update (before the server's step)


class ServerStep:
    """The server's optimizer on merged blocks, with the parallel damping.

    Parameters
    ----------
    server_lr : float
        Step size (``sgd``/``momentum``: 1.0 installs what the clients made; ``adam``: the
        per-coordinate step in weight units).
    damping : str
        One of :data:`fedcybgd.choices.DAMPINGS`.
    optimizer : str
        One of :data:`fedcybgd.choices.SERVER_OPTIMIZERS`.
    beta1, beta2, eps : float
        Momentum / Adam's first-moment decay, Adam's second-moment decay and its epsilon.
    """

    def __init__(self, server_lr: float = 1.0, damping: str = "none", optimizer: str = "sgd",
                 beta1: float = 0.9, beta2: float = 0.99, eps: float = 1e-8) -> None:
        if not 0 < server_lr < math.inf:
            raise ValueError(f"server-lr must be finite and > 0, got {server_lr}")
        if optimizer not in SERVER_OPTIMIZERS:
            raise ValueError(f"server-optimizer = {optimizer!r}; choose one of "
                             f"{list(SERVER_OPTIMIZERS)}")
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1 and 0 < eps < math.inf):
            raise ValueError(f"server optimizer needs 0 <= beta1, beta2 < 1 and eps > 0, got "
                             f"{beta1}, {beta2}, {eps}")
        damping_factor(damping, 1)
        self.server_lr, self.damping, self.optimizer = server_lr, damping, optimizer
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.moments: dict[str, dict[str, Tensors]] = {}  # block -> "m"/"v" -> name -> fp32
        self.steps: dict[str, int] = {}  # block -> steps taken (Adam's bias correction)

    @classmethod
    def from_config(cls, config: ServerStepConfig) -> ServerStep:
        """The step the run config's ``server-*`` keys describe."""
        return cls(config.lr, config.damping, config.optimizer, config.beta1, config.beta2,
                   config.eps)

    def size(self, parallel: int) -> float:
        """The step for a round that installs ``parallel`` blocks."""
        return self.server_lr * damping_factor(self.damping, parallel)

    @torch.no_grad()
    def propose(self, block: str, start: Mapping[str, torch.Tensor],
                merged: dict[str, torch.Tensor], parallel: int) -> Proposal:
        """The block to install and its optimizer state after the step (nothing is changed
        until :meth:`commit`)."""
        size = self.size(parallel)
        if self.optimizer == "sgd":
            # the one function a self-syncing node runs too (bit for bit the same block)
            return Proposal(sgd_step(start, merged, size))
        old = self.moments.get(block, {})
        steps = self.steps.get(block, 0) + 1
        m: Tensors = {}
        v: Tensors = {}
        out: Tensors = {}
        for name, t in merged.items():
            base = start[name].float()
            delta = t.float() - base
            m_old = old.get("m", {}).get(name)
            if self.optimizer == "momentum":
                m[name] = delta if m_old is None else self.beta1 * m_old + delta
                out[name] = (base + size * m[name]).to(t.dtype)
                continue
            v_old = old.get("v", {}).get(name)
            m[name] = (1 - self.beta1) * delta + (0 if m_old is None else self.beta1 * m_old)
            v[name] = (1 - self.beta2) * delta * delta + (0 if v_old is None
                                                          else self.beta2 * v_old)
            m_hat = m[name] / (1 - self.beta1**steps)
            v_hat = v[name] / (1 - self.beta2**steps)
            out[name] = (base + size * m_hat / (v_hat.sqrt() + self.eps)).to(t.dtype)
        moments = {"m": m, "v": v} if v else {"m": m}
        return Proposal(out, moments, steps)

    def commit(self, block: str, proposal: Proposal) -> None:
        """Keep ``proposal``'s optimizer state: its block was installed."""
        if proposal.moments:
            self.moments[block] = proposal.moments
            self.steps[block] = proposal.steps

    def apply(self, start: Mapping[str, torch.Tensor], merged: dict[str, torch.Tensor],
              parallel: int, block: str = "") -> dict[str, torch.Tensor]:
        """Propose and commit at once; the block's new tensors."""
        proposal = self.propose(block, start, merged, parallel)
        self.commit(block, proposal)
        return proposal.tensors

    # Checkpointing: the moments as flat tensor maps per block, the step counts as JSON.
    def state_tensors(self) -> dict[str, Tensors]:
        """Block -> its moments as ``"m.<param>"``/``"v.<param>"`` tensors."""
        return {block: {f"{kind}.{name}": t for kind, ts in moments.items()
                        for name, t in ts.items()}
                for block, moments in self.moments.items()}

    def load_tensors(self, block: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore one block's moments from :meth:`state_tensors`' entry."""
        moments: dict[str, Tensors] = {}
        for key, t in tensors.items():
            kind, _, name = key.partition(".")
            if kind not in ("m", "v", "r") or not name:  # r: quantized install's residual
                raise ValueError(f"server optimizer state of block {block} has tensor {key!r}")
            moments.setdefault(kind, {})[name] = t.float()
        self.moments[block] = moments

    def state(self) -> dict[str, int]:
        """JSON-able step counts."""
        return dict(self.steps)

    def load_state(self, steps: Mapping[str, int]) -> None:
        """Restore :meth:`state`'s output."""
        self.steps = {str(b): int(n) for b, n in steps.items()}


def merge_block(aggregate: Callable[[Sequence[tuple[float, Tensors]]], Tensors], step: ServerStep,
                block: str, start: Mapping[str, torch.Tensor],
                uploads: Sequence[tuple[float, Tensors]], parallel: int) -> Proposal | None:
    """What a block becomes: its uploads merged by ``aggregate``, cast to the block's dtypes,
    moved by ``step`` (``parallel`` blocks move this round); ``None`` if that is not finite in
    the block's dtypes (e.g. finite fp32 values that overflow fp16/bf16). The proposal is
    committed by the caller once the block is installed. The proposal's ``merged_rms`` is the
    size of the merged update itself (what the update screen's reference is made of)."""
    merged = guarded(lambda: aggregate(uploads))
    cast = {name: merged[name].to(start[name].dtype) for name in start}
    if not all_finite(cast):
        return None
    proposal = step.propose(block, start, cast, parallel)
    proposal.merged_rms = update_rms(cast, start)
    return proposal if all_finite(proposal.tensors) else None
