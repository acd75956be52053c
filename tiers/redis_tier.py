"""RedisTier: blobs in Redis or Valkey (one server, Sentinel, or Cluster) over redis-py asyncio + hiredis.

Every call is one pipeline (grouped per node by the cluster client in cluster mode), bounded by
socket timeouts and retried by redis-py's ``Retry``; a circuit breaker in front of it answers misses
at once while the server is unreachable, so a dead Redis costs a request nothing but the cache.
Values are the codec's blobs and are never unpickled; small JSON helpers serve session manifests
and the pub/sub events that peers use to learn what is stored where.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import math
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import suppress
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions as rex
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialWithJitterBackoff

from .base import StatsCounter, TierRole, TierStats
from .breaker import BreakerState, BreakerStats, CircuitBreaker
from .errors import ConfigError, KVTierError, TierUnavailable
from .redis_urls import RedisTarget, parse_redis_url, redacted_url

log = logging.getLogger("kvtier.redis")
T = TypeVar("T")

# Defaults, with units. Timeouts bound every socket operation; the worst case of one call is about
# (retries + 1) * timeout + backoff, after which the breaker takes over.
DEFAULT_SOCKET_TIMEOUT = 2.0  # s, one read or write on an open connection
DEFAULT_CONNECT_TIMEOUT = 1.0  # s, TCP/TLS connect
DEFAULT_RETRIES = 2  # retries after the first attempt, connection errors and timeouts only
DEFAULT_BACKOFF_BASE = 0.02  # s, first retry delay (exponential with full jitter)
DEFAULT_BACKOFF_CAP = 0.5  # s, longest retry delay
DEFAULT_BREAKER_FAILURES = 3  # consecutive failed calls that open the breaker
DEFAULT_BREAKER_RESET = 5.0  # s, first open window; doubles after each failed probe
DEFAULT_BREAKER_MAX_RESET = 60.0  # s, longest open window
DEFAULT_MAX_CONNECTIONS = 64  # per server (per node in cluster mode)
DEFAULT_READ_SIZE = 1 << 20  # bytes per socket read: large blobs parse in far fewer hiredis calls
# A multi-put is cut into pipelines of about this many value bytes (at least one value each). Python
# 3.11's asyncio transport copies whatever the socket does not take at once into a bytearray, so one
# 94 MB pipeline ran at 0.3-0.5 GB/s here and stalled the event loop, while 4 MB pipelines ran at 1.3.
PUT_PIPELINE_BYTES = 4 << 20
MAX_EVENT_BYTES = 1 << 20  # larger pub/sub messages are not events of ours

# The server is unreachable or misbehaving as a whole: these feed the breaker. A ResponseError is an
# answer (the server works), so it is counted but does not.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    rex.ConnectionError, rex.TimeoutError, rex.ClusterError, rex.RedisClusterException,
    OSError, asyncio.TimeoutError,
)


class _Default(enum.Enum):
    TTL = "tier ttl"


TIER_TTL = _Default.TTL  # ``set_raw(..., ttl=TIER_TTL)``: the tier's own TTL


def _positive(name: str, value: object, *, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"redis {name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"redis {name} must be an integer >= {minimum}, got {value!r}")
    return value


class RedisTier:
    """A tier in Redis/Valkey.

    Args:
        url: ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://`` or ``redis+cluster://``
            (see ``tiers.redis_urls``).
        username, password: credentials; they override the URL's and never appear in logs or repr.
        ttl: seconds a value lives after it was last written or read (``None``: no expiry).
        refresh_on_hit: extend the TTL of values that are read (GETEX).
        name: tier name in stats, metrics and headers.
        node_id: this process's id in published events (default ``hostname:pid``).
        socket_timeout, connect_timeout: seconds per socket operation and per connect.
        retries, backoff_base, backoff_cap: redis-py ``Retry`` with ``ExponentialWithJitterBackoff``.
        breaker_failures, breaker_reset, breaker_max_reset: the circuit breaker (see ``CircuitBreaker``).
        max_connections: connection pool size (per node in cluster mode).
        socket_read_size: bytes per socket read.
        clock: monotonic clock for the breaker (tests drive it); wall_clock: timestamps of events.

    Raises:
        ConfigError: a bad URL or setting, at construction.
    """

    role = TierRole.REMOTE
    write_behind = True  # a request never waits on a remote write (TieredStore's queue)

    def __init__(
        self,
        url: str,
        *,
        username: str | None = None,
        password: str | None = None,
        ttl: float | None = None,
        refresh_on_hit: bool = True,
        name: str = "redis",
        node_id: str | None = None,
        socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        backoff_base: float = DEFAULT_BACKOFF_BASE,
        backoff_cap: float = DEFAULT_BACKOFF_CAP,
        breaker_failures: int = DEFAULT_BREAKER_FAILURES,
        breaker_reset: float = DEFAULT_BREAKER_RESET,
        breaker_max_reset: float = DEFAULT_BREAKER_MAX_RESET,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        socket_read_size: int = DEFAULT_READ_SIZE,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.name = name
        self.target: RedisTarget = parse_redis_url(url)
        self.url = redacted_url(url)  # only the redacted form is kept
        ttl_s = _positive("ttl", ttl, allow_none=True)
        self.ttl: int | None = None if ttl_s is None else max(1, math.ceil(ttl_s))
        self.refresh_on_hit = bool(refresh_on_hit)
        self.node_id = node_id or f"{socket.gethostname()}:{os.getpid()}"
        timeout = _positive("socket_timeout", socket_timeout)
        connect = _positive("connect_timeout", connect_timeout)
        base = _positive("backoff_base", backoff_base)
        cap = _positive("backoff_cap", backoff_cap)
        assert base is not None and cap is not None
        if cap < base:
            raise ConfigError("redis backoff_cap must be >= backoff_base")
        retries = _count("retries", retries, 0)
        max_connections = _count("max_connections", max_connections, 1)
        socket_read_size = _count("socket_read_size", socket_read_size, 4096)
        self.breaker = CircuitBreaker(breaker_failures, breaker_reset, breaker_max_reset, clock)
        self._wall = wall_clock
        self._stats = StatsCounter(name)
        self._use_getex = True
        self._closing = asyncio.Event()
        self._closed = False
        t = self.target
        user = username if username is not None else t.username
        secret = password if password is not None else t.password
        self._conn_kwargs: dict[str, Any] = dict(
            username=user, password=secret, socket_timeout=timeout, socket_connect_timeout=connect,
            retry=Retry(ExponentialWithJitterBackoff(cap=cap, base=base), retries),
            socket_read_size=socket_read_size, **t.ssl_kwargs(),
        )
        self._sentinel: Sentinel | None = None
        self._client: Any
        if t.mode == "standalone":
            host, port = t.hosts[0]
            self._client = aioredis.Redis(host=host, port=port, db=t.db, max_connections=max_connections,
                                          **self._conn_kwargs)
        elif t.mode == "unix":
            self._conn_kwargs = {k: v for k, v in self._conn_kwargs.items() if not k.startswith("ssl")}
            self._client = aioredis.Redis(unix_socket_path=t.unix_path, db=t.db, max_connections=max_connections,
                                          **self._conn_kwargs)
        elif t.mode == "sentinel":
            # Sentinels get no credentials unless sentinel_password is given (redis-py's convention:
            # Sentinels often run without auth, and AUTH against one without a password fails).
            sentinel_kwargs: dict[str, Any] = dict(socket_timeout=timeout, socket_connect_timeout=connect,
                                                   **t.ssl_kwargs())
            if t.sentinel_password is not None:
                sentinel_kwargs.update(username=user, password=t.sentinel_password)
            self._sentinel = Sentinel(list(t.hosts), sentinel_kwargs=sentinel_kwargs, **self._conn_kwargs)
            assert t.service_name is not None
            self._client = self._sentinel.master_for(t.service_name, db=t.db, max_connections=max_connections)
        else:
            nodes = [ClusterNode(h, p) for h, p in t.hosts]
            self._client = RedisCluster(startup_nodes=nodes, max_connections=max_connections, **self._conn_kwargs)

    def __repr__(self) -> str:
        return f"RedisTier(name={self.name!r}, url={self.url!r}, mode={self.target.mode}, ttl={self.ttl})"

    __str__ = __repr__

    @property
    def cluster(self) -> bool:
        return self.target.mode == "cluster"

    # -- the breaker-guarded call -------------------------------------------------------------

    async def _run(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run one backend call under the breaker.

        Raises:
            TierUnavailable: the breaker is open, or the server could not be reached (counted).
            KVTierError: the server answered with an error (counted).
        """
        if self._closed:
            raise TierUnavailable(f"{self.name}: closed")
        if not self.breaker.allow():
            raise TierUnavailable(f"{self.name}: circuit open, {self.url} skipped")
        was_closed = self.breaker.closed
        try:
            result = await call()
        except _UNAVAILABLE as exc:
            _raise_swallowed_cancel()
            self._failed(op, exc)
            raise TierUnavailable(f"redis {op} on {self.url} failed: {type(exc).__name__}: {exc}") from exc
        except rex.RedisError as exc:
            _raise_swallowed_cancel()
            self._succeeded(was_closed)
            self._stats.add(errors=1)
            raise KVTierError(f"redis {op} on {self.url}: {exc}") from exc
        except BaseException:
            self.breaker.release_probe()  # cancelled mid-probe: let the next call probe again
            raise
        try:
            _raise_swallowed_cancel()
        except asyncio.CancelledError:
            self.breaker.release_probe()
            raise
        self._succeeded(was_closed)
        return result

    def _failed(self, op: str, exc: BaseException) -> None:
        self._stats.add(errors=1)
        before = self.breaker.state
        self.breaker.record_failure()
        st = self.breaker.stats()
        if st.state is BreakerState.OPEN and before is not BreakerState.OPEN:
            log.warning("redis %s on %s failed (%s: %s); skipping redis for %.1fs", op, self.url,
                        type(exc).__name__, exc, st.retry_in)
        elif st.state is BreakerState.CLOSED:
            log.warning("redis %s on %s failed (%s: %s); failure %d of %d before redis is skipped", op,
                        self.url, type(exc).__name__, exc, st.consecutive_failures, self.breaker.failure_threshold)
        else:
            log.debug("redis %s on %s failed: %s", op, self.url, exc)

    def _succeeded(self, was_closed: bool) -> None:
        self.breaker.record_success()
        if not was_closed:
            log.warning("redis %s reachable again; breaker closed", self.url)

    async def _pipeline(self, op: str, fill: Callable[[Any], None]) -> list[Any]:
        """One non-transactional pipeline; per-command errors come back as exception objects."""

        async def call() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            fill(pipe)
            results: list[Any] = await pipe.execute(raise_on_error=False)
            # In cluster mode a node that is down comes back per command, not as a raised error.
            for r in results:
                if isinstance(r, _UNAVAILABLE):
                    raise r
            return results

        return await self._run(op, call)

    # -- the Tier protocol ----------------------------------------------------------------------

    async def get_many(self, keys: Sequence[bytes]) -> dict[bytes, bytes | memoryview]:
        """Values of the keys present (pipelined GETEX, refreshing their TTL); misses are absent."""
        if not keys:
            return {}
        t0 = time.perf_counter()
        try:
            results = await self._pipeline("get", lambda pipe: self._fill_get(pipe, keys))
            if self._use_getex and self._refresh and any(_unknown_command(r) for r in results):
                self._use_getex = False  # Redis < 6.2: pipelined GET + EXPIRE instead
                log.info("redis %s has no GETEX; using GET + EXPIRE", self.url)
                results = await self._pipeline("get", lambda pipe: self._fill_get(pipe, keys))
        except KVTierError:
            self._stats.add(misses=len(keys), get_seconds=time.perf_counter() - t0)
            return {}
        if self._refresh and not self._use_getex:
            results = results[::2]
        found: dict[bytes, bytes | memoryview] = {}
        errors = nbytes = 0
        for key, value in zip(keys, results):
            if isinstance(value, Exception):
                errors += 1
            elif value is not None:
                found[key] = value
                nbytes += len(value)
        self._stats.add(hits=len(found), misses=len(keys) - len(found), bytes_out=nbytes, errors=errors,
                        get_seconds=time.perf_counter() - t0)
        return found

    @property
    def _refresh(self) -> bool:
        return self.ttl is not None and self.refresh_on_hit

    def _fill_get(self, pipe: Any, keys: Sequence[bytes]) -> None:
        if not self._refresh:
            for key in keys:
                pipe.get(key)
        elif self._use_getex:
            for key in keys:
                pipe.getex(key, ex=self.ttl)
        else:
            for key in keys:
                pipe.get(key)
                pipe.expire(key, self.ttl)

    async def put_many(self, items: Mapping[bytes, bytes]) -> int:
        """SET every item (with ``EX ttl``); returns how many the server accepted."""
        if not items:
            return 0
        t0 = time.perf_counter()
        stored = nbytes = errors = 0
        for batch in _batches(items, PUT_PIPELINE_BYTES):
            def fill(pipe: Any, batch: list[tuple[bytes, bytes]] = batch) -> None:
                for key, value in batch:
                    pipe.set(key, value, ex=self.ttl)
            try:
                results = await self._pipeline("put", fill)
            except KVTierError:
                break  # counted by _run; the rest would fail the same way
            for (_, value), ok in zip(batch, results):
                if ok is True:
                    stored += 1
                    nbytes += len(value)
                else:
                    errors += 1
        self._stats.add(puts=stored, bytes_in=nbytes, put_seconds=time.perf_counter() - t0)
        if errors:
            self._stats.add(errors=errors)
        return stored

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Pipelined EXISTS; an unreachable server answers "absent" for every key."""
        if not keys:
            return []
        try:
            results = await self._pipeline("exists", lambda pipe: [pipe.exists(k) for k in keys])
        except KVTierError:
            return [False] * len(keys)
        return [r == 1 for r in results]

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Pipelined DEL (one key per command, so it works across cluster slots)."""
        if not keys:
            return 0
        try:
            results = await self._pipeline("delete", lambda pipe: [pipe.delete(k) for k in keys])
        except KVTierError:
            return 0
        return sum(r for r in results if isinstance(r, int))

    def stats(self) -> TierStats:
        """Counters; ``available`` is False while the breaker is open or probing."""
        return self._stats.snapshot(available=self.breaker.closed)

    def breaker_stats(self) -> BreakerStats:
        return self.breaker.stats()

    async def aclose(self) -> None:
        """Stop subscribers and close every connection."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        with suppress(Exception):
            await self._client.aclose()
        if self._sentinel is not None:
            for s in self._sentinel.sentinels:
                with suppress(Exception):
                    await s.aclose()

    # -- small values: manifests and health ----------------------------------------------------

    async def get_raw(self, key: bytes | str) -> bytes | None:
        """One value as stored (a JSON manifest, say), or None.

        Raises:
            TierUnavailable: Redis cannot be reached (so "absent" and "unknown" stay distinct).
        """
        value: bytes | None = await self._run("get", lambda: self._client.get(key))
        return value

    async def delete_raw(self, key: bytes | str) -> bool:
        """DEL one key; True when it existed (atomic: of concurrent deletes exactly one wins).

        Raises:
            TierUnavailable: Redis cannot be reached.
        """
        return bool(await self._run("del", lambda: self._client.delete(key)))

    async def set_raw(self, key: bytes | str, value: bytes | str, *, ttl: float | None | _Default = TIER_TTL,
                      only_if_exists: bool = False) -> bool:
        """SET one value; ``ttl``: seconds, None for no expiry, or the tier's TTL (default).

        Returns False when ``only_if_exists`` (SET XX) and the key did not exist.

        Raises:
            TierUnavailable: Redis cannot be reached.
        """
        if ttl is TIER_TTL:
            ex = self.ttl
        elif ttl is None:
            ex = None
        else:
            ex = max(1, math.ceil(_positive("ttl", ttl) or 1))
        return bool(await self._run("set", lambda: self._client.set(key, value, ex=ex, xx=only_if_exists)))

    async def scan(self, pattern: str | bytes, count: int = 1000, limit: int | None = None) -> list[bytes]:
        """Keys matching a glob ``pattern`` (every primary in cluster mode), without duplicates.

        Raises:
            TierUnavailable: Redis cannot be reached.
        """

        async def call() -> list[bytes]:
            seen: dict[bytes, None] = {}
            async for key in self._client.scan_iter(match=pattern, count=count):
                seen[key] = None
                if limit is not None and len(seen) >= limit:
                    break
            return list(seen)

        return await self._run("scan", call)

    async def ping(self) -> bool:
        """True when the server answers (a probe when the breaker allows one); never raises."""
        try:
            return bool(await self._run("ping", lambda: self._client.ping()))
        except KVTierError:
            return False

    # -- events ---------------------------------------------------------------------------------

    def event_json(self, event_type: str, **fields: Any) -> str:
        """The compact JSON of one event: ``{"type", "node", ...fields, "ts"}``."""
        body = {"type": event_type, "node": self.node_id, **fields, "ts": round(self._wall(), 3)}
        return json.dumps(body, separators=(",", ":"), default=_json_default)

    async def publish(self, channel: str, event_type: str, **fields: Any) -> int:
        """Publish one event; returns the number of receivers (0 when Redis is unreachable)."""
        message = self.event_json(event_type, **fields)
        try:
            return int(await self._run("publish", lambda: self._client.publish(channel, message)))
        except KVTierError:
            return 0

    async def publish_chunks_stored(self, channel: str, keys: Sequence[bytes]) -> int:
        return await self.publish(channel, "chunk_stored", keys=[k.decode("ascii", "replace") for k in keys])

    async def publish_session_saved(self, channel: str, session: str, **fields: Any) -> int:
        return await self.publish(channel, "session_saved", session=session, **fields)

    async def events(self, channel: str, *, include_own: bool = False) -> AsyncIterator[dict[str, Any]]:
        """Events published on ``channel`` by peers, as dicts, until the tier is closed.

        The subscription survives restarts of Redis: it reconnects with backoff and then yields
        ``{"type": "reconnected"}``, since events sent while it was away are lost (pub/sub keeps
        nothing). Malformed messages are skipped and counted as errors. Breaking out of the loop,
        or ``aclose()`` of the tier (within half a second), ends it cleanly.
        """
        backoff = ExponentialWithJitterBackoff(cap=5.0, base=0.1)
        failures = 0
        subscribed_before = False
        while not self._closed:
            client, owned = self._pubsub_client(failures)
            pubsub = client.pubsub()
            try:
                await pubsub.subscribe(channel)
                while not self._closed:
                    msg = await pubsub.get_message(timeout=0.5)
                    if msg is None:
                        continue
                    if msg.get("type") == "subscribe":
                        # Also seen when redis-py reconnected and resubscribed by itself.
                        failures = 0
                        if subscribed_before:
                            yield {"type": "reconnected", "node": None, "ts": round(self._wall(), 3)}
                        subscribed_before = True
                        continue
                    if msg.get("type") != "message":
                        continue
                    event = self._parse_event(msg.get("data"))
                    if event is not None and (include_own or event.get("node") != self.node_id):
                        yield event
            except (*_UNAVAILABLE, rex.RedisError) as exc:
                failures += 1
                self._stats.add(errors=1)
                level = logging.DEBUG if isinstance(exc, _UNAVAILABLE) else logging.WARNING
                log.log(level, "subscription to %s on %s lost: %s", channel, self.url, exc)
            finally:
                with suppress(Exception):
                    await pubsub.aclose()
                if owned:
                    with suppress(Exception):
                        await client.aclose()
            if failures and not self._closed:
                with suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._closing.wait(), backoff.compute(failures))

    def _pubsub_client(self, attempt: int) -> tuple[Any, bool]:
        """(client, owned): the tier's own client, or in cluster mode a plain client of one node.

        Valkey/Redis Cluster forwards PUBLISH to every node, so any node serves a subscriber; a
        reconnect moves on to the next known node.
        """
        if not self.cluster:
            return self._client, False
        nodes = [(n.host, n.port) for n in self._client.get_nodes()] or list(self.target.hosts)
        host, port = nodes[attempt % len(nodes)]
        return aioredis.Redis(host=host, port=port, **self._conn_kwargs), True

    def _parse_event(self, data: object) -> dict[str, Any] | None:
        """A message of ours as a dict; anything else (not JSON, no "type", too large) is counted."""
        event: object = None
        if isinstance(data, (bytes, str)) and len(data) <= MAX_EVENT_BYTES:
            with suppress(ValueError):
                event = json.loads(data)
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            self._stats.add(errors=1)
            return None
        return event


def _raise_swallowed_cancel() -> None:
    """Re-raise a cancellation that redis-py lost.

    On Python 3.11, ``asyncio.wait_for`` (which redis-py wraps around socket I/O) drops a
    cancellation that races the completion of its inner task: measured here, 37 of 200 cancelled
    puts went on running. A task that was asked to stop must stop, so a call that returns while its
    task has a cancellation pending raises it.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _unknown_command(result: object) -> bool:
    return isinstance(result, rex.ResponseError) and "unknown command" in str(result).lower()


def _batches(items: Mapping[bytes, bytes], max_bytes: int) -> list[list[tuple[bytes, bytes]]]:
    batches: list[list[tuple[bytes, bytes]]] = [[]]
    size = 0
    for key, value in items.items():
        if batches[-1] and size + len(value) > max_bytes:
            batches.append([])
            size = 0
        batches[-1].append((key, value))
        size += len(value)
    return batches


def _json_default(value: object) -> object:
    if isinstance(value, bytes):
        return value.decode("ascii", "replace")
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"cannot put {type(value).__name__} in an event")
