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
flight). An operator who sets glibc's own ``MALLOC_MMAP_MAX_``, ``MALLOC_TRIM_THRESHOLD_`` or
``MALLOC_ARENA_MAX`` in the environment keeps those: nothing is changed then.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("kvtier.heap")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD = 1 << 30  # freed memory kept for reuse at most (at the heap's top)
OPERATOR_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")


def reuse_freed_memory() -> bool:
    """Make glibc keep freed large blocks for reuse; whether it was changed (not glibc, or the
    environment sets glibc's own tunables: left as it is)."""
    if any(name in os.environ for name in OPERATOR_SETTINGS):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    changed = (bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
               and bool(mallopt(M_ARENA_MAX, 1)))
    log.info("malloc: freed chunk buffers are reused (mmap off, trim threshold %d MiB, one arena): %s",
             TRIM_THRESHOLD >> 20, changed)
    return changed
