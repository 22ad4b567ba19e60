"""Colluding nodes for tests and experiments: replies rewritten as an attacker would send them.

A :class:`Colluders` object rewrites the uploads of a chosen set of nodes after they trained
honestly, so a run plays the same rounds with and without attackers. Every forged upload is
well-formed and exactly what the round asked for (the codec, block, versions and dtypes of the
honest upload it replaces), so only the update screen and the aggregator stand in its way.

Attacks (``kind``):

- ``"push"``: the block moved along one fixed-sign direction (the same for every colluder and
  every round, so the pushes add up), its size just under every bound the attacker knows the
  server applies: ``margin`` x the smaller of ``outlier-factor`` x the screen's reference and
  ``max-update-ratio`` x the block's own RMS (the adaptive attacker: it reads the server's
  screen, as a white-box attacker who knows the rule and the history would).
- ``"flip"``: the node's own honest update reversed and scaled by ``scale`` (no knowledge of
  the screen).

Operator-side only, like the rest of :mod:`fedcybgd.harness`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message

from fedcybgd import protocol
from fedcybgd.client.app import app as client_app
from fedcybgd.compression import decode, encode, read_header
from fedcybgd.config import RunConfig
from fedcybgd.core.checksum import content_checksum
from fedcybgd.harness.faults import set_upload, upload_of
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_model
from fedcybgd.server.app import build_strategy
from fedcybgd.server.common import Evaluator
from fedcybgd.strategies.screen import l2_norm, numel

ATTACKS: tuple[str, ...] = ("push", "flip")


@dataclass
class Colluders:
    """Rewrite the uploads of ``nodes`` (see the module docstring).

    Parameters
    ----------
    nodes : set of int
        The colluding node ids.
    kind : str
        One of :data:`ATTACKS`.
    margin : float
        ``push``: the share of the tightest known bound the forged update's RMS takes.
    scale : float
        ``flip``: how many times its honest update a node sends, reversed.
    seed : int
        Seeds the shared direction.
    """

    nodes: set[int]
    kind: str = "push"
    margin: float = 0.95
    scale: float = 4.0
    seed: int = 1234
    forged: int = field(default=0, init=False)  # uploads rewritten so far
    _direction: dict[str, torch.Tensor] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.kind not in ATTACKS:
            raise ValueError(f"attack {self.kind!r}: choose one of {list(ATTACKS)}")

    def direction(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The fixed-sign unit-RMS direction of parameter ``name`` (the same every round)."""
        if name not in self._direction:
            gen = torch.Generator().manual_seed(self.seed + sum(map(ord, name)))
            signs = torch.randint(0, 2, like.shape, generator=gen).float() * 2 - 1
            self._direction[name] = signs
        return self._direction[name]

    def bound(self, strategy: object, block: str, start: dict[str, torch.Tensor]) -> float:
        """The largest update RMS the server's screen accepts for ``block`` now."""
        screen = strategy.screen  # type: ignore[attr-defined]
        own = l2_norm(start) / math.sqrt(max(numel(start), 1))
        limits = [math.inf]
        ratio = getattr(screen, "max_ratio", 0.0)  # a screen without the block-relative bound
        if ratio:
            limits.append(ratio * own)
        ref = screen.reference(block) if screen.outlier_factor else None
        if ref is not None:
            limits.append(screen.outlier_factor * ref)
        if len(limits) == 1:  # nothing bounds it: as large as the block itself
            limits.append(own)
        return min(limits)

    def forge(self, strategy: object, reply: Message) -> None:
        """Rewrite ``reply``'s upload in place (a reply that carries none is left alone)."""
        if reply.has_error() or protocol.UPLOAD not in reply.content.array_records:
            return
        block, payload = upload_of(reply)
        header = read_header(payload, max_bytes=len(payload))
        start = {k: v.detach().clone() for k, v in
                 strategy.block_tensors(block).items()}  # type: ignore[attr-defined]
        base = start if header.codec.needs_base else None
        if self.kind == "push":
            size = self.margin * self.bound(strategy, block, start)
            sent = {k: start[k] + size * self.direction(k, t) for k, t in start.items()}
        else:
            trained = decode(payload, base=base, expect_block=block,
                             max_bytes=len(payload)).tensors
            sent = {k: start[k] - self.scale * (trained[k] - start[k]) for k in start}
        set_upload(reply, encode(sent, header.spec, block=block,
                                 target_version=header.target_version,
                                 base_version=header.base_version, base=base))
        self.forged += 1

    def __call__(self, strategy: object, replies: Iterable[Message]) -> None:
        """Forge every reply that comes from one of the colluding nodes."""
        for reply in replies:
            if reply.metadata.src_node_id in self.nodes:
                self.forge(strategy, reply)


class Federation:
    """A strategy built from ``config`` as the ServerApp builds it, its in-process nodes (one
    cache folder under ``tmp_path``) and an evaluator of the global model; :meth:`play` runs a
    round with an optional attack between the nodes' replies and the strategy."""

    def __init__(self, config: dict[str, Any], tmp_path: Path, nodes: int = 4) -> None:
        run = RunConfig.from_run_config(config)
        self.grid = LoopbackGrid(client_app, nodes, config,
                                 node_config=lambda i: {"cache-dir": str(tmp_path / "cache")})
        self.model = load_model(run.model)
        weights = dict(self.model.named_parameters())
        self.strategy = build_strategy(run, BlockMap(self.model, run.layers_per_block), weights,
                                       "byzantine", content_checksum(weights))
        self.strategy.node_wait_s = 5.0
        self.run = run
        self.pretrained = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.evaluator: Evaluator | None = None

    def replies(self, server_round: int) -> list[Message]:
        messages = list(self.strategy.configure_train(server_round, ArrayRecord(),
                                                      ConfigRecord(), self.grid))
        return list(self.grid.send_and_receive(messages))

    def play(self, server_round: int, attack: Any = None) -> Any:
        replies = self.replies(server_round)
        if attack is not None:
            attack(self.strategy, replies)
        self.strategy.aggregate_train(server_round, replies)
        return self.strategy.history[-1]

    def node_ids(self) -> list[int]:
        return sorted(self.grid.get_node_ids())

    def evaluate(self) -> Any:
        """The global model's evaluation (the run's task, ``eval-examples`` rows)."""
        if self.evaluator is None:
            self.evaluator = Evaluator(self.run, LayerStack(self.model))
        return self.evaluator()

    def eval_loss(self) -> float:
        return float(self.evaluate().loss)

    def drift(self) -> float:
        """How far the cycle's blocks moved from the pretrained model: the RMS of the
        difference over all their weights."""
        names = [n for b in self.strategy.cycle
                 for n in self.strategy.block_map.info(b).param_names]
        total = sum(float((self.strategy.weights[n].detach().double()
                           - self.pretrained[n].double()).square().sum()) for n in names)
        return math.sqrt(total / sum(self.pretrained[n].numel() for n in names))

    def block_rms(self, block: str) -> float:
        tensors = self.strategy.block_tensors(block)
        return l2_norm(tensors) / math.sqrt(numel(tensors))
