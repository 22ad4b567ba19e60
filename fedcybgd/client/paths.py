"""Server-sent names that become client paths: checked before any file is touched.

A server (or whoever speaks for it) names the lineage and the blocks; the client turns them
into folders and files under its ``cache-dir``. Every such name must match a strict pattern,
and every path built from one must resolve (symlinks followed) inside ``cache-dir``, so an
instruction can neither write nor remove anything outside it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# The server's lineage is 16 hex digits (uuid4); tests use short words.
_LINEAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
# Block names: embed, head, layer.3, layer.0-7.
_BLOCK = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class UnsafeName(ValueError):
    """A server-sent name that would make an unsafe path (or leave the cache folder)."""


def lineage_name(value: str) -> str:
    """``value`` if it is a valid lineage (letters, digits, ``-``, ``_``; at most 64)."""
    if not _LINEAGE.fullmatch(value):
        raise UnsafeName(f"lineage {value[:80]!r} is not a plain name "
                         f"(allowed: {_LINEAGE.pattern})")
    return value


def block_name(value: str) -> str:
    """``value`` if it is a plain block name (letters, digits, ``.``, ``-``, ``_``; no ``..``)."""
    if not _BLOCK.fullmatch(value) or ".." in value:
        raise UnsafeName(f"block name {value[:80]!r} is not a plain name "
                         f"(allowed: {_BLOCK.pattern}, no '..')")
    return value


def inside(root: Path, path: Path, what: str) -> Path:
    """``path`` if it resolves (symlinks followed) inside ``root``; else :class:`UnsafeName`."""
    real_root = root.resolve()
    real = path.resolve()
    if real != real_root and not real.is_relative_to(real_root):
        raise UnsafeName(f"{what} {path} resolves to {real}, outside the cache folder "
                         f"{real_root}")
    return path


@dataclass(frozen=True)
class NodeDirs:
    """The folders of one node in one lineage, both checked to lie inside ``cache-dir``."""

    store: Path  # the block store (:class:`fedcybgd.client.store.BlockStore`)
    rule_state: Path  # the update rules' state between rounds (ZeroLock heads, checkpoints)


def node_dirs(cache_dir: Path, lineage: str, node_id: int) -> NodeDirs:
    """Where node ``node_id`` keeps lineage ``lineage`` under ``cache_dir``.

    Raises
    ------
    UnsafeName
        ``lineage`` is not a plain name, or a folder on the way is a symlink leading out.
    """
    base = cache_dir / "clients" / lineage_name(lineage)
    store = inside(cache_dir, base / f"node-{int(node_id)}", "the node's store")
    state = inside(cache_dir, base / f"node-{int(node_id)}-rule-state", "the rule state folder")
    return NodeDirs(store, state)
