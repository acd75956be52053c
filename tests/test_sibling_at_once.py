"""Another question on the same text, sent the moment an answer ends (an answer regenerated, a last
message edited, questions on one document one after another): llama-server alone serves it from the
slot at once, reusing all but the end. kvtier makes it wait for the save of the answer before only
when recomputing what that save alone would keep (the answered prompt's end and its answer) costs
more than the wait for the save (llama-server's write of the slot, and the hand-over before it).

Real llama-servers (SmolLM2, one slot on the node under test), a real Valkey. The cost model's
rates are pinned: the decision is the subject here, not this machine's speed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar import aftercare
from tests.servers import RedisProc
from tests.sidecars import Answer, Sidecar, post
from tests.test_aborted_answers import SYSTEM, node
from tests.test_repeat_at_once import SAVE_DELAY_S, text

pytestmark = pytest.mark.llama

# An 8B model's slot of 2,000 tokens (250 MiB) written in 1.5 s, on a SmolLM2 slot of ~15 MB.
SLOT_WRITE_S_PER_BYTE = 1e-7
WARM_UP = {"prompt": "Log 1. " + " ".join(f"Entry {i}: value {i}." for i in range(80)), "n_predict": 4,
           "temperature": 0}


async def shared_tokens(llama_url: str) -> int:
    async with aiohttp.ClientSession() as s, s.post(llama_url + "/tokenize", json={"content": SYSTEM}) as r:
        return len((await r.json())["tokens"])


async def first_then_sibling(a: Sidecar, prefill_tps: float) -> Answer:
    """On node ``a`` (one slot): a warm-up saved (its size teaches the expected write), the cost model
    pinned, a question on SYSTEM, and at once another question on it; the second's answer."""
    assert (await post(a.url + "/completion", WARM_UP)).status == 200
    await a.engine.drain(30)
    a.pin_prefill_rate(prefill_tps)
    a.pin_slot_write(SLOT_WRITE_S_PER_BYTE)
    assert (await post(a.url + "/completion", text("What does shelf 7 hold?", 8))).status == 200
    sibling = await post(a.url + "/completion", text("What does shelf 9 hold?", 8))
    assert sibling.status == 200
    return sibling


async def returns_elsewhere(a: Sidecar, b: Sidecar, body: dict[str, Any], shared: int, *, saves: int) -> None:
    """Once ``a``'s ``saves`` saves are stored, ``body`` asked on node ``b`` restores at least the
    ``shared`` tokens, nearly all."""
    await a.engine.drain(30)
    assert await a.store.flush(30)
    assert a.metric("kvtier_save_seconds_count") == saves
    back = await post(b.url + "/completion", body)
    assert back.status == 200
    assert back.body["timings"]["cache_n"] >= 0.95 * shared, (back.body["timings"], shared)


async def test_another_question_at_once_takes_the_slot_when_the_end_it_drops_is_cheaper_than_the_save(
        redis_srv: RedisProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aftercare, "SAVE_DELAY_S", SAVE_DELAY_S)
    async with node(tmp_path, redis_srv.url, "a", ("-np", "1")) as (llama_a, a), \
            node(tmp_path, redis_srv.url, "b") as (_, b):
        shared = await shared_tokens(llama_a.url)
        sibling = await first_then_sibling(a, 1e6)  # the dropped end: microseconds to recompute
        # Served from the slot, as by llama-server alone, without waiting for the first answer's save.
        assert sibling.body["timings"]["cache_n"] >= shared, sibling.body["timings"]
        assert a.metric("kvtier_saves_skipped_ends_total") == 1
        assert a.metric("kvtier_saves_skipped_total") == 1
        # The sibling's own save stored the shared text: the first question, asked again on another
        # node, restores it and computes only its own end.
        await returns_elsewhere(a, b, text("What does shelf 7 hold?", 8), shared, saves=2)  # the warm-up's, the sibling's


async def test_another_question_at_once_waits_for_the_save_when_the_end_it_drops_costs_more(
        redis_srv: RedisProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aftercare, "SAVE_DELAY_S", SAVE_DELAY_S)
    async with node(tmp_path, redis_srv.url, "a", ("-np", "1")) as (llama_a, a):
        shared = await shared_tokens(llama_a.url)
        sibling = await first_then_sibling(a, 1.0)  # the dropped end: ~20 s to recompute, against a 1.5 s write
        assert sibling.body["timings"]["cache_n"] >= shared, sibling.body["timings"]  # the slot, after its save
        assert a.metric("kvtier_saves_skipped_total") == 0
        await a.engine.drain(30)
        assert a.metric("kvtier_save_seconds_count") == 3
