"""Reading a FedCyBGD train reply: what the node says of itself, and its block's upload.

Built on the reply gate (:mod:`fedcybgd.strategies.replies`): every field is checked and
anything wrong raises :class:`~fedcybgd.strategies.replies.Dropped` with a reason. A reply
carries the node's state (the block versions it holds, its memory budget, its status) and, when
it trained, one upload of its assigned block: weights through a codec, or a zeroth-order step
log that the server replays on the block the node started from.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import Message

from fedcybgd import protocol
from fedcybgd.compression import (
    decode,
    parse_spec,
    payload_from_array,
    raw_fp32_bytes,
    read_header,
    uses_base,
)
from fedcybgd.compression.header import MAX_HEADER_BYTES, PayloadHeader
from fedcybgd.compression.tensors import dtype_name
from fedcybgd.model.blocks import BlockMap
from fedcybgd.protocol import Holding, seedlog, selfsync, zeroth_order
from fedcybgd.strategies.record import RoundRecord
from fedcybgd.strategies.replies import (
    BAD_PAYLOAD,
    BAD_SEEDLOG,
    CLIENT_ERROR,
    MALFORMED,
    MISMATCH,
    NOT_TRAINED,
    REPLAY_FAILED,
    Dropped,
    bounded,
    examples_weight,
    guarded,
    number,
    only_records,
    scalar_metrics,
    text,
)
from fedcybgd.strategies.versions import BlockVersions

log = logging.getLogger(__name__)


@dataclass
class NodeBook:
    """What the server knows of each node, from its own replies."""

    holdings: dict[int, dict[str, Holding]] = field(default_factory=dict)  # node -> held
    budgets: dict[int, float] = field(default_factory=dict)  # node -> memory budget (MB)
    excluded: dict[int, str] = field(default_factory=dict)  # node -> why it takes no part
    # node -> blocks it self-syncs (credited in ``holdings``; told in its next instruction)
    promised: dict[int, dict[str, selfsync.Promotion]] = field(default_factory=dict)
    zo: dict[int, str] = field(default_factory=dict)  # node -> its "<torch>|<z fingerprint>"
    # Nodes sent instructions in a round a killed server lost (fedcybgd.server.resume): each may
    # or may not have applied that round's downloads, so ``holdings`` is unconfirmed for them
    # until their next reply.
    unconfirmed: set[int] = field(default_factory=set)

    def state(self) -> dict[str, Any]:
        """JSON-able state (node ids as strings)."""
        return {
            "holdings": {str(n): protocol.dump_holdings(h) for n, h in self.holdings.items()},
            "excluded": {str(n): why for n, why in self.excluded.items()},
            "budgets": {str(n): mb for n, mb in self.budgets.items()},
            "promised": {str(n): selfsync.dump_promotions(p) for n, p in self.promised.items()},
            "zo": {str(n): zo for n, zo in self.zo.items()},
            "unconfirmed": sorted(str(n) for n in self.unconfirmed),
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state`'s output."""
        self.holdings = {int(n): protocol.load_holdings(t) for n, t in state["holdings"].items()}
        self.excluded = {int(n): str(why) for n, why in state["excluded"].items()}
        self.budgets = {int(n): float(mb) for n, mb in state.get("budgets", {}).items()}
        self.promised = {int(n): selfsync.load_promotions(t)
                         for n, t in state.get("promised", {}).items()}
        self.zo = {int(n): str(zo) for n, zo in state.get("zo", {}).items()}
        unconfirmed = state.get("unconfirmed", [])
        if not isinstance(unconfirmed, list) or \
                not all(isinstance(n, str) and n.isdecimal() for n in unconfirmed):
            raise ValueError(f"unconfirmed nodes = {unconfirmed!r:.80}, expected a list of "
                             "node ids")
        self.unconfirmed = {int(n) for n in unconfirmed}


@dataclass
class BlockUpload:
    """An upload that passed the gate: the trained block and what the node reported."""

    weight: float  # examples, capped at what a node can see in a round
    tensors: dict[str, torch.Tensor]
    metrics: dict[str, float]  # train_loss (may be NaN), peak_mem_mb, train_s, ...
    rule: str  # the update rule the node used
    # what the upload decodes to (before the screen may clip it) and, when the node kept it as
    # a pending self-sync copy (its reported checksum matches the decoded one), that checksum
    decoded: dict[str, torch.Tensor] = field(default_factory=dict)
    pending: str = ""
    kind: str = protocol.WEIGHTS  # weights or a step log (protocol.SEEDLOG)
    payload_bytes: int = 0
    log: bytes = b""  # the encoded step log (kind SEEDLOG): what seed-log downloads resend
    payload: bytes = b""  # the weights payload (kind WEIGHTS): an install delta when it makes one
    replay_passes: float = 0.0  # the step log's replay work, in passes over the block


class ReplyReader:
    """Read train replies into :class:`BlockUpload`, keeping the :class:`NodeBook` current.

    Parameters
    ----------
    versions : BlockVersions
        The global blocks: an upload is decoded against (or replayed on) the block the node
        started from, which is still the global one while replies are read.
    nodes : NodeBook
        Updated from every reply that carries a state record.
    upload_codec : str
        What the nodes are asked for unless a round says otherwise; a step log is accepted
        only when the asked codec is ``"seedlog"``.
    seedlog_fallback : str
        The codec weights come through when a step log was asked for.
    max_steps, max_examples : int
        A step log's most steps; a reply's most ``num-examples``.
    max_payload_bytes : int
        The most bytes of any upload (each block has its own bound too, see
        :meth:`payload_limit`).
    device : str
        Where step logs are replayed (the result comes back to the CPU).
    """

    def __init__(self, versions: BlockVersions, nodes: NodeBook, *, upload_codec: str,
                 seedlog_fallback: str, max_steps: int, max_examples: int,
                 max_payload_bytes: int, device: str = "cpu") -> None:
        self.device = device
        self.seedlog_fallback = seedlog_fallback
        self.versions = versions
        self.nodes = nodes
        self.upload_codec = upload_codec
        self.max_steps = max_steps
        self.max_examples = max_examples
        self.max_payload_bytes = max_payload_bytes

    @property
    def block_map(self) -> BlockMap:
        """The model's blocks."""
        return self.versions.block_map

    def payload_limit(self, block: str) -> int:
        """The most bytes an upload of ``block`` may have: ``max_payload_bytes``, and at most
        what any codec of ours makes of the block (3x its fp32 size, for top-k's indices) plus
        a full header."""
        own = 3 * raw_fp32_bytes(self.versions.tensors(block)) + MAX_HEADER_BYTES + 64
        return min(self.max_payload_bytes, own)

    def note_state(self, node: int, state: Mapping[str, Any]) -> str:
        """Take what the node says it holds and its budget; return its status."""
        # what it holds is what it says now: an earlier self-sync promise is settled
        self.nodes.promised.pop(node, None)
        self.nodes.unconfirmed.discard(node)
        try:
            self.nodes.holdings[node] = protocol.load_holdings(
                text(state, protocol.HOLDINGS, max_len=1 << 20))
        except (Dropped, ValueError, TypeError, RecursionError) as err:
            log.warning("node %d sent unreadable holdings (%s); will resync it", node, err)
            self.nodes.holdings.pop(node, None)
        budget = number(state, protocol.MEMORY_BUDGET, low=0.0, high=1e9, default=0.0)
        if budget > 0:
            self.nodes.budgets[node] = budget
        zo = text(state, protocol.ZO_NODE, default="", max_len=128)
        if zo:
            self.nodes.zo[node] = zo
        return text(state, protocol.STATUS, default="", max_len=64)

    def read(self, reply: Message, node: int, block: str, record: RoundRecord,
             codec: str | None = None) -> BlockUpload:
        """``node``'s upload of ``block``, or :class:`Dropped`. The upload's bytes count in
        ``record.bytes_up`` once its payload is read, even if it is dropped later: they
        crossed the wire.

        ``codec`` is the upload codec the node was asked for (default: ``upload_codec``); a
        weights payload must be exactly what the round asked for (:meth:`check_bound`)."""
        if reply.has_error():
            raise Dropped(CLIENT_ERROR, str(reply.error.reason)[:500])
        content = reply.content
        state = content.config_records.get(protocol.STATE)
        if state is None:
            raise Dropped(MALFORMED, "no state record")
        status = self.note_state(node, state)
        reason = text(state, protocol.REASON, default="")
        if status == protocol.REJECTED:
            self.nodes.excluded[node] = reason[:500]
            log.warning("node %d takes no part: %s", node, self.nodes.excluded[node])
            raise Dropped(NOT_TRAINED, f"rejected: {reason[:200]}")
        if status != protocol.OK:
            raise Dropped(NOT_TRAINED, f"{status}: {reason[:200]}")
        only_records(content, arrays={protocol.UPLOAD}, metrics={protocol.METRICS},
                     configs={protocol.STATE})
        metrics = scalar_metrics(content.metric_records[protocol.METRICS])
        weight = examples_weight(metrics, protocol.NUM_EXAMPLES, self.max_examples)
        for key in ("train_loss", "peak_mem_mb", "train_s"):
            metrics[key] = bounded(metrics, key, default=math.nan if key == "train_loss" else 0.0)
        upload = content.array_records[protocol.UPLOAD]
        if list(upload.keys()) != [block]:
            raise Dropped(MALFORMED, f"expected an upload of block '{block}', got "
                                     f"{list(upload)[:5]}")
        payload = guarded(lambda: payload_from_array(upload[block]), BAD_PAYLOAD)
        record.bytes_up += len(payload)
        limit = self.payload_limit(block)
        if len(payload) > limit:
            raise Dropped(BAD_PAYLOAD, f"upload of {len(payload)} bytes exceeds the block's "
                                       f"limit of {limit}")
        kind = text(state, protocol.UPLOAD_KIND, default=protocol.WEIGHTS, max_len=16)
        tensors, passes = self._decode(payload, kind, block, limit, record.round,
                                       self.upload_codec if codec is None else codec)
        # A node's claim to keep a pending copy counts only for the very upload decoded here
        # (a weights payload: its header checksum is what ``decode`` verified).
        claim = text(state, protocol.SELF_SYNC_CHECKSUM, default="", max_len=64)
        pending = (claim if claim and kind == protocol.WEIGHTS
                   and claim == read_header(payload, max_bytes=limit).checksum else "")
        if reason:
            log.info("node %d: %s", node, reason[:500])
        return BlockUpload(weight, tensors, metrics,
                           text(state, protocol.RULE, default="", max_len=64),
                           decoded=tensors, pending=pending, kind=kind,
                           payload_bytes=len(payload),
                           log=payload if kind == protocol.SEEDLOG else b"",
                           payload=payload if kind == protocol.WEIGHTS else b"",
                           replay_passes=passes)

    def check_bound(self, header: PayloadHeader, block: str, server_round: int, codec: str
                    ) -> None:
        """A weights upload must be what the round asked for, or it is dropped as
        ``mismatch``: the codec the node was asked for (``seedlog-fallback`` when a step log
        was asked), the block, the version it started from (the block's current one) and the
        round as its target, and each tensor's dtype (shapes: :func:`decode` checks them).
        A re-sent old block, a stale upload or a payload in another precision is none of these.
        """
        asked = self.seedlog_fallback if codec == protocol.SEEDLOG else codec
        if str(header.codec) != str(parse_spec(asked)):
            raise Dropped(MISMATCH, f"upload codec {header.spec[:64]!r}, but {asked!r} was "
                                    "asked for")
        if header.block != block:
            raise Dropped(MISMATCH, f"upload is for block {header.block[:64]!r}, not {block!r}")
        current = self.versions.versions[block]
        if header.base_version != current or header.target_version != server_round:
            raise Dropped(MISMATCH, f"upload goes from version {header.base_version} to "
                                    f"{header.target_version}; round {server_round} asked for "
                                    f"{current} to {server_round}")
        start = self.versions.tensors(block)
        for entry in header.entries:
            like = start.get(entry.name)
            want = dtype_name(like.dtype, tensor=entry.name) if like is not None else None
            if want is not None and entry.dtype != want:
                raise Dropped(MISMATCH, f"tensor {entry.name[:64]!r} is {entry.dtype}, the "
                                        f"block's is {want}")

    def _decode(self, payload: bytes, kind: str, block: str, limit: int, server_round: int,
                codec: str) -> tuple[dict[str, torch.Tensor], float]:
        """The uploaded block from a weights payload or a replayed step log, and the replay's
        work in passes over the block (0 for weights)."""
        # the start of the client's training: blocks are installed after all replies
        start = self.versions.tensors(block)
        if kind == protocol.SEEDLOG:
            if codec != protocol.SEEDLOG:
                raise Dropped(BAD_SEEDLOG, "a seed log was sent, but weights were asked for")
            layout = zeroth_order.unit_layout(self.block_map, block)
            step_log = guarded(lambda: seedlog.decode_seedlog(
                payload, max_steps=self.max_steps,
                max_bytes=seedlog.max_log_bytes(self.max_steps, len(layout))), BAD_SEEDLOG)
            if step_log.block != block:
                raise Dropped(BAD_SEEDLOG, f"seed log is for block '{step_log.block[:64]}'")
            replayed = guarded(
                lambda: zeroth_order.replay(start, step_log, layout, device=self.device),
                REPLAY_FAILED)
            sizes = [sum(start[name].numel() for name in unit) for unit in layout]
            return replayed, zeroth_order.replay_passes(step_log, sizes)
        if kind == protocol.WEIGHTS:
            header = guarded(lambda: read_header(payload, max_bytes=limit), BAD_PAYLOAD)
            self.check_bound(header, block, server_round, codec)
            return guarded(lambda: decode(
                payload,
                base=start if uses_base(header.spec) else None,
                expect_block=block,
                expect_shapes={k: tuple(v.shape) for k, v in start.items()},
                max_bytes=limit,
            ).tensors, BAD_PAYLOAD), 0.0
        raise Dropped(MALFORMED, f"upload-kind {kind!r} is neither weights nor seedlog")
