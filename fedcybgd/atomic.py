"""Crash-safe file writes: a temp file in the same folder, fsync'd, then ``os.replace``.

A reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_bytes(path: Path, data: bytes) -> None:
    """Atomically write ``data`` to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def save_tensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Atomically write ``tensors`` as a safetensors file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, tmp,
                  metadata=metadata)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
