"""RedisManifests: small JSON values (session manifests) in Redis, on the shared ``RedisConnection``.

Unlike the chunk tier, these calls raise ``TierUnavailable`` when Redis cannot be reached, so that
"absent" and "unknown" stay distinct: a session must not look deleted because Redis was down.
"""

from __future__ import annotations

import enum

from .keys import glob_prefix
from .redis_conn import RedisConnection, ttl_seconds


class _Default(enum.Enum):
    TTL = "store ttl"


STORE_TTL = _Default.TTL  # ``set(..., ttl=STORE_TTL)``: the store's own TTL

SCAN_COUNT = 1000  # keys the server looks at per SCAN step


class RedisManifests:
    """Values by key in Redis/Valkey (every primary in cluster mode).

    Args:
        connection: the shared connection (its breaker guards every call).
        ttl: seconds a value lives after it was last written (``None``: no expiry); the chunk
            tier's TTL, so a manifest does not outlive its chunks by much.

    Raises:
        ConfigError: a bad ``ttl``.
    """

    def __init__(self, connection: RedisConnection, *, ttl: float | None = None):
        self.connection = connection
        self.ttl = ttl_seconds(ttl)

    def __repr__(self) -> str:
        return f"RedisManifests(url={self.connection.url!r}, ttl={self.ttl})"

    @property
    def shared(self) -> bool:
        return True

    async def get(self, key: bytes | str) -> bytes | None:
        """One value as stored, or None.

        Raises:
            TierUnavailable: Redis cannot be reached.
        """
        client = self.connection.client

        async def call() -> bytes | None:
            value = await client.get(key)
            assert value is None or isinstance(value, bytes)  # responses are never decoded
            return value

        return await self.connection.run("get", call)

    async def set(self, key: bytes | str, value: bytes | str, *, ttl: float | None | _Default = STORE_TTL,
                  only_if_exists: bool = False) -> bool:
        """SET one value; ``ttl``: seconds, None for no expiry, or the store's TTL (default).

        Returns False when ``only_if_exists`` (SET XX) and the key did not exist.

        Raises:
            TierUnavailable: Redis cannot be reached. ConfigError: a bad ``ttl``.
        """
        ex = self.ttl if isinstance(ttl, _Default) else ttl_seconds(ttl)
        client = self.connection.client
        return bool(await self.connection.run("set", lambda: client.set(key, value, ex=ex, xx=only_if_exists)))

    async def delete(self, key: bytes | str) -> bool:
        """DEL one key; True when it existed (atomic: of concurrent deletes exactly one wins).

        Raises:
            TierUnavailable: Redis cannot be reached.
        """
        return bool(await self.connection.run("del", lambda: self.connection.client.delete(key)))

    async def keys(self, prefix: bytes) -> list[bytes]:
        """Keys starting with ``prefix`` (a SCAN of its escaped glob).

        Raises:
            TierUnavailable: Redis cannot be reached.
        """
        return await self.scan(glob_prefix(prefix))

    async def scan(self, pattern: str | bytes, count: int = SCAN_COUNT, limit: int | None = None) -> list[bytes]:
        """Keys matching a glob ``pattern`` (every primary in cluster mode), without duplicates.

        Raises:
            TierUnavailable: Redis cannot be reached.
        """

        async def call() -> list[bytes]:
            seen: dict[bytes, None] = {}
            async for key in self.connection.client.scan_iter(match=pattern, count=count):
                seen[key] = None
                if limit is not None and len(seen) >= limit:
                    break
            return list(seen)

        return await self.connection.run("scan", call)
