"""What both sides of the wire agree on. This module: record keys, config keys and reply
statuses. Its submodules: the arithmetic both sides must compute alike, bit for bit
(:mod:`~fedcybgd.protocol.zeroth_order` perturbations and step-log replay,
:mod:`~fedcybgd.protocol.selfsync` and :mod:`~fedcybgd.protocol.seedsync` for blocks a node
rebuilds instead of downloading, :mod:`~fedcybgd.protocol.prior`), and how big a message
is on the wire (:mod:`~fedcybgd.protocol.message_size`).

The strategy and the client never import each other; they share these names and modules, the
payload format of :mod:`fedcybgd.compression` and Flower records.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# Records of a train instruction (server -> client).
CONFIG = "config"  # ConfigRecord: the round's assignment
DOWNLOAD = "download"  # ArrayRecord: block name -> payload Array
# ArrayRecord: block name -> step-log chain (fedcybgd.protocol.seedsync)
DOWNLOAD_LOGS = "download-logs"
# ArrayRecord: chain_key(block, i) -> the i-th install delta to apply to the block, from 0
DOWNLOAD_CHAIN = "download-chain"

# Records of a reply (client -> server).
UPLOAD = "upload"  # ArrayRecord: block name -> payload Array
METRICS = "metrics"  # MetricRecord: train metrics, "num-examples"
STATE = "state"  # ConfigRecord: status, holdings, rule used

# Keys of the instruction's ConfigRecord.
ROUND = "server-round"
BLOCK = "block"
RULE = "update-rule"
SEED = "seed"
LINEAGE = "lineage"  # identifies the server's model history; caches are kept per lineage
BASE_HASH = "base-hash"  # hash of the pretrained weights the run starts from
EXPECT = "expect-holdings"  # JSON: what the server assumes the client holds after download
UPLOAD_CODEC = "upload-codec"
ZO_FINGERPRINT = "zo-fingerprint"  # the server's z/update arithmetic (seed-log replay check)
ZO_TORCH = "zo-torch"  # the server's torch version (seed-log replay check)
SEEDLOG_FALLBACK = "seedlog-fallback"  # codec for weights when a seed log cannot be replayed
LOCAL_STEPS = "local-steps"  # steps the server asks for; a seed log may hold no more
LR = "lr"  # the round's client learning rate (the server's schedule); absent: the run config's
DP_CLIP = "dp-clip-norm"  # central DP, adaptive clip: this round's clip; absent: the run config's
DP_UNCLIPPED = "dp_unclipped"  # train metric: 1.0 if the delta was within the clip, else 0.0
# the class shares training aims at (fedcybgd.protocol.prior): a list of floats, one per
# class; absent: equal shares. Instructions of FedCyBGD and of the FedAvg baselines alike.
CLASS_PRIOR = "class-prior"

# Keys of the reply's ConfigRecord.
STATUS = "status"
HOLDINGS = "holdings"  # JSON: block -> [version, checksum]
REASON = "reason"
UPLOAD_KIND = "upload-kind"  # WEIGHTS or SEEDLOG
ZO_NODE = "zo-node"  # "<torch>|<z fingerprint>" of the node (may it be sent step logs?)
MEMORY_BUDGET = "memory-budget-mb"  # what the node declared (0: none)

# Upload kinds, and the upload codec that asks for a seed log.
WEIGHTS = "weights"
SEEDLOG = "seedlog"

# Reply statuses.
OK = "ok"
RESYNC = "resync"  # the client's cache differs from what the server assumed; nothing trained
REJECTED = "rejected"  # the client cannot take part (different base model, no fitting rule)
# A ``rejected`` reason that starts so: the node's own privacy budget is spent (dp = "example")
PRIVACY_BUDGET = "privacy budget"
REFUSED = "refused"  # the instruction was unsafe or malformed (e.g. a name that is no path)

NUM_EXAMPLES = "num-examples"

# The node-key query (server -> client, message type QUERY_NODE_KEY; its CONFIG record holds
# only ROUND). The reply holds one ConfigRecord IDENTITY with NODE_KEY: the node's stable key
# (node config `node-key`, else its `partition-id`), by which the server orders nodes for
# sampling and derives their seeds, so that runs do not depend on Flower's (random) node ids.
QUERY_NODE_KEY = "query.node_key"
IDENTITY = "identity"
NODE_KEY = "node-key"
# ... and, with class-prior = global on a task with classes, the node's class counts (a list of
# ints, one per class) from which the server pools the prior
CLASS_COUNTS = "class-counts"
# What a node key may look like (both sides check it): short, no spaces, no path separators.
NODE_KEY_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,63}"


@dataclass(frozen=True)
class Holding:
    """A block version a client holds: the server's version number and a content checksum."""

    version: int
    checksum: str


def get_int(record: Mapping[str, Any], key: str) -> int:
    """An integer field of a record; ``ValueError`` naming the key if absent or mistyped."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"record field {key!r} must be an integer, got {value!r}")
    return value


def get_str(record: Mapping[str, Any], key: str) -> str:
    """A string field of a record; ``ValueError`` naming the key if absent or mistyped."""
    value = record.get(key)
    if not isinstance(value, str):
        raise ValueError(f"record field {key!r} must be a string, got {value!r}")
    return value


def class_prior(record: Mapping[str, Any]) -> list[float] | None:
    """The :data:`CLASS_PRIOR` shares of an instruction's record (``None``: absent, equal
    shares); ``ValueError`` naming the key unless 2 to 4096 finite positive floats."""
    value = record.get(CLASS_PRIOR)
    if value is None:
        return None
    if (not isinstance(value, list) or not 2 <= len(value) <= 4096
            or not all(isinstance(x, float) and 0 < x < float("inf") for x in value)):
        raise ValueError(f"record field {CLASS_PRIOR!r} must be 2 to 4096 positive finite "
                         f"floats, got {str(value)[:80]}")
    return value


def chain_key(block: str, index: int) -> str:
    """The :data:`DOWNLOAD_CHAIN` key of ``block``'s ``index``-th install delta."""
    return f"{block}#{index}"


def read_chain_keys(keys: Iterable[str], max_length: int = 4096) -> dict[str, int]:
    """Block -> chain length of :data:`DOWNLOAD_CHAIN` keys; ``ValueError`` naming the key
    unless every block's indices run 0, 1, ... without a gap, each below ``max_length``."""
    seen: dict[str, set[int]] = {}
    for key in keys:
        block, sep, index = key.rpartition("#")
        if not sep or not block or not index.isdigit() or index != str(int(index)):
            raise ValueError(f"record '{DOWNLOAD_CHAIN}' key {key[:80]!r} is not '<block>#<n>'")
        if int(index) >= max_length:
            raise ValueError(f"record '{DOWNLOAD_CHAIN}' key {key[:80]!r}: index over "
                             f"{max_length - 1}")
        seen.setdefault(block, set()).add(int(index))
    for block, indices in seen.items():
        if indices != set(range(len(indices))):
            raise ValueError(f"record '{DOWNLOAD_CHAIN}' block {block[:80]!r}: indices "
                             f"{sorted(indices)[:8]} do not run 0, 1, ...")
    return {block: len(indices) for block, indices in seen.items()}


def dump_holdings(holdings: Mapping[str, Holding]) -> str:
    """Holdings as compact JSON (ConfigRecords cannot nest)."""
    return json.dumps({k: [h.version, h.checksum] for k, h in sorted(holdings.items())})


def load_holdings(text: str) -> dict[str, Holding]:
    """Parse :func:`dump_holdings` output; ``ValueError`` on anything malformed."""
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError("holdings must be a JSON object")
    out: dict[str, Holding] = {}
    for name, value in raw.items():
        if (
            not isinstance(name, str)
            or not isinstance(value, list)
            or len(value) != 2
            or not isinstance(value[0], int)
            or not isinstance(value[1], str)
        ):
            raise ValueError(f"bad holdings entry for {name!r}: {value!r}")
        out[name] = Holding(value[0], value[1])
    return out

# Self-sync: the node computes the block the server installs from its own upload.
# Instruction: SELF_SYNC (bool) asks the node to keep its decoded upload as a pending copy;
# PROMOTE (JSON, see fedcybgd.protocol.selfsync) tells it which pending copy became which installed
# version, through which server step, and its checksum. Reply (STATE): SELF_SYNC_CHECKSUM, the
# checksum of the pending copy the node kept ("" when none).
SELF_SYNC = "self-sync"
PROMOTE = "self-synced"
SELF_SYNC_CHECKSUM = "self-sync-checksum"
