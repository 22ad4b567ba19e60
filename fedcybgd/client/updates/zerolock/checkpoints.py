"""ZeroLock's state on disk: the local heads kept between rounds and the in-round crash
checkpoint a round resumes from.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn

from fedcybgd.client.paths import block_name
from fedcybgd.client.updates.zerolock.chunks import Chunk
from fedcybgd.core.atomic import save_tensors
from fedcybgd.data.prompts import Batch
from fedcybgd.tasks.shares import BatchIterator

log = logging.getLogger(__name__)


STATE_DIR = "zerolock"
CHECKPOINT_FILE = "checkpoint.safetensors"


def atomic_save(tensors: Mapping[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
    """Write a safetensors file atomically (see :mod:`fedcybgd.core.atomic`)."""
    save_tensors(path, tensors, meta)


def read_state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """Tensors and metadata of a safetensors file, ``None`` if absent or unreadable."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
        return load_file(str(path)), meta
    except (OSError, ValueError, SafetensorError) as err:  # corrupt: start afresh
        log.warning("ignoring unreadable %s (%s)", path, err)
        return None


def heads_path(state_dir: Path, block: str) -> Path:
    """Where the tuned maps of ``block`` are kept between rounds."""
    return state_dir / STATE_DIR / "heads" / f"{block_name(block)}.safetensors"


def checkpoint_path(state_dir: Path) -> Path:
    """Where a round's in-progress checkpoint is kept."""
    return state_dir / STATE_DIR / CHECKPOINT_FILE


@dataclass
class Progress:
    """Round progress besides the tensors: what a resumed round continues from."""

    step: int = 0  # batches consumed (applied + skipped steps)
    losses: list[float] = field(default_factory=list)  # final chunk's loss per applied step
    examples: int = 0
    skipped: int = 0
    chunk_sums: list[float] = field(default_factory=list)
    chunk_counts: list[int] = field(default_factory=list)


def save_checkpoint(
    path: Path, identity: dict[str, Any], progress: Progress, chunks: list[Chunk]
) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        c = f"c{chunk.index}"
        for j, master in enumerate(chunk.masters):
            tensors[f"{c}.w.{j}"] = master
        for name, p in translator_params(chunk):
            tensors[f"{c}.map.{name}"] = p
        for oname, opt in chunk.named_optimizers():
            for idx, state in opt.state_dict()["state"].items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"{c}.{oname}.{idx}.{key}"] = value
    progress.chunk_sums = [c.loss_sum for c in chunks]
    progress.chunk_counts = [c.loss_count for c in chunks]
    meta = {
        "identity": json.dumps(identity, sort_keys=True),
        "progress": json.dumps(asdict(progress)),
    }
    atomic_save(tensors, path, meta)


def fits_chunks(tensors: dict[str, torch.Tensor], meta: dict[str, str],
                chunks: list[Chunk]) -> bool:
    """Does a checkpoint hold every tensor these chunks need, with the right shapes?"""
    try:
        progress = Progress(**json.loads(meta["progress"]))
    except (KeyError, TypeError, ValueError):
        return False
    if len(progress.chunk_sums) != len(chunks) or len(progress.chunk_counts) != len(chunks):
        return False
    for chunk in chunks:
        c = f"c{chunk.index}"
        wanted = {f"{c}.w.{j}": m.shape for j, m in enumerate(chunk.masters)}
        wanted.update({f"{c}.map.{n}": p.shape for n, p in translator_params(chunk)})
        for key, shape in wanted.items():
            if key not in tensors or tensors[key].shape != shape:
                return False
    return True


def restore_checkpoint(
    tensors: dict[str, torch.Tensor], meta: dict[str, str], chunks: list[Chunk]
) -> Progress:
    progress = Progress(**json.loads(meta["progress"]))
    with torch.no_grad():
        for chunk in chunks:
            c = f"c{chunk.index}"
            for j, (master, p) in enumerate(zip(chunk.masters, chunk.params, strict=True)):
                master.copy_(tensors[f"{c}.w.{j}"])
                if not chunk.shared:
                    p.copy_(master)
            for name, param in translator_params(chunk):
                param.copy_(tensors[f"{c}.map.{name}"])
            for oname, opt in chunk.named_optimizers():
                state_dict = opt.state_dict()
                state: dict[int, dict[str, torch.Tensor]] = {}
                prefix = f"{c}.{oname}."
                for key, value in tensors.items():
                    if key.startswith(prefix):
                        idx, name = key[len(prefix) :].split(".", 1)
                        state.setdefault(int(idx), {})[name] = value
                state_dict["state"] = state
                opt.load_state_dict(state_dict)
            chunk.loss_sum = progress.chunk_sums[chunk.index]
            chunk.loss_count = progress.chunk_counts[chunk.index]
    return progress


def translator_params(chunk: Chunk) -> list[tuple[str, nn.Parameter]]:
    translator = chunk.head.translator
    return [] if translator is None else list(translator.named_parameters())


def skip_batches(batches: Iterator[Batch], count: int) -> None:
    """Consume ``count`` batches (a BatchIterator skips without tokenizing)."""
    if isinstance(batches, BatchIterator):
        batches.step += count
        return
    for _ in range(count):
        next(batches)
