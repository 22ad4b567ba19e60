"""Which nodes take part in a round, and the seed each is given.

Nodes are sampled in the order of their stable keys (:mod:`fedcybgd.strategies.node_keys`), not
of the ids Flower assigns, and seeds derive from the keys, so a ``seed`` gives the same run in
every runtime. Only whole groups of ``per_block`` nodes are sampled (each block of a round gets
``per_block`` nodes).

Under central DP the accountant claims amplification by sampling, which holds only against
someone who cannot predict the sample: the round's sample is then drawn from the server's
secret :class:`~fedcybgd.protocol.dp.NoiseKey` instead of the run's ``seed`` (the rest of the run
stays reproducible from the seed; the sample is reproducible only from the checkpoint).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Container
from typing import Any

from flwr.serverapp import Grid

from fedcybgd.protocol.dp import NoiseKey
from fedcybgd.strategies.node_keys import NodeKeys

log = logging.getLogger(__name__)


class NodeSampler:
    """Sample a round's nodes and give each its seed.

    Parameters
    ----------
    seed : int
        The run's seed.
    secret : NoiseKey, optional
        Draw the samples from this server-side secret instead of ``seed`` (central DP).
    """

    def __init__(self, seed: int = 0, secret: NoiseKey | None = None) -> None:
        self.seed = seed
        self.secret = secret
        self.keys = NodeKeys()
        self.population = 0  # the usable, keyed nodes the last sample was drawn from

    def sample(self, grid: Grid, server_round: int, *, count: int, per_block: int,
               excluded: Container[int], wait_s: float) -> list[int]:
        """Up to ``count`` usable nodes (a multiple of ``per_block``), in sampling order.

        Waits up to ``wait_s`` for ``count`` nodes to connect; an excluded node counts as
        connected (it is present, just of no use), and a node that has not told its key sits
        the round out. A new node's first answer (its key) is given ``wait_s`` too: a cold
        start (a Ray worker or a phone loading torch and the app) may take minutes, and a node
        not keyed in time sits the round out.
        """
        deadline = time.monotonic() + wait_s
        while True:
            connected = sorted(grid.get_node_ids())
            usable = [n for n in connected if n not in excluded]
            if len(connected) >= count or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        if len(usable) < per_block:
            raise RuntimeError(f"round {server_round}: {len(usable)} usable nodes connected, "
                               f"fewer than clients-per-block={per_block}")
        self.keys.learn(grid, usable, server_round, timeout_s=max(self.keys.timeout_s, wait_s))
        nodes = self.keys.order(usable)
        self.population = len(nodes)
        take = min(count, len(nodes) // per_block * per_block)
        if take < count:
            log.warning("round %d: only %d usable nodes (%d with a node key) for "
                        "clients-per-round=%d; training %d blocks", server_round, len(usable),
                        len(nodes), count, take // per_block)
        draw = (self.secret.rng(f"nodes/{server_round}") if self.secret is not None
                else random.Random(f"{self.seed}:nodes:{server_round}"))
        return draw.sample(nodes, take)

    def seed_of(self, server_round: int, node: int) -> int:
        """``node``'s seed for ``server_round``, from its key."""
        ident = self.keys.ident(node)
        return random.Random(f"{self.seed}:client:{server_round}:{ident}").randrange(2**31)

    def state(self) -> dict[str, Any]:
        """JSON-able state: the keys learnt."""
        return self.keys.state()

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state`'s output."""
        self.keys.load_state(state)
