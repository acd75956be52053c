"""MemoryTier: blobs in this process's RAM under a byte budget."""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from .base import StatsCounter, TierRole, TierStats
from .errors import ConfigError
from .policies import EvictionPolicy, make_policy


class MemoryTier:
    """In-process tier with a byte budget and a pluggable eviction policy.

    Keys passed in one call are taken to be one prefix chain in order (root first), as the
    ``TieredStore`` passes them. They are recorded deepest first, so the root ends up the most
    recently used: among equally cold entries a chunk's descendants are evicted before the chunk.

    Args:
        capacity: byte budget (values only; the per-entry overhead of ~100 bytes is not counted).
        policy: ``s3fifo`` (default) or ``lru``.
    """

    role = TierRole.LOCAL
    write_behind = False

    def __init__(self, capacity: int, *, policy: str = "s3fifo", name: str = "memory"):
        if capacity <= 0:
            raise ConfigError(f"memory tier capacity must be positive, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._policy: EvictionPolicy = make_policy(policy, capacity)
        self._data: dict[bytes, bytes | memoryview] = {}
        self._used = 0
        self._lock = threading.Lock()
        self._stats = StatsCounter(name)

    async def get_many(self, keys: Sequence[bytes]) -> dict[bytes, bytes | memoryview]:
        return self.get_many_sync(keys)

    def get_many_sync(self, keys: Sequence[bytes]) -> dict[bytes, bytes | memoryview]:
        found: dict[bytes, bytes | memoryview] = {}
        with self._lock:
            for key in reversed(keys):
                value = self._data.get(key)
                if value is not None:
                    self._policy.on_access(key)
                    found[key] = value
        nbytes = sum(len(v) for v in found.values())
        self._stats.add(hits=len(found), misses=len(keys) - len(found), bytes_out=nbytes)
        return found

    async def put_many(self, items: Mapping[bytes, bytes | memoryview]) -> int:
        return self.put_many_sync(items)

    def put_many_sync(self, items: Mapping[bytes, bytes | memoryview]) -> int:
        stored = evicted = nbytes = 0
        with self._lock:
            for key in reversed(list(items)):
                value = _owned(items[key])
                size = len(value)
                if size > self.capacity:
                    continue  # larger than the whole tier: never cached here
                old = self._data.pop(key, None)
                if old is not None:
                    self._used -= len(old)
                    self._policy.on_remove(key)
                evicted += self._evict_for(size)
                self._data[key] = value
                self._used += size
                self._policy.on_insert(key, size)
                stored += 1
                nbytes += size
        self._stats.add(puts=stored, bytes_in=nbytes, evictions=evicted)
        return stored

    def make_room(self, nbytes: int, keep: Collection[bytes] = ()) -> None:
        """Evict now what a put of ``nbytes`` would evict (before a save's chunks are cut, before a
        fetch whose chunks will be promoted here): the old values are freed before the new ones
        exist, so the process holds the budget and the chunks in hand, not both. The values of
        ``keep`` (the fetch's own) stay, as most recently used."""
        with self._lock:
            evicted = self._evict_for(min(nbytes, self.capacity), keep)
        self._stats.add(evictions=evicted)

    def _evict_for(self, size: int, keep: Collection[bytes] = ()) -> int:
        """Evict until ``size`` more bytes fit in the budget (the lock held), sparing ``keep``; how
        many were evicted."""
        evicted = 0
        spared: list[bytes] = []
        while self._used + size > self.capacity and len(self._data) > len(spared):
            victim = self._policy.victim()
            if victim in keep:
                spared.append(victim)
                continue
            self._used -= len(self._data.pop(victim))
            evicted += 1
        for key in spared:
            self._policy.on_insert(key, len(self._data[key]))
        return evicted

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._data for k in keys]

    async def delete(self, keys: Sequence[bytes]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                old = self._data.pop(key, None)
                if old is not None:
                    self._used -= len(old)
                    self._policy.on_remove(key)
                    removed += 1
        return removed

    async def expire(self, keys: Sequence[bytes], seconds: float) -> int:
        """Deleted now: only this node reads them (``Tier.expire``)."""
        return await self.delete(keys)

    async def delete_prefix(self, prefix: bytes) -> int:
        """Delete every value whose key starts with ``prefix`` (a namespace's, on a purge)."""
        with self._lock:
            doomed = [k for k in self._data if k.startswith(prefix)]
        return await self.delete(doomed)

    def stats(self) -> TierStats:
        with self._lock:
            entries, used = len(self._data), self._used
        return self._stats.snapshot(entries=entries, bytes_used=used, capacity=self.capacity)

    async def aclose(self) -> None:
        with self._lock:
            self._data.clear()
            self._used = 0


def _owned(value: bytes | bytearray | memoryview) -> bytes | memoryview:
    """``value`` as the tier may keep it: bytes as they are, and a read-only view of a whole numpy
    buffer of its own (a codec-framed chunk, a value the bulk lane read) without a copy. Anything
    else is copied: a kept view must never pin a larger buffer, see its bytes change, or map a
    file another process may cut short."""
    if isinstance(value, bytes):
        return value
    view = memoryview(value)
    base = view.obj
    if (view.readonly and view.c_contiguous and isinstance(base, np.ndarray) and base.base is None
            and base.nbytes == view.nbytes):
        return view
    return bytes(view)
