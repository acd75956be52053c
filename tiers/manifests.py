"""Where session manifests live: the ``ManifestStore`` protocol, and ``LocalManifests`` in this process.

A manifest store keeps small JSON values by key. ``RedisManifests`` (``tiers.redis_manifests``)
shares them with every node; ``LocalManifests`` keeps them in this process, for a node without Redis.
"""

from __future__ import annotations

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
    """Manifests in a dict of this process: node-local, gone with the process, no expiry."""

    def __init__(self) -> None:
        self._values: dict[bytes, bytes] = {}

    @property
    def shared(self) -> bool:
        return False

    async def get(self, key: bytes) -> bytes | None:
        return self._values.get(key)

    async def set(self, key: bytes, value: bytes, *, only_if_exists: bool = False) -> bool:
        if only_if_exists and key not in self._values:
            return False
        self._values[key] = bytes(value)
        return True

    async def delete(self, key: bytes) -> bool:
        return self._values.pop(key, None) is not None

    async def keys(self, prefix: bytes) -> list[bytes]:
        return [k for k in self._values if k.startswith(prefix)]
