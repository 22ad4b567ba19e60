"""The train instruction: what one node is told to do in a round.

The inverse of :mod:`fedcybgd.strategies.reader`: the node's ClientApp reads these fields
(:mod:`fedcybgd.protocol` names them) and answers with its state and upload.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fedcybgd import protocol
from fedcybgd.protocol import selfsync, zeroth_order
from fedcybgd.strategies.downloads import Download
from fedcybgd.strategies.matching import Assignment


@dataclass(frozen=True)
class RunTerms:
    """What every instruction of a run says alike."""

    lineage: str  # this model history
    base_hash: str  # hash of the pretrained weights it started from
    upload_codec: str  # codec spec, or "seedlog"
    local_steps: int
    seedlog_fallback: str  # weights codec of a node that cannot send a replayable step log
    device: str = "cpu"  # where the server replays step logs (its z fingerprint is for it)
    self_sync: bool = False  # ask nodes to keep their decoded upload (fedcybgd.protocol.selfsync)


def train_message(server_round: int, assignment: Assignment, seed: int, download: Download,
                  terms: RunTerms, config: ConfigRecord, lr: float | None = None,
                  promotions: Mapping[str, selfsync.Promotion] | None = None) -> Message:
    """The instruction for ``assignment``: the caller's ``config`` plus the round, block,
    rule, seed, the holdings to expect after ``download``, the run's terms, ``lr`` (when
    the server sets the clients' rate) and the blocks the node self-syncs (``promotions``)."""
    cfg = ConfigRecord(dict(config))
    cfg.update({
        protocol.ROUND: server_round,
        protocol.BLOCK: assignment.block,
        protocol.RULE: assignment.rule,
        protocol.SEED: seed,
        protocol.LINEAGE: terms.lineage,
        protocol.BASE_HASH: terms.base_hash,
        protocol.EXPECT: protocol.dump_holdings(download.expect),
        protocol.UPLOAD_CODEC: terms.upload_codec,
        protocol.LOCAL_STEPS: terms.local_steps,
    })
    if lr is not None:
        cfg[protocol.LR] = float(lr)
    if terms.self_sync:
        cfg[protocol.SELF_SYNC] = True
    if promotions:
        cfg[protocol.PROMOTE] = selfsync.dump_promotions(promotions)
    if terms.upload_codec == protocol.SEEDLOG:
        # the node replays only if its generator and torch match the server's
        cfg.update({protocol.ZO_FINGERPRINT: zeroth_order.z_fingerprint(terms.device),
                    protocol.ZO_TORCH: torch.__version__,
                    protocol.SEEDLOG_FALLBACK: terms.seedlog_fallback})
    content = RecordDict({protocol.CONFIG: cfg, protocol.DOWNLOAD: download.arrays})
    if len(download.logs):
        content.array_records[protocol.DOWNLOAD_LOGS] = download.logs
    if len(download.chained):
        content.array_records[protocol.DOWNLOAD_CHAIN] = download.chained
    return Message(content, dst_node_id=assignment.node, message_type=MessageType.TRAIN,
                   group_id=str(server_round))
