"""Another conversation, sent the moment an answer ends on a server whose slots are all taken:
llama-server alone starts it at once (its own prompt cache, when on, first copies the slot's state
to host memory). kvtier makes it wait for the save of that answer only when recomputing what that
save alone would store costs more than the wait: the end past what the tiers already hold (an
earlier turn's save) is a new question and an answer, a few tokens.

Real llama-servers (SmolLM2, one slot on the node under test), a real Valkey. The cost model's
rates are pinned: the decision is the subject here, not this machine's speed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar import aftercare
from tests.servers import RedisProc
from tests.sidecars import post
from tests.test_aborted_answers import node
from tests.test_repeat_at_once import SAVE_DELAY_S, text
from tests.test_sibling_at_once import SLOT_WRITE_S_PER_BYTE, WARM_UP, returns_elsewhere, shared_tokens

pytestmark = pytest.mark.llama

OTHER = {"prompt": "Inventory. " + " ".join(f"Crate {i} weighs {i * 7} kg." for i in range(60)), "n_predict": 4,
         "temperature": 0}


async def test_another_conversation_at_once_takes_the_slot_when_the_end_no_tier_holds_is_cheaper_than_the_save(
        redis_srv: RedisProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aftercare, "SAVE_DELAY_S", SAVE_DELAY_S)
    async with node(tmp_path, redis_srv.url, "a", ("-np", "1")) as (llama_a, a), \
            node(tmp_path, redis_srv.url, "b") as (_, b):
        shared = await shared_tokens(llama_a.url)
        assert (await post(a.url + "/completion", WARM_UP)).status == 200  # its size teaches the expected write
        await a.engine.drain(30)  # saved before the next request: nothing waits for it
        first = text("What does shelf 7 hold?", 8)
        turn1 = await post(a.url + "/completion", first)
        assert turn1.status == 200
        await a.engine.drain(30)  # the first turn is saved: the tiers hold it
        a.pin_prefill_rate(1e6)  # the end past it: microseconds to recompute
        a.pin_slot_write(SLOT_WRITE_S_PER_BYTE)
        second = {**first, "prompt": first["prompt"] + turn1.body["content"] + "\nQuestion: And shelf 9?\nAnswer:"}
        assert (await post(a.url + "/completion", second)).status == 200
        other = await post(a.url + "/completion", OTHER)  # the moment the second turn's answer ended
        assert other.status == 200
        assert a.metric("kvtier_saves_skipped_ends_total") == 1, a.decisions()
        assert a.metric("kvtier_saves_skipped_total") == 1
        # The second turn, asked again on another node, restores what the first turn's save stored
        # and computes the rest: the end the skipped save would have kept.
        await returns_elsewhere(a, b, second, shared, saves=3)  # the warm-up's, the first turn's, the other's


async def test_another_conversation_at_once_waits_for_the_save_of_a_first_turn_no_tier_holds(
        redis_srv: RedisProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aftercare, "SAVE_DELAY_S", SAVE_DELAY_S)
    async with node(tmp_path, redis_srv.url, "a", ("-np", "1")) as (_, a):
        assert (await post(a.url + "/completion", WARM_UP)).status == 200
        await a.engine.drain(30)
        a.pin_prefill_rate(100.0)  # the whole first turn (~600 tokens): ~6 s, against a ~1.5 s write
        a.pin_slot_write(SLOT_WRITE_S_PER_BYTE)
        # A text no earlier test stored (the Valkey is shared): none of it is restored.
        new = "Ledger. " + " ".join(f"Day {i}: {i * 11} coins paid to mill {i % 9}." for i in range(60))
        first = await post(a.url + "/completion", {"prompt": new, "n_predict": 8, "temperature": 0})
        assert first.status == 200 and first.headers["X-KVTier-Restored-Tokens"] == "0"
        assert (await post(a.url + "/completion", OTHER)).status == 200
        assert a.metric("kvtier_saves_skipped_total") == 0, a.decisions()
        await a.engine.drain(30)
        assert a.metric("kvtier_save_seconds_count") == 3


async def test_with_llama_servers_own_cache_the_end_is_let_go_and_a_return_here_loads_it_from_there(
        redis_srv: RedisProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # llama-server's prompt cache on: the other conversation has it copy the slot there first, as
    # alone, so the second turn's save is skipped however dear its end (the tiers hold the first
    # turn, and a return here loads the rest from that cache).
    monkeypatch.setattr(aftercare, "SAVE_DELAY_S", SAVE_DELAY_S)
    async with node(tmp_path, redis_srv.url, "a", ("-np", "1", "--cache-ram", "1024")) as (_, a):
        assert (await post(a.url + "/completion", WARM_UP)).status == 200
        await a.engine.drain(30)
        turn1 = await post(a.url + "/completion", text("What does shelf 5 hold?", 8))
        assert turn1.status == 200
        await a.engine.drain(30)
        assert a.engine.watcher.llama_cache.on
        a.pin_prefill_rate(1.0)  # the end: tens of seconds to recompute
        a.pin_slot_write(SLOT_WRITE_S_PER_BYTE)
        second = text("What does shelf 5 hold?", 8)
        second["prompt"] += turn1.body["content"] + "\nQuestion: And shelf 6?\nAnswer:"
        assert (await post(a.url + "/completion", second)).status == 200
        assert (await post(a.url + "/completion", OTHER)).status == 200
        assert a.metric("kvtier_saves_skipped_ends_total") == 1, a.decisions()
        back = await post(a.url + "/completion", second)
        # Back on this node: llama-server's cache holds all of it (~790 tokens), and kvtier's tiers the
        # first turn; at most the end is computed again.
        assert back.status == 200 and back.body["timings"]["prompt_n"] <= 30, (back.restored, back.body["timings"])
