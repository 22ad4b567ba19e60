"""Measure a process's peak resident memory over a stretch of code."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def release_freed() -> None:
    """Hand memory freed by the C allocator back to the OS (glibc ``malloc_trim``; a no-op
    elsewhere). Replacing a model's fp32 tensors by bf16/int8 ones frees them into the heap,
    which glibc keeps unless asked: without this the RSS would not show the saving."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


MMAP_THRESHOLD = 1 << 20  # bytes: larger allocations get their own mapping, unmapped on free
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold (``mallopt(M_MMAP_THRESHOLD)``; False where not glibc).

    glibc raises the threshold each time a mapped block is freed (up to 32 MB), after which
    blocks of that size come from the heap, which fragments and keeps the freed memory: with
    frozen int8/bf16 blocks, whose every Linear converts a weight chunk of up to 16 MB per
    forward, the RSS grew 140-190 MB above the loaded model (SmolLM2-135M) though the tensors
    alive at once were far smaller. A pinned threshold also turns the dynamic adjustment off,
    so allocations above ``threshold`` are mapped and returned to the OS on free.
    """
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


class PeakMemory:
    """Context manager sampling RSS in a thread; ``peak_mb`` is the highest value seen.

    ``ru_maxrss`` only knows the whole process's lifetime peak, so a sampler is what gives the
    peak of one training round in a long-lived client process.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.start_bytes = 0
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, rss_bytes())

    def __enter__(self) -> PeakMemory:
        self.start_bytes = self.peak_bytes = rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, rss_bytes())

    @property
    def peak_mb(self) -> float:
        """Peak RSS in MiB."""
        return self.peak_bytes / 2**20


@dataclass(frozen=True)
class CgroupMemory:
    """The memory limit the operating system enforces on this process's control group.

    ``limit_bytes`` is the hard limit (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``);
    ``others_bytes`` what the rest of the group holds in anonymous memory (the group's anonymous
    memory less this process's RSS: in a node's container, the SuperNode beside the ClientApp).
    Page cache is left out: the kernel reclaims it before it kills anything.
    """

    limit_bytes: int
    others_bytes: int

    def room_mb(self, margin_mb: float = 64.0) -> float:
        """What this process may grow to (its RSS included) before the group hits its limit."""
        return (self.limit_bytes - self.others_bytes) / 2**20 - margin_mb


def _cgroup_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(version, folder)`` of this process's memory cgroup, from ``/proc/self/cgroup``."""
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hierarchy, controllers, path = line.split(":", 2)
            if hierarchy == "0" and controllers == "":
                found.append((2, root / path.lstrip("/")))
            elif "memory" in controllers.split(","):
                found.append((1, root / "memory" / path.lstrip("/")))
    # inside a container the group's own folder is mounted as the root
    found += [(2, root), (1, root / "memory")]
    return found


def _read_int(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        text = path.read_text().strip()
        return None if text == "max" else int(text)
    return None


def _anon_bytes(stat: Path, keys: tuple[str, ...]) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        fields = dict(line.split() for line in stat.read_text().splitlines() if line.strip())
        return sum(int(fields[k]) for k in keys if k in fields)
    return None


def cgroup_memory(root: Path = Path("/sys/fs/cgroup")) -> CgroupMemory | None:
    """This process's enforced memory limit, or None when there is none (or it is not Linux).

    A limit at or above the machine's memory is no limit (v1 writes a huge number for none).
    """
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(
        os, "sysconf") else 0
    for version, folder in _cgroup_dirs(root):
        if version == 2:
            limit = _read_int(folder / "memory.max")
            anon = _anon_bytes(folder / "memory.stat", ("anon",))
        else:
            limit = _read_int(folder / "memory.limit_in_bytes")
            anon = _anon_bytes(folder / "memory.stat", ("total_rss",))
        if limit is None or (machine and limit >= machine):
            continue
        others = max(0, (anon or 0) - rss_bytes())
        return CgroupMemory(limit, others)
    return None
