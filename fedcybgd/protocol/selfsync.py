"""Self-sync: the arithmetic both sides must do alike for a node to hold the installed block.

When one node alone trained a block, the server installs ``start + size * (upload - start)``
(``size = 1``: the decoded upload itself). The node holds ``start`` and its own decoded upload,
so it can compute the installed block bit for bit, provided both sides run the same
element-wise fp32 operations: :func:`sgd_step` is that one function, used by the server's
``sgd`` step (:mod:`fedcybgd.strategies.server_step`) and by the client. The server tells the
node, in its next instruction, each block it credited (:func:`dump_promotions`): version,
checksum and step size; the node checks the checksum of what it computed before it holds it, so
a difference (another torch, another CPU) costs a download, never a silently wrong copy.

Neither side imports the other; both import this module.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

Tensors = dict[str, torch.Tensor]


@torch.no_grad()
def sgd_step(start: Mapping[str, torch.Tensor], merged: Mapping[str, torch.Tensor],
             size: float) -> Tensors:
    """``start + size * (merged - start)`` per tensor, in fp32, cast to ``start``'s dtypes.

    ``size == 1`` returns ``merged`` cast to ``start``'s dtypes (bit for bit what the server
    installs then). Two separate IEEE operations (no fused multiply-add), so every CPU gives
    the same bits.
    """
    out: Tensors = {}
    for name, s in start.items():
        t = merged[name].to(s.dtype)
        if size == 1.0:
            out[name] = t
            continue
        base = s.float()
        out[name] = (base + size * (t.float() - base)).to(s.dtype)
    return out


def weighted_mean(uploads: Sequence[tuple[float, Mapping[str, torch.Tensor]]]) -> Tensors:
    """Mean of ``(weight, tensors)`` weighted by the weights (example counts), in float64, in
    the order given; a single upload is returned as it is (exact). The ``mean`` aggregator's
    arithmetic, here so that a node rebuilding a merge (:mod:`fedcybgd.protocol.seedsync`) runs the
    server's very operations."""
    if len(uploads) == 1:
        return dict(uploads[0][1])
    total = sum(w for w, _ in uploads)
    first = uploads[0][1]
    merged: Tensors = {}
    for name in first:
        acc = sum((w / total) * t[name].double() for w, t in uploads)
        merged[name] = acc.to(first[name].dtype)  # type: ignore[union-attr]
    return merged


@dataclass(frozen=True)
class Promotion:
    """A pending self-synced block the server installed: at ``version``, with ``checksum``,
    through :func:`sgd_step` of ``size`` from the node's start copy."""

    version: int
    checksum: str
    size: float


def dump_promotions(promotions: Mapping[str, Promotion]) -> str:
    """Promotions as compact JSON (ConfigRecords cannot nest)."""
    return json.dumps({b: [p.version, p.checksum, p.size] for b, p in sorted(promotions.items())})


def load_promotions(text: str) -> dict[str, Promotion]:
    """Parse :func:`dump_promotions` output; ``ValueError`` naming what is malformed."""
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError(f"self-synced blocks must be a JSON object, got {type(raw).__name__}")
    out: dict[str, Promotion] = {}
    for block, entry in raw.items():
        if (not isinstance(entry, list) or len(entry) != 3
                or isinstance(entry[0], bool) or not isinstance(entry[0], int) or entry[0] < 1
                or not isinstance(entry[1], str) or len(entry[1]) != 64
                or isinstance(entry[2], bool) or not isinstance(entry[2], int | float)
                or not 0 < float(entry[2]) < math.inf):
            raise ValueError(f"self-synced block {str(block)[:80]!r}: bad entry {entry!r:.120}")
        out[str(block)] = Promotion(entry[0], entry[1], float(entry[2]))
    return out
