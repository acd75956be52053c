"""Slot choice for concurrent conversations: a request never takes the slot of another conversation
that is still live while a colder slot is free, so that conversation's next turn (an agent's main
thread coming back after its sub-agents) finds its slot, its KV still there.

A real llama-server (SmolLM2, two slots), a real Valkey.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.servers import RedisProc
from tests.sidecars import post
from tests.test_aborted_answers import SYSTEM, node
from tests.test_repeat_at_once import text

pytestmark = pytest.mark.llama

# Shares its first words with SYSTEM, then nothing: a sub-agent's window with the same preamble.
OTHER = SYSTEM[:SYSTEM.index("Record 0")] + " ".join(f"River {i} runs {i * 11} km to the sea." for i in range(30))


async def test_a_live_conversations_slot_is_not_taken_while_a_colder_one_is_free(
        redis_srv: RedisProc, tmp_path: Path) -> None:
    async with node(tmp_path, redis_srv.url, "a") as (_, a):
        first = await post(a.url + "/completion", text("What does shelf 7 hold?", 8))
        assert first.status == 200
        main_slot = int(first.headers["X-KVTier-Slot"])
        await a.engine.drain(30)

        # Another conversation shares a few tokens with the live one: it takes the empty slot,
        # not the live conversation's (the longest common prefix alone would have chosen that one).
        side = await post(a.url + "/completion", {"prompt": OTHER, "n_predict": 4, "temperature": 0})
        assert side.status == 200
        assert int(side.headers["X-KVTier-Slot"]) != main_slot
        await a.engine.drain(30)

        # The live conversation comes back: its slot still holds it, nothing restored or recomputed.
        body = text("What does shelf 7 hold?", 8)
        body["prompt"] = str(body["prompt"]) + first.body["content"] + "\nQuestion: And shelf 9?\nAnswer:"
        back = await post(a.url + "/completion", body)
        assert back.status == 200
        assert int(back.headers["X-KVTier-Slot"]) == main_slot and back.restored == 0, back.headers
        assert back.body["timings"]["cache_n"] >= first.body["tokens_evaluated"] - 1, back.body["timings"]


async def test_a_new_conversation_sent_at_once_takes_a_free_slot_not_the_saving_one(
        redis_srv: RedisProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The same choice while the live conversation's save has not read its slot yet (the other
    # conversation comes the moment the answer ends): it shares a few tokens with that slot only, so
    # it takes the empty slot at once. It used to wait for that save (and, with an 8B-shaped model,
    # behind its write in llama-server's queue: a fresh node's second request stalled 0.66 s), then
    # took the empty slot all the same.
    from sidecar import aftercare
    monkeypatch.setattr(aftercare, "SAVE_DELAY_S", 5.0)  # the save's pause outlasts the other answer
    async with node(tmp_path, redis_srv.url, "a") as (_, a):
        first = await post(a.url + "/completion", text("What does shelf 7 hold?", 8))
        assert first.status == 200
        main_slot = int(first.headers["X-KVTier-Slot"])
        side = await post(a.url + "/completion", {"prompt": OTHER, "n_predict": 4, "temperature": 0})
        assert side.status == 200
        assert int(side.headers["X-KVTier-Slot"]) != main_slot
        # It did not wait: the first answer's save is still in its pause (a request waiting for
        # its slot would have ended that).
        assert a.metric("kvtier_save_seconds_count") == 0
        await a.engine.drain(30)
        assert a.metric("kvtier_save_seconds_count") == 2
