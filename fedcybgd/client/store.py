"""The client's on-disk model cache: which version of each block it holds, and the tensors.

Version 0 of every block is the pretrained model the client already has; only blocks at a
later version are stored, one safetensors file each, named by block and version. The manifest
is written last and atomically (temp file + rename), so a crash leaves the previous complete
state; a file that fails its checksum is dropped and the server resends that block.

Besides the blocks it holds, the store keeps two kinds of per-block state:

- a *pending* copy (self-sync, :mod:`fedcybgd.protocol.selfsync`): the node's own decoded upload of
the
  block it just trained, with the holding it trained from. It is held only once the server's
  next instruction says the installed version is what the node can compute from it
  (:meth:`put` of the computed block); until then it is not in :attr:`holdings`, so nothing
  trains on it.
- a *residual* (error feedback): what a lossy upload codec dropped of the node's last update of
  the block, added to its next upload of that block; kept by the round that made it, so a
  redone round uses the residual of before it, as the first attempt did.

The store's folder comes checked from :func:`fedcybgd.client.paths.node_dirs`; the file names
in it are the store's own, and a manifest naming any other path is discarded.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from fedcybgd.client.paths import UnsafeName, block_name
from fedcybgd.core.atomic import save_tensors, write_bytes
from fedcybgd.core.checksum import content_checksum
from fedcybgd.protocol import Holding

log = logging.getLogger(__name__)
_MANIFEST = "manifest.json"
_FILE = re.compile(r"[A-Za-z0-9._-]+@v[0-9]+-[0-9a-f]{12}\.safetensors")  # put()'s names
_PENDING = re.compile(r"[A-Za-z0-9._-]+@pending-[0-9a-f]{12}\.safetensors")
_RESIDUAL = re.compile(r"[A-Za-z0-9._-]+@residual-r[0-9]+-[0-9a-f]{12}\.safetensors")
# Residuals kept per block: the newest, and the one it was made from, so that a round the
# server redoes (it resumed from the checkpoint before it) gets the residual it got first.
_RESIDUAL_GENERATIONS = 2


@dataclass(frozen=True)
class Pending:
    """A pending self-sync copy: its checksum, file, and the holding it was trained from."""

    checksum: str
    file: str
    start: Holding


class BlockStore:
    """Blocks a client holds beyond the pretrained model, for one server lineage.

    Parameters
    ----------
    root : Path
        The store's folder (created if missing).
    base_hash : str
        Hash of the pretrained weights; a store built on other weights is discarded.
    """

    def __init__(self, root: Path, base_hash: str) -> None:
        self.root = root
        self.base_hash = base_hash
        self.root.mkdir(parents=True, exist_ok=True)
        self.holdings: dict[str, Holding] = {}
        self._files: dict[str, str] = {}
        self.pending: dict[str, Pending] = {}
        # block -> [(round, checksum, file)], oldest first
        self._residuals: dict[str, list[tuple[int, str, str]]] = {}
        self._load_manifest()

    def _load_manifest(self) -> None:
        path = self.root / _MANIFEST
        if not path.exists():
            return
        try:
            manifest = json.loads(path.read_bytes())
            if manifest.get("base_hash") != self.base_hash:
                raise ValueError("built on different pretrained weights")
            for name, entry in manifest["blocks"].items():
                file = str(entry["file"])
                if not _FILE.fullmatch(file):
                    raise ValueError(f"block {name[:80]!r}: {file[:80]!r} is not a cache file")
                self.holdings[name] = Holding(int(entry["version"]), str(entry["checksum"]))
                self._files[name] = file
            for name, entry in manifest.get("pending", {}).items():
                file = str(entry["file"])
                if not _PENDING.fullmatch(file):
                    raise ValueError(f"pending {name[:80]!r}: {file[:80]!r} is not a cache file")
                start = Holding(int(entry["start"][0]), str(entry["start"][1]))
                self.pending[name] = Pending(str(entry["checksum"]), file, start)
            for name, entries in manifest.get("residuals", {}).items():
                kept = []
                for entry in entries:
                    file = str(entry["file"])
                    if not _RESIDUAL.fullmatch(file):
                        raise ValueError(f"residual {name[:80]!r}: {file[:80]!r} is not a "
                                         "cache file")
                    kept.append((int(entry["round"]), str(entry["checksum"]), file))
                self._residuals[name] = kept
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            log.warning("client cache %s is unusable (%s); starting a fresh one", self.root, err)
            self.clear()

    def _write_manifest(self) -> None:
        blocks = {
            name: {"version": h.version, "checksum": h.checksum, "file": self._files[name]}
            for name, h in self.holdings.items()
        }
        pending = {name: {"checksum": p.checksum, "file": p.file,
                          "start": [p.start.version, p.start.checksum]}
                   for name, p in self.pending.items()}
        residuals = {name: [{"round": r, "checksum": c, "file": f} for r, c, f in entries]
                     for name, entries in self._residuals.items()}
        body = json.dumps({"base_hash": self.base_hash, "blocks": blocks, "pending": pending,
                           "residuals": residuals}, indent=1)
        write_bytes(self.root / _MANIFEST, body.encode())

    def clear(self) -> None:
        """Forget everything: the client then holds the pretrained model only."""
        if self.root.is_symlink():  # rmtree would refuse it anyway; say why
            raise UnsafeName(f"client cache {self.root} is a symlink; not clearing it")
        log.info("clearing the client cache %s", self.root)
        try:
            shutil.rmtree(self.root)
        except FileNotFoundError:
            pass
        except OSError as err:  # what is left is disowned by the empty manifest below
            log.warning("could not remove all of %s (%s)", self.root, err)
        self.root.mkdir(parents=True, exist_ok=True)
        self.holdings.clear()
        self._files.clear()
        self.pending.clear()
        self._residuals.clear()
        self._write_manifest()

    def load(self, block: str) -> dict[str, torch.Tensor] | None:
        """Tensors of a stored block, or ``None`` (and the entry dropped) if unreadable."""
        if block not in self.holdings:
            return None
        try:
            tensors = load_file(str(self.root / self._files[block]))
        except (OSError, SafetensorError) as err:
            log.warning("cached block %s unreadable (%s); dropping it", block, err)
            self.drop(block)
            return None
        if content_checksum(tensors) != self.holdings[block].checksum:
            log.warning("cached block %s fails its checksum; dropping it", block)
            self.drop(block)
            return None
        return tensors

    def put(self, block: str, version: int, tensors: dict[str, torch.Tensor]) -> Holding:
        """Store a block version (version 0 means: back to pretrained, nothing stored)."""
        old = self._files.get(block)
        if version == 0:
            self.drop(block)
            return Holding(0, "")
        holding = Holding(version, content_checksum(tensors))
        name = f"{block_name(block)}@v{version}-{holding.checksum[:12]}.safetensors"
        save_tensors(self.root / name, tensors)
        self.holdings[block] = holding
        self._files[block] = name
        self._write_manifest()
        if old and old != name:
            (self.root / old).unlink(missing_ok=True)
        return holding

    def drop(self, block: str) -> None:
        """Forget one block (the client falls back to its pretrained version)."""
        self.holdings.pop(block, None)
        old = self._files.pop(block, None)
        self._write_manifest()
        if old:
            (self.root / old).unlink(missing_ok=True)

    def _read(self, file: str, checksum: str, what: str) -> dict[str, torch.Tensor] | None:
        try:
            tensors = load_file(str(self.root / file))
        except (OSError, SafetensorError) as err:
            log.warning("%s unreadable (%s)", what, err)
            return None
        if content_checksum(tensors) != checksum:
            log.warning("%s fails its checksum", what)
            return None
        return tensors

    # Self-sync: the pending copy of a block the node trained.
    def put_pending(self, block: str, tensors: dict[str, torch.Tensor], start: Holding) -> str:
        """Keep ``tensors`` (the node's decoded upload of ``block``, trained from ``start``) as
        the block's pending copy, replacing any earlier one; returns its checksum."""
        checksum = content_checksum(tensors)
        name = f"{block_name(block)}@pending-{checksum[:12]}.safetensors"
        save_tensors(self.root / name, tensors)
        old = self.pending.get(block)
        self.pending[block] = Pending(checksum, name, start)
        self._write_manifest()
        if old and old.file != name:
            (self.root / old.file).unlink(missing_ok=True)
        return checksum

    def load_pending(self, block: str) -> Pending | None:
        """The pending copy's record of ``block`` (its tensors: :meth:`pending_tensors`)."""
        return self.pending.get(block)

    def pending_tensors(self, block: str) -> dict[str, torch.Tensor] | None:
        """The pending copy's tensors, or ``None`` if there is none or it fails its checksum."""
        entry = self.pending.get(block)
        if entry is None:
            return None
        return self._read(entry.file, entry.checksum, f"pending copy of block {block}")

    def discard_pending(self, keep: set[str] | None = None) -> None:
        """Forget every pending copy but those of ``keep``."""
        gone = [b for b in self.pending if keep is None or b not in keep]
        if not gone:
            return
        files = [self.pending.pop(b).file for b in gone]
        self._write_manifest()
        for file in files:
            (self.root / file).unlink(missing_ok=True)

    # Error feedback: what lossy uploads dropped.
    def put_residual(self, block: str, server_round: int, tensors: dict[str, torch.Tensor]
                     ) -> None:
        """Keep ``tensors`` as the residual ``block``'s upload of ``server_round`` left (one of
        that round or later, from an attempt the server did not keep, is replaced)."""
        checksum = content_checksum(tensors)
        name = f"{block_name(block)}@residual-r{int(server_round)}-{checksum[:12]}.safetensors"
        save_tensors(self.root / name, tensors)
        entries = [e for e in self._residuals.get(block, []) if e[0] < server_round]
        entries.append((int(server_round), checksum, name))
        gone = entries[:-_RESIDUAL_GENERATIONS]
        self._residuals[block] = entries[-_RESIDUAL_GENERATIONS:]
        self._write_manifest()
        live = {f for _, _, f in self._residuals[block]}
        for old in [e for e in self._residual_files(block) if e not in live] + [
                f for _, _, f in gone]:
            (self.root / old).unlink(missing_ok=True)

    def _residual_files(self, block: str) -> list[str]:
        prefix = f"{block_name(block)}@residual-"
        return [p.name for p in self.root.glob(f"{prefix}*.safetensors")]

    def residual(self, block: str, before_round: int) -> dict[str, torch.Tensor] | None:
        """The residual to add to ``block``'s upload of ``before_round``: the newest one made
        before that round, or ``None`` (none kept, or unreadable: then forgotten, which only
        costs the compression error it held)."""
        entries = [e for e in self._residuals.get(block, []) if e[0] < before_round]
        if not entries:
            return None
        _, checksum, file = entries[-1]
        tensors = self._read(file, checksum, f"residual of block {block}")
        if tensors is None:
            self.drop_residual(block)
        return tensors

    def drop_residual(self, block: str) -> None:
        """Forget the residuals of ``block``."""
        entries = self._residuals.pop(block, None)
        if entries:
            self._write_manifest()
            for _, _, file in entries:
                (self.root / file).unlink(missing_ok=True)
