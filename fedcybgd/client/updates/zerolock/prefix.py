"""ZeroLock's prefix cache: the frozen layers below a block, computed once per batch.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from fedcybgd.data.prompts import Batch
from fedcybgd.model.layerwise import Hidden, LayerStack

log = logging.getLogger(__name__)


class PrefixCache:
    """Outputs of the frozen layers ``0..end-1`` per example, for one round.

    A row is keyed by its real tokens; only right-padded rows are cached (their states at real
    positions do not depend on the batch's width or other rows). A batch is served from the
    cache only when every row is there; otherwise the prefix runs on the whole batch and its
    rows are stored while the bound allows.
    """

    def __init__(self, stack: LayerStack, end: int, max_bytes: int) -> None:
        self.stack = stack
        self.end = end
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    @torch.no_grad()
    def __call__(self, batch: Batch) -> Hidden:
        """The hidden states entering layer ``end`` for ``batch`` (no grad)."""
        hidden = self.stack.embed(batch.input_ids, batch.attention_mask)
        if self.end == 0:
            return hidden
        keys = self._keys(batch) if self.max_bytes > 0 else None
        if keys is not None and all(k in self._rows for k in keys):
            states = hidden.states.clone()
            for row, key in enumerate(keys):
                cached = self._rows[key]
                states[row, : cached.shape[0]] = cached
            self.hits += 1
            return hidden.with_states(states)
        self.misses += 1
        out = self.stack.run(hidden, 0, self.end)
        if keys is not None:
            for row, key in enumerate(keys):
                if key in self._rows:
                    continue
                length = int(batch.attention_mask[row].sum())
                size = length * out.states.shape[-1] * out.states.element_size()
                if self.bytes + size > self.max_bytes:
                    break
                self._rows[key] = out.states[row, :length].clone()
                self.bytes += size
        return out

    @staticmethod
    def _keys(batch: Batch) -> list[bytes] | None:
        mask = batch.attention_mask
        lengths = mask.sum(dim=1)
        positions = torch.arange(mask.shape[1], device=mask.device)
        if not torch.equal(mask.bool(), positions[None, :] < lengths[:, None]):
            return None  # not right-padded: states at real positions may depend on padding
        return [
            batch.input_ids[row, : int(lengths[row])].cpu().numpy().tobytes()
            for row in range(mask.shape[0])
        ]
