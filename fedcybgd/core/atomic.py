"""Crash-safe file writes: a temp file in the same folder, fsync'd, renamed, folder fsync'd.

A reader sees the old file or the new one, never half of one; after the call returns the new
file survives a power loss too (the rename is only durable once its folder is fsync'd).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

TEMP_SUFFIX = ".tmp"  # every temp file this module makes ends so (and starts with a dot)


def fsync_dir(path: Path) -> None:
    """Make the entries of folder ``path`` (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """``mkdir -p`` whose new folders survive a power loss (each parent fsync'd)."""
    missing: list[Path] = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    path.mkdir(parents=True, exist_ok=True)
    for folder in reversed(missing):
        fsync_dir(folder.parent)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_via_temp(path: Path, write: Callable[[str], object]) -> None:
    """Write a temp file beside ``path`` with ``write(temp_path)``, fsync, rename, fsync folder."""
    make_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        _fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)  # only still there when writing failed
    fsync_dir(path.parent)


def write_bytes(path: Path, data: bytes) -> None:
    """Atomically and durably write ``data`` to ``path``."""
    _write_via_temp(path, lambda tmp: Path(tmp).write_bytes(data))


def save_tensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Atomically and durably write ``tensors`` as a safetensors file."""
    contiguous = {k: v.detach().contiguous() for k, v in tensors.items()}
    _write_via_temp(path, lambda tmp: save_file(contiguous, tmp, metadata=metadata))


def append_line(path: Path, line: str) -> None:
    """Append one line to ``path`` and fsync it (the file is created, durably, if missing)."""
    created = not path.exists()
    with path.open("a") as f:
        f.write(line.rstrip("\n") + "\n")
        f.flush()
        os.fsync(f.fileno())
    if created:
        fsync_dir(path.parent)
