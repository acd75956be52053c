"""PendingSaves.held against real Valkey: a save's block never waits for Redis to take its markers,
and the markers go once the block ends (never left behind for their TTL). The flows that rely on
the markers (a next turn on another node waiting for a save): tests/test_pending_saves.py."""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
import redis

from integrations import flows
from integrations.memkind import LookupShape
from integrations.pendingflow import pending_marks
from tests.servers import RedisProc, free_port
from tiers.codec import BlobCodec
from tiers.keys import Namespace, prefix_chain
from tiers.memory import MemoryTier
from tiers.pending import PendingMark, PendingSaves
from tiers.redis_conn import RedisConnection
from tiers.redis_tier import RedisTier
from tiers.store import TieredStore

KEYS = [b"kvtier:test:p:a", b"kvtier:test:p:b"]
MARK = PendingMark(512, "node-a")


async def test_a_save_does_not_wait_for_its_markers_and_clears_them_once_they_land(redis_srv: RedisProc) -> None:
    connection = RedisConnection(redis_srv.url, socket_timeout=5)
    pending = PendingSaves(connection, ttl=30)
    r = redis.Redis(port=redis_srv.port)
    try:
        r.execute_command("CLIENT", "PAUSE", 500, "WRITE")  # Redis takes no write for 0.5 s
        t0 = time.perf_counter()
        async with pending.held(KEYS, MARK):
            entered = time.perf_counter() - t0
            assert r.get(KEYS[0]) is None  # the markers are still on their way
            await asyncio.sleep(0.05)
        left = time.perf_counter() - t0
        assert entered < 0.25, f"the block waited {entered:.3f} s for Redis"
        assert left >= 0.4, "the exit did not wait for the markers to land before deleting them"
        assert r.exists(*KEYS) == 0, "markers left behind"
        async with pending.held(KEYS, MARK):  # unpaused: set while the block runs, renewed, deleted
            for _ in range(100):
                if r.exists(*KEYS) == len(KEYS):
                    break
                await asyncio.sleep(0.01)
            assert PendingMark.parse(r.get(KEYS[1])) == MARK and 0 < r.pttl(KEYS[1]) <= 30_000
        assert r.exists(*KEYS) == 0
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
        r.close()
        await connection.aclose()


async def test_a_save_that_lifts_its_markers_has_them_gone_at_once_and_never_renewed(redis_srv: RedisProc) -> None:
    # A save held back for seconds (``aftercare.held_beside``) lifts its markers: no one waits for it.
    connection = RedisConnection(redis_srv.url, socket_timeout=5)
    pending = PendingSaves(connection, ttl=0.3)  # renewed every 0.1 s
    r = redis.Redis(port=redis_srv.port)
    try:
        async with pending.held(KEYS, MARK) as lift:
            await asyncio.sleep(0.1)  # the markers landed
            assert r.exists(*KEYS) == len(KEYS)
            await lift()  # returns at once; the markers go right after
            for _ in range(100):
                if r.exists(*KEYS) == 0:
                    break
                await asyncio.sleep(0.01)
            assert r.exists(*KEYS) == 0
            r.set(KEYS[0], b"another save's")  # renewals past the lift would keep it alive
            await asyncio.sleep(0.5)
            assert r.exists(KEYS[0]) == 1 and r.pttl(KEYS[0]) == -1
            await lift()  # once is enough: a second changes nothing
        assert r.get(KEYS[0]) == b"another save's", "the exit deleted markers that were no longer its own"
    finally:
        r.close()
        await connection.aclose()


async def test_a_lift_while_redis_takes_no_write_returns_at_once_and_the_markers_go_once_they_land(
        redis_srv: RedisProc) -> None:
    # A held save's wait (and a request for its slot) must not wait for a hung Redis's timeouts.
    connection = RedisConnection(redis_srv.url, socket_timeout=5)
    pending = PendingSaves(connection, ttl=30)
    r = redis.Redis(port=redis_srv.port)
    try:
        r.execute_command("CLIENT", "PAUSE", 500, "WRITE")
        t0 = time.perf_counter()
        async with pending.held(KEYS, MARK) as lift:
            await asyncio.sleep(0.05)  # the markers are sent, and wait in Redis
            t1 = time.perf_counter()
            await lift()
            lifted = time.perf_counter() - t1
        left = time.perf_counter() - t0
        assert lifted < 0.02, f"the lift waited {lifted:.3f} s for Redis"
        assert left >= 0.4, "the exit did not wait for the markers to land and be deleted"
        assert r.exists(*KEYS) == 0, "markers left behind"
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
        r.close()
        await connection.aclose()


async def test_a_save_cancelled_while_its_markers_are_on_their_way_leaves_nothing_renewing(
        redis_srv: RedisProc) -> None:
    connection = RedisConnection(redis_srv.url, socket_timeout=5)
    pending = PendingSaves(connection, ttl=30)
    r = redis.Redis(port=redis_srv.port)
    inside = asyncio.Event()

    async def save() -> None:
        async with pending.held(KEYS, MARK):
            inside.set()
            await asyncio.sleep(10)

    try:
        r.execute_command("CLIENT", "PAUSE", 500, "WRITE")
        task = asyncio.create_task(save())
        await asyncio.wait_for(inside.wait(), 1)
        task.cancel()  # the block ends; its exit waits for the markers
        await asyncio.sleep(0.05)
        task.cancel()  # and that wait is cancelled too (a shutdown)
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        holders = [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__name__", "") == "_hold"]
        assert not holders, "a task still holds (and renews) the markers"
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
        r.close()
        await connection.aclose()


async def test_a_save_goes_on_without_markers_when_redis_is_unreachable() -> None:
    connection = RedisConnection(f"redis://127.0.0.1:{free_port()}", socket_timeout=1, connect_timeout=1,
                                 retries=0)
    pending = PendingSaves(connection)
    ran = False
    try:
        async with pending.held(KEYS, MARK):
            ran = True
        assert ran
    finally:
        await connection.aclose()


async def test_a_lookup_waits_only_for_a_save_that_names_more_than_the_chunks_and_the_tail(
        redis_srv: RedisProc) -> None:
    """``flows.find_prefix_waiting`` waits for a save in flight on another node that names more
    than the chunks and the tail the tiers hold together, never for one that names no more than
    the tail (its marks name the chunk and the tail's first 16 tokens: past the chunk)."""
    ns = Namespace("f" * 32, chunk_tokens=64)
    connection = RedisConnection(redis_srv.url, socket_timeout=5)
    pending = PendingSaves(connection, ttl=30)
    store = TieredStore([MemoryTier(1 << 20), RedisTier(connection)], BlobCodec("none"))
    tokens = np.arange(1000, 1100, dtype=np.int32)  # a chunk of 64 and 36 more tokens
    chain = prefix_chain(ns, tokens[:64])
    try:
        await store.store(ns, chain, lambda i: b"c" * 64)
        await store.store_tail(ns, chain[-1], tokens[64:84], b"t" * 64)  # 84 tokens stored
        assert await store.flush(5)

        async def look(marked: int) -> flows.FoundAfterWait:
            async with pending.held([k for k, _ in pending_marks(ns, tokens[:marked])], PendingMark(marked, "b")):
                await asyncio.sleep(0.05)  # the marks are in Redis
                return await flows.find_prefix_waiting(store, pending, ns, tokens, LookupShape(),
                                                       limit=lambda save, have: 0.1)

        # A save of what is stored: its marks name 64 and 80 tokens, past the chunk, not the tail.
        same = await look(84)
        assert same.found.n_tokens == 84 and same.waited is None
        more = await look(99)  # one that names 96 tokens: waited for, to the bound (its marks stay)
        assert more.found.n_tokens == 84 and more.waited is not None
        assert (more.waited.save.n_tokens, more.waited.ended) == (96, False) and more.before == 84
    finally:
        await store.aclose()
