"""Where session manifests live: the ``ManifestStore`` protocol, and ``LocalManifests`` in this process.

A manifest store keeps small JSON values by key. ``RedisManifests`` (``tiers.redis_manifests``)
shares them with every node; ``LocalManifests`` keeps them in this process, for a node without Redis.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, runtime_checkable


@runtime_checkable
class ManifestStore(Protocol):
    """Small values by key; "absent" is None or False, an unreachable backend raises ``TierUnavailable``."""

    @property
    def shared(self) -> bool:
        """True when every node sees the same values."""
        ...

    async def get(self, key: bytes) -> bytes | None: ...

    async def set(self, key: bytes, value: bytes, *, only_if_exists: bool = False) -> bool:
        """Store ``value``; False when ``only_if_exists`` and the key did not exist (nothing stored)."""
        ...

    async def delete(self, key: bytes) -> bool:
        """Remove ``key``; True when it existed (of concurrent deletes exactly one wins)."""
        ...

    async def keys(self, prefix: bytes) -> list[bytes]:
        """Every key that starts with ``prefix``, without duplicates, in no particular order."""
        ...


class LocalManifests:
    """Manifests in a dict of this process: node-local, gone with the process, no expiry.

    Args:
        max_bytes: keep at most this many bytes of values, the least recently used going first
            (None: no bound).
    """

    def __init__(self, *, max_bytes: int | None = None) -> None:
        self._values: OrderedDict[bytes, bytes] = OrderedDict()
        self._max_bytes = max_bytes
        self._bytes = 0

    @property
    def shared(self) -> bool:
        return False

    async def get(self, key: bytes) -> bytes | None:
        value = self._values.get(key)
        if value is not None:
            self._values.move_to_end(key)
        return value

    async def set(self, key: bytes, value: bytes, *, only_if_exists: bool = False) -> bool:
        if only_if_exists and key not in self._values:
            return False
        self._bytes += len(value) - len(self._values.get(key, b""))
        self._values[key] = bytes(value)
        self._values.move_to_end(key)
        while self._max_bytes is not None and self._bytes > self._max_bytes and self._values:
            _, dropped = self._values.popitem(last=False)
            self._bytes -= len(dropped)
        return True

    async def delete(self, key: bytes) -> bool:
        value = self._values.pop(key, None)
        if value is None:
            return False
        self._bytes -= len(value)
        return True

    async def keys(self, prefix: bytes) -> list[bytes]:
        return [k for k in self._values if k.startswith(prefix)]
