"""RedisConnection: one Redis or Valkey (one server, Sentinel, or Cluster), shared by the chunk tier,
the manifest store and the event bus.

It owns the redis-py asyncio client, its ``Retry`` and the circuit breaker in front of it: every call
goes through ``run``, bounded by socket timeouts and retried by redis-py, and while the server is
unreachable the breaker answers at once, so a dead Redis costs a request nothing but the cache. Its
users (``RedisTier``, ``RedisManifests``, ``EventBus``) hold the same connection: one pool, one
breaker, one count of failed calls.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any, TypedDict, TypeVar

import redis.asyncio as aioredis
import redis.exceptions as rex
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialWithJitterBackoff

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

# The server is unreachable or misbehaving as a whole: these feed the breaker. A ResponseError is an
# answer (the server works), so it is counted but does not.
UNAVAILABLE: tuple[type[BaseException], ...] = (
    rex.ConnectionError, rex.TimeoutError, rex.ClusterError, rex.RedisClusterException,
    OSError, asyncio.TimeoutError,
)

RedisClient = aioredis.Redis | RedisCluster
AnyPipeline = Pipeline | ClusterPipeline


class RedisOptions(TypedDict, total=False):
    """``RedisConnection``'s keyword arguments, for callers that pass them through."""

    username: str | None
    password: str | None
    socket_timeout: float
    connect_timeout: float
    retries: int
    backoff_base: float
    backoff_cap: float
    breaker_failures: int
    breaker_reset: float
    breaker_max_reset: float
    max_connections: int
    socket_read_size: int
    clock: Callable[[], float]


def positive_seconds(name: str, value: object, *, allow_none: bool = False) -> float | None:
    """``value`` as positive seconds (None passes when ``allow_none``).

    Raises:
        ConfigError: not a finite positive number.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"redis {name} must be a positive number of seconds, got {value!r}")
    return float(value)


def ttl_seconds(ttl: object) -> int | None:
    """A TTL setting (seconds or None) as the whole seconds of ``SET EX`` (at least 1)."""
    ttl_s = positive_seconds("ttl", ttl, allow_none=True)
    return None if ttl_s is None else max(1, math.ceil(ttl_s))


def _count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"redis {name} must be an integer >= {minimum}, got {value!r}")
    return value


class RedisConnection:
    """The client, retries and circuit breaker of one Redis/Valkey deployment.

    Args:
        url: ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://`` or ``redis+cluster://``
            (see ``tiers.redis_urls``).
        username, password: credentials; they override the URL's and never appear in logs or repr.
        socket_timeout, connect_timeout: seconds per socket operation and per connect.
        retries, backoff_base, backoff_cap: redis-py ``Retry`` with ``ExponentialWithJitterBackoff``.
        breaker_failures, breaker_reset, breaker_max_reset: the circuit breaker (see ``CircuitBreaker``).
        max_connections: connection pool size (per node in cluster mode).
        socket_read_size: bytes per socket read.
        clock: monotonic clock for the breaker (tests drive it).

    Raises:
        ConfigError: a bad URL or setting, at construction.
    """

    def __init__(
        self,
        url: str,
        *,
        username: str | None = None,
        password: str | None = None,
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
    ):
        self.target: RedisTarget = parse_redis_url(url)
        self.url = redacted_url(url)  # only the redacted form is kept
        timeout = positive_seconds("socket_timeout", socket_timeout)
        connect = positive_seconds("connect_timeout", connect_timeout)
        base = positive_seconds("backoff_base", backoff_base)
        cap = positive_seconds("backoff_cap", backoff_cap)
        assert base is not None and cap is not None
        if cap < base:
            raise ConfigError("redis backoff_cap must be >= backoff_base")
        retries = _count("retries", retries, 0)
        max_connections = _count("max_connections", max_connections, 1)
        socket_read_size = _count("socket_read_size", socket_read_size, 4096)
        self.breaker = CircuitBreaker(breaker_failures, breaker_reset, breaker_max_reset, clock)
        self._errors = 0
        self._probe: asyncio.Task[None] | None = None  # the background probe while the breaker is open
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
        self.client: RedisClient
        if t.mode == "standalone":
            host, port = t.hosts[0]
            self.client = aioredis.Redis(host=host, port=port, db=t.db, max_connections=max_connections,
                                         **self._conn_kwargs)
        elif t.mode == "unix":
            self._conn_kwargs = {k: v for k, v in self._conn_kwargs.items() if not k.startswith("ssl")}
            self.client = aioredis.Redis(unix_socket_path=t.unix_path, db=t.db, max_connections=max_connections,
                                         **self._conn_kwargs)
        elif t.mode == "sentinel":
            # Sentinels get no credentials unless sentinel_password is given (redis-py's convention:
            # Sentinels often run without auth, and AUTH against one without a password fails).
            sentinel_kwargs: dict[str, Any] = dict(socket_timeout=timeout, socket_connect_timeout=connect,
                                                   **t.ssl_kwargs())
            if t.sentinel_password is not None:
                sentinel_kwargs.update(username=user, password=t.sentinel_password)
            self._sentinel = Sentinel(  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
                list(t.hosts), sentinel_kwargs=sentinel_kwargs, **self._conn_kwargs)
            assert t.service_name is not None
            self.client = self._sentinel.master_for(t.service_name, db=t.db, max_connections=max_connections)
        else:
            nodes = [ClusterNode(h, p) for h, p in t.hosts]
            self.client = RedisCluster(startup_nodes=nodes, max_connections=max_connections, **self._conn_kwargs)

    def __repr__(self) -> str:
        return f"RedisConnection(url={self.url!r}, mode={self.target.mode})"

    __str__ = __repr__

    @property
    def cluster(self) -> bool:
        return self.target.mode == "cluster"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def errors(self) -> int:
        """Failed calls (unreachable server or an error answer) and errors its users counted."""
        return self._errors

    def count_error(self, n: int = 1) -> None:
        """Count an error a user found itself (a malformed event, a lost subscription)."""
        self._errors += n

    def breaker_stats(self) -> BreakerStats:
        return self.breaker.stats()

    # -- the breaker-guarded call -------------------------------------------------------------

    async def run(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run one backend call under the breaker.

        Raises:
            TierUnavailable: closed, the breaker is open, or the server could not be reached (counted).
            KVTierError: the server answered with an error (counted).
        """
        if self._closed:
            raise TierUnavailable(f"redis {self.url}: closed")
        if not self.breaker.allow():
            self._probe_in_background()
            raise TierUnavailable(f"redis: circuit open, {self.url} skipped")
        was_closed = self.breaker.closed
        try:
            result = await call()
        except UNAVAILABLE as exc:
            raise_swallowed_cancel()
            self._failed(op, exc)
            raise TierUnavailable(f"redis {op} on {self.url} failed: {type(exc).__name__}: {exc}") from exc
        except rex.RedisError as exc:
            raise_swallowed_cancel()
            self._succeeded(was_closed)
            self._errors += 1
            raise KVTierError(f"redis {op} on {self.url}: {exc}") from exc
        except BaseException:
            self.breaker.release_probe()  # cancelled mid-probe: let the next call probe again
            raise
        try:
            raise_swallowed_cancel()
        except asyncio.CancelledError:
            self.breaker.release_probe()
            raise
        self._succeeded(was_closed)
        return result

    def _failed(self, op: str, exc: BaseException) -> None:
        self._errors += 1
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

    def _probe_in_background(self) -> None:
        """While calls are skipped, PING now and then (``CircuitBreaker.background_probe_due``) in a
        task no caller waits on, so a Redis that is back is used again within ``breaker_reset``
        seconds, not after the whole (up to ``breaker_max_reset``) open window."""
        if self._probe is not None and not self._probe.done():
            return
        if self.breaker.background_probe_due():
            self._probe = asyncio.get_running_loop().create_task(self._background_probe(), name="kvtier-redis-probe")

    async def _background_probe(self) -> None:
        try:
            await self.client.ping()
        except Exception as exc:
            log.debug("redis %s: background probe failed: %s", self.url, exc)
            return
        if not self.breaker.closed and not self._closed:
            self.breaker.record_success()
            log.warning("redis %s reachable again (background probe); breaker closed", self.url)

    async def pipeline(self, op: str, fill: Callable[[AnyPipeline], object]) -> list[Any]:
        """One non-transactional pipeline under ``run``; per-command errors come back as exception
        objects in the result list (a value per command, as redis-py returns them)."""

        async def call() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            fill(pipe)
            results: list[Any] = await pipe.execute(raise_on_error=False)
            # In cluster mode a node that is down comes back per command, not as a raised error.
            for r in results:
                if isinstance(r, UNAVAILABLE):
                    raise r
            return results

        return await self.run(op, call)

    async def ping(self) -> bool:
        """True when the server answers (a probe when the breaker allows one); never raises."""
        try:
            return bool(await self.run("ping", self.client.ping))
        except KVTierError:
            return False

    # -- subscriptions --------------------------------------------------------------------------

    def pubsub_client(self, attempt: int) -> tuple[aioredis.Redis, bool]:
        """(client, owned): the shared client, or in cluster mode a plain client of one node that
        the caller closes.

        Valkey/Redis Cluster forwards PUBLISH to every node, so any node serves a subscriber; a
        reconnect (``attempt``) moves on to the next known node.
        """
        if not isinstance(self.client, RedisCluster):
            return self.client, False
        nodes = [(n.host, int(n.port)) for n in self.client.get_nodes()] or list(self.target.hosts)
        host, port = nodes[attempt % len(nodes)]
        return aioredis.Redis(host=host, port=port, **self._conn_kwargs), True

    async def wait_closed(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``aclose``; True when it was called."""
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._closing.wait(), timeout)
        return self._closed

    async def aclose(self) -> None:
        """Stop subscribers and close every connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.wait({self._probe}, timeout=1.0)
        with suppress(Exception):
            await self.client.aclose()
        if self._sentinel is not None:
            for s in self._sentinel.sentinels:
                with suppress(Exception):
                    await s.aclose()


def raise_swallowed_cancel() -> None:
    """Re-raise a cancellation that redis-py lost.

    On Python 3.11, ``asyncio.wait_for`` (which redis-py wraps around socket I/O) drops a
    cancellation that races the completion of its inner task: measured here, 37 of 200 cancelled
    puts went on running. A task that was asked to stop must stop, so a call that returns while its
    task has a cancellation pending raises it.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
