"""A prompt sent again the moment its answer ends (a client retrying, a benchmark calibrating
itself, an agent's next step already here): llama-server alone serves it from the slot at once.
kvtier must too, rather than make it wait for the save of the answer it repeats or continues;
the save of the new answer stores what the slot holds.

Real llama-servers (SmolLM2, two slots each), a real Valkey.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar import aftercare
from sidecar.http import upstream
from tests.servers import RedisProc
from tests.sidecars import post
from tests.test_aborted_answers import SYSTEM, node

pytestmark = pytest.mark.llama

SAVE_DELAY_S = 1.5  # the save starts late here (as on a loaded host): the repeat surely finds it pending


async def chat_step(url: str, messages: list[dict[str, str]], question: str) -> dict[str, Any]:
    """An agent's chat step: ``question`` and the answer are added to ``messages``; the answer's timings."""
    messages.append({"role": "user", "content": question})
    answer = await post(url + "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0})
    assert answer.status == 200, answer.text
    messages.append({"role": "assistant", "content": answer.body["choices"][0]["message"]["content"]})
    return dict(answer.body["timings"])


def text(question: str, n: int) -> dict[str, Any]:
    return {"prompt": f"{SYSTEM}\nQuestion: {question}\nAnswer:", "n_predict": n, "temperature": 0}


async def test_a_prompt_sent_again_at_once_is_served_from_its_slot_without_waiting_for_the_save(
        redis_srv: RedisProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aftercare, "SAVE_DELAY_S", SAVE_DELAY_S)
    events: list[str] = []  # completions sent to llama-server, and answers read for their timings
    learn, start = aftercare.Aftercare._learn, upstream.Connection.start

    def learned(self: aftercare.Aftercare, plan: Any, answer: bytes) -> None:
        events.append("learned")
        learn(self, plan, answer)

    def sent(self: upstream.Connection, response: Any, data: bytes) -> None:
        if data.startswith(b"POST /completion "):
            events.append("sent")
        start(self, response, data)

    monkeypatch.setattr(aftercare.Aftercare, "_learn", learned)
    monkeypatch.setattr(upstream.Connection, "start", sent)
    async with node(tmp_path, redis_srv.url, "a") as (llama_a, a), node(tmp_path, redis_srv.url, "b") as (_, b):
        async with aiohttp.ClientSession() as s, s.post(llama_a.url + "/tokenize", json={"content": SYSTEM}) as r:
            shared = len((await r.json())["tokens"])
        body = text("What does shelf 7 hold?", 8)
        first = await post(a.url + "/completion", body)
        assert first.status == 200
        again = await post(a.url + "/completion", body)
        assert again.status == 200 and again.content == first.content
        assert again.body["timings"]["prompt_n"] <= 2, again.body["timings"]  # the slot's own KV, reused
        # It ended the pause before the first answer's save, which was not made: llama-server never
        # stopped for it, and the repeat did not wait for it (bench neverworse times that).
        assert a.metric("kvtier_saves_skipped_total") == 1
        # It waited for the slot as a follow-up: untokenized, as llama-server alone reads no more.
        assert a.metric("kvtier_follow_ups_total") == 1
        # The repeat was sent on before the first answer's timings were read: that is off its path.
        assert events[:3] == ["sent", "sent", "learned"], events

        # The repeat's own save stores what the slot holds: another node restores the prefix.
        await a.engine.drain(30)
        assert await a.store.flush(30)
        assert a.metric("kvtier_save_seconds_count") == 1
        there = await post(b.url + "/completion", text("What does shelf 9 hold?", 8))
        assert there.status == 200
        assert there.body["timings"]["cache_n"] >= 0.95 * shared, (there.body["timings"], shared)


async def test_a_repeat_finds_its_slot_when_every_slot_held_a_longer_conversation_before(
        redis_srv: RedisProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The common case on a busy server: all slots hold earlier conversations, longer than the
    # prompt answered now. While its save is pending the slot holds that prompt, not what it held
    # before: the repeat waits for it (bench neverworse, from its fifth repetition on, restored
    # the prompt from the tiers into another slot after waiting for the save, 0.6-1 s).
    monkeypatch.setattr(aftercare, "SAVE_DELAY_S", SAVE_DELAY_S)
    async with node(tmp_path, redis_srv.url, "a") as (_, a):
        for n in (1, 2):  # both slots: longer prompts sharing nothing with the next one
            earlier = {"prompt": f"Log {n}. " + " ".join(f"Entry {i}: value {i * n}." for i in range(120)),
                       "n_predict": 4, "temperature": 0}
            assert (await post(a.url + "/completion", earlier)).status == 200
            await a.engine.drain(30)
        body = {"prompt": "Question: what colour is the sky on a clear day?\nAnswer:", "n_predict": 8, "temperature": 0}
        first = await post(a.url + "/completion", body)
        assert first.status == 200
        again = await post(a.url + "/completion", body)
        assert again.status == 200 and again.content == first.content
        assert again.body["timings"]["prompt_n"] <= 2, again.body["timings"]
        assert a.metric("kvtier_saves_skipped_total") == 1
        assert a.metric("kvtier_restore_seconds_count") == 0


async def test_a_follow_ups_save_is_made_when_an_unrelated_request_waits_for_its_slot(
        redis_srv: RedisProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A follow-up (the same text with another end, sent to its slot without tokenizing) does not
    # know its prompt's tokens: a request of the same tenant waiting for that slot may continue it
    # or not, and its save is made (it was skipped for any waiter, and the slot recorded as empty)
    # when the end it adds costs more to recompute than the wait (``end_cheaper``; pinned here).
    monkeypatch.setattr(aftercare, "SAVE_DELAY_S", SAVE_DELAY_S)
    async with node(tmp_path, redis_srv.url, "a", ("-np", "1")) as (_, a):
        assert (await post(a.url + "/completion", text("What does shelf 7 hold?", 8))).status == 200
        await a.engine.drain(30)
        a.pin_prefill_rate(1.0)
        follow = asyncio.ensure_future(post(a.url + "/completion", text("What does shelf 8 hold?", 8)))
        await asyncio.sleep(0.2)  # it has the one slot: the next request waits for it
        unrelated = {"prompt": "Log 3. " + " ".join(f"Entry {i}: value {i * 3}." for i in range(60)),
                     "n_predict": 4, "temperature": 0}
        other = await post(a.url + "/completion", unrelated)
        assert other.status == 200 and (await follow).status == 200
        await a.engine.drain(30)
        assert a.metric("kvtier_follow_ups_total") == 1
        assert a.metric("kvtier_saves_skipped_total") == 0
        assert a.metric("kvtier_save_seconds_count") == 3
        assert a.engine.slots.tokens(0).size > 0


async def test_a_request_waiting_for_a_busy_slot_ends_the_pause_before_its_save(
        redis_srv: RedisProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every slot busy (the one slot here) and an unrelated request waiting: the save after the
    # answer is sent at once, not after the pause, and the slot goes to the request at its
    # hand-over (llama-server alone would start it right after the answer). The save is made.
    pause = 10.0
    monkeypatch.setattr(aftercare, "SAVE_DELAY_S", pause)
    async with node(tmp_path, redis_srv.url, "a", ("-np", "1")) as (_, a):
        first = asyncio.ensure_future(post(a.url + "/completion", text("What does shelf 7 hold?", 24)))
        await asyncio.sleep(0.2)  # it has the one slot: the next request waits for it
        unrelated = {"prompt": "Log 3. " + " ".join(f"Entry {i}: value {i * 3}." for i in range(60)),
                     "n_predict": 4, "temperature": 0}
        t0 = asyncio.get_running_loop().time()
        other = await post(a.url + "/completion", unrelated)
        waited = asyncio.get_running_loop().time() - t0
        assert (await first).status == 200 and other.status == 200
        assert waited < pause, waited  # after the pause it would have taken longer than the pause
        await a.engine.drain(30)
        assert a.metric("kvtier_saves_skipped_total") == 0
        assert a.metric("kvtier_save_seconds_count") == 2  # the first answer's save too


async def test_a_next_turn_within_a_longer_pause_before_a_slow_save_skips_it(
        redis_srv: RedisProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # llama-server's write of a slot stops its other slots for as long as it takes: kvtier holds
    # such a save back for half the write it expects (``aftercare.save_pause``; its share and bounds
    # are tested in tests/test_sidecar_logic.py), and a next turn of the conversation within that
    # pause skips the save and its stall. After a fast write, and before the first one for a
    # prompt as small as this (its size at the prior rate), the pause stays short: a turn 0.2 s
    # later finds the save made. The repeats, sent on as
    # follow-ups (untokenized), leave saves that a repeat of theirs could skip as well: those wait
    # the pause too (2 s here, the bound raised), and are made after it.
    monkeypatch.setattr(aftercare, "SAVE_PAUSE_MAX_S", 2.0)
    async with node(tmp_path, redis_srv.url, "a", ("-np", "1")) as (_, a):
        for start, expected_write_s, skipped in (("", None, 0), ("Shelves. ", 20.0, 1)):  # None: as written
            # A prompt with another start each time: a text that continues the slot's last one
            # would go to it as a follow-up, untokenized, and no next turn waits for that one's save.
            body = {"prompt": f"{start}{SYSTEM}\nQuestion: What does shelf 7 hold?\nAnswer:", "n_predict": 4,
                    "temperature": 0}
            if expected_write_s is not None:  # as a large slot's write: the pause at its bound
                nbytes = a.engine.files.bytes_about(a.engine.slots.held_about(0))
                a.pin_slot_write(expected_write_s / nbytes)
            assert (await post(a.url + "/completion", body)).status == 200
            await asyncio.sleep(0.2)
            again = await post(a.url + "/completion", body)
            assert again.status == 200 and again.body["timings"]["prompt_n"] <= 2, again.body["timings"]
            await a.engine.drain(30)
            assert a.metric("kvtier_saves_skipped_total") == skipped
        assert a.metric("kvtier_save_seconds_count") == 3  # all but the one skipped


async def test_a_fresh_nodes_first_save_is_held_back_at_the_prior_write_rate(
        redis_srv: RedisProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before llama-server has written a slot of 1 MiB or more here, the pause prices the write at
    # the cost model's prior rate (the slot's size per token is known from the start-up probe's
    # save): an agent's first tool call on a fresh node skips the first save as a later one would.
    # The prior lowered here stands for a large model's slot (SmolLM2's few MB at 1 GB/s keep the
    # 30 ms floor). Without a prior the pause was that floor, and a turn 0.2 s later found the save made.
    from sidecar.costmodel import CostModel
    monkeypatch.setattr(CostModel, "SLOT_WRITE_PRIOR_BPS", 1e6)
    monkeypatch.setattr(aftercare, "SAVE_PAUSE_MAX_S", 2.0)
    async with node(tmp_path, redis_srv.url, "a", ("-np", "1")) as (_, a):
        assert a.engine.cost.slot_write_s_per_byte.samples == 0  # no write learned yet
        body = text("What does shelf 7 hold?", 4)
        assert (await post(a.url + "/completion", body)).status == 200
        await asyncio.sleep(0.2)
        again = await post(a.url + "/completion", body)
        assert again.status == 200 and again.body["timings"]["prompt_n"] <= 2, again.body["timings"]
        await a.engine.drain(30)
        assert a.metric("kvtier_saves_skipped_total") == 1
        assert a.metric("kvtier_save_seconds_count") == 1  # the repeat's answer only


async def test_a_chats_next_step_at_once_skips_the_save_of_a_follow_ups_answer(
        redis_srv: RedisProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An agent over the chat API: each step is the chat so far, the last answer and one new
    # message, sent the moment that answer ends. Step 2 comes after step 1's save: a follow-up of
    # the idle slot, sent on untokenized, so the tokens its answer ran on are never known. Step 3,
    # at once, extends what step 2 asked: it waits for that slot untokenized too, and step 2's save
    # is skipped (step 3's stores all of it), as llama-server alone serves step 3 from the slot at
    # once. Before, no waiter could match a follow-up's answer: step 3 was tokenized, waited for
    # step 2's save and its write (the stall every other slot shares).
    monkeypatch.setattr(aftercare, "SAVE_DELAY_S", SAVE_DELAY_S)
    async with node(tmp_path, redis_srv.url, "a", ("-np", "1")) as (_, a):
        messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        await chat_step(a.url, messages, "What does shelf 7 hold?")
        await a.engine.drain(30)  # step 1's save made
        await chat_step(a.url, messages, "And shelf 8?")
        assert a.metric("kvtier_follow_ups_total") == 1 and a.metric("kvtier_saves_skipped_total") == 0
        third = await chat_step(a.url, messages, "And shelf 9?")  # at once: step 2's save is still pending
        assert a.metric("kvtier_follow_ups_total") == 2
        assert a.metric("kvtier_saves_skipped_total") == 1
        assert third["cache_n"] > 600 and third["prompt_n"] < 40, third  # the slot's own KV, reused
        await a.engine.drain(30)
        assert a.metric("kvtier_save_seconds_count") == 2  # steps 1 and 3
        assert a.metric("kvtier_cache_errors_total", stage="save") == 0


async def test_an_agents_steps_that_come_back_as_soon_as_before_skip_the_saves_between(
        redis_srv: RedisProc, tmp_path: Path) -> None:
    # An agent whose tool calls take 0.3 s: far longer than the 30 ms pause before a small state's
    # save, so each step used to find the last answer's save made, and at real KV sizes wait for
    # its write (llama-server stops every slot for it: 0.15-3 s for 375 MiB). The gap from an
    # answer to the follow-up that continues it tells the loop's pace: the save after that
    # follow-up's answer waits up to twice the gap (``aftercare.FOLLOW_UP_PAUSE_GAPS``), and the
    # next step, as soon as the last, skips it. Only the first answer's save and the last's are made.
    async with node(tmp_path, redis_srv.url, "a", ("-np", "1")) as (_, a):
        messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        timings: list[dict[str, Any]] = []
        for k in range(5):
            if k:
                await asyncio.sleep(0.3)  # the tool call
            timings.append(await chat_step(a.url, messages, f"And shelf {7 + k}?"))
        assert a.metric("kvtier_follow_ups_total") == 4
        assert a.metric("kvtier_saves_skipped_total") == 3, timings  # steps 2-4's, by steps 3-5
        assert all(t["prompt_n"] < 40 for t in timings[1:]), timings  # the slot's own KV, reused
        await a.engine.drain(30)
        assert a.metric("kvtier_save_seconds_count") == 2  # steps 1 and 5
        assert a.metric("kvtier_cache_errors_total", stage="save") == 0


async def test_a_step_that_came_while_the_loop_was_held_up_still_skips_the_save(
        redis_srv: RedisProc, tmp_path: Path) -> None:
    # On a busy host the sidecar's event loop can reach the end of a save's pause late, when the
    # next step's bytes are already waiting to be read: the save must not go on before that step
    # has had a moment to ask for the slot. Here the loop is held up for 0.5 s right after step 2's
    # answer (its pause: 30-200 ms) while step 3 is sent from another thread 50 ms after it.
    async with node(tmp_path, redis_srv.url, "a", ("-np", "1")) as (_, a):
        messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]

        def body(question: str) -> bytes:
            messages.append({"role": "user", "content": question})
            return json.dumps({"messages": messages, "max_tokens": 8, "temperature": 0}).encode()

        def answered(raw: bytes) -> None:
            messages.append({"role": "assistant", "content": json.loads(raw)["choices"][0]["message"]["content"]})

        def send(data: bytes, after: float) -> bytes:
            time.sleep(after)
            req = urllib.request.Request(a.url + "/v1/chat/completions", data,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                return bytes(r.read())

        answered(await asyncio.to_thread(send, body("What does shelf 7 hold?"), 0.0))
        await a.engine.drain(30)
        answered(await asyncio.to_thread(send, body("And shelf 8?"), 0.0))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            third = pool.submit(send, body("And shelf 9?"), 0.05)  # sent from its thread at once
            asyncio.get_running_loop().call_soon(time.sleep, 0.5)  # the loop held up, past the pause
            assert json.loads(await asyncio.wrap_future(third))["choices"]
        assert a.metric("kvtier_follow_ups_total") == 2
        assert a.metric("kvtier_saves_skipped_total") == 1  # step 2's, by step 3
        await a.engine.drain(30)
        assert a.metric("kvtier_save_seconds_count") == 2  # steps 1 and 3
