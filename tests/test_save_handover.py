"""A slot whose save waits in llama-server's queue goes to a request that waits for it.

llama-server runs a slot save between the batches the other slots compute, so on a busy server the
save after an answer waits seconds. llama-server alone would give that slot to the next request at
once. kvtier hands it over once the save is in llama-server's queue (which runs the save first), and
the save, when it ends, stores what the answer left without recording it over the next request's slot.

Real llama-servers (SmolLM2, two slots each, 2,048-token batches), a real Valkey.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from sidecar.slots import SlotTable
from tests.servers import LlamaServer, RedisProc
from tests.sidecars import post
from tests.test_aborted_answers import SYSTEM, node
from tests.test_hardening_storage import completion as text

pytestmark = pytest.mark.llama

ARGS = ("-np", "2", "-c", "16384", "-b", "2048", "-ub", "512")
LONG = " ".join(f"Line {i}: the kite over field {i} flies {i * 5} metres up." for i in range(200))
OTHER = " ".join(f"Verse {i}: the tide at cove {i} turns at {i % 12} o'clock." for i in range(20))
# About 1,400 tokens, computed alone if the long prompt is still on its way through the sidecar (on
# a loaded CI host that took longer than SYSTEM alone computes): its answer ends once the long
# prompt computes beside it either way.
FIRST = SYSTEM + " " + " ".join(f"Record {i}: the jar on shelf {i} is empty." for i in range(40, 100))


async def test_a_request_takes_a_slot_whose_save_waits_behind_other_batches(redis_srv: RedisProc,
                                                                           tmp_path: Path) -> None:
    async with node(tmp_path, redis_srv.url, "a", ARGS) as (llama, a), node(tmp_path, redis_srv.url, "b", ARGS) as (_, b):
        # What the table holds matches llama-server before the prompts go (the health check's job,
        # done now): should a slot need reading again (a resync takes a lease of its own), that
        # happens here and not in the middle of this set-up.
        await a.engine.watcher.check_server()
        table = a.engine.watcher.slots
        assert table is not None and table.computing == 0
        # The short prompt takes slot 0, which llama-server fills its batches from first, so its
        # answer ends while the long one still computes its 2,048-token batches in slot 1.
        answer = asyncio.ensure_future(post(a.url + "/completion", text(FIRST + "\nQuestion: shelf 7?\nAnswer:", 1)))
        await until_computing(table, 1, answer)
        assert table.slots[0].busy, "the short prompt took slot 1: the long one would fill every batch before it"
        long_prompt = asyncio.ensure_future(post(a.url + "/completion", text(LONG, 2)))
        # The long prompt reaches llama-server while the short one computes (seconds here).
        await until_computing(table, 2, answer)
        assert (await answer).status == 200
        # Both slots busy: the long prompt computes, the other one's save waits for its batch.
        other = await post(a.url + "/completion", text(OTHER, 2))
        assert other.status == 200
        assert a.metric("kvtier_saves_handed_over_total") == 1, (
            a.metric("kvtier_saves_skipped_total"), a.metric("kvtier_bytes_saved_total"),
            {stage: a.metric("kvtier_cache_errors_total", stage=stage) for stage in ("save", "server_changed")},
            timeline(llama))
        assert (await long_prompt).status == 200
        assert await a.engine.drain(60)
        assert await a.store.flush(30)

        assert a.metric("kvtier_cache_errors_total", stage="save") == 0

        # What the answer left was stored: another node restores its prefix.
        back = await post(b.url + "/completion", text(FIRST + "\nQuestion: shelf 9?\nAnswer:", 2))
        assert back.status == 200 and back.restored > 0 and back.prompt_n < 80, (back.restored, back.prompt_n)


async def until_computing(table: SlotTable, n: int, answer: asyncio.Future[object]) -> None:
    """Until ``n`` slots compute; fails when the short prompt's answer ends first (the set-up
    did not happen: nothing would make its save wait)."""
    while table.computing < n:
        assert not answer.done(), f"the short prompt was answered before {n} slot(s) computed"
        await asyncio.sleep(0.005)


def timeline(llama: LlamaServer) -> list[str]:
    """llama-server's slot launches and releases, from its log (what a failure shows)."""
    assert llama.process is not None and llama.process.log is not None
    return [line.strip() for line in llama.process.log.read_text(errors="replace").splitlines()
            if "launch_slot_" in line or "release:" in line or "prompt eval time" in line]


def test_a_save_that_began_before_a_hand_over_records_nothing() -> None:
    async def run() -> None:
        table = SlotTable(1)
        lease = await table.acquire(np.arange(10, dtype=np.int32))
        grant = table.slots[0].leases
        answered = np.arange(10, dtype=np.int32)
        table.begin_save(0, (answered, "t"))
        waiter = asyncio.ensure_future(table.acquire(np.arange(100, 120, dtype=np.int32), owner="t"))
        await asyncio.sleep(0)
        assert table.wanted(0)
        table.hand_over(lease)
        nxt = await waiter
        assert nxt.slot == 0 and nxt.cached_tokens == 0 and table.slots[0].busy
        assert table.slots[0].tokens.tolist() == answered.tolist() and not table.slots[0].saving
        saved = table.record_saved(0, np.arange(12, dtype=np.int32), "t", grant)  # the late save
        assert saved.tokens.size == 12 and table.slots[0].tokens.size == 10  # not recorded
        assert table.record_saved(0, np.arange(30, dtype=np.int32), "t", grant + 1).tokens is table.slots[0].tokens

    asyncio.run(run())
