"""The tiers one process runs, built in one place for the sidecar and the llama-cpp-python cache."""

from __future__ import annotations

import os
from typing import Any

from .base import Tier
from .codec import BlobCodec
from .memory import MemoryTier
from .redis_backend import RedisBackend
from .store import DEFAULT_QUEUE_LIMIT, DEFAULT_WINDOW_BYTES, TieredStore


def build_store(codec: BlobCodec, memory_bytes: int, *, eviction: str = "s3fifo",
                shared_dir: str | os.PathLike[str] | None = None, shared_bytes: int | str = "4G",
                redis_url: str | None = None, redis_ttl: float | None = None, node_id: str | None = None,
                redis_options: dict[str, Any] | None = None,
                queue_limit: int = DEFAULT_QUEUE_LIMIT,
                window_bytes: int = DEFAULT_WINDOW_BYTES) -> tuple[TieredStore, RedisBackend | None]:
    """This process's memory tier, the node's shared directory when given, Redis when given.

    Returns the store and the Redis behind its last tier (session manifests, events), or None.
    Nothing is sent to Redis here: the connection is made by the first call.

    Raises:
        ConfigError: a bad size, directory or Redis URL.
    """
    tiers: list[Tier] = [MemoryTier(memory_bytes, policy=eviction)]
    if shared_dir:
        from .shared import SharedTier

        tiers.append(SharedTier(shared_dir, shared_bytes))
    redis = None
    if redis_url:
        redis = RedisBackend.open(redis_url, ttl=redis_ttl, node_id=node_id, **(redis_options or {}))
        tiers.append(redis.tier)
    return TieredStore(tiers, codec, queue_limit=queue_limit, window_bytes=window_bytes), redis
