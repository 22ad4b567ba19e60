"""Per-round checkpoints: changed blocks as safetensors, the rest as one JSON state file.

Blocks are the natural unit: a round changes a few of them, so a checkpoint writes only the
blocks whose content is new. Each block file is named by its block, version and content
checksum, so a file of that name holds exactly that content: an interrupted save can leave
files behind, but never one that a later save would mistake for its own. ``state.json`` is
written last (atomically, fsync'd) and names each file with its checksum; :meth:`load` checks
every file against it. Files no state refers to are removed afterwards, each one logged.

Loading trusts nothing it reads: ``state.json`` is checked field by field (:meth:`read_state`),
and each block file against its checksum and, given a :data:`Layout`, against what the model
expects of it (tensor names, shapes, dtypes: nothing is broadcast or cast into place). Anything
wrong is a :class:`CheckpointError` naming the file.

Crash tests: ``on_file_written`` is called after every file the checkpoint writes (block files
first, ``state.json`` last), so a test can stop the server between any two of them.

Beside the checkpoint, ``sent.json`` names the nodes sent instructions since it was saved
(:meth:`Checkpointer.note_sent`, written before a round's instructions go out, removed by the
next save): a server killed mid-round leaves nodes that may have applied that round's downloads,
and its resume must not take the checkpoint's record of what they hold on trust
(:meth:`Checkpointer.read_sent`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from fedcybgd.core.atomic import TEMP_SUFFIX, fsync_dir, make_dirs, save_tensors, write_bytes
from fedcybgd.core.checksum import content_checksum

log = logging.getLogger(__name__)

STATE = "state.json"
SENT = "sent.json"  # the nodes sent instructions since the checkpoint was saved
FORMAT = 2  # 2: block files named and verified by content checksum
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_CHECKSUM = re.compile(r"[0-9a-f]{64}")
_FILE = re.compile(rf"{_NAME.pattern}@v[0-9]+-{_CHECKSUM.pattern}\.safetensors")
# A generous bound on a safetensors header: its size field and metadata, then per tensor
_HEADER_BYTES, _HEADER_BYTES_PER_TENSOR = 4096, 1024


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read back as written (missing, damaged, altered or malformed
    file, or tensors that are not what the model holds)."""


@dataclass(frozen=True)
class TensorSpec:
    """What one saved tensor must be.

    Attributes
    ----------
    shape : tuple of (int or None)
        Its exact shape; ``None`` stands for a dimension of any length.
    dtype : torch.dtype
        Its exact dtype (a tensor of another dtype is refused, never cast).
    """

    shape: tuple[int | None, ...]
    dtype: torch.dtype

    def matches(self, tensor: torch.Tensor) -> bool:
        """Does ``tensor`` have this shape (same rank, no broadcasting) and this dtype?"""
        shape = tuple(tensor.shape)
        return tensor.dtype == self.dtype and len(shape) == len(self.shape) and all(
            want is None or want == got for want, got in zip(self.shape, shape, strict=True))

    def describe(self) -> str:
        dims = ", ".join("*" if d is None else str(d) for d in self.shape)
        return f"shape ({dims}{',' if len(self.shape) == 1 else ''}) {self.dtype}"


@dataclass(frozen=True)
class EntryLayout:
    """The tensors one checkpoint entry (a block, or state kept with a block) must hold.

    Attributes
    ----------
    tensors : Mapping[str, TensorSpec]
        Tensor name -> what it must be.
    complete : bool
        Every tensor must be there (``True``), or any non-empty subset of them.
    """

    tensors: Mapping[str, TensorSpec]
    complete: bool = True

    def max_file_bytes(self) -> int | None:
        """The most bytes a safetensors file of this entry takes (``None``: unbounded, a
        dimension of any length)."""
        total = _HEADER_BYTES
        for spec in self.tensors.values():
            if any(d is None for d in spec.shape):
                return None
            numel = 1
            for d in spec.shape:
                numel *= int(d or 0)
            total += numel * spec.dtype.itemsize + _HEADER_BYTES_PER_TENSOR
        return total


# entry name -> what it must hold, or None for a name that is no entry of this model's
Layout = Callable[[str], EntryLayout | None]


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
        self._round: int | None = None  # the round of the checkpoint saved or loaded
        self._sent: set[int] = set()  # nodes sent instructions since that checkpoint

    @property
    def round(self) -> int | None:
        """The round of the checkpoint last saved or read (``None``: neither yet)."""
        return self._round

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
        self._round, self._sent = server_round, set()
        self._written(self.root / STATE)
        # the nodes sent instructions before it answered them all: the state records them now
        (self.root / SENT).unlink(missing_ok=True)
        self._prune({e["file"] for e in entries.values()})

    def note_sent(self, nodes: Iterable[int]) -> None:
        """Record, durably and before a round's instructions go out, that ``nodes`` are sent
        them (added to those sent since the checkpoint: a resumed round killed again keeps the
        nodes of the round lost before it)."""
        self._sent |= set(nodes)
        make_dirs(self.root)
        body = {"after_round": self._round or 0, "nodes": sorted(str(n) for n in self._sent)}
        write_bytes(self.root / SENT, json.dumps(body).encode())

    def read_sent(self) -> set[int]:
        """The nodes :meth:`note_sent` recorded since the checkpoint :meth:`read_state` read
        (none: nothing was sent since it, or the record is of an earlier checkpoint, which
        its own state answers for); call after :meth:`read_state`.

        Raises
        ------
        CheckpointError
            ``sent.json`` is unreadable, malformed, or of a round after the checkpoint's.
        """
        path = self.root / SENT
        current = self._round
        assert current is not None, "read_sent() before read_state()"
        if not path.exists():
            return set()
        try:
            body = json.loads(path.read_bytes())
        except (OSError, ValueError, RecursionError) as err:
            raise CheckpointError(f"checkpoint file {path} is unreadable: {err}") from err
        after = body.get("after_round") if isinstance(body, dict) else None
        nodes = body.get("nodes") if isinstance(body, dict) else None
        if not isinstance(after, int) or isinstance(after, bool) or \
                not 0 <= after <= current or not isinstance(nodes, list) or \
                not all(isinstance(n, str) and n.isdecimal() and len(n) <= 20 for n in nodes):
            raise CheckpointError(
                f"checkpoint file {path} is malformed: {_short(body)}, expected after_round "
                f"(0..{current}, the checkpoint's round) and the nodes (ids as strings)")
        if after < current:
            log.info("checkpoint: %s is of round %d's checkpoint, before this one's (%d): "
                     "the state answers for its nodes", path, after, current)
            return set()
        self._sent = {int(n) for n in nodes}
        return set(self._sent)

    def amend(self, key: str, value: Any) -> None:
        """Set ``key`` of the saved ``state.json`` to ``value`` (a JSON value), the rest of it
        and the block files as they are on disk (a stopped run records how its segment ended).

        Raises
        ------
        CheckpointError
            ``state.json`` cannot be read back (see :meth:`read_state`).
        """
        state = self.read_state()
        state[key] = value
        write_bytes(self.root / STATE, json.dumps(state, indent=1).encode())

    def _written(self, path: Path) -> None:
        if self.on_file_written is not None:
            self.on_file_written(path)

    def _prune(self, keep: set[str]) -> None:
        """Remove the files the new ``state.json`` does not name, each one logged."""
        removed = False
        for path in sorted(self.root.iterdir()):
            if path.name in keep or path.name in (STATE, SENT):
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

    def load(
        self, layout: Layout | None = None
    ) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
        """The saved state and the saved blocks' tensors: :meth:`read_state`, then
        :meth:`load_blocks`.

        Raises
        ------
        CheckpointError
            See :meth:`read_state` and :meth:`load_blocks`.
        """
        state = self.read_state()
        return state, self.load_blocks(state, layout)

    def read_state(self) -> dict[str, Any]:
        """``state.json``, its format, round and block entries checked (the rest of it is the
        caller's to check).

        Raises
        ------
        CheckpointError
            ``state.json`` is missing, unreadable, not JSON (truncated, garbage, nested too
            deeply to parse), of another format, or its ``round`` or ``blocks`` are malformed;
            the message names the file.
        """
        path = self.root / STATE
        try:
            state = json.loads(path.read_bytes())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"checkpoint state {path} is unreadable: {err}") from err
        except RecursionError:
            raise CheckpointError(f"checkpoint state {path} is unreadable: its JSON is nested "
                                  "too deeply to parse") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint state {path} is malformed: it holds a "
                                  f"{type(state).__name__}, not an object")
        if state.get("format") != FORMAT:
            found = state.get("format", 1)
            raise CheckpointError(
                f"checkpoint state {path} has format {_short(found)}, expected {FORMAT} (block "
                "files verified by checksum); it cannot be resumed: start with overwrite = "
                "true or use another output-dir"
            )
        server_round: Any = state.get("round")
        if not _is_int(server_round) or server_round < 0:
            raise CheckpointError(f"checkpoint state {path} is malformed: round = "
                                  f"{_short(server_round)}, expected an integer >= 0")
        entries = state.get("blocks")
        if not isinstance(entries, dict):
            raise CheckpointError(f"checkpoint state {path} is malformed: blocks = "
                                  f"{_short(entries)}, expected an object of block entries")
        for name, entry in entries.items():
            self._check_entry(name, entry)
        self._round = server_round
        return state

    def _check_entry(self, name: str, entry: Any) -> None:
        where = f"checkpoint state {self.root / STATE} is malformed: block entry {_short(name)}"
        if not _NAME.fullmatch(name):
            raise CheckpointError(f"{where} is not a block name")
        if not isinstance(entry, dict) or set(entry) != {"version", "checksum", "file"}:
            raise CheckpointError(f"{where} = {_short(entry)}, expected an object of version, "
                                  "checksum and file")
        version, checksum, file = entry["version"], entry["checksum"], entry["file"]
        if not _is_int(version) or version < 1:
            raise CheckpointError(f"{where} has version {_short(version)}, expected an "
                                  "integer >= 1")
        if not isinstance(checksum, str) or not _CHECKSUM.fullmatch(checksum):
            raise CheckpointError(f"{where} has checksum {_short(checksum)}, expected 64 hex "
                                  "digits")
        if not isinstance(file, str) or file != block_file(name, version, checksum):
            raise CheckpointError(f"{where} names file {_short(file)}, not the file of that "
                                  f"block, version and checksum "
                                  f"({block_file(name, version, checksum)})")

    def load_blocks(
        self, state: Mapping[str, Any], layout: Layout | None = None
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Every block file ``state`` (from :meth:`read_state`) names, checked against its
        checksum and, with ``layout``, against what the model expects of that entry.

        Raises
        ------
        CheckpointError
            A block file is missing, unreadable, not the content ``state.json`` names, an entry
            the layout does not know, or a tensor of another name, shape or dtype than the
            layout's (the message names the file, the tensor, expected and found).
        """
        blocks: dict[str, dict[str, torch.Tensor]] = {}
        for name, entry in state["blocks"].items():
            if layout is not None and layout(name) is None:
                raise CheckpointError(
                    f"checkpoint state {self.root / STATE} names block {name!r}, which this "
                    "model has not (another model, or other layers-per-block?)"
                )
            self._check_size(name, entry["file"], None if layout is None else layout(name))
            tensors = self._load_block(name, entry)
            if layout is not None:
                self._check_layout(name, entry["file"], tensors, layout(name))
            blocks[name] = tensors
        for name, entry in state["blocks"].items():
            self._checksums[(name, entry["version"])] = entry["checksum"]
        self._referenced = {e["file"] for e in state["blocks"].values()}
        return blocks

    def _load_block(self, name: str, entry: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        file, expected = entry["file"], entry["checksum"]
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

    def _check_size(self, name: str, file: str, layout: EntryLayout | None) -> None:
        """Refuse a file larger than its entry's tensors can be, before reading it."""
        path = self.root / file
        bound = None if layout is None else layout.max_file_bytes()
        try:
            size = path.stat().st_size
        except OSError as err:
            raise CheckpointError(f"checkpoint file {path} (block {name}) is unreadable: "
                                  f"{err}") from err
        if bound is not None and size > bound:
            raise CheckpointError(f"checkpoint file {path} (block {name}) is {size} bytes, more "
                                  f"than the model's tensors of that block take ({bound})")

    def _check_layout(self, name: str, file: str, tensors: Mapping[str, torch.Tensor],
                      layout: EntryLayout | None) -> None:
        assert layout is not None
        where = f"checkpoint file {self.root / file} (block {name})"
        extra = sorted(set(tensors) - set(layout.tensors))
        missing = sorted(set(layout.tensors) - set(tensors))
        if extra or (layout.complete and missing) or not tensors:
            raise CheckpointError(f"{where} holds unexpected tensors {_short(extra)} and lacks "
                                  f"{_short(missing)} (it holds {len(tensors)})")
        for key, tensor in sorted(tensors.items()):
            spec = layout.tensors[key]
            found = TensorSpec(tuple(tensor.shape), tensor.dtype)
            if not spec.matches(tensor):
                raise CheckpointError(f"{where}: tensor {key!r} has {found.describe()}, the "
                                      f"model expects {spec.describe()}")
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise CheckpointError(f"{where}: tensor {key!r} holds NaN or infinite values")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    """``repr(value)``, cut short (a damaged file may hold anything)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}...({len(text)} characters)"
