"""FedCyBGD: federated cycle block gradient descent as a Flower Message-API strategy.

Each round, ``clients-per-round`` nodes are sampled and ``clients-per-round /
clients-per-block`` distinct blocks are taken from a cycle over the model's blocks; every block
goes to ``clients-per-block`` nodes, which train only it and upload only it. Distinct blocks
train in parallel and are merged (a Jacobi step over disjoint blocks); the copies of one block
are averaged, weighted by examples. A block whose clients all failed goes back to the front of
the queue, so a cycle never skips a block.

The server keeps a version per block (the round it last changed) and, per node, what that node
holds, from the node's own replies. A node downloads only the blocks whose version it lacks.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedcybgd import protocol
from fedcybgd.blocks import BlockMap
from fedcybgd.checksum import content_checksum
from fedcybgd.compression import (
    decode,
    encode,
    payload_from_array,
    payload_to_array,
    raw_fp32_bytes,
    read_header,
    seedlog,
    uses_base,
)
from fedcybgd.compression.header import MAX_HEADER_BYTES
from fedcybgd.protocol import Holding
from fedcybgd.strategies.aggregate import Aggregator, Upload, build_aggregator
from fedcybgd.strategies.node_keys import NodeKeys
from fedcybgd.strategies.replies import (
    BAD_PAYLOAD,
    BAD_SEEDLOG,
    CLIENT_ERROR,
    MALFORMED,
    NO_REPLY,
    NON_FINITE,
    NOT_TRAINED,
    REPLAY_FAILED,
    DropLog,
    Dropped,
    bounded,
    examples_weight,
    guarded,
    number,
    only_records,
    scalar_metrics,
    text,
)
from fedcybgd.strategies.schedule import BlockSchedule
from fedcybgd.strategies.screen import UpdateScreen, all_finite
from fedcybgd.strategies.server_step import ServerStep

log = logging.getLogger(__name__)


@dataclass
class RoundLog:
    """What happened in one round; the server turns it into a ``metrics.jsonl`` line."""

    round: int
    blocks: list[str] = field(default_factory=list)
    clients: list[int] = field(default_factory=list)
    update_rules: list[str] = field(default_factory=list)
    failed_blocks: list[str] = field(default_factory=list)
    bytes_down: int = 0
    bytes_up: int = 0
    bytes_down_raw: int = 0
    bytes_up_raw: int = 0
    train_loss: float | None = None
    client_peak_mem_mb: float = 0.0
    client_train_s: float = 0.0
    examples: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> assignments that failed
    accepted: dict[str, list[int]] = field(default_factory=dict)  # installed block -> its nodes


class FedCyBGD(Strategy):
    """Cycle block gradient descent over Flower nodes.

    Parameters
    ----------
    block_map : BlockMap
        The model's block partition (names and the parameter names each block owns).
    weights : Mapping[str, torch.Tensor]
        The global weights by parameter name. Updated in place, so passing a model's own
        parameters keeps that model current (the server evaluates it directly).
    cycle : list[str], optional
        Blocks to train, in model order. Default: every block.
    block_schedule : str
        ``ascending``, ``descending`` or ``random``.
    clients_per_round, clients_per_block : int
        Nodes per round, and nodes sharing (and averaging) one block.
    update_rule : str
        Rule the clients are asked to use (a node may override it for itself).
    upload_codec : str
        Codec spec (see :mod:`fedcybgd.compression`) of uploads: a ``delta`` is against the
        block the client started from. ``"seedlog"`` asks zeroth-order clients for their step
        log, which the server replays; others send weights through ``seedlog_fallback``.
    download_codec : str
        Codec spec for blocks a node only needs frozen; a lossy spec leaves the node an
        approximate copy, marked as such by its checksum.
    exact_codec : str
        Lossless codec spec for the block a node will train (default: exact XOR delta + zstd).
    download_fraction : float
        The paper's random dropping: the fraction of a node's stale frozen blocks it is sent
        each round (1.0 sends all). The node's own block is always sent.
    version_history : int
        Past exact versions kept per block, so a node holding one of them gets a delta against
        it; otherwise deltas are against the pretrained block.
    rule_for_budget : Callable[[str, str, float], str | None], optional
        ``(preferred rule, block, budget MB) -> rule`` that fits the budget, or ``None``; see
        :func:`fedcybgd.memory_model.fitting_rule`. Nodes report their budget in their replies;
        from then on each gets only assignments whose estimated peak fits.
    pretrained : Callable[[str], dict[str, torch.Tensor]], optional
        Reads a block's pretrained tensors (e.g. from the model's safetensors files). Without
        it the strategy keeps a copy of each block before first overwriting it.
    seed : int
        Seeds node sampling, block order and the clients' round seeds.
    lineage, base_hash : str
        Identity of this model history and hash of the pretrained weights it started from.
    max_payload_bytes : int
        Uploads larger than this are rejected (each block also has its own bound, derived
        from its size).
    node_wait_s : float
        How long to wait for enough nodes to connect (nodes the strategy has excluded count as
        connected: waiting is only for nodes that have not connected yet).
    local_steps, batch_size : int
        What a node is asked to do per round: a seed log may have at most ``local_steps``
        steps, and a reply's ``num-examples`` counts at most ``local_steps * batch_size``.
    aggregate : str or Aggregator
        How the uploads of one block merge (``clients_per_block > 1``): ``"mean"`` (weighted
        by examples), ``"median"``, ``"trimmed-mean"``, or a callable (see
        :mod:`fedcybgd.strategies.aggregate`).
    trim_fraction : float
        Fraction trimmed at each end by ``"trimmed-mean"``.
    max_update_norm, outlier_factor : float
        Update admission (see :class:`fedcybgd.strategies.screen.UpdateScreen`): clip each
        node's block delta to this L2 norm (0: off); refuse a delta this many times larger
        than the block's recent accepted ones (0: off).
    server_lr, parallel_damping : float, str
        The server's step on each merged block (see
        :class:`fedcybgd.strategies.server_step.ServerStep`).
    client_lr : Callable[[int], float], optional
        ``round -> learning rate`` sent to the clients (see
        :mod:`fedcybgd.strategies.lr_schedule`); without it clients use their run config's.
    return_arrays : bool
        Return the full global weights from :meth:`aggregate_train`, as ``Strategy.start``
        expects. A ServerApp reading ``weights`` directly turns this off to skip the copy.
    """

    def __init__(
        self,
        *,
        block_map: BlockMap,
        weights: Mapping[str, torch.Tensor],
        cycle: list[str] | None = None,
        block_schedule: str = "ascending",
        clients_per_round: int = 4,
        clients_per_block: int = 1,
        update_rule: str = "fo",
        upload_codec: str = "fp32",
        download_codec: str = "fp32",
        exact_codec: str = "xor+zstd",
        seedlog_fallback: str = "delta+int8+zstd",
        download_fraction: float = 1.0,
        version_history: int = 2,
        pretrained: Callable[[str], dict[str, torch.Tensor]] | None = None,
        rule_for_budget: Callable[[str, str, float], str | None] | None = None,
        seed: int = 0,
        lineage: str = "default",
        base_hash: str = "",
        max_payload_bytes: int = 2**31,
        node_wait_s: float = 300.0,
        return_arrays: bool = True,
        local_steps: int = 6,
        batch_size: int = 8,
        aggregate: str | Aggregator = "mean",
        trim_fraction: float = 0.2,
        max_update_norm: float = 0.0,
        outlier_factor: float = 10.0,
        server_lr: float = 1.0,
        parallel_damping: str = "none",
        client_lr: Callable[[int], float] | None = None,
    ) -> None:
        if clients_per_round < 1 or clients_per_block < 1:
            raise ValueError("clients-per-round and clients-per-block must be >= 1")
        if not 0 < download_fraction <= 1:
            raise ValueError(f"download-fraction must be in (0, 1], got {download_fraction}")
        if version_history < 0:
            raise ValueError(f"version-history must be >= 0, got {version_history}")
        if clients_per_round % clients_per_block:
            raise ValueError(
                f"clients-per-round ({clients_per_round}) must be a multiple of "
                f"clients-per-block ({clients_per_block})"
            )
        self.block_map = block_map
        self.weights = dict(weights)
        self.schedule = BlockSchedule(cycle or block_map.names, block_schedule, seed)
        self.clients_per_round = clients_per_round
        self.clients_per_block = clients_per_block
        self.update_rule = update_rule
        self.upload_codec = upload_codec
        self.download_codec = download_codec
        self.exact_codec = exact_codec
        self.seedlog_fallback = seedlog_fallback
        self.download_fraction = download_fraction
        self.version_history = version_history
        self._read_pretrained = pretrained
        self.rule_for_budget = rule_for_budget
        self.budgets: dict[int, float] = {}  # node -> declared memory budget (MB)
        self._pristine: dict[str, dict[str, torch.Tensor]] = {}
        self._kept: dict[str, dict[Holding, dict[str, torch.Tensor]]] = {}
        self.seed = seed
        self.lineage = lineage
        self.base_hash = base_hash
        self.max_payload_bytes = max_payload_bytes
        self.node_wait_s = node_wait_s
        self.return_arrays = return_arrays
        if local_steps < 1 or batch_size < 1:
            raise ValueError("local-steps and batch-size must be >= 1")
        self.local_steps = local_steps
        self.batch_size = batch_size
        self.aggregate = (build_aggregator(aggregate, trim_fraction)
                          if isinstance(aggregate, str) else aggregate)
        self.screen = UpdateScreen(outlier_factor=outlier_factor, max_norm=max_update_norm)
        self.step = ServerStep(server_lr, parallel_damping)
        self.client_lr = client_lr

        self.versions: dict[str, int] = {name: 0 for name in block_map.names}
        self.checksums: dict[str, str] = {}  # block -> checksum of its current (version > 0)
        self.holdings: dict[int, dict[str, Holding]] = {}  # node -> what it holds
        self.excluded: dict[int, str] = {}  # node -> why it takes no part
        self.history: list[RoundLog] = []
        self._assigned: dict[int, str] = {}  # node -> block, for the round in flight
        self._sent: list[Message] = []  # this round's instructions (ids are set on push)
        # A re-queued block keeps its seed, so a client can resume its in-round checkpoint.
        self._retry_seeds: dict[str, int] = {}
        self._seeds: dict[int, int] = {}  # node -> seed, for the round in flight
        self._pairs: list[tuple[int, str, str]] = []  # (node, block, rule) in flight
        self._returned: ArrayRecord | None = None

    # ----------------------------------------------------------------- global model access
    def block_tensors(self, block: str) -> dict[str, torch.Tensor]:
        """The global tensors of ``block`` (views, not copies)."""
        return {name: self.weights[name] for name in self.block_map.info(block).param_names}

    def install_checkpoint(self, block: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Put a checkpointed block into the global weights (before :meth:`load_state`).

        Its pretrained tensors are kept first when no reader can bring them back, since
        deltas to nodes are taken against them.
        """
        if self._read_pretrained is None and block not in self._pristine:
            self._pristine[block] = {k: v.detach().clone()
                                     for k, v in self.block_tensors(block).items()}
        target = self.block_tensors(block)
        if set(tensors) != set(target):
            raise ValueError(f"checkpoint of block '{block}' has tensors {sorted(tensors)}")
        with torch.no_grad():
            for name, tensor in target.items():
                tensor.copy_(tensors[name])

    def _load_arrays(self, arrays: ArrayRecord) -> None:
        state = arrays.to_torch_state_dict()
        missing = set(self.weights) - set(state)
        if missing:
            raise ValueError(f"initial arrays lack parameters {sorted(missing)[:5]} ...")
        with torch.no_grad():
            for name, tensor in self.weights.items():
                tensor.copy_(state[name])

    # ----------------------------------------------------------------------- node handling
    @functools.cached_property
    def node_keys(self) -> NodeKeys:
        """Node id -> stable key (see :mod:`fedcybgd.strategies.node_keys`): sampling order and
        seeds follow the keys, so a seed gives the same run whatever ids Flower assigns."""
        return NodeKeys()

    def _sample_nodes(self, grid: Grid, server_round: int) -> list[int]:
        deadline = time.monotonic() + self.node_wait_s
        while True:
            connected = sorted(grid.get_node_ids())
            usable = [n for n in connected if n not in self.excluded]
            # An excluded node is present but useless: waiting is only for nodes that have not
            # connected yet.
            if len(connected) >= self.clients_per_round or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        if len(usable) < self.clients_per_block:
            raise RuntimeError(
                f"round {server_round}: {len(usable)} usable nodes connected, fewer than "
                f"clients-per-block={self.clients_per_block}"
            )
        # Nodes in key order, not id order; a node that has not told its key sits out.
        self.node_keys.learn(grid, usable, server_round)
        nodes = self.node_keys.order(usable)
        count = min(self.clients_per_round, len(nodes) // self.clients_per_block
                    * self.clients_per_block)
        if count < self.clients_per_round:
            log.warning(
                "round %d: only %d usable nodes (%d with a node key) for clients-per-round=%d; "
                "training %d blocks", server_round, len(usable), len(nodes),
                self.clients_per_round, count // self.clients_per_block,
            )
        rng = random.Random(f"{self.seed}:nodes:{server_round}")
        return rng.sample(nodes, count)

    def _node_seed(self, server_round: int, node: int) -> int:
        ident = self.node_keys.ident(node)
        return random.Random(f"{self.seed}:client:{server_round}:{ident}").randrange(2**31)

    # --------------------------------------------------------------------------- training
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per sampled node: its block, and the blocks it must download."""
        if len(arrays) and arrays is not self._returned:
            self._load_arrays(arrays)
        nodes = self._sample_nodes(grid, server_round)
        blocks = self.schedule.take(len(nodes) // self.clients_per_block)
        nodes = nodes[: len(blocks) * self.clients_per_block]
        self._assigned = {}
        self._round = RoundLog(server_round)
        payloads: dict[tuple[Any, ...], bytes] = {}
        messages = []
        pairs = self._pairs = self._match(nodes, blocks)
        self._seeds = {}
        for node, block, rule in pairs:
            self._assigned[node] = block
            retry = self._retry_seeds.pop(block, None) if self.clients_per_block == 1 else None
            self._seeds[node] = retry if retry is not None else self._node_seed(
                server_round, node)
            download, expect = self._plan_download(server_round, node, block, payloads)
            cfg = ConfigRecord(dict(config))
            cfg.update(
                {
                    protocol.ROUND: server_round,
                    protocol.BLOCK: block,
                    protocol.RULE: rule,
                    protocol.SEED: self._seeds[node],
                    protocol.LINEAGE: self.lineage,
                    protocol.BASE_HASH: self.base_hash,
                    protocol.EXPECT: protocol.dump_holdings(expect),
                    protocol.UPLOAD_CODEC: self.upload_codec,
                    protocol.LOCAL_STEPS: self.local_steps,
                }
            )
            if self.client_lr is not None:
                cfg[protocol.LR] = float(self.client_lr(server_round))
            if self.upload_codec == protocol.SEEDLOG:
                cfg.update({protocol.ZO_FINGERPRINT: seedlog.z_fingerprint(),
                            protocol.ZO_TORCH: torch.__version__,
                            protocol.SEEDLOG_FALLBACK: self.seedlog_fallback})
            content = RecordDict({protocol.CONFIG: cfg, protocol.DOWNLOAD: download})
            messages.append(
                Message(content, dst_node_id=node, message_type=MessageType.TRAIN,
                        group_id=str(server_round))
            )
        self._round.blocks = list(blocks)
        self._round.clients = [node for node, _, _ in pairs]
        for block in blocks:
            if block not in self._assigned.values():
                log.info("round %d: no sampled node can fit block %s; re-queued",
                         server_round, block)
        self._sent = messages
        return messages

    def _match(self, nodes: list[int], blocks: list[str]) -> list[tuple[int, str, str]]:
        """Pair nodes with blocks (``clients_per_block`` each) and pick each node's rule.

        Without budgets every node gets the run's rule. With budgets, the roomiest nodes take
        the blocks the preferred rule finds most expensive (the lowest layers, for ``fo``), and
        each node gets the first rule that fits; a node that fits nothing sits the round out.
        """
        if self.rule_for_budget is None or not any(n in self.budgets for n in nodes):
            return [(node, blocks[i // self.clients_per_block], self.update_rule)
                    for i, node in enumerate(nodes)]
        roomy = sorted(nodes, key=lambda n: -self.budgets.get(n, math.inf))
        ordered = sorted(blocks, key=self.block_map.lowest_layer_of)
        pairs = []
        for i, node in enumerate(roomy):
            block = ordered[i // self.clients_per_block]
            budget = self.budgets.get(node, 0.0)
            rule = self.rule_for_budget(self.update_rule, block, budget) if budget else (
                self.update_rule)
            if rule is not None:
                pairs.append((node, block, rule))
        return pairs

    def pretrained_block(self, block: str) -> dict[str, torch.Tensor]:
        """Version 0 of ``block``: what every node has without downloading anything."""
        if block in self._pristine:
            return self._pristine[block]
        if self._read_pretrained is not None:
            return self._read_pretrained(block)
        return self.block_tensors(block)  # never overwritten yet: still pretrained

    def _base_for(
        self, block: str, held: Holding | None
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """The best delta base a node has: its exact held version if we kept it, else v0."""
        if held is not None:
            if held == self.current(block):
                return held.version, self.block_tensors(block)
            kept = self._kept.get(block, {}).get(held)
            if kept is not None:
                return held.version, kept
        return 0, self.pretrained_block(block)

    def current(self, block: str) -> Holding | None:
        """The global version of ``block`` as a holding (``None`` while pretrained)."""
        version = self.versions[block]
        return Holding(version, self.checksums[block]) if version else None

    def _plan_download(
        self, server_round: int, node: int, assigned: str, payloads: dict[tuple[Any, ...], bytes]
    ) -> tuple[ArrayRecord, dict[str, Holding]]:
        """Payloads a node needs and what it will hold after applying them.

        The assigned block must arrive exact. A frozen block the node lacks comes through
        ``download_codec`` (possibly lossy, then the node's copy is approximate); a frozen block
        already held at the current version, even approximately, is not sent again.
        """
        held = self.holdings.get(node, {})
        download = ArrayRecord()
        expect: dict[str, Holding] = {}
        stale: list[str] = []
        exact: list[str] = []
        for block in self.block_map.names:
            have, want = held.get(block), self.current(block)
            if have == want:
                pass
            elif block == assigned:
                exact.append(block)
            elif want is not None and have is not None and have.version == want.version:
                pass  # an approximate copy of the current version is good enough frozen
            else:
                stale.append(block)
            if have is not None:
                expect[block] = have
        if self.download_fraction < 1 and stale:
            rng = random.Random(f"{self.seed}:drop:{server_round}:{node}")
            stale = rng.sample(stale, math.ceil(self.download_fraction * len(stale)))
        for block, spec in [(b, self.exact_codec) for b in exact] + [
            (b, self.download_codec) for b in stale
        ]:
            base_version, base = self._base_for(block, held.get(block))
            key = (block, self.versions[block], spec, base_version, held.get(block))
            if key not in payloads:
                payloads[key] = encode(
                    self.block_tensors(block),
                    spec,
                    block=block,
                    target_version=self.versions[block],
                    base_version=base_version,
                    base=base if uses_base(spec) else None,
                )
            payload = payloads[key]
            download[block] = payload_to_array(payload)
            expect[block] = Holding(self.versions[block],
                                    read_header(payload, max_bytes=len(payload)).checksum)
            self._round.bytes_down += len(payload)
            self._round.bytes_down_raw += raw_fp32_bytes(self.block_tensors(block))
        return download, expect

    def payload_limit(self, block: str) -> int:
        """The most bytes an upload of ``block`` may have: ``max_payload_bytes``, and at most
        what any codec of ours makes of the block (3x its fp32 size, for top-k's indices) plus
        a full header."""
        own = 3 * raw_fp32_bytes(self.block_tensors(block)) + MAX_HEADER_BYTES + 64
        return min(self.max_payload_bytes, own)

    def _note_state(self, node: int, state: Mapping[str, Any]) -> str:
        """Take what the node says it holds and its budget; return its status."""
        try:
            self.holdings[node] = protocol.load_holdings(text(state, protocol.HOLDINGS,
                                                              max_len=1 << 20))
        except (Dropped, ValueError, TypeError, RecursionError) as err:
            log.warning("node %d sent unreadable holdings (%s); will resync it", node, err)
            self.holdings.pop(node, None)
        budget = number(state, protocol.MEMORY_BUDGET, low=0.0, high=1e9, default=0.0)
        if budget > 0:
            self.budgets[node] = budget
        return text(state, protocol.STATUS, default="", max_len=64)

    def _read_reply(
        self, reply: Message, node: int, block: str
    ) -> tuple[float, dict[str, torch.Tensor], dict[str, float], str]:
        """Read one reply through the gate: ``(weight, tensors, metrics, rule used)``, or
        :class:`Dropped`."""
        if reply.has_error():
            raise Dropped(CLIENT_ERROR, str(reply.error.reason)[:500])
        content = reply.content
        state = content.config_records.get(protocol.STATE)
        if state is None:
            raise Dropped(MALFORMED, "no state record")
        status = self._note_state(node, state)
        reason = text(state, protocol.REASON, default="")
        if status == protocol.REJECTED:
            self.excluded[node] = reason[:500]
            log.warning("node %d takes no part: %s", node, self.excluded[node])
            raise Dropped(NOT_TRAINED, f"rejected: {reason[:200]}")
        if status != protocol.OK:
            raise Dropped(NOT_TRAINED, f"{status}: {reason[:200]}")
        only_records(content, arrays={protocol.UPLOAD}, metrics={protocol.METRICS},
                     configs={protocol.STATE})
        metrics = scalar_metrics(content.metric_records[protocol.METRICS])
        weight = examples_weight(metrics, protocol.NUM_EXAMPLES,
                                 self.local_steps * self.batch_size)
        for key in ("train_loss", "peak_mem_mb", "train_s"):
            metrics[key] = bounded(metrics, key, default=math.nan if key == "train_loss" else 0.0)
        upload = content.array_records[protocol.UPLOAD]
        if list(upload.keys()) != [block]:
            raise Dropped(MALFORMED, f"expected an upload of block '{block}', got "
                                     f"{list(upload)[:5]}")
        payload = guarded(lambda: payload_from_array(upload[block]), BAD_PAYLOAD)
        self._round.bytes_up += len(payload)
        limit = self.payload_limit(block)
        if len(payload) > limit:
            raise Dropped(BAD_PAYLOAD, f"upload of {len(payload)} bytes exceeds the block's "
                                       f"limit of {limit}")
        # the start of the client's training: blocks are installed after all replies
        start = self.block_tensors(block)
        kind = text(state, protocol.UPLOAD_KIND, default=protocol.WEIGHTS, max_len=16)
        if kind == protocol.SEEDLOG:
            if self.upload_codec != protocol.SEEDLOG:
                raise Dropped(BAD_SEEDLOG, "a seed log was sent, but weights were asked for")
            step_log = guarded(
                lambda: seedlog.decode_seedlog(payload, max_steps=self.local_steps), BAD_SEEDLOG)
            if step_log.block != block:
                raise Dropped(BAD_SEEDLOG, f"seed log is for block '{step_log.block[:64]}'")
            layout = seedlog.unit_layout(self.block_map, block)
            tensors = guarded(lambda: seedlog.replay(start, step_log, layout), REPLAY_FAILED)
        elif kind == protocol.WEIGHTS:
            tensors = guarded(lambda: decode(
                payload,
                base=start if uses_base(read_header(payload, max_bytes=limit).spec) else None,
                expect_block=block,
                expect_shapes={k: tuple(v.shape) for k, v in start.items()},
                max_bytes=limit,
            ).tensors, BAD_PAYLOAD)
        else:
            raise Dropped(MALFORMED, f"upload-kind {kind!r} is neither weights nor seedlog")
        if reason:
            log.info("node %d: %s", node, reason[:500])
        return weight, tensors, metrics, text(state, protocol.RULE, default="", max_len=64)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Admit each upload through the gate, merge each block's, install, re-queue the rest.

        No reply can end the round: whatever goes wrong reading one becomes a drop, counted by
        reason in the round's ``dropped``.
        """
        drops = DropLog(server_round)
        results: dict[str, list[tuple[float, dict[str, torch.Tensor], float]]] = {}
        senders: dict[str, list[int]] = {}
        losses: list[tuple[float, float]] = []
        # Replies are matched to this round's instructions by message id: an error reply made
        # by the SuperLink (e.g. the node died) comes from the SuperLink's own id, and a late
        # reply to an earlier round must not pass for this round's upload.
        by_id = {m.metadata.message_id: m.metadata.dst_node_id for m in self._sent}
        for reply in replies:
            node = by_id.get(reply.metadata.reply_to_message_id)
            block = self._assigned.pop(node, None) if node is not None else None
            if node is None or block is None:
                log.warning("round %d: ignored a reply from node %d that answers no open "
                            "instruction of this round (late, duplicate or forged)",
                            server_round, reply.metadata.src_node_id)
                continue
            try:
                weight, tensors, got, rule = guarded(
                    functools.partial(self._read_reply, reply, node, block))
                tensors, rms = guarded(functools.partial(
                    self.screen.admit, block, self.block_tensors(block), tensors))
            except Dropped as drop:
                drops.add(node, f"upload of block {block}", drop)
                continue
            results.setdefault(block, []).append((weight, tensors, rms))
            senders.setdefault(block, []).append(node)
            losses.append((weight, got["train_loss"]))
            self._round.examples += int(weight)
            self._round.bytes_up_raw += raw_fp32_bytes(tensors)
            self._round.update_rules.append(rule)
            self._round.client_peak_mem_mb = max(self._round.client_peak_mem_mb,
                                                 got["peak_mem_mb"])
            self._round.client_train_s = max(self._round.client_train_s, got["train_s"])
        for node, block in self._assigned.items():
            drops.add(node, f"upload of block {block}", Dropped(NO_REPLY, "timeout or lost"))
        self._assigned = {}

        block_seed = {block: self._seeds[node] for node, block, _ in self._pairs}
        installed = 0
        for block in self._round.blocks:
            uploads = results.get(block)
            if uploads and self._install(block, uploads, server_round, drops, len(results)):
                installed += 1
                self._round.accepted[block] = senders[block]
                continue
            self.schedule.requeue(block)
            if block in block_seed:
                self._retry_seeds[block] = block_seed[block]
            self._round.failed_blocks.append(block)
        finite = [(w, loss) for w, loss in losses if loss == loss]
        if finite:
            self._round.train_loss = sum(w * x for w, x in finite) / sum(w for w, _ in finite)
        self._round.dropped = drops.as_dict()
        self.history.append(self._round)

        metrics = MetricRecord(
            {
                "blocks_trained": installed,
                "blocks_failed": len(self._round.failed_blocks),
                "bytes_down": self._round.bytes_down,
                "bytes_up": self._round.bytes_up,
                "bytes_down_raw": self._round.bytes_down_raw,
                "bytes_up_raw": self._round.bytes_up_raw,
                "client_peak_mem_mb": self._round.client_peak_mem_mb,
                "dropped": sum(self._round.dropped.values()),
            }
        )
        if self._round.train_loss is not None:
            metrics["train_loss"] = self._round.train_loss
        if not installed or not self.return_arrays:
            return None, metrics
        self._returned = ArrayRecord(
            {k: v.detach().clone() for k, v in self.weights.items()}
        )
        return self._returned, metrics

    def _install(
        self,
        block: str,
        uploads: list[tuple[float, dict[str, torch.Tensor], float]],
        version: int,
        drops: DropLog,
        parallel: int,
    ) -> bool:
        """Merge ``block``'s admitted uploads, take the server's step (``parallel`` blocks move
        this round) and install the result; ``False`` if it is not finite in the model's
        dtypes (nothing is installed then)."""
        pairs: list[Upload] = [(w, t) for w, t, _ in uploads]
        merged = guarded(lambda: self.aggregate(pairs))
        target = self.block_tensors(block)
        merged = self.step.apply(target, {name: merged[name].to(target[name].dtype)
                                          for name in target}, parallel)
        if not all_finite(merged):
            # e.g. finite fp32 values that overflow the model's fp16/bf16
            for _ in uploads:
                drops.counts[NON_FINITE] += 1
            log.warning("block %s: the merged update is not finite in the model's dtypes; "
                        "nothing installed", block)
            return False
        previous = self.current(block)
        if previous is None:
            if self._read_pretrained is None:
                self._pristine[block] = {k: v.detach().clone() for k, v in target.items()}
        elif self.version_history:
            kept = self._kept.setdefault(block, {})
            kept[previous] = {k: v.detach().clone() for k, v in target.items()}
            while len(kept) > self.version_history:
                del kept[min(kept, key=lambda h: h.version)]
        with torch.no_grad():
            for name, tensor in merged.items():
                self.weights[name].copy_(tensor)
        self.versions[block] = version
        self.checksums[block] = content_checksum(self.block_tensors(block))
        for _, _, rms in uploads:
            self.screen.accepted(block, rms)
        return True

    # ------------------------------------------------------------------------- evaluation
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No federated evaluation: the server evaluates the global model itself."""
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Nothing to aggregate (see :meth:`configure_evaluate`)."""
        return None

    def summary(self) -> None:
        """Log the strategy's settings."""
        log.info(
            "FedCyBGD: %d blocks in the cycle (%s order), %d clients/round, %d clients/block, "
            "rule %s, upload %s, download %s",
            len(self.schedule.blocks), self.schedule.order, self.clients_per_round,
            self.clients_per_block, self.update_rule, self.upload_codec, self.download_codec,
        )

    # ------------------------------------------------------------------------- checkpoints
    def state(self) -> dict[str, Any]:
        """JSON-able state (weights are saved separately, per block)."""
        return {
            "versions": dict(self.versions),
            "checksums": dict(self.checksums),
            "schedule": self.schedule.state(),
            "holdings": {
                str(node): protocol.dump_holdings(h) for node, h in self.holdings.items()
            },
            "excluded": {str(node): why for node, why in self.excluded.items()},
            "budgets": {str(node): mb for node, mb in self.budgets.items()},
            "retry_seeds": dict(self._retry_seeds),
            "update_sizes": self.screen.state(),
            "node_keys": self.node_keys.state(),
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state`'s output (weights must be restored by the caller)."""
        self.versions.update({k: int(v) for k, v in state["versions"].items()})
        self.checksums = {k: str(v) for k, v in state["checksums"].items()}
        self.schedule.load_state(state["schedule"])
        self.holdings = {
            int(node): protocol.load_holdings(text) for node, text in state["holdings"].items()
        }
        self.excluded = {int(node): str(why) for node, why in state["excluded"].items()}
        self.budgets = {int(node): float(mb) for node, mb in state.get("budgets", {}).items()}
        self._retry_seeds = {str(b): int(s) for b, s in state.get("retry_seeds", {}).items()}
        self.screen.load_state(state.get("update_sizes", {}))
        self.node_keys.load_state(state.get("node_keys", {}))
