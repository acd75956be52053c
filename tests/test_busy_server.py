"""Restores beside slots that compute: llama-server runs a slot restore between its decode batches,
so one sent while another slot computes a long prompt waits for the batch then running, and the
request after it for the next one (the same prompt recomputed joins that one). kvtier learns that wait by how many slots compute, shows it
as the restore's ``queue`` phase, and a restore decision at that level prices it in.

Real llama-servers (SmolLM2, two slots each, 2,048-token batches), a real Valkey.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.servers import RedisProc
from tests.sidecars import post
from tests.test_aborted_answers import SYSTEM, node
from tests.test_hardening_storage import completion as text

pytestmark = pytest.mark.llama

# Batches of 2,048 tokens: the long prompt's first batch takes a second or more here.
ARGS = ("-np", "2", "-c", "8192", "-b", "2048", "-ub", "512")
LONG = " ".join(f"Line {i}: the kite over field {i} flies {i * 5} metres up." for i in range(140))


async def test_a_restore_beside_a_computing_slot_teaches_its_queue_wait(redis_srv: RedisProc, tmp_path: Path) -> None:
    async with node(tmp_path, redis_srv.url, "a", ARGS) as (_, a), node(tmp_path, redis_srv.url, "b", ARGS) as (_, b):
        stored = await post(a.url + "/completion", text(SYSTEM + "\nQuestion: shelf 7?\nAnswer:", 2))
        assert stored.status == 200
        await a.engine.drain(30)
        assert await a.store.flush(30)

        # Node b: one slot computes the long prompt while the other restores the stored prefix.
        long_prompt = asyncio.ensure_future(post(b.url + "/completion", text(LONG, 2)))
        while b.engine.watcher.slots is None or b.engine.watcher.slots.computing == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # into its first batch
        beside = await post(b.url + "/completion", text(SYSTEM + "\nQuestion: shelf 9?\nAnswer:", 2))
        assert beside.status == 200 and beside.restored > 0, beside.headers
        assert (await long_prompt).status == 200

        cost = b.engine.cost
        waited = b.metric("kvtier_restore_phase_seconds_sum", phase="queue")
        assert waited > 0.05, waited  # it waited for the long prompt's batch
        assert 0.8 * waited < cost.queue_wait(1) <= waited  # fading since (half-life 2 min)
        assert cost.queue_wait(0) == 0.0  # nothing computes beside a restore at level 0
        # A decision beside one computing slot adds that wait to the restore, and prices the
        # recompute at the rate measured beside one computing slot (the long prompt's, or all prompts').
        alone, busy = cost.decide(600, {"redis": 600 * 23040}, 0), cost.decide(600, {"redis": 600 * 23040}, 1)
        assert busy.predicted_restore_s == pytest.approx(alone.predicted_restore_s + cost.queue_wait(1), rel=0.01)
        assert busy.predicted_recompute_s == pytest.approx(600 / cost.prefill_rate(1, 600))
