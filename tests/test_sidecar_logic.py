"""Pure logic of the sidecar: slot choice and fairness, the cost model, settings, metrics parsing."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from integrations.kvflow import TailRecord
from integrations.llama_server import Timings, stream_finished
from sidecar import aftercare, slotrecord
from sidecar.asked import FOLLOW_UP_MAX_CHARS, continues
from sidecar.cli_client import summarize_metrics
from sidecar.config import Settings, load_settings
from sidecar.costmodel import CostModel
from sidecar.http.relay import Relay
from sidecar.llamacache import LlamaPromptCache
from sidecar.metrics import Metrics, watch_loop_lag
from sidecar.prompts import chat_digests
from sidecar.proxy import upstream_body
from sidecar.requestplan import NO_TOKENS, RequestPlan
from sidecar.slots import Lease, SlotTable
from tiers.errors import ConfigError
from tiers.keys import common_prefix
from tiers.redis_urls import redacted_url


def arr(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


def test_common_prefix() -> None:
    assert common_prefix(arr(1, 2, 3), arr(1, 2, 4)) == 2
    assert common_prefix(arr(1, 2), arr(1, 2, 3)) == 2
    assert common_prefix(arr(), arr(1)) == 0
    assert common_prefix(arr(5), arr(1)) == 0


async def test_slot_choice_prefers_longest_prefix_then_lru() -> None:
    clock = iter(range(1000))
    table = SlotTable(3, clock=lambda: float(next(clock)))
    table.set_tokens(0, arr(1, 2, 3, 4))
    table.set_tokens(1, arr(1, 2, 9))
    lease = await table.acquire(arr(1, 2, 3, 7))
    assert (lease.slot, lease.cached_tokens) == (0, 3)
    other = await table.acquire(arr(8, 8))
    assert other.slot == 1 or other.slot == 2
    assert other.cached_tokens == 0


async def test_a_live_conversations_slot_is_not_taken_while_a_colder_one_is_free() -> None:
    now = [0.0]
    table = SlotTable(3, clock=lambda: now[0])

    async def turn(tokens: np.ndarray, at: float) -> tuple[int, int]:
        now[0] = at
        with await table.acquire(tokens) as lease:
            table.set_tokens(lease.slot, tokens)
            return lease.slot, lease.cached_tokens

    for slot, tokens in ((0, arr(5, 5)), (1, arr(1, 2, 9, 9, 9, 9)), (2, arr(7))):
        now[0] = 10.0 + slot
        with await table.acquire(tokens, want=slot):
            table.set_tokens(slot, tokens)
    # Slot 1's conversation is live: a prompt sharing two of its tokens (and overwriting four) takes
    # the coldest slot, 0, instead.
    assert await turn(arr(1, 2, 8, 8, 8, 8), 20.0) == (0, 0)
    # A prompt that reuses more of a live slot than it overwrites takes it; one that continues it, too.
    assert await turn(arr(1, 2, 8, 8, 8, 3), 21.0) == (0, 5)
    assert await turn(arr(7, 7), 22.0) == (2, 1)
    # Once no longer live, the longest prefix wins again, whatever it overwrites: slot 0 (1, 2, 8, ...)
    # is not the coldest, slot 1 is.
    assert await turn(arr(1, 2, 8, 4), 21.0 + slotrecord.LIVE_S + 1) == (0, 3)


def test_a_restore_decision_prices_the_queue_wait_and_prefill_rate_of_its_level() -> None:
    now = [100.0]
    cost = CostModel(prefill_tps=1000.0, restore_gbps=1.0, clock=lambda: now[0])
    cost.observe_prefill(1000, 1000.0, sharing=0)  # 1,000 tokens/s alone
    cost.observe_prefill(1000, 10000.0, sharing=2)  # 100 beside two others
    nbytes = {"ram": 100 << 20}
    assert cost.decide(1000, nbytes, 0).restore and cost.queue_wait(0) == 0.0
    # Nothing learned beside computing slots yet: no wait, the nearest measured rate below.
    assert cost.decide(1000, nbytes, 1).predicted_recompute_s == pytest.approx(1.0)
    cost.observe_queue_wait(1, 5.0)  # a restore sent beside one computing slot waited 5 s
    busy = cost.decide(1000, nbytes, 1)
    assert not busy.restore and busy.predicted_restore_s > 5.0, busy
    # Beside two: the wait of the nearest level below measured, and that level's prefill, so
    # slow that waiting 5 s to restore beats it.
    two = cost.decide(1000, nbytes, 2)
    assert two.predicted_recompute_s == pytest.approx(10.0) and cost.queue_wait(2) == 5.0
    assert two.restore, two
    # Unknown level (forwarding, waits for saves): the rate over all prompts, no wait.
    assert cost.decide(1000, nbytes).predicted_restore_s < 1.0
    # The wait fades while no restore measures it again (none is tried while it is priced in).
    now[0] += CostModel.QUEUE_WAIT_HALF_LIFE_S
    assert cost.queue_wait(1) == pytest.approx(2.5)
    now[0] += 4 * CostModel.QUEUE_WAIT_HALF_LIFE_S
    assert cost.decide(1000, nbytes, 1).restore
    cost.observe_queue_wait(1, 0.0)  # a new sample blends with the faded value
    assert cost.queue_wait(1) == pytest.approx(0.7 * 5.0 / 32, rel=0.01)


async def test_tenants_never_count_each_others_tokens() -> None:
    table = SlotTable(1)
    table.set_tokens(0, arr(1, 2, 3), owner="a")
    lease = await table.acquire(arr(1, 2, 3, 4), owner="b")
    assert lease.cached_tokens == 0 and lease.foreign
    lease.release()
    table.set_tokens(0, arr(1, 2, 3), owner="b")
    lease = await table.acquire(arr(1, 2, 3, 4), owner="b")
    assert lease.cached_tokens == 3 and not lease.foreign


async def test_a_slot_being_saved_is_hot_with_the_prompt_it_just_answered() -> None:
    table = SlotTable(2)
    table.set_tokens(0, np.arange(100, dtype=np.int32), owner="t")
    answering = await table.acquire(np.arange(300, dtype=np.int32), owner="t")
    saving = table.slots[answering.slot]
    assert saving.id == 0
    saving.saving = True  # its answer ended; its save has not read the slot yet
    saving.answered = (np.arange(300, dtype=np.int32), "t")
    held, owner = saving.hot()
    assert held.size == 300 and owner == "t"  # what the fleet view publishes, and slot choice sees
    # The next turn of that conversation waits for its own slot rather than take the idle one.
    waiting = asyncio.ensure_future(table.acquire(np.arange(320, dtype=np.int32), owner="t"))
    other = await table.acquire(np.arange(320, dtype=np.int32), owner="u")  # another tenant: the idle slot
    assert other.slot == 1 and other.cached_tokens == 0 and not waiting.done()
    saving.saving, saving.answered = False, None
    table.set_tokens(0, np.arange(316, dtype=np.int32), owner="t")  # what the save read
    answering.release()
    lease = await asyncio.wait_for(waiting, 1)
    assert (lease.slot, lease.cached_tokens) == (0, 316)
    assert saving.hot()[0].size == 316  # once saved: what the slot table knows


async def test_a_slot_saving_a_shorter_prompt_than_it_held_before_is_hot_with_that_prompt() -> None:
    # Every slot held a longer conversation before; the answer that just ended ran on a shorter,
    # unrelated prompt, which replaced the slot's tokens past their common prefix (none here).
    table = SlotTable(2)
    for slot in (0, 1):
        table.set_tokens(slot, np.arange(1000 * (slot + 1), 1000 * (slot + 1) + 900, dtype=np.int32), owner="t")
    prompt = np.arange(5000, 5300, dtype=np.int32)
    answering = await table.acquire(prompt, owner="t")
    assert table.held_about(answering.slot) == 900
    table.begin_save(answering.slot, (prompt, "t"))
    assert table.slots[answering.slot].hot()[0] is prompt  # not the 900 tokens it held before
    assert table.held_about(answering.slot) == 300  # what its save will write is about this prompt's size
    # The same prompt again, at once: it waits for that slot rather than take the idle one.
    again = asyncio.ensure_future(table.acquire(prompt, owner="t"))
    await asyncio.sleep(0)
    assert not again.done() and table.awaited(answering.slot)
    table.skip_save(answering.slot, ())
    table.end_save(answering)
    lease = await asyncio.wait_for(again, 1)
    assert (lease.slot, lease.cached_tokens) == (answering.slot, 300)


async def test_a_waiter_keeps_the_answered_prompt_up_to_where_its_own_prompt_differs() -> None:
    # What a request waiting for a saving slot keeps of the prompt it answered: their common
    # prefix, for the same tenant, when it may take that slot. A skipped save loses the rest.
    table = SlotTable(1)
    prompt = np.arange(5000, 5300, dtype=np.int32)
    answering = await table.acquire(prompt, owner="t")
    table.begin_save(answering.slot, (prompt, "t"))
    assert table.kept_by_waiter(answering.slot) == 0  # no one waits
    sibling = np.concatenate([prompt[:280], np.arange(9000, 9012, dtype=np.int32)])  # another last question
    other_tenant = asyncio.ensure_future(table.acquire(prompt, owner="u"))
    await asyncio.sleep(0)
    assert table.kept_by_waiter(answering.slot) == 0  # another tenant's tokens keep nothing
    waiting = asyncio.ensure_future(table.acquire(sibling, owner="t"))
    await asyncio.sleep(0)
    assert table.kept_by_waiter(answering.slot) == 280
    assert not table.awaited(answering.slot)  # it does not hold all the answered prompt
    again = asyncio.ensure_future(table.acquire(prompt, owner="t"))
    await asyncio.sleep(0)
    assert table.kept_by_waiter(answering.slot) == 300 and table.awaited(answering.slot)
    again.cancel()
    waiting.cancel()
    await asyncio.sleep(0)
    assert table.kept_by_waiter(answering.slot) == 0  # those that left keep nothing
    other_tenant.cancel()


class _Priced:
    """The two figures ``end_cheaper`` weighs (pure logic): a slot's write, a recompute's time."""

    def __init__(self, write_s: float, tokens_per_s: float):
        self.write_s, self.tokens_per_s = write_s, tokens_per_s

    def expected_write(self, tokens: int) -> float:
        return self.write_s

    def recompute_s(self, tokens: int, sharing: int | None = None) -> float:
        return tokens / self.tokens_per_s


async def test_any_waiting_request_skips_a_save_whose_end_no_tier_holds_costs_less_than_the_wait() -> None:
    # A conversation's second turn answered on the only slot, its first turn saved (the tiers hold
    # it); another tenant's new conversation waits for the slot. The end only this save would
    # store is the new question and the answer: 38 tokens, priced at 38 ms against a 200 ms write.
    table = SlotTable(1)
    first = np.arange(1000, 3008, dtype=np.int32)
    lease = await table.acquire(first[:2000], owner="t")
    table.begin_save(lease.slot, (first[:2000], "t"))
    table.record_saved(lease.slot, first, "t", grant=table.slots[lease.slot].leases)
    table.end_save(lease)
    assert table.slots[lease.slot].stored == 2008
    # Another tenant's prompt with the same tokens: the tiers hold them under the first tenant's
    # namespace only.
    assert (table.stored_of(lease.slot, first, "t"), table.stored_of(lease.slot, first, "u")) == (2008, 0)
    second = np.concatenate([first, np.arange(7000, 7030, dtype=np.int32)])
    lease = await table.acquire(second, owner="t")
    assert lease.cached_tokens == 2008
    table.begin_save(lease.slot, (second, "t"))
    body = json.dumps({"content": "x", "timings": {"prompt_n": 30, "cache_n": 2008, "predicted_n": 8}}).encode()

    def answer() -> Timings | None:
        return Timings.from_answer(body)
    plan = aftercare_plan(lease)
    priced = _Priced(write_s=0.2, tokens_per_s=1000.0)
    assert not aftercare.end_cheaper(plan, answer, priced, priced)  # type: ignore[arg-type]  # no one waits
    other = asyncio.ensure_future(table.acquire(np.arange(50_000, 50_500, dtype=np.int32), owner="u"))
    await asyncio.sleep(0)
    assert aftercare.end_cheaper(plan, answer, priced, priced)  # type: ignore[arg-type]
    # Priced dearer than the wait, it is let go all the same where llama-server's own prompt cache
    # copies the slot before the waiting request (it keeps none of it) and the tiers hold the rest;
    # not for another tenant's request, which has the slot erased (no copy).
    dear = _Priced(write_s=0.2, tokens_per_s=10.0)
    assert not aftercare.end_cheaper(plan, answer, dear, dear)  # type: ignore[arg-type]
    assert not aftercare.end_cheaper(plan, answer, dear, dear, LlamaPromptCache(8192, 1000))  # type: ignore[arg-type]
    same = asyncio.ensure_future(table.acquire(np.arange(60_000, 60_500, dtype=np.int32), owner="t"))
    other.cancel()
    await asyncio.sleep(0)
    assert aftercare.end_cheaper(plan, answer, dear, dear, LlamaPromptCache(8192, 1000))  # type: ignore[arg-type]
    assert not aftercare.end_cheaper(plan, answer, dear, dear, LlamaPromptCache(0, 1000))  # type: ignore[arg-type]
    table.skip_save(lease.slot, ())
    assert table.slots[lease.slot].stored == 2008  # the slot holds the second prompt; the tiers, the first
    table.end_save(lease)
    (await same).release()
    # The same for a first turn (the tiers hold none of it): its 2,046 tokens cost 2 s to recompute.
    fresh = SlotTable(1)
    lease = await fresh.acquire(second, owner="t")
    fresh.begin_save(lease.slot, (second, "t"))
    waiting = asyncio.ensure_future(fresh.acquire(np.arange(50_000, 50_500, dtype=np.int32), owner="u"))
    await asyncio.sleep(0)
    assert not aftercare.end_cheaper(aftercare_plan(lease), answer, priced, priced)  # type: ignore[arg-type]
    # ...llama-server's cache or not: the other nodes have only this save to restore it from.
    assert not aftercare.end_cheaper(aftercare_plan(lease), answer, priced, priced,  # type: ignore[arg-type]
                                     LlamaPromptCache(8192, 1000))
    waiting.cancel()


def aftercare_plan(lease: Lease) -> RequestPlan:
    return RequestPlan(NO_TOKENS, lease, None, "t")  # type: ignore[arg-type]  # no namespace: not stored


async def test_a_repeat_waits_untokenized_for_the_slot_whose_save_has_not_read_it() -> None:
    table = SlotTable(2)
    prompt = np.arange(5000, 5300, dtype=np.int32)
    asked = "The records. " + "Shelf 7 holds the ledgers. " * 40 + "\nQuestion: what does shelf 7 hold?\nAnswer:"
    answering = await table.acquire(prompt, owner="t")
    table.begin_save(answering.slot, (prompt, "t"), asked)
    assert table.pending_follow_up(asked, owner="t") == answering.slot
    assert table.pending_follow_up(asked, owner="other") is None  # another tenant's answer
    assert table.pending_follow_up("Another record. " * 60, owner="t") is None
    # A continuation (another end): tokenized first, since only its tokens tell whether it holds
    # all the answered prompt (the save is skipped for it only then).
    assert table.pending_follow_up(asked[:-40] + " What does shelf 9 hold?\nAnswer:", owner="t") is None
    assert table.follow_up(asked, owner="t") is None  # the slot is busy: only a waiter gets it
    again = asyncio.ensure_future(table.await_follow_up(asked, owner="t"))
    await asyncio.sleep(0)
    assert not again.done() and table.awaited(answering.slot)  # the save is skipped for it
    table.skip_save(answering.slot, asked)
    table.end_save(answering)
    lease = await asyncio.wait_for(again, 1)
    assert lease is not None and (lease.slot, lease.cached_tokens) == (answering.slot, 0)
    lease.release()

    async def repeat_waiting(slot: int) -> tuple[Lease, asyncio.Future[Lease | None]]:
        """An answer on ``slot`` ends, its save begins, and the same request waits for the slot."""
        answering = await table.acquire(prompt, owner="t", want=slot)
        table.begin_save(answering.slot, (prompt, "t"), asked)
        again = asyncio.ensure_future(table.await_follow_up(asked, owner="t"))
        await asyncio.sleep(0)
        return answering, again

    # Handed over while its save waits in llama-server's queue: the follow-up goes there all the same.
    answering, again = await repeat_waiting(lease.slot)
    table.hand_over(answering)
    lease = await asyncio.wait_for(again, 1)
    assert lease is not None and lease.slot == answering.slot
    lease.release()
    # A save that failed before it read the slot (what was asked is forgotten): the full path instead.
    answering, again = await repeat_waiting(lease.slot)
    table.save_failed(answering)
    table.end_save(answering)
    assert await asyncio.wait_for(again, 1) is None
    assert not table.slots[answering.slot].busy  # given back, for the full path to take
    # An answer whose request failed records nothing to follow (what it asked is not given).
    failed = await table.acquire(prompt, owner="t")
    table.begin_save(failed.slot, None)
    assert table.pending_follow_up(asked, owner="t") is None


async def test_a_chats_next_turn_waits_untokenized_for_the_slot_whose_save_has_not_read_it() -> None:
    """An agent's next step, sent the moment the last answer ended: the chat so far, that answer
    and one new message. It waits for the slot as a follow-up, and the save it makes needless is
    skipped (``awaited``), also when the answer it extends was a follow-up's (tokens never known)."""
    table = SlotTable(2)
    table.set_tokens(0, np.arange(5000, 5300, dtype=np.int32), owner="t")

    def msgs(*texts: str) -> tuple[int, ...]:
        return tuple(hash(t) for t in texts)

    answered = msgs("sys", "q1", "a1", "q2")  # a follow-up's: sent on untokenized
    answering = await table.acquire(np.arange(5000, 5300, dtype=np.int32), owner="t", want=0)
    table.begin_save(0, None, answered)
    nxt = msgs("sys", "q1", "a1", "q2", "a2", "q3")
    assert table.pending_follow_up(nxt, owner="t") == 0
    assert table.pending_follow_up(nxt, owner="other") is None  # another tenant's answer
    assert table.pending_follow_up(msgs("sys", "q1", "a1", "q9"), owner="t") is None  # another last question
    assert table.pending_follow_up(msgs("sys", "q1", "a1", "q2", "a2", "q3", "a3", "q4"), owner="t") is None
    assert not table.awaited(0)
    waiting = asyncio.ensure_future(table.await_follow_up(nxt, owner="t"))
    await asyncio.sleep(0)
    assert not waiting.done() and table.awaited(0) and table.wanted(0)
    table.skip_save(0, answered)
    table.end_save(answering)
    lease = await asyncio.wait_for(waiting, 1)
    assert lease is not None and (lease.slot, lease.cached_tokens) == (0, 0)
    assert table.slots[0].followers == [] and table.slots[0].tokens.size == 300  # what the table knew stays
    lease.release()
    # A client that leaves while it waits: no longer awaited, so the save is made.
    again = await table.acquire(np.arange(5000, 5300, dtype=np.int32), owner="t", want=0)
    table.begin_save(0, None, answered)
    left = asyncio.ensure_future(table.await_follow_up(nxt, owner="t"))
    await asyncio.sleep(0)
    assert not left.done() and table.awaited(0)
    left.cancel()
    await asyncio.sleep(0)
    assert not table.awaited(0) and table.slots[0].followers == []
    table.end_save(again)
    # Two waiting at once: the one that extends the answer, and one that extends only the answer
    # before it. When the first has the slot and answered, the save of its answer is skipped for
    # a waiter that extends or repeats what it asked, not for the other.
    again = await table.acquire(np.arange(5000, 5300, dtype=np.int32), owner="t", want=0)
    table.begin_save(0, None, answered)
    first = asyncio.ensure_future(table.await_follow_up(nxt, owner="t"))
    other = asyncio.ensure_future(table.await_follow_up(msgs("sys", "q1", "a1", "q2", "b2", "r3"), owner="t"))
    await asyncio.sleep(0)
    table.skip_save(0, answered)
    table.end_save(again)
    lease = await asyncio.wait_for(first, 1)
    assert lease is not None and not other.done()
    table.begin_save(0, None, nxt)  # the first one's answer
    assert not table.awaited(0)  # the other extends the answer before it, not this one
    table.record_saved(0, np.arange(5000, 5400, dtype=np.int32), "t")
    table.record_asked(0, nxt)
    table.end_save(lease)
    assert await asyncio.wait_for(other, 1) is None  # the full path instead


async def test_a_failed_save_leaves_the_slot_holding_the_prompt_its_answer_ran_on() -> None:
    table = SlotTable(1)
    table.set_tokens(0, np.arange(1000, 1900, dtype=np.int32), owner="a")  # another tenant's, longer
    prompt = np.arange(5000, 5300, dtype=np.int32)
    lease = await table.acquire(prompt, owner="b")
    table.begin_save(0, (prompt, "b"))
    table.save_failed(lease)  # before the save read the slot (a full slot dir)
    table.end_save(lease)
    assert table.slots[0].tokens.tolist() == prompt.tolist() and table.slots[0].owner == "b"
    # Tenant a's old conversation is not counted as held (nor is b's prompt, for a).
    assert (await table.acquire(np.arange(1000, 1900, dtype=np.int32), owner="a")).cached_tokens == 0
    # A follow-up's prompt is not known (never tokenized): what the table knew stays, the
    # conversation it continued, and no request waiting for the slot is taken for its continuation.
    other = SlotTable(1)
    other.set_tokens(0, prompt, owner="b")
    follow_up = await other.acquire(prompt, owner="b")
    other.begin_save(0, None)
    unrelated = asyncio.ensure_future(other.acquire(np.arange(7000, 7100, dtype=np.int32), owner="b"))
    await asyncio.sleep(0)
    assert not unrelated.done() and not other.awaited(0)
    other.save_failed(follow_up)
    other.end_save(follow_up)
    assert other.slots[0].tokens.tolist() == prompt.tolist() and other.slots[0].owner == "b"
    (await asyncio.wait_for(unrelated, 1)).release()


def test_a_restore_keeps_the_recorded_tail_only_while_it_holds_all_that_tail_covers() -> None:
    """The next save of a slot deletes the tail recorded for it once superseded: a restore of
    another context that brings no tail must not leave the one before recorded as its own."""
    table = SlotTable(1)
    first = np.arange(1000, 1300, dtype=np.int32)
    table.set_tokens(0, first, owner="a")
    table.slots[0].tail = TailRecord(b"tail-of-first", 300)
    table.record_restore(0, np.concatenate([first, np.arange(5, 105, dtype=np.int32)]), owner="a", tail=None)
    assert table.slots[0].tail == TailRecord(b"tail-of-first", 300)  # the same context, continued
    table.record_restore(0, np.arange(7000, 7400, dtype=np.int32), owner="a", tail=None)
    assert table.slots[0].tail is None  # another context: the first's tail is not its own
    table.record_restore(0, first[:256], owner="a", tail=TailRecord(b"restored", 256))
    assert table.slots[0].tail == TailRecord(b"restored", 256)
    table.record_restore(0, first[:200], owner="a", tail=None)
    assert table.slots[0].tail is None  # fewer tokens than that tail ends at


async def test_more_requests_than_slots_queue_fairly_and_never_share() -> None:
    table = SlotTable(2)
    in_use: set[int] = set()
    order: list[int] = []

    async def request(i: int) -> None:
        lease = await table.acquire(arr(i))
        assert lease.slot not in in_use, "two requests on one slot"
        in_use.add(lease.slot)
        order.append(i)
        await asyncio.sleep(0.01)
        in_use.discard(lease.slot)
        lease.release()

    tasks = []
    for i in range(10):
        tasks.append(asyncio.create_task(request(i)))
        await asyncio.sleep(0)  # arrival order
    await asyncio.gather(*tasks)
    assert order == list(range(10))
    assert table.queue_depth == 0 and not any(s.busy for s in table.slots)


async def test_waiting_for_a_specific_slot_times_out_and_cancels_cleanly() -> None:
    table = SlotTable(2)
    held = await table.acquire(arr(1), want=0)
    with pytest.raises(TimeoutError):
        await table.acquire(arr(1), want=0, timeout=0.05)
    assert table.queue_depth == 0
    free = await table.acquire(arr(2), timeout=0.05)  # the other slot is not blocked by the waiter
    assert free.slot == 1
    held.release()
    with pytest.raises(ValueError):
        await table.acquire(arr(1), want=5)


def test_a_request_continues_a_held_one_by_its_end_only() -> None:
    def msgs(*texts: str) -> tuple[int, ...]:
        roles = ["system", "user", "assistant", "user", "assistant", "user"]
        return chat_digests([{"role": roles[i], "content": t} for i, t in enumerate(texts)])

    held = msgs("sys", "q1")
    assert continues(held, msgs("sys", "q1"))  # asked again (regenerated)
    assert continues(held, msgs("sys", "q2"))  # another last question on the same history
    assert continues(held, msgs("sys", "q1", "a1", "q2"))  # the next turn: the answer and a new message
    assert not continues(held, msgs("sys2", "q1"))  # another history
    assert not continues(held, msgs("sys", "q2", "a1", "q3"))  # not the held last message
    assert not continues(held, msgs("sys", "q1", "a1", "q2", "a2", "q3"))  # turns served elsewhere since
    assert not continues(held, msgs("sys"))
    assert not continues(msgs("q1"), msgs("q2"))  # nothing shared but the role
    assert continues(msgs("q1"), msgs("q1", "a1", "q2"))
    assert not continues((), msgs("q1")) and not continues((), ())
    # A digest covers role and content alike.
    assert chat_digests([{"role": "user", "content": "x"}]) != chat_digests([{"role": "system", "content": "x"}])
    # Text prompts: all but a short end of the new prompt must start the held one.
    doc = "Document. " * 100
    assert continues(doc + "Question 1?", doc + "Question 2, a longer one?")
    assert continues(doc + "Q1?", doc + "Q1?") and continues(doc, doc + "x" * FOLLOW_UP_MAX_CHARS)
    assert not continues(doc, doc + "x" * (FOLLOW_UP_MAX_CHARS + 1))  # too much new text
    assert not continues("x" + doc, doc + "Q?") and not continues(doc[:400], doc)
    assert not continues("Q1?", "Q2?")  # short prompts take the full path
    assert not continues(doc, held) and not continues(held, doc)  # a text never continues a chat


async def test_follow_up_takes_only_an_idle_slot_of_the_same_tenant_holding_the_chat() -> None:
    table = SlotTable(2)
    chat = (1, 2)
    assert table.follow_up(chat) is None  # no slot holds a chat
    table.set_tokens(1, arr(5, 6, 7), owner="t")
    table.slots[1].asked = chat
    assert table.follow_up((1, 3)) is None  # another tenant (the default, "") must not use it
    assert table.follow_up((1, 3), owner="t", want=0) is None  # not the slot asked for
    lease = table.follow_up((1, 3), owner="t")
    assert lease is not None and lease.slot == 1 and table.slots[1].busy
    assert table.follow_up((1, 3), owner="t") is None  # busy
    lease.release()
    # Waiting requests keep their turn: no follow-up jumps the queue.
    held = await table.acquire(arr(9), want=1)
    waiter = asyncio.create_task(table.acquire(arr(9), want=1))
    await asyncio.sleep(0)
    assert table.queue_depth == 1
    table.slots[1].busy = False  # idle for a moment, its waiter not woken yet
    assert table.follow_up((1, 3), owner="t") is None
    table.slots[1].busy = True
    held.release()
    (await waiter).release()
    # New tokens (a restore, a save, a failure) make the slot forget its chat.
    table.set_tokens(1, arr(5, 6, 7, 8), owner="t")
    assert table.slots[1].asked == () and table.follow_up((1, 3), owner="t") is None


def test_cost_model_restores_only_when_faster() -> None:
    cpu = CostModel(prefill_tps=200, restore_gbps=1.0)
    assert cpu.decide(4096, {"redis": 4096 * 23040}).restore  # 20 s of prefill vs ~0.2 s
    fast = CostModel(prefill_tps=2000, restore_gbps=1.0)
    assert not fast.decide(16, {"redis": 16 * 23040}).restore  # fixed costs dominate a short prefix
    gpu = CostModel(prefill_tps=20000, restore_gbps=0.1)
    assert not gpu.decide(4096, {"redis": 4096 * 131072}).restore  # fast prefill, slow network
    learned = CostModel(prefill_tps=200, restore_gbps=1.0)
    for _ in range(5):
        learned.observe_prefill(4000, 200)  # 20k tokens/s measured
    assert not learned.decide(1024, {"redis": 1024 * 131072}).restore
    assert not cpu.decide(0, {}).restore
    floor = CostModel(min_tokens=512)
    assert not floor.decide(256, {"memory": 256}).restore


@pytest.mark.parametrize("fetch_gbps, restore_gbps, bytes_per_token", [
    (10.0, 3.0, 131072),  # 8B KV fetched at 10 GB/s (a RAM tier's speed), llama-server's load at 3 GB/s
    (2.0, 3.0, 32768),  # a q8_0 8B over ~25 GbE
    (1.25, 3.0, 131072),  # 8B f16 over 10 GbE: never faster than a 10,000 tokens/s prefill
])
def test_a_gpu_class_prefill_rate_restores_exactly_past_the_crossover(
        fetch_gbps: float, restore_gbps: float, bytes_per_token: int) -> None:
    """With ``--prefill-tps-prior 10000`` and measured data-path rates, a prefix is restored exactly
    when its restore, fixed costs included, beats ``margin`` times its recompute."""
    cost = CostModel(prefill_tps=10_000, restore_gbps=0.5, margin=0.8)
    cost.observe_fetch("redis", 1 << 30, (1 << 30) / (fetch_gbps * 1e9))
    cost.observe_restore(1 << 30, (1 << 30) / (restore_gbps * 1e9))
    per_token_restore = bytes_per_token / (fetch_gbps * 1e9) + bytes_per_token / (restore_gbps * 1e9)
    per_token_saved = cost.margin / 10_000 - per_token_restore
    # restore_s = t0 + n * per_token_restore < margin * n / rate  <=>  n > t0 / per_token_saved
    crossover = CostModel.FIXED_OVERHEAD_S / per_token_saved if per_token_saved > 0 else None
    for n in [1, 16, 64, 128, 256, 384, 512, 1024, 4096, 8192, 32768]:
        decision = cost.decide(n, {"redis": n * bytes_per_token})
        assert decision.predicted_recompute_s == pytest.approx(n / 10_000)
        assert decision.restore == (crossover is not None and n > crossover), (n, crossover, decision)
    if crossover is not None:  # one token either side of it decides the other way
        at = int(crossover)
        assert not cost.decide(at, {"redis": at * bytes_per_token}).restore
        assert cost.decide(at + 1, {"redis": (at + 1) * bytes_per_token}).restore


def test_a_recompute_is_priced_at_the_rate_of_prompts_about_as_long() -> None:
    """A GPU node's short follow-ups (fixed costs per batch: 40 tokens in 15 ms) and long prompts
    (4,000 in 0.25 s) teach different rates. A 4,000-token recompute is priced at the long prompts'
    rate, so an 8B prefix over 10 GbE (0.6 s to restore) is recomputed, as llama-server alone would;
    the rate over all prompts, mostly follow-ups, would have priced it at 1.5 s and restored it."""
    cost = CostModel(prefill_tps=300, restore_gbps=0.5, margin=0.8)
    cost.observe_fetch("redis", 1 << 30, (1 << 30) / 1.25e9)
    cost.observe_restore(1 << 30, (1 << 30) / 3e9)
    for step in range(40):  # an agent: a long prompt, then nine follow-ups, four times
        if step % 10 == 0:
            cost.observe_prefill(4000, 250.0)
        else:
            cost.observe_prefill(40, 15.0)
    nbytes = {"redis": 4000 * 131072}
    decision = cost.decide(4000, nbytes)
    assert decision.predicted_recompute_s == pytest.approx(0.25)
    assert not decision.restore and decision.predicted_restore_s == pytest.approx(0.604, abs=0.01), decision
    assert 4000 / cost.prefill_rate(None) * cost.margin > decision.predicted_restore_s  # what one rate would do
    assert cost.recompute_s(40) == pytest.approx(0.015)  # a follow-up at the follow-ups' rate
    # Lengths not measured take the nearest measured (the longer of two as near): 300 tokens, the
    # follow-ups'; 1,000, the long prompts'.
    assert cost.prefill_rate(None, 300) == pytest.approx(40 / 0.015)
    assert cost.prefill_rate(None, 1000) == pytest.approx(16_000)
    # By level as before: beside one computing slot, nothing measured there, the level below.
    assert cost.recompute_s(4000, sharing=1) == pytest.approx(0.25)
    # No lookup is spared that a decision on a smaller gain would have restored.
    for gain in (40, 300, 1000, 4000):
        if not cost.could_restore(gain, 4000, 131072):
            assert not any(cost.decide(g, {"redis": (4000 - gain + g) * 131072}).restore for g in range(1, gain + 1))


def test_a_lookup_is_spared_when_no_prefix_could_be_restored() -> None:
    cpu = CostModel(prefill_tps=200, restore_gbps=1.0)
    # The slot holds 2,048 of 2,060 tokens: restoring all 2,060 never beats computing 12.
    assert not cpu.could_restore(12, 2060, 23040)
    assert cpu.could_restore(2059, 2060, 23040)  # an empty slot: a stored prefix may well pay
    assert not cpu.could_restore(0, 2060, 23040)
    # Whenever could_restore is False, no prefix up to that length would be decided a restore.
    for gain, n in [(12, 2060), (300, 4096), (40, 512), (1000, 1200)]:
        if not cpu.could_restore(gain, n, 131072):
            assert not any(cpu.decide(g, {"memory": (n - gain + g) * 131072}).restore for g in range(1, gain + 1))
    assert not CostModel(min_tokens=512).could_restore(300, 4096, 23040)


def test_the_prefill_rate_is_learned_by_how_many_slots_compute_beside_it() -> None:
    model = CostModel(prefill_tps=300)
    assert model.prefill_rate(2) == 300  # nothing measured: the prior, at every level
    model.observe_prefill(300, 1000, sharing=0)  # 300 tokens/s alone
    model.observe_prefill(300, 3000, sharing=2)  # 100 tokens/s beside two others
    assert model.prefill_rate(0) == 300 and model.prefill_rate(2) == 100
    assert model.prefill_rate(1) == 300  # not measured at 1: the nearest level below
    assert model.prefill_rate(9) == 100  # 3 or more: the highest measured below
    assert model.prefill_tps.value == 300 * 0.7 + 100 * 0.3  # the rate over all prompts (the planner's)
    model.observe_prefill(8, 1000, sharing=1)  # too short to teach anything
    assert model.prefill_rate(1) == 300


def test_a_save_is_held_back_by_half_of_llama_servers_expected_write_within_bounds() -> None:
    cost = CostModel()
    prior = (512 << 20) / CostModel.SLOT_WRITE_PRIOR_BPS
    assert cost.expected_slot_write(512 << 20) == pytest.approx(prior)  # nothing learned yet: the prior
    cost.observe_slot_write(512 << 10, 5.0)  # under 1 MiB: its fixed costs would teach a wrong rate
    assert cost.expected_slot_write(512 << 20) == pytest.approx(prior)
    cost.observe_slot_write(512 << 20, 0.4)  # 512 MiB in 0.4 s (an 8B model's 4,000-token slot)
    assert cost.expected_slot_write(1 << 30) == pytest.approx(0.8)
    assert aftercare.save_pause(None) == aftercare.SAVE_DELAY_S  # not known: the short pause
    assert aftercare.save_pause(0.01) == aftercare.SAVE_DELAY_S  # a fast write: never under it
    assert aftercare.save_pause(0.4) == pytest.approx(0.2)  # half the stall the save would cause
    assert aftercare.save_pause(5.0) == aftercare.SAVE_PAUSE_MAX_S  # a long one: bounded


def test_a_save_after_a_loops_step_waits_twice_the_steps_gap_within_bounds() -> None:
    # A follow-up's answer that came 0.3 s after the answer it continued: its next step, as soon,
    # finds the save still held back (and skips it).
    assert aftercare.save_pause(None, 0.3) == pytest.approx(0.6)
    assert aftercare.save_pause(0.4, 0.05) == pytest.approx(0.2)  # the write's pause is longer
    assert aftercare.save_pause(None, 0.001) == aftercare.SAVE_DELAY_S  # never under it
    assert aftercare.save_pause(None, 1.5) == aftercare.FOLLOW_UP_PAUSE_MAX_S  # bounded
    # A step that came later than the bound: a pause could not reach the next one; the usual pause.
    assert aftercare.save_pause(0.4, 2.5) == pytest.approx(0.2)


def test_settings_precedence_and_redaction(tmp_path: Path) -> None:
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text("cache-size: 1G\nchunk_tokens: 128\nredis_url: redis://u:hunter2@r:6379/0\n")
    s = load_settings(["--config", str(cfg), "--slot-dir", str(tmp_path), "--chunk-tokens", "64"],
                      env={"KVTIER_CACHE_SIZE": "3G", "KVTIER_CHUNK_TOKENS": "32"})
    assert s.cache_size == 3 << 30  # env beats file
    assert s.chunk_tokens == 64  # flag beats env
    assert "hunter2" not in str(s.redacted()) and "hunter2" not in repr(s)
    assert redacted_url("rediss://user:pw@host:1/0") == "rediss://user:***@host:1/0"
    secret = tmp_path / "token"
    secret.write_text("abc\n")
    s2 = load_settings(["--slot-dir", str(tmp_path), "--auth-token-file", str(secret), "--auth-all"], env={})
    assert s2.auth_token == "abc" and s2.auth_all
    with pytest.raises(ConfigError):
        load_settings(["--slot-dir", str(tmp_path), "--max-body", "10"], env={})
    with pytest.raises(ConfigError):
        load_settings([], env={})  # slot_dir is required
    with pytest.raises(ConfigError):
        load_settings(["--slot-dir", str(tmp_path), "--node-id", "bad id!"], env={})
    for flag, bad in (("--local-tokenizer", "yes"), ("--local-tokenizer", ""), ("--keep-restore-files", "-1"),
                      ("--keep-restore-files", "lots"), ("--keep-restore-files", "9" * 30),
                      ("--stream-window", "0"), ("--stream-window", "-1M"), ("--queue-limit", "0")):
        with pytest.raises(ConfigError):
            load_settings(["--slot-dir", str(tmp_path), flag, bad], env={})
    assert load_settings(["--slot-dir", str(tmp_path), "--keep-restore-files", "0"], env={}).keep_restore_files == 0
    # Given only what is required, `kvtier serve` runs on the defaults Settings declares; the node
    # is named after the host unless told otherwise.
    assert load_settings(["--slot-dir", str(tmp_path), "--node-id", "n"], env={}) == Settings(
        slot_dir=str(tmp_path), node_id="n")
    assert load_settings(["--slot-dir", str(tmp_path)], env={}).node_id == socket.gethostname()


def test_timings_are_found_in_json_and_sse_tails() -> None:
    assert Timings.from_answer(b'{"content": "x", "timings": {"prompt_n": 5, "prompt_ms": 2.0}}').prompt_n == 5
    sse = b'data: {"content": "a"}\n\ndata: {"stop": true, "timings": {"prompt_n": 7}}\n\ndata: [DONE]\n\n'
    assert Timings.from_answer(sse).prompt_n == 7
    assert Timings.from_answer(b"not json") is None
    assert Timings.from_answer(b'data: {"timings": "bad"}\n\n') is None


@pytest.mark.parametrize("raw", [
    b'{"prompt": [1, 2, 3], "n_predict": 4}',
    b'  {"prompt":"caf\\u00e9 \xc3\xa9","stream":true}\n',  # escapes, UTF-8, whitespace around
    b'{"prompt": "x", "id_slot": 3, "cache_prompt": false}',  # the client's keys are overridden
    b'{"prompt": "x", "cache_salt": "tenant-a"}',  # the salt stays with kvtier
    b'\xef\xbb\xbf{"prompt": "x"}',  # a BOM: re-encoded
    b'{"prompt": [5, 6], "cache_prompt": true}',  # only the slot appended
    b'{"prompt": "x", "cache_prompt": false, "cache_prompt": true}',  # a key twice: re-encoded once
    b'{"prompt": "x", "cache\\u005fprompt": true}',  # an escaped key: re-encoded
    b'{"prompt": "x", "seed": 123456789012345678901234567890}',  # beyond orjson's integers
])
def test_upstream_body_pins_the_slot_and_keeps_the_rest(raw: bytes) -> None:
    body = json.loads(raw)
    out = upstream_body(raw, body, 2)
    want = {k: v for k, v in body.items() if k != "cache_salt"} | {"id_slot": 2, "cache_prompt": True}
    pairs = json.loads(out, object_pairs_hook=list)
    assert dict(pairs) == want and len(pairs) == len(want)  # valid JSON, no key twice
    if b"cache_prompt" in raw and b"false" not in raw and b"\\u005f" not in raw and b"seed" not in raw:
        assert out == raw[:-1] + b',"id_slot":2}'  # the client's bytes, unchanged before the slot


def test_stats_summary_from_metrics_text() -> None:
    m = Metrics()
    m.tokens_restored.inc(300)
    m.tokens_recomputed.inc(100)
    text = m.render().decode()
    text += 'kvtier_tier_hits_total{tier="redis"} 3.0\nkvtier_tier_misses_total{tier="redis"} 1.0\n'
    s = summarize_metrics(text)
    assert s["tokens"]["restored"] == 300 and s["tokens"]["restored_share"] == 0.75
    assert s["tiers"]["redis"]["hit_rate"] == 0.75


def test_an_answer_whose_last_event_arrived_is_finished_though_its_connection_was_cut() -> None:
    """The OpenAI client closes its connection right after ``data: [DONE]``, which can cancel the
    relay before llama-server's end of stream reached it: the answer is still whole, and saved."""
    chat_end = (b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
                b'data: {"choices":[{"finish_reason":"stop","delta":{}}],"timings":{"prompt_n":3}}\n\n'
                b"data: [DONE]\n\n")
    assert Relay(status=200, stream=True, tail=bytearray(chat_end)).ok
    completion_end = b'data: {"content":"x","stop":false}\n\ndata: {"content":"","stop":true,"timings":{}}\n\n'
    assert Relay(status=200, stream=True, tail=bytearray(completion_end)).ok
    # Cut before the last event: not whole (the slot may still be generating).
    assert not Relay(status=200, stream=True, tail=bytearray(chat_end[:-len(b"data: [DONE]\n\n")])).ok
    assert not Relay(status=200, stream=True, tail=bytearray(completion_end[:-30])).ok
    assert not Relay(status=500, stream=True, tail=bytearray(chat_end)).ok
    assert not stream_finished(b"")


def test_task_ids_that_go_back_tell_another_process() -> None:
    table = SlotTable(2)
    assert table.note_tasks([{"id": 0, "id_task": 7}, {"id": 1}]) is None  # nothing recorded to compare
    assert table.note_tasks([{"id": 0, "id_task": 7}, {"id": 1}]) is False
    assert not table.note_tasks([{"id": 0, "id_task": 9}, {"id": 1, "id_task": 10}])  # they grow
    assert table.note_tasks([{"id": 0, "id_task": 2}, {"id": 1, "id_task": 11}])  # slot 0 went back
    assert table.note_tasks([{"id": 0, "id_task": 2}, {"id": 1}])  # slot 1's task is gone
    assert not table.note_tasks([{"id": 0, "id_task": 2}, {"id": 1}])  # recorded: the same process


def test_the_loop_lag_metric_shows_a_stalled_loop() -> None:
    """A loop blocked for 0.3 s (as by a thread holding the GIL) shows as one sample of 0.25 s or
    more; the samples around it stay small."""
    def stall() -> None:
        time.sleep(0.3)  # called on the loop's thread: the loop stops

    async def run() -> Metrics:
        metrics = Metrics()
        watcher = asyncio.ensure_future(watch_loop_lag(metrics.loop_lag_seconds, 0.01))
        await asyncio.sleep(0.1)
        stall()
        await asyncio.sleep(0.1)
        watcher.cancel()
        return metrics

    metrics = asyncio.run(run())
    get = metrics.registry.get_sample_value
    count = get("kvtier_event_loop_lag_seconds_count")
    late = count - get("kvtier_event_loop_lag_seconds_bucket", {"le": "0.25"})
    assert count >= 5 and late == 1
    assert 0.25 <= get("kvtier_event_loop_lag_seconds_sum") < 0.25 + 0.05 * count
