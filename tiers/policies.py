"""Eviction policies: each one only decides *what* to evict; the tier owns storage and sizes.

Prefix awareness comes from the order the tier reports keys in: a tier records the keys of one
chain deepest first (see ``MemoryTier``), so within a batch the root is the warmest entry and a
chunk's descendants, useless without it, go before it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class EvictionPolicy(Protocol):
    name: str

    def on_insert(self, key: bytes, size: int) -> None: ...

    def on_access(self, key: bytes) -> None: ...

    def on_remove(self, key: bytes) -> None:
        """The key left the tier for a reason other than ``victim`` (delete, overwrite)."""
        ...

    def victim(self) -> bytes:
        """Choose and forget the next key to evict; the tier must then drop it."""
        ...


class LRUPolicy:
    """Least recently used."""

    name = "lru"

    def __init__(self, capacity: int = 0):
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def on_insert(self, key: bytes, size: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victim(self) -> bytes:
        key, _ = self._order.popitem(last=False)
        return key


class S3FIFOPolicy:
    """S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and a ghost FIFO.

    New keys enter the small queue (10% of the bytes); keys hit again before they leave it are
    promoted to main, the rest are evicted early and remembered in the ghost queue, so a key that
    returns soon after goes straight to main. One-hit wonders (a session seen once) therefore never
    push out the shared prefixes that many sessions reuse, which is where LRU loses.
    """

    name = "s3fifo"
    SMALL_FRACTION = 0.10
    MAX_FREQ = 3

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError("S3FIFOPolicy needs a positive byte capacity")
        self.capacity = capacity
        self._small: OrderedDict[bytes, int] = OrderedDict()  # key -> size
        self._main: OrderedDict[bytes, int] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._ghost_limit = 0  # entries; follows the number of cached entries
        self._freq: dict[bytes, int] = {}
        self._small_bytes = 0

    def on_insert(self, key: bytes, size: int) -> None:
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = size
        else:
            self._small[key] = size
            self._small_bytes += size
        self._ghost_limit = max(self._ghost_limit, len(self._small) + len(self._main))

    def on_access(self, key: bytes) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def on_remove(self, key: bytes) -> None:
        self._freq.pop(key, None)
        if key in self._small:
            self._small_bytes -= self._small.pop(key)
        else:
            self._main.pop(key, None)

    def victim(self) -> bytes:
        while True:
            if self._small and (self._small_bytes > self.capacity * self.SMALL_FRACTION or not self._main):
                key, size = self._small.popitem(last=False)
                self._small_bytes -= size
                if self._freq.get(key, 0) > 0:
                    self._freq[key] = 0
                    self._main[key] = size
                    continue
                self._remember(key)
                del self._freq[key]
                return key
            key, size = self._main.popitem(last=False)
            if self._freq.get(key, 0) > 0:
                self._freq[key] -= 1
                self._main[key] = size
                continue
            del self._freq[key]
            return key

    def _remember(self, key: bytes) -> None:
        self._ghost[key] = None
        while len(self._ghost) > max(self._ghost_limit, 1):
            self._ghost.popitem(last=False)


POLICIES = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    return cls(capacity)  # type: ignore[no-any-return]
