"""A Redis that hangs (takes commands, answers none: paused, failing over, cut off by a partition
that drops packets) costs a request no more than recomputing its prompt would.

Its socket timeouts (2 s) and retries (three tries) would make each call wait ~6 s, and a new
prompt's lookup makes several: 19 s for a 1 s request, before the breaker had seen enough failures.
A request's lookups and restores now give up on Redis at a deadline (``redis_conn.request_deadline``):
``REDIS_WAIT_FLOOR_S`` past the cost model's recompute time of the prompt. A call given up after
``LATE_AS_DOWN_S`` counts as a failure for the breaker, which then skips Redis after a few requests.

The in-process cache (``KVTierCache``) bounds its lookups the same way, at the rate its own
context measured: its first completion on a hung Redis took 19.7 s for 1.3 s of compute.

Real Valkey (stopped with SIGSTOP), real llama-server and sidecar, a real in-process SmolLM2.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from integrations.llama_cpp_cache import KVTierCache, restore_session, save_session
from integrations.llama_cpp_state import prefill_seconds
from sidecar.appkeys import REDIS
from tests.inprocess import counting_llama
from tests.servers import RedisProc, smollm2_path
from tests.sidecars import post
from tests.test_aborted_answers import node
from tiers.errors import TierUnavailable
from tiers.redis_conn import (
    GET_CHUNKS,
    LATE_AS_DOWN_S,
    PUT_CHUNKS,
    REDIS_WAIT_FLOOR_S,
    REQUEST_DEADLINE,
    SESSION_CALL_S,
    RedisConnection,
    call_budget,
    request_deadline,
)
from tiers.writebehind import WriteBehind


@contextlib.contextmanager
def hung(server: RedisProc) -> Iterator[None]:
    """The server stopped (SIGSTOP): connections are taken by the kernel, nothing is answered.
    (``CLIENT PAUSE ALL`` would hold back its own ``UNPAUSE`` until the pause ends.)"""
    assert server.process.proc is not None
    pid = server.process.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def new_prompt() -> dict[str, Any]:
    """~330 tokens no tier holds (its first line tells it apart from every other test's)."""
    return {"prompt": f"Note {uuid.uuid4().hex}: " + "the cat sat on the mat. " * 40, "n_predict": 2,
            "temperature": 0}


@pytest.mark.llama
async def test_a_request_waits_for_a_hung_redis_no_longer_than_recomputing_would_take(
        redis_srv: RedisProc, tmp_path: Path) -> None:
    async with node(tmp_path, redis_srv.url, "a") as (_, a):
        # Priced at 300 tokens/s whatever this host computes: the deadline (~1.2 s) is then over
        # LATE_AS_DOWN_S here and on a faster machine alike.
        a.pin_prefill_rate(300.0)
        assert (await post(a.url + "/completion", new_prompt())).status == 200
        assert await a.engine.drain(30)
        estimate = a.engine.cost.recompute_s(330)
        with hung(redis_srv):
            took = []
            for _ in range(4):
                t0 = time.perf_counter()
                answer = await post(a.url + "/completion", new_prompt())
                took.append(time.perf_counter() - t0)
                assert answer.status == 200, answer.text
                assert answer.body["timings"]["prompt_n"] > 300  # recomputed
            compute = answer.body["timings"]["prompt_ms"] / 1000
            # Each waited for Redis at most the floor past the estimate (plus this host's jitter);
            # unbounded, the first one took 19 s.
            bound = compute + REDIS_WAIT_FLOOR_S + estimate + 1.0
            assert max(took) < bound, f"took {[round(t, 2) for t in took]} s, over {bound:.2f} s"
            # A deadline of ~1 s is over LATE_AS_DOWN_S: the breaker opened after three requests,
            # and the fourth did not wait for Redis at all.
            assert estimate + REDIS_WAIT_FLOOR_S > LATE_AS_DOWN_S
            assert a.app[REDIS].breaker_stats().opened == 1
            assert took[-1] < compute + 0.5 * estimate, f"the last one still waited ({took[-1]:.2f} s)"
        assert await a.engine.drain(30)


@pytest.mark.llama
def test_an_in_process_completion_waits_for_a_hung_redis_no_longer_than_evaluating_its_prompt(
        redis_srv: RedisProc) -> None:
    llm = counting_llama(smollm2_path())
    try:
        prompt = new_prompt()["prompt"]
        assert prefill_seconds(llm, 100) is None  # nothing evaluated yet: no rate to price with
        cache = KVTierCache(llm, redis_url=redis_srv.url, chunk_tokens=64)  # the default socket timeouts, retries
        llm.set_cache(cache)
        llm.create_completion(prompt, max_tokens=2, temperature=0)  # measures this context's rate
        assert cache.flush(30)
        estimate = prefill_seconds(llm, 330)
        assert estimate is not None and estimate > 0
        with hung(redis_srv):
            took = []
            for _ in range(4):
                llm.reset()
                llm.evals.clear()  # type: ignore[attr-defined]
                t0 = time.perf_counter()
                llm.create_completion(new_prompt()["prompt"], max_tokens=2, temperature=0)
                took.append(time.perf_counter() - t0)
                assert llm.evals[0] > 300  # type: ignore[attr-defined]  # recomputed
            redis_tier = cache.stats()["tiers"]["redis"]
        llm.set_cache(None)
        cache.close()
        # Each waited for Redis at most the floor past the estimate (plus this host's jitter), on
        # top of its compute (about the estimate again); unbounded, the first took 19.7 s.
        bound = 2 * estimate + REDIS_WAIT_FLOOR_S + 1.0
        assert max(took) < bound, f"took {[round(t, 2) for t in took]} s, over {bound:.2f} s"
        if estimate + REDIS_WAIT_FLOOR_S > LATE_AS_DOWN_S:  # calls cut that late open the breaker
            assert not redis_tier["available"] and redis_tier["errors"] >= 3
            assert took[-1] < 1.5 * estimate + 0.5, f"the last one still waited ({took[-1]:.2f} s)"
    finally:
        llm.set_cache(None)
        llm.close()


@pytest.mark.llama
def test_an_in_process_session_restore_on_a_hung_redis_takes_seconds(redis_srv: RedisProc) -> None:
    llm = counting_llama(smollm2_path())
    try:
        with KVTierCache(llm, redis_url=redis_srv.url, chunk_tokens=64) as cache:
            llm.set_cache(cache)
            llm.create_completion(new_prompt()["prompt"], max_tokens=2, temperature=0)
            held = llm.n_tokens
            save_session(llm, "kept")
            assert cache.flush(30)
            llm.reset()
            with hung(redis_srv):
                t0 = time.perf_counter()
                # Its manifest read and touch are each given up after SESSION_CALL_S (12 s before);
                # this process's memory tier still holds the session.
                assert restore_session(llm, "kept") == held
                assert time.perf_counter() - t0 < 3 * SESSION_CALL_S + 1.0
            llm.set_cache(None)
    finally:
        llm.set_cache(None)
        llm.close()


async def test_a_call_is_given_up_at_the_deadline_and_fails_the_breaker_only_when_it_waited_long(
        redis_srv: RedisProc) -> None:
    connection = RedisConnection(redis_srv.url, socket_timeout=5, retries=0)
    try:
        assert await connection.run("ping", connection.client.ping)
        with hung(redis_srv):
            t0 = time.perf_counter()
            with request_deadline(0.2), pytest.raises(TierUnavailable, match="deadline"):
                await connection.run("get", lambda: connection.client.get(b"kvtier:test:hung"))
            assert 0.15 < time.perf_counter() - t0 < 1.0
            assert connection.breaker.stats().consecutive_failures == 0  # short: no sign of a dead server
            assert connection.errors == 1
            with request_deadline(LATE_AS_DOWN_S + 0.1), pytest.raises(TierUnavailable):
                await connection.run("get", lambda: connection.client.get(b"kvtier:test:hung"))
            assert connection.breaker.stats().consecutive_failures == 1
            with request_deadline(0.0), pytest.raises(TierUnavailable):  # already past: not even sent
                await connection.run("get", lambda: connection.client.get(b"kvtier:test:hung"))
        # Outside a deadline, as before: the server answers (on a connection of its own: the ones
        # given up were dropped, their answers never read as another call's).
        assert await connection.run("ping", connection.client.ping)
        assert await connection.run("get", lambda: connection.client.get(b"kvtier:test:hung")) is None
        with request_deadline(0.0):  # chunk values under way are never cut (the cost model chose them)
            assert await connection.run(GET_CHUNKS, lambda: connection.client.get(b"kvtier:test:hung")) is None
    finally:
        await connection.aclose()


async def test_a_call_budget_bounds_each_call_but_not_the_transfer_of_chunk_values(redis_srv: RedisProc) -> None:
    connection = RedisConnection(redis_srv.url, socket_timeout=5, retries=0)
    try:
        assert await connection.run("ping", connection.client.ping)
        with hung(redis_srv):
            for _ in range(2):  # each call gets the budget afresh (a request's deadline is one for all)
                t0 = time.perf_counter()
                with call_budget(0.3), pytest.raises(TierUnavailable, match="deadline"):
                    await connection.run("get", lambda: connection.client.get(b"kvtier:test:hung"))
                assert 0.25 < time.perf_counter() - t0 < 1.5
            t0 = time.perf_counter()
            with call_budget(5.0), request_deadline(0.2), pytest.raises(TierUnavailable):  # the sooner of the two
                await connection.run("get", lambda: connection.client.get(b"kvtier:test:hung"))
            assert time.perf_counter() - t0 < 1.5
        with call_budget(0.0):  # chunk values, read or written, are never cut (the caller sized them)
            assert await connection.run(GET_CHUNKS, lambda: connection.client.get(b"kvtier:test:hung")) is None
            assert await connection.run(PUT_CHUNKS, lambda: connection.client.set(b"kvtier:test:hung", b"v", ex=5))
    finally:
        await connection.aclose()


@pytest.mark.llama
async def test_a_session_operation_on_a_hung_redis_fails_in_seconds_and_keeps_no_slot(
        redis_srv: RedisProc, tmp_path: Path) -> None:
    async with node(tmp_path, redis_srv.url, "a") as (_, a):
        body = {"prompt": "the cat sat on the mat. " * 40, "n_predict": 2, "id_slot": 0}
        assert (await post(a.url + "/completion", body, headers={"X-Session-Id": "kept"})).status == 200
        assert await a.engine.drain(30)
        assert (await post(a.url + "/v1/sessions/kept", {"slot": 0}, method="PUT")).status == 200
        with hung(redis_srv):
            # A restore's manifest read and touch are each given up after SESSION_CALL_S (each
            # waited up to ~6 s of timeouts and retries before).
            t0 = time.perf_counter()
            restored = await post(a.url + "/v1/sessions/kept/restore", {"slot": 1})
            assert restored.status == 503, restored.text
            assert time.perf_counter() - t0 < 3 * SESSION_CALL_S + 1.0
            # A save's writes wait out Redis (they go through the write-behind queue), but the slot
            # is free once its state is read: a request for it does not wait with them (18 s before).
            saving = asyncio.create_task(post(a.url + "/v1/sessions/kept", {"slot": 0}, method="PUT"))
            await asyncio.sleep(0.5)
            t0 = time.perf_counter()
            user = await post(a.url + "/completion", {**body, "prompt": body["prompt"] + " again"})
            assert user.status == 200 and time.perf_counter() - t0 < 3.0, time.perf_counter() - t0
            assert (await saving).status == 503
        assert await a.engine.drain(30)


async def test_the_write_behind_worker_started_during_a_request_keeps_no_deadline() -> None:
    # A request's write can start the worker; its later writes must not carry that request's deadline.
    seen: list[float | None] = []

    class Recording:  # a tier that records the deadline its calls see (pure logic)
        name = "recording"

        async def contains_many(self, keys: list[bytes]) -> list[bool]:
            seen.append(REQUEST_DEADLINE.get())
            return [False] * len(keys)

        async def put_many(self, items: dict[bytes, Any]) -> int:
            return len(items)

    behind = WriteBehind([Recording()])  # type: ignore[list-item]
    try:
        with request_deadline(0.05):
            behind.submit([b"k"], lambda i: b"v")
        assert await behind.flush(5.0)
        assert seen == [None]
    finally:
        await behind.aclose(1.0)
