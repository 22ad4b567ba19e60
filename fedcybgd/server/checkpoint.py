"""Per-round checkpoints: changed blocks as safetensors, the rest as one JSON state file.

Blocks are the natural unit: a round changes a few of them, so a checkpoint writes only the
blocks whose version moved, each to a file named by block and version. ``state.json`` is
written last and atomically and names the files it needs, so a crash mid-write leaves the
previous checkpoint intact; files no state refers to are removed afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from fedcybgd.atomic import save_tensors, write_bytes

_STATE = "state.json"


class Checkpointer:
    """Save and restore the server's state in ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def exists(self) -> bool:
        """Is there a complete checkpoint?"""
        return (self.root / _STATE).is_file()

    def save(
        self,
        server_round: int,
        blocks: Mapping[str, tuple[int, Mapping[str, torch.Tensor]]],
        state: Mapping[str, Any],
    ) -> None:
        """Write a checkpoint after ``server_round``.

        Parameters
        ----------
        blocks : Mapping[str, tuple[int, Mapping[str, torch.Tensor]]]
            Every block whose version is above 0: ``name -> (version, tensors)``.
        state : Mapping
            JSON-able server state (strategy state, lineage, run config).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        files: dict[str, str] = {}
        for name, (version, tensors) in blocks.items():
            file = f"{name}@v{version}.safetensors"
            files[name] = file
            if not (self.root / file).exists():
                save_tensors(self.root / file, tensors)
        body = {"round": server_round, "block_files": files, **state}
        write_bytes(self.root / _STATE, json.dumps(body, indent=1).encode())
        keep = set(files.values()) | {_STATE}
        for path in self.root.iterdir():
            if path.name not in keep and not path.name.startswith(".state.json"):
                path.unlink(missing_ok=True)

    def load(self) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
        """The saved state and the saved blocks' tensors."""
        state = json.loads((self.root / _STATE).read_bytes())
        blocks = {
            name: load_file(str(self.root / file)) for name, file in state["block_files"].items()
        }
        return state, blocks
