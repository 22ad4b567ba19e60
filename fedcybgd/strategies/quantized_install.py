"""Quantized install: the server installs ``start + Q(new - start)``, so one low-bit delta
brings every node that holds ``start`` exactly to the installed block, exactly.

Without it the server installs the merged fp32 block: a node that trained it (with others) or
holds it frozen gets a lossy low-bit copy, and when it next trains the block it must be sent the
exact block again (``xor+zstd``, 55-75% of fp32 for a dense update). With it, the installed
block *is* what the lossy delta decodes to, through the same :func:`fedcybgd.compression.decode`
a node runs, so the node's copy is exact (its checksum matches the server's) at the delta's
cost. What the quantizer dropped is kept per block on the server and added to that block's next
step (error feedback), so the rounding does not accumulate; it is checkpointed with the block's
server optimizer state (as the moment ``"r"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedcybgd.compression import decode, encode, lossy_delta_spec
from fedcybgd.strategies.replies import NON_FINITE, Dropped
from fedcybgd.strategies.screen import all_finite

Tensors = dict[str, torch.Tensor]
RESIDUAL = "r"  # the moment name the residual is checkpointed under


@dataclass(frozen=True)
class Installed:
    """A block as the server installs it, the payload that makes ``start`` into it, and the
    rounding left over for the block's next step."""

    tensors: Tensors
    payload: bytes
    residual: Tensors


class QuantizedInstall:
    """Round each installed block to what ``spec`` (a lossy ``delta`` codec) transmits.

    Parameters
    ----------
    spec : str
        A ``delta`` codec spec, e.g. ``"delta+int8+zstd"`` (the download codec's cost).
    """

    def __init__(self, spec: str) -> None:
        self.spec = str(lossy_delta_spec(spec))

    @torch.no_grad()
    def round(self, block: str, start: Mapping[str, torch.Tensor], start_version: int,
              new: Mapping[str, torch.Tensor], version: int,
              residual: Mapping[str, torch.Tensor] | None) -> Installed:
        """``new`` (plus the block's carried ``residual``) rounded to a ``spec`` delta against
        ``start``, which is the block at ``start_version``; ``version`` is the round."""
        target = {name: (t.float() + residual[name] if residual else t.float()).to(t.dtype)
                  for name, t in new.items()}
        if not all_finite(target):  # a carried residual can overflow the model's dtype
            raise Dropped(NON_FINITE, f"block {block}: the install target (the merged block "
                                      "plus its carried rounding) is not finite; not rounded")
        payload = encode(target, self.spec, block=block, target_version=version,
                         base_version=start_version, base=start)
        size = len(payload)
        tensors = decode(payload, base=start, expect_block=block, max_bytes=size,
                         expect_shapes={n: tuple(t.shape) for n, t in target.items()}).tensors
        left = {name: new[name].float() + (residual[name] if residual else 0) -
                tensors[name].float() for name in new}
        return Installed(tensors, payload, left)
