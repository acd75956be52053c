"""The sidecar process reuses the memory it frees for its next chunk buffers (glibc's malloc).

At an 8B model's KV shape a chunk is 32 MiB (256 tokens of 128 KiB). glibc serves an allocation that
large with a fresh ``mmap`` and unmaps it when it is freed, so every save's and restore's buffers
would be pages the kernel hands out for the first time, each faulted in and zeroed: on a 2-core VM
numpy fills such a buffer at 0.6-0.7 GB/s and a reused one at 4-12 GB/s (docs/scaling.md §8). With
``mmap`` off for large blocks and a high trim threshold, a freed chunk buffer (an evicted RAM-tier
chunk, a restore's read buffer) stays in the heap and the next cut or read of the same size takes it.
All threads share that one heap (one malloc arena): chunks are cut, read and freed on different
threads (the save pool, the bulk lane, the event loop), and with an arena per thread a buffer freed
into one thread's arena was of no use to the next cut on another, which faulted in a fresh one.

The cost: the process keeps up to ``TRIM_THRESHOLD`` of freed memory instead of returning it, so its
RSS stays near its peak (the RAM tier's budget plus the buffers of the largest save or restore in
flight). Freed blocks that no new one fits (a partial tail's, smaller than a chunk) would stay in
it too, between blocks in use: ``release_holes`` gives their pages back after each save and restore.
An operator who sets glibc's own ``MALLOC_MMAP_MAX_``, ``MALLOC_TRIM_THRESHOLD_`` or
``MALLOC_ARENA_MAX`` in the environment keeps those: nothing is changed then.

``heap_usage`` (``kvtier_heap_bytes``) tells how much of the heap is in use, free, and free at its top.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvtier.heap")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD = 1 << 30  # freed memory kept for reuse at most (at the heap's top)
OPERATOR_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")


# Free heap bytes between blocks in use (not at the top) that ``release_holes`` gives back: about
# an 8B model's chunk. A freed partial tail is smaller than a chunk, and no chunk fits where it was.
HOLE_BYTES = 32 << 20
_reusing: list[bool] = []  # [True] once ``reuse_freed_memory`` changed glibc's settings


def reuse_freed_memory() -> bool:
    """Make glibc keep freed large blocks for reuse; whether it was changed (not glibc, or the
    environment sets glibc's own tunables: left as it is)."""
    if any(name in os.environ for name in OPERATOR_SETTINGS):
        return False
    mallopt = _libc_function("mallopt")
    if mallopt is None:  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    changed = (bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
               and bool(mallopt(M_ARENA_MAX, 1)))
    log.info("malloc: freed chunk buffers are reused (mmap off, trim threshold %d MiB, one arena): %s",
             TRIM_THRESHOLD >> 20, changed)
    if changed:
        _reusing[:] = [True]
    return changed


def release_holes(min_bytes: int = HOLE_BYTES) -> bool:
    """Give the pages of free heap blocks between blocks in use back to the OS once they add up to
    ``min_bytes`` (glibc's ``malloc_trim``, which keeps up to ``TRIM_THRESHOLD`` free at the top for
    the next cut); whether it did. Only with ``reuse_freed_memory``'s settings (else glibc maps
    large blocks apart, and no such holes form).

    A save's or a restore's evictions free chunk buffers right before its own buffers are taken, so
    those are reused; what stays free in between afterwards is mostly a freed partial tail, which
    no chunk fits, held in the process's memory for nothing. At a 70B shape these grew by a tail
    (66 MiB) per two saves (``bench datapath``).
    """
    usage = heap_usage() if _reusing else None
    if usage is None or usage.free - usage.free_at_top < min_bytes:
        return False
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(TRIM_THRESHOLD)
    return True


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@dataclass(frozen=True, slots=True)
class HeapUsage:
    """glibc's malloc heap (``mallinfo2``): bytes in use, bytes free and kept for reuse, and of
    those the part at the heap's top. The rest are holes between blocks in use, which only a block
    that fits reuses; ``release_holes`` gives their pages back, and they still count as free."""

    in_use: int
    free: int
    free_at_top: int


@functools.cache
def _libc_function(name: str) -> Any:
    """A C library function (a ctypes function: glibc's), or None where it is not there."""
    lib = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(lib), name) if lib else None
    except (OSError, AttributeError):
        return None


def heap_usage() -> HeapUsage | None:
    """The process's malloc heap now; None where glibc's ``mallinfo2`` (2.33 and later) is not there."""
    fn = _libc_function("mallinfo2")
    if fn is None:
        return None
    fn.argtypes, fn.restype = [], _MallInfo2
    info = fn()
    return HeapUsage(info.uordblks + info.hblkhd, info.fordblks, info.keepcost)
