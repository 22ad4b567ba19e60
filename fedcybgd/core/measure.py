"""Measure a process's peak resident memory over a stretch of code."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
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

    @property
    def delta_mb(self) -> float:
        """Peak RSS above the RSS at entry, in MiB."""
        return (self.peak_bytes - self.start_bytes) / 2**20
