"""RedisTier: chunk blobs in Redis or Valkey, the ``Tier`` over a shared ``RedisConnection``.

Every call is one pipeline (grouped per node by the cluster client in cluster mode) run under the
connection's breaker; an unreachable server answers misses, never an exception. Values are the
codec's blobs and are never unpickled. Manifests (``tiers.redis_manifests``) and events
(``tiers.events``) use the same connection.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Unpack

import redis.exceptions as rex

from .base import StatsCounter, TierRole, TierStats
from .breaker import BreakerStats, CircuitBreaker
from .errors import KVTierError, TierUnavailable
from .redis_bulk import Buffer, BulkLane, Command
from .redis_conn import GET_CHUNKS, PUT_CHUNKS, AnyPipeline, RedisConnection, RedisOptions, ttl_seconds
from .redis_urls import RedisTarget

log = logging.getLogger("kvtier.redis")

# A multi-put is cut into pipelines of about this many value bytes (at least one value each). Python
# 3.11's asyncio transport copies whatever the socket does not take at once into a bytearray, so one
# 94 MB pipeline ran at 0.3-0.5 GB/s here and stalled the event loop, while 4 MB pipelines ran at 1.3.
PUT_PIPELINE_BYTES = 4 << 20
# Which of many keys exist, as one command with one array reply. A redis-py pipeline of EXISTS
# costs ~10 us of Python per key: 2.8 ms for the 255 candidate tails of a lookup here, 0.54 ms as
# this script (0.24 against 0.19 ms for 8 keys). Not in cluster mode, where keys span slots. Flagged
# no-writes (Redis 7+): a script without flags waits out a CLIENT PAUSE WRITE (a failover) where
# EXISTS does not, and a full server refuses it; a server before 7 cannot compile it (pipelined then).
EXISTS_MANY = ("#!lua flags=no-writes\n"
               "local out = {} for i = 1, #KEYS do out[i] = redis.call('EXISTS', KEYS[i]) end return out")


class _PresenceScript:
    """``EXISTS_MANY`` on one server, loaded with SCRIPT LOAD before its first call and again after
    a call failed (a restarted server has lost it): during a write pause (CLIENT PAUSE WRITE, a
    failover) the server holds back an EVALSHA of a script it does not hold, since it cannot tell
    whether it writes."""

    def __init__(self, connection: RedisConnection):
        self.connection = connection
        self.script = connection.client.register_script(EXISTS_MANY)
        self.loaded = False

    async def __call__(self, keys: Sequence[bytes]) -> list[Any]:
        try:
            if not self.loaded:
                await self.connection.run("script load", lambda: self.connection.client.script_load(EXISTS_MANY))
                self.loaded = True
            return list(await self.connection.run("exists", lambda: self.script(keys=list(keys))))
        except KVTierError:
            self.loaded = False
            raise


class RedisTier:
    """A tier in Redis/Valkey: shared by every node, written behind the request.

    Args:
        connection: a ``RedisConnection``, or a URL to open one with ``options`` (the tier then
            owns it; ``aclose`` closes it either way).
        ttl: seconds a value lives after it was last written or read (``None``: no expiry).
        refresh_on_hit: extend the TTL of values that are read (GETEX).
        name: tier name in stats, metrics and headers.
        options: ``RedisConnection`` settings, only with a URL.

    Raises:
        ConfigError: a bad URL or setting, at construction.
    """

    role = TierRole.REMOTE
    write_behind = True  # a request never waits on a remote write (TieredStore's queue)

    def __init__(self, connection: RedisConnection | str, *, ttl: float | None = None, refresh_on_hit: bool = True,
                 name: str = "redis", **options: Unpack[RedisOptions]):
        if isinstance(connection, str):
            connection = RedisConnection(connection, **options)
        elif options:
            raise ValueError("connection options go to the RedisConnection, not to a tier given one")
        self.connection = connection
        self.name = name
        self.ttl = ttl_seconds(ttl)
        self.refresh_on_hit = bool(refresh_on_hit)
        self._stats = StatsCounter(name)
        self._use_getex = True
        self._exists_script = None if connection.cluster else _PresenceScript(connection)

    def __repr__(self) -> str:
        c = self.connection
        return f"RedisTier(name={self.name!r}, url={c.url!r}, mode={c.target.mode}, ttl={self.ttl})"

    __str__ = __repr__

    @property
    def url(self) -> str:
        """The connection's URL, password redacted."""
        return self.connection.url

    @property
    def target(self) -> RedisTarget:
        return self.connection.target

    @property
    def breaker(self) -> CircuitBreaker:
        return self.connection.breaker

    # -- the Tier protocol ----------------------------------------------------------------------

    async def get_many(self, keys: Sequence[bytes]) -> dict[bytes, bytes | memoryview]:
        """Values of the keys present (pipelined GETEX, refreshing their TTL); misses are absent."""
        return (await self._get(keys, with_ttl=False))[0]

    async def get_many_with_ttl(self, keys: Sequence[bytes]) -> tuple[dict[bytes, bytes | memoryview], dict[bytes, int]]:
        """``get_many``, and the TTL (ms, -1: none) each value had before this read refreshed it,
        for ``reset_ttl`` to give back to a value its reader rejects (one ``PTTL`` before each
        ``GETEX`` in the same pipeline; nothing when the read refreshes nothing)."""
        return await self._get(keys, with_ttl=True)

    async def _get(self, keys: Sequence[bytes], *,
                   with_ttl: bool) -> tuple[dict[bytes, bytes | memoryview], dict[bytes, int]]:
        if not keys:
            return {}, {}
        t0 = time.perf_counter()
        try:
            results = await self._get_replies(keys, with_ttl)
            if self._use_getex and self._refresh and any(_unknown_command(r) for r in results):
                self._use_getex = False  # Redis < 6.2: pipelined GET + EXPIRE instead
                log.info("redis %s has no GETEX; using GET + EXPIRE", self.url)
                results = await self._get_replies(keys, with_ttl)
        except KVTierError:
            self._stats.add(misses=len(keys), get_seconds=time.perf_counter() - t0)
            return {}, {}
        ttls: dict[bytes, int] = {}
        if self._refresh:
            # Per key: [PTTL,] GETEX, or [PTTL,] GET, EXPIRE (servers without GETEX).
            step = (1 if self._use_getex else 2) + with_ttl
            if with_ttl:
                ttls = {k: t for k, t in zip(keys, results[::step]) if isinstance(t, int) and (t > 0 or t == -1)}
            results = results[int(with_ttl)::step]
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
        return found, {k: t for k, t in ttls.items() if k in found}

    async def reset_ttl(self, ttls: Mapping[bytes, int]) -> None:
        """Give values the TTL (ms, -1: none) they had before a read refreshed it. Never raises."""
        if not ttls:
            return

        def fill(pipe: AnyPipeline) -> None:
            for key, ms in ttls.items():
                if ms > 0:
                    pipe.pexpire(key, ms)
                else:
                    pipe.persist(key)

        try:
            await self.connection.pipeline("pexpire", fill)
        except KVTierError:
            pass  # counted by the connection

    @property
    def _refresh(self) -> bool:
        return self.ttl is not None and self.refresh_on_hit

    async def _get_replies(self, keys: Sequence[bytes], with_ttl: bool) -> list[Any]:
        """Per key: [PTTL,] GETEX (or GET, or GET + EXPIRE), through the bulk lane when there is one
        (values straight into buffers of their own), else one redis-py pipeline."""
        lane = self.connection.bulk
        if lane is None or (self._refresh and not self._use_getex):
            return await self.connection.pipeline(GET_CHUNKS, lambda pipe: self._fill_get(pipe, keys, with_ttl))
        if not self._refresh:
            commands: list[Command] = [(b"GET", key) for key in keys]
        else:
            ex = (b"EX", b"%d" % self.ttl) if self.ttl is not None else ()
            commands = [c for key in keys for c in ([(b"PTTL", key)] if with_ttl else []) + [(b"GETEX", key, *ex)]]
        step = 2 if self._refresh and with_ttl else 1
        return await self.connection.run(GET_CHUNKS, lambda: lane.execute(commands, step=step))

    def _fill_get(self, pipe: AnyPipeline, keys: Sequence[bytes], with_ttl: bool) -> None:
        if not self._refresh:
            for key in keys:
                pipe.get(key)
            return
        assert self.ttl is not None
        for key in keys:
            if with_ttl:
                pipe.pttl(key)
            if self._use_getex:
                pipe.getex(key, ex=self.ttl)
            else:
                pipe.get(key)
                pipe.expire(key, self.ttl)

    async def put_many(self, items: Mapping[bytes, Buffer]) -> int:
        """SET every item (with ``EX ttl``); returns how many the server accepted."""
        if not items:
            return 0
        t0 = time.perf_counter()
        lane = self.connection.bulk
        stored, nbytes, errors = await (self._put_bulk(lane, items) if lane is not None else self._put_pipelined(items))
        self._stats.add(puts=stored, bytes_in=nbytes, put_seconds=time.perf_counter() - t0)
        if errors:
            self._stats.add(errors=errors)
        return stored

    async def _put_pipelined(self, items: Mapping[bytes, Buffer]) -> tuple[int, int, int]:
        """SET ``items`` through redis-py, in pipelines of ``PUT_PIPELINE_BYTES``: (stored, bytes
        stored, values refused)."""
        stored = nbytes = errors = 0
        for batch in _batches(items, PUT_PIPELINE_BYTES):
            def fill(pipe: AnyPipeline, batch: list[tuple[bytes, Buffer]] = batch) -> None:
                for key, value in batch:
                    pipe.set(key, value, ex=self.ttl)
            try:
                results = await self.connection.pipeline(PUT_CHUNKS, fill)
            except KVTierError:
                break  # counted by the connection; the rest would fail the same way
            for (_, value), ok in zip(batch, results):
                if ok is True:
                    stored += 1
                    nbytes += len(value)
                else:
                    errors += 1
        return stored, nbytes, errors

    async def _put_bulk(self, lane: BulkLane, items: Mapping[bytes, Buffer]) -> tuple[int, int, int]:
        """SET ``items`` through the bulk lane: (stored, bytes stored, values refused)."""
        ex = (b"EX", b"%d" % self.ttl) if self.ttl is not None else ()
        commands: list[Command] = [(b"SET", key, value, *ex) for key, value in items.items()]
        sizes = [memoryview(value).nbytes for value in items.values()]
        try:
            results = await self.connection.run(PUT_CHUNKS, lambda: lane.execute(commands, sizes=sizes, writes=True))
        except KVTierError:
            return 0, 0, 0  # counted by the connection
        ok = [r == b"OK" for r in results]
        return sum(ok), sum(n for n, good in zip(sizes, ok) if good), len(ok) - sum(ok)

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """EXISTS of each key, in one script call (``EXISTS_MANY``), else pipelined: in cluster mode,
        after the script failed (counted), and for good once it was refused (``_script_refused``);
        an unreachable server answers "absent" for every key."""
        if not keys:
            return []
        if (script := self._exists_script) is not None and len(keys) > 1:
            try:
                results = await script(keys)
            except TierUnavailable:
                return [False] * len(keys)
            except KVTierError as exc:  # pipelined below; refused for good: not tried again
                if _script_refused(exc.__cause__):
                    self._exists_script = None
                    log.info("redis %s refused the presence script (%s); EXISTS per key from now on", self.url, exc)
            else:
                return [r == 1 for r in results]

        def fill(pipe: AnyPipeline) -> None:
            for k in keys:
                pipe.exists(k)

        try:
            results = await self.connection.pipeline("exists", fill)
        except KVTierError:
            return [False] * len(keys)
        return [r == 1 for r in results]

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Pipelined DEL (one key per command, so it works across cluster slots)."""
        return await _each_key(self.connection, "delete", keys, lambda pipe, k: pipe.delete(k))

    async def expire(self, keys: Sequence[bytes], seconds: float) -> int:
        """Pipelined EXPIRE: the keys stay readable ``seconds`` more, then go (``Tier.expire``)."""
        ttl = max(1, math.ceil(seconds))
        return await _each_key(self.connection, "expire", keys, lambda pipe, k: pipe.expire(k, ttl))

    def stats(self) -> TierStats:
        """Counters; ``errors`` holds every failed call of the connection (chunks, manifests and
        events alike); ``available`` is False while the breaker is open or probing."""
        snap = self._stats.snapshot(available=self.connection.breaker.closed)
        return replace(snap, errors=snap.errors + self.connection.errors)

    def breaker_stats(self) -> BreakerStats:
        return self.connection.breaker_stats()

    async def ping(self) -> bool:
        """True when the server answers (see ``RedisConnection.ping``); never raises."""
        return await self.connection.ping()

    async def aclose(self) -> None:
        """Close the connection (the manifests and events on it stop too). Idempotent."""
        await self.connection.aclose()


async def _each_key(connection: RedisConnection, op: str, keys: Sequence[bytes],
                    command: Callable[[AnyPipeline, bytes], object]) -> int:
    """``command`` for each key, one pipeline (keys of any cluster slot); how many keys it applied
    to (0 when Redis cannot be reached: counted by the connection)."""
    if not keys:
        return 0

    def fill(pipe: AnyPipeline) -> None:
        for k in keys:
            command(pipe, k)

    try:
        results = await connection.pipeline(op, fill)
    except KVTierError:
        return 0
    return sum(int(r) for r in results if isinstance(r, int))


def _unknown_command(result: Any) -> bool:
    return isinstance(result, rex.ResponseError) and "unknown command" in str(result).lower()


def _script_refused(error: BaseException | None) -> bool:
    """The server will not run the presence script: an ACL, a proxy without scripts, or a Redis
    before 7 (which cannot compile its flags line)."""
    return (isinstance(error, rex.NoPermissionError) or _unknown_command(error)
            or (isinstance(error, rex.ResponseError) and "error compiling script" in str(error).lower()))


def _batches(items: Mapping[bytes, Buffer], max_bytes: int) -> list[list[tuple[bytes, Buffer]]]:
    batches: list[list[tuple[bytes, Buffer]]] = [[]]
    size = 0
    for key, value in items.items():
        if batches[-1] and size + len(value) > max_bytes:
            batches.append([])
            size = 0
        batches[-1].append((key, value))
        size += len(value)
    return batches
