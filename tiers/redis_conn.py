"""RedisConnection: one Redis or Valkey (one server, Sentinel, or Cluster), shared by the chunk tier,
the manifest store and the event bus.

It owns the redis-py asyncio client (built from ``ClientOptions``, one factory per mode, in
``tiers.redis_clients``) and the circuit breaker in front of it: every call goes through ``run``,
bounded by socket timeouts and retried by redis-py, and while the server is unreachable the breaker
answers at once, so a dead Redis costs a request nothing but the cache. Its users (``RedisTier``,
``RedisManifests``, ``EventBus``) hold the same connection: one pool, one breaker, one count of
failed calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import suppress
from contextvars import ContextVar
from typing import Any, TypedDict, TypeVar

import redis.asyncio as aioredis
import redis.exceptions as rex
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline, RedisCluster

from .breaker import BreakerState, BreakerStats, CircuitBreaker
from .errors import ConfigError, KVTierError, TierUnavailable
from .redis_bulk import DEFAULT_BULK_CONNECTIONS, BulkLane
from .redis_clients import (
    DEFAULT_BACKOFF_BASE,
    DEFAULT_BACKOFF_CAP,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_SIZE,
    DEFAULT_RETRIES,
    DEFAULT_SOCKET_TIMEOUT,
    ClientOptions,
    RedisClient,
    build_clients,
    positive_seconds,
)
from .redis_urls import RedisTarget, redacted_url

log = logging.getLogger("kvtier.redis")
T = TypeVar("T")

# The breaker's defaults, with units (the client's are in ``tiers.redis_clients``).
DEFAULT_BREAKER_FAILURES = 3  # consecutive failed calls that open the breaker
DEFAULT_BREAKER_RESET = 5.0  # s, first open window; doubles after each failed probe
DEFAULT_BREAKER_MAX_RESET = 60.0  # s, longest open window

# The server is unreachable or misbehaving as a whole: these feed the breaker. A ResponseError is an
# answer (the server works), so it is counted but does not.
UNAVAILABLE: tuple[type[BaseException], ...] = (
    rex.ConnectionError, rex.TimeoutError, rex.ClusterError, rex.RedisClusterException,
    OSError, asyncio.TimeoutError,
)

AnyPipeline = Pipeline | ClusterPipeline

# When the calls a request waits on must have been answered (the event loop's clock; None: no bound,
# as for background work). Set by ``request_deadline`` around a request's lookups and restores.
REQUEST_DEADLINE: ContextVar[float | None] = ContextVar("kvtier_redis_request_deadline", default=None)
# Beyond recomputing the prompt, what a request may wait for Redis while it looks up and restores
# (``deadline_past``): a healthy server answers a lookup in milliseconds, a loaded one within this.
REDIS_WAIT_FLOOR_S = 0.1
# A call given up at its deadline after this long feeds the breaker as a failure: a healthy
# server, however loaded, answers well within it, and a hung one (paused, failing over, partitioned)
# is then skipped after a few requests rather than costing each its whole deadline.
LATE_AS_DOWN_S = 0.5
# The one call a deadline does not cut: reading chunk values, which the cost model chose knowing
# their size and learns its fetch rates from. A server that sends them is not hung, and one that
# hangs has failed the lookup before (a hang that begins during the transfer waits out the timeouts).
GET_CHUNKS = "get chunks"
# Writing chunk values: sized by the caller (a session of a long conversation is gigabytes).
PUT_CHUNKS = "put"
# How long one call, all its tries together, may wait for the server (None: its timeouts and
# retries), bulk transfers aside. Set by ``call_budget`` around explicit operations (the sessions
# API): a hung server then fails one of them in seconds rather than after ~6 s per call.
CALL_BUDGET: ContextVar[float | None] = ContextVar("kvtier_redis_call_budget", default=None)
# The budget of one call of a session operation (save, restore, show, delete; the sidecar's API and
# the in-process functions): a healthy server, even a loaded one, answers a manifest or a lookup
# well within it; over LATE_AS_DOWN_S, so calls cut there feed the breaker.
SESSION_CALL_S = 1.0


@contextlib.contextmanager
def request_deadline(seconds: float) -> Iterator[None]:
    """Redis calls made in the block (by this task and the tasks it starts meanwhile) are given up
    once ``seconds`` have passed, with ``TierUnavailable``: a request waits for Redis no longer than
    recomputing would take, however long the socket timeouts and retries (seconds when the server
    hangs). Long-lived workers are started outside any request's context (``WriteBehind``)."""
    token = REQUEST_DEADLINE.set(asyncio.get_running_loop().time() + max(0.0, seconds))
    try:
        yield
    finally:
        REQUEST_DEADLINE.reset(token)


def deadline_past(compute_s: float) -> float:
    """The ``request_deadline`` of a request whose prompt computes in ``compute_s`` (the sidecar's
    cost model, or the in-process context's own rate): all its lookups and its restore together
    wait for Redis no longer than that, past which no restore pays; a hung server's timeouts and
    retries would cost seconds."""
    return REDIS_WAIT_FLOOR_S + max(0.0, compute_s)


@contextlib.contextmanager
def call_budget(seconds: float) -> Iterator[None]:
    """Each Redis call made in the block (by this task and the tasks it starts meanwhile), other
    than the transfer of chunk values, is given up after ``seconds``, with ``TierUnavailable``."""
    token = CALL_BUDGET.set(max(0.0, seconds))
    try:
        yield
    finally:
        CALL_BUDGET.reset(token)


async def within_call_budget(seconds: float, call: Awaitable[T]) -> T:
    """``call`` awaited in ``call_budget(seconds)``: for coroutines run on another thread's loop,
    where the caller's context does not reach."""
    with call_budget(seconds):
        return await call


def _call_deadline(op: str, now: float) -> float | None:
    """When a call of ``op`` made now must have been answered: the request's deadline, or the
    call budget's, whichever comes first (None: no bound)."""
    until = REQUEST_DEADLINE.get() if op != GET_CHUNKS else None
    budget = CALL_BUDGET.get() if op not in (GET_CHUNKS, PUT_CHUNKS) else None
    if budget is not None:
        until = now + budget if until is None else min(until, now + budget)
    return until


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
    bulk_connections: int
    clock: Callable[[], float]


def ttl_seconds(ttl: object) -> int | None:
    """A TTL setting (seconds or None) as the whole seconds of ``SET EX`` (at least 1)."""
    ttl_s = positive_seconds("ttl", ttl, allow_none=True)
    return None if ttl_s is None else max(1, math.ceil(ttl_s))


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
        bulk_connections: sockets of the ``BulkLane`` that carries chunk values to one server (a
            ``redis://``, ``rediss://`` or ``unix://`` URL); 0 sends them through redis-py too.
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
        bulk_connections: int = DEFAULT_BULK_CONNECTIONS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.options = ClientOptions.from_url(
            url, username=username, password=password, socket_timeout=socket_timeout,
            connect_timeout=connect_timeout, retries=retries, backoff_base=backoff_base, backoff_cap=backoff_cap,
            max_connections=max_connections, socket_read_size=socket_read_size,
        )
        self.target: RedisTarget = self.options.target
        self.url = redacted_url(url)  # only the redacted form is kept
        self.breaker = CircuitBreaker(breaker_failures, breaker_reset, breaker_max_reset, clock)
        self._errors = 0
        self._probe: asyncio.Task[None] | None = None  # the background probe while the breaker is open
        self._closing = asyncio.Event()
        self._closed = False
        clients = build_clients(self.options)
        self.client: RedisClient = clients.client
        self._conn_kwargs = clients.connection_kwargs
        self._sentinel = clients.sentinel
        if isinstance(bulk_connections, bool) or not isinstance(bulk_connections, int) or bulk_connections < 0:
            raise ConfigError(f"redis bulk_connections must be an integer >= 0, got {bulk_connections!r}")
        # Chunk values of one server go over blocking sockets in threads (``tiers.redis_bulk``).
        self.bulk = (BulkLane(self.options, connections=bulk_connections)
                     if bulk_connections and BulkLane.available(self.options) else None)

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
        t0 = asyncio.get_running_loop().time()
        until = _call_deadline(op, t0)
        if until is None:
            return await self._guarded(op, call)
        try:
            async with asyncio.timeout_at(until):
                return await self._guarded(op, call)
        except TimeoutError:  # the deadline's (the call's own failures come as TierUnavailable)
            self._late(op, asyncio.get_running_loop().time() - t0)
            raise TierUnavailable(f"redis {op} on {self.url}: no answer by its deadline") from None

    async def _guarded(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
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

    def _late(self, op: str, waited: float) -> None:
        """A call given up at its deadline (a request's, or its call budget's): counted, and a
        failure for the breaker when it went unanswered for ``LATE_AS_DOWN_S``."""
        if waited >= LATE_AS_DOWN_S:
            self._failed(op, TimeoutError(f"no answer in {waited:.2f} s, by its deadline"))
        else:
            self._errors += 1
            log.info("redis %s on %s: no answer in %.3f s, by its deadline", op, self.url, waited)

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
        if self.bulk is not None:
            self.bulk.close()
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
