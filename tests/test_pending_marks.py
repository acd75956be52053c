"""PendingSaves.held against real Valkey: a save's block never waits for Redis to take its markers,
and the markers go once the block ends (never left behind for their TTL). The flows that rely on
the markers (a next turn on another node waiting for a save): tests/test_pending_saves.py."""

from __future__ import annotations

import asyncio
import contextlib
import time

import redis

from tests.servers import RedisProc, free_port
from tiers.pending import PendingMark, PendingSaves
from tiers.redis_conn import RedisConnection

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
