"""RedisBackend: the three uses of one Redis/Valkey, opened together on one ``RedisConnection``.

``tier`` holds chunk blobs (a ``Tier`` of the ``TieredStore``), ``manifests`` the session
manifests (``SessionStore``), ``events`` the pub/sub bus (pre-warming, announcements). The sidecar
and the in-process llama-cpp cache open Redis the same way, here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Unpack

from .events import EventBus
from .redis_conn import RedisConnection, RedisOptions
from .redis_manifests import RedisManifests
from .redis_tier import RedisTier


@dataclass(frozen=True, slots=True)
class RedisBackend:
    connection: RedisConnection
    tier: RedisTier
    manifests: RedisManifests
    events: EventBus

    @classmethod
    def open(cls, url: str, *, ttl: float | None = None, refresh_on_hit: bool = True, name: str = "redis",
             node_id: str | None = None, wall_clock: Callable[[], float] = time.time,
             **options: Unpack[RedisOptions]) -> RedisBackend:
        """Connect (lazily: nothing is sent before the first call) and build the three parts.

        Args:
            url: see ``RedisConnection``; ``options`` are its settings.
            ttl: seconds chunks and manifests live after their last write (chunks: or read).
            refresh_on_hit, name: the chunk tier's (see ``RedisTier``).
            node_id, wall_clock: the event bus's (see ``EventBus``).

        Raises:
            ConfigError: a bad URL or setting.
        """
        connection = RedisConnection(url, **options)
        return cls(
            connection,
            RedisTier(connection, ttl=ttl, refresh_on_hit=refresh_on_hit, name=name),
            RedisManifests(connection, ttl=ttl),
            EventBus(connection, node_id=node_id, wall_clock=wall_clock),
        )

    async def aclose(self) -> None:
        """Close the connection: every part stops (idempotent; closing the tier does the same)."""
        await self.connection.aclose()
