"""A save waits while other slots compute: llama-server alone would run them with nothing beside,
and a save stops every slot while llama-server writes the slot, then takes CPU from them while
kvtier cuts and stores it. It goes once no other slot computes, when a request wants its slot, or
when a drain begins (``aftercare.held_beside``, ``--save-defer``).

Real llama-server (SmolLM2, two slots), a real Valkey.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from sidecar.appkeys import UPSTREAM
from tests.servers import RedisProc
from tests.sidecars import Answer, Sidecar, post
from tests.test_aborted_answers import node

pytestmark = pytest.mark.llama

# --save-defer whose half outlasts the other request (past half of it, a long prompt beside lets a
# held save go: the test below its own).
LONG_DEFER = 30.0
SHORT = {"prompt": "Shelf 7 holds blue jars of honey and red jars of jam.\nQuestion: What does shelf 7 hold?\nAnswer:",
         "n_predict": 4, "temperature": 0}


def long_request(days_n: int = 80) -> dict[str, Any]:
    """Another user's request for the other slot: ~1,500 tokens (``days_n`` 80) no tier holds (its first
    token tells it apart from every earlier test's, on the shared Valkey) and 64 to answer, several seconds here."""
    days = " ".join(f"Day {i}: {i * 13} coins paid to mill {i % 7} for grain." for i in range(days_n))
    return {"prompt": f"Ledger {uuid.uuid4().hex}. {days}", "n_predict": 64, "ignore_eos": True, "temperature": 0}


async def answered_beside_another(url: str, long: dict[str, Any] | None = None) -> tuple[Answer, asyncio.Task[Answer]]:
    """``SHORT`` answered while nothing else computes, then at once ``long`` (default: a new
    ``long_request()``) on the other slot."""
    first = await post(url + "/completion", SHORT)
    assert first.status == 200, first.text
    other = asyncio.ensure_future(post(url + "/completion", long or long_request()))
    await asyncio.sleep(1.0)  # the first answer's pause (30 ms) and a save of its ~1 MB are long past
    assert not other.done(), "the other request ended too soon to tell"
    return first, other


async def saves_while(a: Sidecar, other: asyncio.Task[Answer], metric: str = "kvtier_save_seconds_count") -> float:
    """The saves made (``metric``: held saves gone) by the end of ``other`` (looked at every 20 ms until it ended)."""
    made = a.metric(metric)
    while not other.done():
        made = a.metric(metric)
        await asyncio.sleep(0.02)
    return made


async def test_a_save_waits_while_another_slot_computes_and_goes_once_none_does(
        redis_srv: RedisProc, tmp_path: Path) -> None:
    async with node(tmp_path, redis_srv.url, "a") as (_, a):
        a.engine.aftercare.defer_s = LONG_DEFER
        _, other = await answered_beside_another(a.url)
        assert a.metric("kvtier_pending_saves") == 1
        # Held back for the whole of the other request: its prompt, then its answer (llama-server's
        # queue alone would hold the save only until the end of the prompt's batch).
        assert await saves_while(a, other) == 0
        assert (await other).status == 200
        assert await a.engine.drain(30)
        assert a.metric("kvtier_save_seconds_count") == 2  # the held one, then the other's
        # The held one; and the other's too when the held one's write began first (one at a time).
        assert a.metric("kvtier_save_deferred_seconds_count") in (1, 2)
        assert a.metric("kvtier_save_deferred_seconds_sum") >= 0.9  # it waited for the other request
        assert a.metric("kvtier_saves_skipped_total") == 0


async def test_a_held_save_waits_for_a_quiet_moment_after_the_other_slot_answers(
        redis_srv: RedisProc, tmp_path: Path) -> None:
    async with node(tmp_path, redis_srv.url, "a") as (_, a):
        a.engine.aftercare.defer_s = LONG_DEFER
        long = long_request()
        _, other = await answered_beside_another(a.url, long)
        assert (await other).status == 200
        # The other slot's client asks again at once (a retry, its next turn): the held save does not
        # go into that request (saved as it began, it would be made while the slot answers its 64 tokens).
        again = asyncio.ensure_future(post(a.url + "/completion", long))
        assert await saves_while(a, again) == 0
        assert (await again).body["timings"]["prompt_n"] <= 1  # served from its slot
        assert await a.engine.drain(30)
        assert a.metric("kvtier_save_seconds_count") == 2  # the held one, then the repeat's
        assert a.metric("kvtier_saves_skipped_total") == 1  # the other's first answer: its repeat came


async def test_a_held_saves_quiet_moment_outlasts_a_small_saves_pause(redis_srv: RedisProc, tmp_path: Path) -> None:
    async with node(tmp_path, redis_srv.url, "a") as (_, a):
        a.engine.aftercare.defer_s = LONG_DEFER
        long = long_request()
        _, other = await answered_beside_another(a.url, long)
        assert (await other).status == 200
        # The other slot's client asks again 0.1 s after its answer (an agent's tool call). The held
        # save's own pause is 30 ms (a small write), but its quiet moment is HELD_QUIET_S (0.25 s): it
        # has not gone by then, and stays held through that request.
        await asyncio.sleep(0.1)
        again = asyncio.ensure_future(post(a.url + "/completion", long))
        assert await saves_while(a, again, "kvtier_save_deferred_seconds_count") == 0
        assert (await again).status == 200
        assert await a.engine.drain(30)
        assert a.metric("kvtier_save_deferred_seconds_count") >= 1


async def test_past_half_its_wait_a_held_save_goes_beside_a_long_prompt(redis_srv: RedisProc, tmp_path: Path) -> None:
    """Once the node knows how long a write takes, a save held beside another slot's long prompt goes at
    half ``--save-defer`` (that prompt has more than ten times the write left to compute, and llama-server
    writes the slot between its batches), not at the end of the wait, into whatever request comes then."""
    async with node(tmp_path, redis_srv.url, "a") as (_, a):
        a.engine.aftercare.defer_s = 2.0
        warm = await post(a.url + "/completion", {**SHORT, "prompt": "Shelf 9 holds tins of tea.\nQuestion: And shelf 9?\nAnswer:"})
        assert warm.status == 200
        for _ in range(250):  # nothing computes beside it: saved at once, and its write learned
            if a.metric("kvtier_save_seconds_count") == 1:
                break
            await asyncio.sleep(0.02)
        assert a.engine.aftercare.saver.expected_write(40) is not None
        _, other = await answered_beside_another(a.url)
        assert await saves_while(a, other, "kvtier_save_deferred_seconds_count") == 1  # gone beside it
        assert (await other).status == 200
        assert 0.9 <= a.metric("kvtier_save_deferred_seconds_sum") < 1.9  # at half the wait, not at its end
        assert await a.engine.drain(30)


async def test_a_request_that_wants_the_slot_ends_the_wait(redis_srv: RedisProc, tmp_path: Path) -> None:
    async with node(tmp_path, redis_srv.url, "a") as (_, a):
        first, other = await answered_beside_another(a.url)
        # The same prompt again: it waits for that slot (its save held back), which serves it as
        # llama-server alone would, and the save is skipped (the repeat's own save stores it all).
        again = await post(a.url + "/completion", SHORT)
        assert again.status == 200
        assert not other.done()  # served while the other request still computed
        assert again.headers["X-KVTier-Slot"] == first.headers["X-KVTier-Slot"]
        assert again.body["timings"]["prompt_n"] <= 1
        assert a.metric("kvtier_saves_skipped_total") == 1
        assert (await other).status == 200
        assert await a.engine.drain(30)


async def test_a_drain_ends_the_wait(redis_srv: RedisProc, tmp_path: Path) -> None:
    async with node(tmp_path, redis_srv.url, "a") as (_, a):
        _, other = await answered_beside_another(a.url)
        t0 = time.perf_counter()
        assert await a.engine.drain(30)  # a shutdown: the held save goes now
        assert a.metric("kvtier_save_seconds_count") == 1
        assert not other.done(), f"the drain waited for the other request ({time.perf_counter() - t0:.1f} s)"
        assert (await other).status == 200


async def test_no_wait_with_save_defer_0(redis_srv: RedisProc, tmp_path: Path) -> None:
    async with node(tmp_path, redis_srv.url, "a") as (_, a):
        a.engine.aftercare.defer_s = 0.0  # --save-defer 0
        _, other = await answered_beside_another(a.url)
        assert await saves_while(a, other) == 1  # saved beside the other request
        assert a.metric("kvtier_save_deferred_seconds_count") == 0
        assert (await other).status == 200


async def test_saves_that_come_due_together_are_written_one_at_a_time(redis_srv: RedisProc, tmp_path: Path) -> None:
    async with node(tmp_path, redis_srv.url, "a") as (_, a):
        files = a.engine.aftercare.saver.files
        writes: list[tuple[float, float]] = []  # llama-server's write of a slot and kvtier's read of it
        save = files.save

        async def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await save(*args, **kwargs)
            finally:
                writes.append((t0, time.perf_counter()))

        files.save = timed  # type: ignore[method-assign]
        # The held save and the other request's come due together as that request ends: one goes,
        # the other waits for its write (a request that came meanwhile would wait for that one write
        # in llama-server's queue, not for both).
        _, other = await answered_beside_another(a.url)
        assert (await other).status == 200
        for _ in range(500):  # no drain: it would end the wait
            if len(writes) == 2:
                break
            await asyncio.sleep(0.02)
        (_, first_read), (second_sent, _) = sorted(writes)
        assert first_read <= second_sent


async def test_a_redis_that_takes_no_writes_does_not_keep_a_held_saves_slot(
        redis_srv: RedisProc, tmp_path: Path) -> None:
    """The held save's pending-save marks are lifted as its wait begins. With Redis taking no write
    (paused: a hung or failing-over server), a lift that waited for Redis to take them kept the slot
    through Redis's timeouts and retries (5 s here). A request for the slot meanwhile goes to
    llama-server as it comes."""
    paused = redis.Redis(port=redis_srv.port)
    async with node(tmp_path, redis_srv.url, "a") as (_, a):
        upstream = a.app[UPSTREAM]
        request, sent = upstream.request, []

        async def timed(*args: Any, **kwargs: Any) -> Any:
            sent.append(time.perf_counter())
            return await request(*args, **kwargs)

        upstream.request = timed
        try:
            paused.client_pause(60_000, all=False)  # writes only: lookups still answer
            first, other = await answered_beside_another(a.url)
            t0 = time.perf_counter()
            again = await post(a.url + "/completion", SHORT)
            assert again.status == 200
            assert again.headers["X-KVTier-Slot"] == first.headers["X-KVTier-Slot"]
            assert again.body["timings"]["prompt_n"] <= 1
            # (llama-server then serves it beside the other request's prompt: seconds here, as alone.)
            waited = sent[-1] - t0
            assert waited < 1.0, f"the request for the held save's slot waited {waited:.1f} s in kvtier"
        finally:
            paused.client_unpause()
            paused.close()
        assert (await other).status == 200
        assert await a.engine.drain(30)
