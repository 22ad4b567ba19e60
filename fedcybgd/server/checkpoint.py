"""Per-round checkpoints: changed blocks as safetensors, the rest as one JSON state file.

Blocks are the natural unit: a round changes a few of them, so a checkpoint writes only the
blocks whose content is new. Each block file is named by its block, version and content
checksum, so a file of that name holds exactly that content: an interrupted save can leave
files behind, but never one that a later save would mistake for its own. ``state.json`` is
written last (atomically, fsync'd) and names each file with its checksum; :meth:`load` checks
every file against it. Files no state refers to are removed afterwards, each one logged.

Crash tests: ``on_file_written`` is called after every file the checkpoint writes (block files
first, ``state.json`` last), so a test can stop the server between any two of them.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from fedcybgd.atomic import TEMP_SUFFIX, fsync_dir, make_dirs, save_tensors, write_bytes
from fedcybgd.checksum import content_checksum

log = logging.getLogger(__name__)

STATE = "state.json"
FORMAT = 2  # 2: block files named and verified by content checksum
_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*@v[0-9]+-[0-9a-f]{64}\.safetensors")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read back as written (missing, damaged or altered file)."""


def block_file(name: str, version: int, checksum: str) -> str:
    """The file name of one block version with content ``checksum``."""
    return f"{name}@v{version}-{checksum}.safetensors"


class Checkpointer:
    """Save and restore the server's state in ``root``.

    Parameters
    ----------
    root : Path
        The checkpoint folder (created on the first save).
    on_file_written : Callable[[Path], None], optional
        Called with each file's path right after it is durably written: a seam for crash tests.
    """

    def __init__(self, root: Path, on_file_written: Callable[[Path], None] | None = None) -> None:
        self.root = root
        self.on_file_written = on_file_written
        # (block, version) -> checksum of what this process saved or loaded: a block version's
        # content never changes within one process, so it is hashed once.
        self._checksums: dict[tuple[str, int], str] = {}
        self._referenced: set[str] = set()  # files of the last checkpoint saved or loaded

    def exists(self) -> bool:
        """Is there a complete checkpoint?"""
        return (self.root / STATE).is_file()

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
        make_dirs(self.root)
        entries: dict[str, dict[str, Any]] = {}
        for name, (version, tensors) in blocks.items():
            checksum = self._checksums.get((name, version)) or content_checksum(tensors)
            self._checksums[(name, version)] = checksum
            file = block_file(name, version, checksum)
            entries[name] = {"version": version, "checksum": checksum, "file": file}
            path = self.root / file
            # Same name, same content: a file left by an interrupted save is this very block.
            if not path.is_file():
                save_tensors(path, tensors)
                self._written(path)
        body = {**state, "format": FORMAT, "round": server_round, "blocks": entries}
        write_bytes(self.root / STATE, json.dumps(body, indent=1).encode())
        self._written(self.root / STATE)
        self._prune({e["file"] for e in entries.values()})

    def _written(self, path: Path) -> None:
        if self.on_file_written is not None:
            self.on_file_written(path)

    def _prune(self, keep: set[str]) -> None:
        """Remove the files the new ``state.json`` does not name, each one logged."""
        removed = False
        for path in sorted(self.root.iterdir()):
            if path.name in keep or path.name == STATE:
                continue
            if path.is_dir() or path.is_symlink():
                log.warning("checkpoint: leaving %s alone (not a file this checkpoint wrote)",
                            path)
                continue
            if path.name in self._referenced:
                log.debug("checkpoint: removing superseded %s", path.name)
            elif path.name.startswith(".") and path.name.endswith(TEMP_SUFFIX):
                log.warning("checkpoint: removing %s, a partial write of an interrupted save",
                            path)
            else:
                log.warning("checkpoint: removing %s, which no checkpoint refers to (left by "
                            "an interrupted save)", path)
            path.unlink()
            removed = True
        if removed:
            fsync_dir(self.root)
        self._referenced = keep

    def load(self) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
        """The saved state and the saved blocks' tensors, each file checked against the state.

        Raises
        ------
        CheckpointError
            ``state.json`` is unreadable or of another format, or a block file is missing,
            unreadable or not the content ``state.json`` names (the message names the file).
        """
        state_path = self.root / STATE
        try:
            state = json.loads(state_path.read_bytes())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"checkpoint state {state_path} is unreadable: {err}") from err
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            found = state.get("format", 1) if isinstance(state, dict) else "?"
            raise CheckpointError(
                f"checkpoint state {state_path} has format {found}, expected {FORMAT} (block "
                "files verified by checksum); it cannot be resumed: start with overwrite = "
                "true or use another output-dir"
            )
        blocks: dict[str, dict[str, torch.Tensor]] = {}
        try:
            for name, entry in state["blocks"].items():
                blocks[name] = self._load_block(name, entry)
                self._checksums[(name, int(entry["version"]))] = str(entry["checksum"])
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CheckpointError(f"checkpoint state {state_path} is malformed: {err!r}") from err
        self._referenced = {str(e["file"]) for e in state["blocks"].values()}
        return state, blocks

    def _load_block(self, name: str, entry: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        file, expected = str(entry["file"]), str(entry["checksum"])
        if not _FILE.fullmatch(file) or not file.endswith(f"-{expected}.safetensors"):
            raise CheckpointError(
                f"checkpoint state {self.root / STATE} names {file!r} for block {name}, "
                f"which is not the file of checksum {expected}"
            )
        path = self.root / file
        try:
            tensors = load_file(str(path))
        except (OSError, SafetensorError) as err:
            raise CheckpointError(f"checkpoint file {path} (block {name}) is unreadable: "
                                  f"{err}") from err
        actual = content_checksum(tensors)
        if actual != expected:
            raise CheckpointError(
                f"checkpoint file {path} (block {name}) is damaged or altered: its content "
                f"checksum is {actual}, state.json expects {expected}"
            )
        return tensors
