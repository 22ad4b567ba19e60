"""What of FedCyBGD's server a checkpoint holds as tensors, and putting it back.

A checkpoint's tensor entries are ``name -> (version, tensors)``: every block above version 0
under its own name, the server optimizer's state of such a block under :data:`SERVER_STATE` +
its name (at the block's version: it changes only with it), and the deltas of its kept installs
under :data:`INSTALL_PAYLOAD` + its name (``payload.0``, the oldest, ``payload.1``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedcybgd.strategies.server_step import ServerStep
from fedcybgd.strategies.versions import BlockVersions, Tensors

SERVER_STATE = "server-opt."  # checkpoint entries of the server optimizer's per-block state
INSTALL_PAYLOAD = "install-via."  # ... and of the delta a block was installed through


def checkpoint_entries(blocks: BlockVersions, step: ServerStep) -> dict[str, tuple[int, Tensors]]:
    """Every tensor entry a checkpoint saves (module docstring)."""
    versions = blocks.versions
    out = {b: (v, blocks.tensors(b)) for b, v in versions.items() if v > 0}
    for block, tensors in step.state_tensors().items():
        out[SERVER_STATE + block] = (versions[block], tensors)
    for block, payloads in blocks.install_payloads().items():
        out[INSTALL_PAYLOAD + block] = (versions[block], {
            f"payload.{i}": torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            for i, payload in enumerate(payloads)})
    return out


def restore_entry(blocks: BlockVersions, step: ServerStep, entry: str,
                  tensors: Mapping[str, torch.Tensor]) -> None:
    """Put one entry of :func:`checkpoint_entries` back: a block into the global weights, a
    block's server optimizer state (before the strategy's ``load_state``) or its installs'
    deltas."""
    if entry.startswith(SERVER_STATE):
        name = entry.removeprefix(SERVER_STATE)
        if name not in blocks.versions:
            raise ValueError(f"checkpointed server optimizer state of unknown block {name}")
        step.load_tensors(name, tensors)
        return
    if entry.startswith(INSTALL_PAYLOAD):
        name = entry.removeprefix(INSTALL_PAYLOAD)
        keys = [f"payload.{i}" for i in range(len(tensors))]
        if name not in blocks.versions or not tensors or set(tensors) != set(keys):
            raise ValueError(f"checkpointed install payload {entry!r} is not one of ours")
        blocks.restore_install_payloads(name, [tensors[key].numpy().tobytes() for key in keys])
        return
    blocks.install_checkpoint(entry, tensors)
