"""A ``TieredStore`` for synchronous code: the tiers on an event loop in a daemon thread.

llama-cpp-python is synchronous and kvtier's tiers are asyncio. ``SyncStore`` runs the store on a
loop of its own (``call`` waits for one coroutine there), so background Redis writes go on while the
caller computes, and one store can be shared by several caches of one process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from collections.abc import Coroutine, Mapping
from typing import Any, Self, TypeVar

from tiers.base import parse_size
from tiers.codec import BlobCodec
from tiers.errors import KVTierError
from tiers.events import EventBus
from tiers.memory import MemoryTier
from tiers.pending import PendingSaves
from tiers.redis_backend import RedisBackend
from tiers.sessions import SessionStore
from tiers.stack import build_store
from tiers.store import TieredStore

from .flows import pending_of, sessions_of

log = logging.getLogger("kvtier.llama_cpp")
T = TypeVar("T")

# Defaults, with units.
DEFAULT_CAPACITY = 2 << 30  # bytes of the in-process memory tier (llama-cpp-python's own default)
DEFAULT_SHARED_CAPACITY = "4G"  # bytes of the node-shared directory tier, when one is given
DEFAULT_TIMEOUT = 30.0  # s, the longest one cache call waits for the store (then: a miss)
DRAIN_TIMEOUT = 10.0  # s, how long close() waits for queued Redis writes


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def _shutdown(loop: asyncio.AbstractEventLoop, thread: threading.Thread, store: TieredStore | None,
              drain_timeout: float) -> None:
    """Drain and close the store on its loop, then stop the loop and join its thread (idempotent)."""
    if loop.is_closed() or not thread.is_alive():
        return
    if threading.current_thread() is thread:
        # Garbage-collected on the loop's own thread (a Llama <-> cache cycle can be collected
        # anywhere): nothing may wait here, so the close runs as a task and stops the loop after.
        if store is None:
            loop.stop()
        else:
            loop.create_task(store.aclose(drain_timeout)).add_done_callback(lambda _: loop.stop())
        return
    if store is not None:
        try:
            asyncio.run_coroutine_threadsafe(store.aclose(drain_timeout), loop).result(drain_timeout + 5)
        except Exception:
            log.warning("closing the kvtier store failed", exc_info=True)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


class SyncStore:
    """A ``TieredStore`` for synchronous callers: it lives on an event loop in a daemon thread.

    llama-cpp-python is synchronous and the tiers are asyncio; ``call`` runs one coroutine on the
    store's loop and waits for it (``asyncio.run_coroutine_threadsafe``). Background Redis writes
    go on while the caller computes. ``close()`` (or the context manager, or garbage collection, or
    interpreter exit) drains queued writes for up to ``drain_timeout`` seconds and stops the loop.

    Args:
        memory_bytes: capacity of the in-process memory tier (an int or a size such as ``"2G"``).
        redis_url: Redis/Valkey URL (see ``tiers.redis_urls``); None: no Redis tier.
        redis_ttl: seconds a chunk lives in Redis after its last write or read (None: no expiry).
        redis_options: further ``RedisBackend.open`` keyword arguments (timeouts, credentials,
            ``node_id``, ...).
        shared_dir: a directory shared by the processes of this node (e.g. in /dev/shm); None: none.
        shared_bytes: capacity of the shared directory tier.
        compression: the blob codec's compression (``adaptive``, ``lz4``, ``zstd``, ``none``).
        mac_key: a secret shared with every node and sidecar (the sidecar's ``--chunk-key``): values
            carry a keyed MAC and values without a valid one are dropped (see ``BlobCodec``).
        drain_timeout: seconds ``close()`` waits for queued Redis writes.
    """

    def __init__(
        self,
        *,
        memory_bytes: int | str = DEFAULT_CAPACITY,
        redis_url: str | None = None,
        redis_ttl: float | None = None,
        redis_options: Mapping[str, Any] | None = None,
        shared_dir: str | os.PathLike[str] | None = None,
        shared_bytes: int | str = DEFAULT_SHARED_CAPACITY,
        compression: str = "adaptive",
        mac_key: bytes | None = None,
        drain_timeout: float = DRAIN_TIMEOUT,
    ):
        codec = BlobCodec(compression, mac_key=mac_key)
        memory = parse_size(memory_bytes, name="memory capacity")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=_run_loop, args=(self._loop,), name="kvtier-llama-cpp", daemon=True)
        self._thread.start()
        self.backend: RedisBackend | None = None
        self._sessions: SessionStore | None = None
        self._pending: PendingSaves | None = None
        try:
            # Tiers are built on the loop: asyncio clients belong to the loop that runs them.
            self.store, self.backend = self.call(
                self._build(codec, memory, redis_url, redis_ttl, dict(redis_options or {}), shared_dir, shared_bytes)
            )
        except BaseException:
            _shutdown(self._loop, self._thread, None, 0)
            raise
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self._thread, self.store, drain_timeout)

    @staticmethod
    async def _build(codec: BlobCodec, memory: int, redis_url: str | None, redis_ttl: float | None,
                     redis_options: dict[str, Any], shared_dir: str | os.PathLike[str] | None,
                     shared_bytes: int | str) -> tuple[TieredStore, RedisBackend | None]:
        # On the loop: asyncio clients belong to the loop that runs them.
        node_id = redis_options.pop("node_id", None)
        return build_store(codec, memory, shared_dir=shared_dir, shared_bytes=shared_bytes, redis_url=redis_url,
                           redis_ttl=redis_ttl, node_id=node_id, redis_options=redis_options)

    @property
    def events(self) -> EventBus | None:
        """The Redis event bus (publish, subscribe); None without Redis."""
        return self.backend.events if self.backend is not None else None

    @property
    def pending(self) -> PendingSaves | None:
        """Marks of saves in flight, shared with every node through Redis; None without Redis."""
        if self._pending is None:
            self._pending = pending_of(self.backend)
        return self._pending

    @property
    def redis(self) -> EventBus | None:
        """Deprecated: the event bus, as ``events`` (what ``KVTierCache`` used to publish with)."""
        return self.events

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = DEFAULT_TIMEOUT) -> T:
        """Run ``coro`` on the store's loop and return its result.

        Raises:
            KVTierError: the store is closed. TimeoutError: ``timeout`` passed (the call is cancelled).
        """
        if self._loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise KVTierError("the kvtier store is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    @property
    def memory(self) -> MemoryTier:
        tier = self.store.tiers[0]
        assert isinstance(tier, MemoryTier)
        return tier

    @property
    def sessions(self) -> SessionStore:
        """The ``tiers.sessions.SessionStore`` of this store (manifests in Redis when configured)."""
        if self._sessions is None:
            self._sessions = sessions_of(self.store, self.backend)
        return self._sessions

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until queued Redis writes are done; False if ``timeout`` passed first."""
        return bool(self.call(self.store.flush(timeout), None if timeout is None else timeout + 5))

    def close(self) -> None:
        """Drain queued writes (bounded), close the tiers and stop the loop thread. Idempotent."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
