"""The parts the engine is made of, each on its own: the shared KV flows (``integrations.kvflow``),
the slot lease, the restore planner, and a request whose preparation is cancelled.

Pure logic on synthetic states (``tests.test_statefile``'s reference encoder) and an in-process
memory tier; the same parts meet real llama-servers in test_sidecar.py and test_llama_cpp_cache.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from integrations import flows, kvflow, pendingflow, prefixrefs
from integrations.chunkassemble import assemble_state
from integrations.llama_server import Timings
from integrations.memkind import LookupShape, MemoryKind
from integrations.stateparse import parse_state
from sidecar.aftercare import held_beside
from sidecar.config import Settings
from sidecar.costmodel import CostModel
from sidecar.engine import KVEngine
from sidecar.metrics import Metrics
from sidecar.planner import EARLY_LOOKUP_S, WASTED_LIMIT, EarlyLookup, RestorePlanner
from sidecar.prompts import Prompt
from sidecar.slots import Lease, SlotTable
from sidecar.watcher import Target
from tests.test_statefile import logical, ref_file, ref_recurrent
from tiers.codec import BlobCodec
from tiers.keys import Namespace, prefix_chain, tail_hash_after, tail_key
from tiers.memory import MemoryTier
from tiers.sessions import SessionStore
from tiers.store import TieredStore

C = 64  # tokens per chunk in these tests
NS = Namespace("f" * 32, chunk_tokens=C)
RECURRENT = LookupShape(kind=MemoryKind.RECURRENT)


def memory_store() -> TieredStore:
    return TieredStore([MemoryTier(64 << 20)], BlobCodec("none"))


def state_of(lg):  # type: ignore[no-untyped-def]
    return parse_state(ref_file(lg))


def test_restorable_tokens_leaves_one_to_compute_and_fits_the_context() -> None:
    assert kvflow.restorable_tokens(100) == 99
    assert kvflow.restorable_tokens(100, n_ctx=50) == 49
    assert kvflow.restorable_tokens(0) == 0 and kvflow.restorable_tokens(1) == 0


async def test_a_stored_state_is_found_and_fetched_whole_with_its_tail() -> None:
    store = memory_store()
    lg = logical(150, seed=1)  # two chunks and a 22-token tail
    stored = await kvflow.store_state(store, NS, state_of(lg))
    assert stored.chunks is not None and stored.chunks.chunks_total == 2 and stored.tail_stored
    assert stored.tail is not None and stored.tail.end == 150
    tokens = np.asarray(lg.tokens + [7, 8, 9], np.int32)  # the next prompt continues the state
    found = await kvflow.find_prefix(store, NS, tokens)
    assert found.chunks.matched_tokens == 128 and found.tail is not None and found.n_tokens == 150
    assert found.bytes_by_tier(C, 10) == {"memory": 150 * 10}
    got = await kvflow.fetch_prefix(store, NS, found)
    assert got.n_tokens == 150 and got.tail is not None and got.tiers == frozenset({"memory"})
    # The fetched payloads are the state's cells, byte for byte.
    image = assemble_state(got.payloads, tokens, v_trans=False)
    assert bytes(image) == ref_file(lg)
    # One token is always left to compute: a prompt equal to the state gets the tail's first 16
    # cells (a prefix reference), not the whole tail.
    found_same = await kvflow.find_prefix(store, NS, np.asarray(lg.tokens, np.int32))
    assert found_same.n_tokens == 128 + prefixrefs.REF_STEP


async def test_a_recurrent_state_is_one_tail_found_only_by_prompts_that_continue_it() -> None:
    """Recurrent memory alone (mamba2): one tail of all 300 tokens (over four chunks' worth), no
    chunk; found only with ``tail_only`` by a prompt that continues every saved token, restored
    as the saved file; the next turn's state replaces it. As a session, too."""
    store = memory_store()
    lg = logical(300, seed=5)
    raw = ref_file(lg, memory=ref_recurrent(299))
    stored = await kvflow.store_state(store, NS, parse_state(raw))
    assert stored.chunks is None and stored.tail_stored and stored.tail is not None and stored.tail.end == 300
    tokens = np.asarray(lg.tokens + [7, 8, 9], np.int32)
    found = await kvflow.find_prefix(store, NS, tokens, RECURRENT)
    assert found.chunks.n_chunks == 0 and found.tail is not None and found.n_tokens == 300
    got = await kvflow.fetch_prefix(store, NS, found)
    assert got.n_tokens == 300 and bytes(assemble_state(got.payloads, tokens, v_trans=False)) == raw
    # A prompt that leaves saved tokens out, or only repeats them, finds nothing to restore.
    for short in (tokens[:250], tokens[:300]):
        assert (await kvflow.find_prefix(store, NS, short, RECURRENT)).n_tokens == 0
    # The next turn's state: its tail continues this one, which is deleted.
    lg2 = logical(310, seed=5)
    lg2.tokens = lg.tokens + [7, 8, 9] + lg2.tokens[303:]
    nxt = await kvflow.store_state(store, NS, parse_state(ref_file(lg2, memory=ref_recurrent(309, seed=1))),
                                   previous=stored.tail, previous_tokens=np.asarray(lg.tokens, np.int32))
    assert nxt.tail_deleted and await store.tiers[0].contains_many([stored.tail.key]) == [False]
    found = await kvflow.find_prefix(store, NS, np.asarray(lg2.tokens + [1], np.int32), RECURRENT)
    assert found.n_tokens == 310
    sessions = SessionStore(store, check=kvflow.content_mismatch)
    manifest = await kvflow.save_session(sessions, NS, "mamba", parse_state(raw), node="a")
    assert (manifest.chunks, manifest.tail_tokens) == (0, 300)
    payloads, _ = await sessions.fetch(NS, manifest)
    assert bytes(assemble_state(payloads, manifest.tokens, v_trans=False)) == raw


async def test_the_shared_flows_restore_a_session_and_track_tails_and_marked_stores() -> None:
    """``integrations.flows``: a session's image is the state saved; a restore and a store tell
    which tail the context answers for; ``SaveMarks`` holds its marks around the stores it runs in
    the background and drains them; ``find_prefix_waiting`` without marks is one lookup."""
    store = memory_store()
    lg = logical(150, seed=6)
    raw = ref_file(lg)
    sessions = SessionStore(store, check=kvflow.content_mismatch)
    await kvflow.save_session(sessions, NS, "s1", parse_state(raw), node="a")
    image = await flows.session_image(sessions, NS, "s1", v_trans=False)
    assert bytes(image.joined()) == raw and image.nbytes == len(raw) and image.manifest.n_tokens == 150

    held: list[int] = []

    class Pending:  # the part of tiers.pending.PendingSaves a marked store uses
        @contextlib.asynccontextmanager
        async def held(self, keys: list[bytes], mark: object) -> AsyncIterator[None]:
            held.append(len(keys))
            yield

    marks = flows.SaveMarks(Pending(), "a")  # type: ignore[arg-type]
    stored = await marks.store_state(store, NS, state_of(lg))
    assert await marks.drain(5) and held == [len(pendingflow.pending_marks(NS, np.asarray(lg.tokens, np.int32)))]
    assert stored.tail is not None and flows.tail_after_store(stored, None) == stored.tail
    failed = kvflow.StoredState(None, stored.tail, tail_error=OSError("down"))
    assert flows.tail_after_store(failed, None) is None  # the tail never stored: the old one stands
    tokens = np.asarray(lg.tokens + [1], np.int32)
    after = await flows.find_prefix_waiting(store, None, NS, tokens, LookupShape(), limit=lambda save, have: 1.0)
    assert after.found.n_tokens == 150 and after.waited is None
    got = await kvflow.fetch_prefix(store, NS, after.found)
    assert flows.restored_tail(got) == kvflow.TailRecord(stored.tail.key, 150)


async def test_a_tail_after_a_missing_chunk_is_not_restored() -> None:
    store = memory_store()
    lg = logical(150, seed=2)
    await kvflow.store_state(store, NS, state_of(lg))
    tokens = np.asarray(lg.tokens + [1], np.int32)
    found = await kvflow.find_prefix(store, NS, tokens)
    chain = prefix_chain(NS, tokens, 2)
    await store.delete_everywhere([f"kvtier:{NS.id}:c:{chain[1].hex()}".encode()])  # chunk 1 is gone
    got = await kvflow.fetch_prefix(store, NS, found)
    assert got.n_tokens == C and got.tail is None and len(got.payloads) == 1


async def test_the_tail_a_state_extends_is_deleted_and_one_it_leaves_is_kept() -> None:
    store = memory_store()
    lg = logical(300, seed=3)
    first = await kvflow.store_state(store, NS, state_of(lg.prefix(150)))
    assert first.tail is not None
    # A state that diverges inside the old tail (another answer) keeps it: it still serves its prompt.
    other = logical(300, seed=4)
    fork = lg.prefix(140)
    fork.tokens += other.tokens[140:170]
    fork.pos += list(range(140, 170))
    fork.seqs += [[0]] * 30
    fork.k = [np.concatenate([a, b[140:170]]) for a, b in zip(fork.k, other.k)]
    fork.v = [np.concatenate([a, b[140:170]]) for a, b in zip(fork.v, other.v)]
    forked = await kvflow.store_state(store, NS, state_of(fork), previous=first.tail,
                                      previous_tokens=np.asarray(lg.tokens[:150], np.int32))
    assert not forked.tail_deleted and (await store.tiers[0].contains_many([first.tail.key])) == [True]
    # A state holding all of the old tail and more makes it useless: deleted.
    longer = await kvflow.store_state(store, NS, state_of(lg.prefix(200)), previous=first.tail,
                                      previous_tokens=np.asarray(lg.tokens[:150], np.int32))
    assert longer.tail_deleted and (await store.tiers[0].contains_many([first.tail.key])) == [False]
    assert longer.tail is not None and longer.tail.end == 200
    expected = tail_key(NS, tail_hash_after(prefix_chain(NS, lg.tokens[:192])[-1], lg.tokens[192:200]))
    assert longer.tail.key == expected


async def test_lease_is_bound_to_its_table_and_released_once() -> None:
    old = SlotTable(1)
    lease = await old.acquire(np.arange(3, dtype=np.int32))
    new = SlotTable(1)  # llama-server restarted: the watcher built a new table
    held = await new.acquire(np.arange(3, dtype=np.int32))
    lease.release()
    assert not old.slots[0].busy and new.slots[0].busy  # the new table's slot stays with its holder
    lease.release()  # idempotent
    assert new.try_acquire(0) is None
    with held:
        pass
    assert not new.slots[0].busy and held.released


@pytest.mark.parametrize("granted_first", [False, True])  # True: given the slot, then cancelled before it ran
async def test_a_waiter_that_gives_up_hands_its_slot_on(granted_first: bool) -> None:
    table = SlotTable(1)
    first = await table.acquire(np.arange(3, dtype=np.int32))
    waiter = asyncio.create_task(table.acquire(np.arange(3, dtype=np.int32)))
    await asyncio.sleep(0)
    if granted_first:
        first.release()
        assert table.slots[0].busy  # the waiter's now
    waiter.cancel()
    first.release()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not table.slots[0].busy and table.queue_depth == 0


def target(n_ctx: int = 0, bytes_per_token: int = 23_040) -> Target:
    return Target(1, 1, False, "m", NS, bytes_per_token, n_ctx)


async def test_planner_restores_only_what_pays() -> None:
    store = memory_store()
    lg = logical(300, seed=5)
    await kvflow.store_state(store, NS, state_of(lg))
    tokens = np.asarray(lg.tokens + [1, 2], np.int32)
    slow_prefill = RestorePlanner(store, CostModel(prefill_tps=50), Metrics())
    found = await slow_prefill.plan(NS, tokens, 0, target(), slot=0)
    assert found is not None and found.n_tokens == 300
    # The slot already holds every full chunk a restore could bring: no lookup at all.
    assert await slow_prefill.plan(NS, tokens, 256, target(), slot=0) is None
    # A fast prefill (a GPU) recomputes 300 tokens rather than read 7 MB.
    fast_prefill = RestorePlanner(store, CostModel(prefill_tps=1e6), Metrics())
    assert await fast_prefill.plan(NS, tokens, 0, target(), slot=0) is None
    # Never more than the slot's context.
    small = await slow_prefill.plan(NS, tokens, 0, target(n_ctx=140), slot=0)
    assert small is not None and small.n_tokens == 128  # 11 more tokens would fit: less than a step


async def test_a_whole_state_shorter_than_a_chunk_is_planned_too() -> None:
    """Recurrent memory alone: a state of fewer tokens than a chunk is still its one tail, and the
    planner looks it up (a plain KV cache would restore no full chunk of it)."""
    store = memory_store()
    lg = logical(C - 10, seed=7)
    await kvflow.store_state(store, NS, parse_state(ref_file(lg, memory=ref_recurrent(C - 11))))
    tokens = np.asarray(lg.tokens + [1, 2], np.int32)
    recurrent = Target(1, 1, False, "m", NS, 0, 0, MemoryKind.RECURRENT)
    found = await RestorePlanner(store, CostModel(prefill_tps=50), Metrics()).plan(NS, tokens, 0, recurrent, slot=0)
    assert found is not None and found.n_tokens == C - 10


async def test_the_route_checks_lookup_is_planned_with_while_fresh() -> None:
    """A request served here after the route check does not look the tiers up a second time,
    unless the lookup was of another namespace or has gone stale (a slot wait came between)."""
    store = memory_store()
    lg = logical(300, seed=8)
    await kvflow.store_state(store, NS, state_of(lg))
    tokens = np.asarray(lg.tokens + [1, 2], np.int32)
    lookups = 0
    lookup_chain = store.lookup_chain

    async def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal lookups
        lookups += 1
        return await lookup_chain(*args, **kwargs)

    store.lookup_chain = counted  # type: ignore[method-assign]
    found = await kvflow.find_prefix(store, NS, tokens)
    planner = RestorePlanner(store, CostModel(prefill_tps=50), Metrics())
    lookups = 0
    planned = await planner.plan(NS, tokens, 0, target(), slot=0, early=EarlyLookup(NS, found, time.perf_counter()))
    assert planned is found and lookups == 0
    stale = EarlyLookup(NS, found, time.perf_counter() - 2 * EARLY_LOOKUP_S)
    assert (await planner.plan(NS, tokens, 0, target(), slot=0, early=stale)) is not None and lookups == 1
    other = EarlyLookup(NS.salted("tenant-b"), found, time.perf_counter())
    assert (await planner.plan(NS, tokens, 0, target(), slot=0, early=other)) is not None and lookups == 2


def test_restores_thrown_away_stop_restores_of_that_layout() -> None:
    metrics = Metrics()
    planner = RestorePlanner(memory_store(), CostModel(prefill_tps=50), metrics)
    thrown = Timings(prompt_n=1_000, prompt_ms=900.0, predicted_n=1, predicted_ms=10.0, cache_n=0)
    kept = Timings(prompt_n=30, prompt_ms=30.0, predicted_n=1, predicted_ms=10.0, cache_n=970)
    for _ in range(2):
        assert not planner.learn(thrown, 1_000, 970, 0, restored=970, layout="kv_pair")
    assert planner.learn(kept, 1_000, 970, 0, restored=970, layout="kv_pair")  # one kept: the count starts over
    for _ in range(WASTED_LIMIT - 1):
        planner.learn(thrown, 1_000, 970, 0, restored=970, layout="kv_pair")
    assert "kv_pair" not in planner.off
    planner.learn(thrown, 1_000, 970, 0, restored=970, layout="kv_pair")
    assert planner.off == {"kv_pair"}
    assert metrics.registry.get_sample_value("kvtier_restores_wasted_total", {"layout": "kv_pair"}) == 2 + WASTED_LIMIT
    planner.learn(thrown, 1_000, 0, 0)  # no restore: nothing wasted
    assert metrics.registry.get_sample_value("kvtier_restores_wasted_total", {"layout": "kv_pair"}) == 2 + WASTED_LIMIT


async def test_no_restore_for_a_layout_that_is_off() -> None:
    store = memory_store()
    lg = logical(300, seed=6)
    await kvflow.store_state(store, NS, state_of(lg))
    tokens = np.asarray(lg.tokens + [1, 2], np.int32)
    planner = RestorePlanner(store, CostModel(prefill_tps=50), Metrics())
    assert await planner.plan(NS, tokens, 0, target(), slot=0) is not None
    planner.off.add("kv")
    assert await planner.plan(NS, tokens, 0, target(), slot=0) is None


class _HangingPlanner:
    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def plan(self, *args: object, **kw: object) -> None:
        self.entered.set()
        await asyncio.Event().wait()


async def test_a_request_cancelled_while_it_restores_gives_its_slot_back() -> None:
    store = memory_store()
    engine = KVEngine(Settings(slot_dir="."), None, store, Metrics(), SessionStore(store))  # type: ignore[arg-type]
    table = SlotTable(1)
    engine.watcher.target, engine.watcher.slots = target(), table
    planner = _HangingPlanner()
    engine.planner = planner  # type: ignore[assignment]
    prompt = Prompt(np.arange(500, dtype=np.int32))
    task = asyncio.create_task(engine.prepare(prompt))
    await planner.entered.wait()
    assert table.slots[0].busy
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not table.slots[0].busy


@pytest.mark.parametrize("v_trans", [False, True])
def test_first_cells_of_a_chunk_are_the_shorter_state(v_trans: bool) -> None:
    from integrations.chunksplit import first_cells, split_state

    lg = logical(150, seed=6)
    split = split_state(parse_state(ref_file(lg, v_trans=v_trans)), C, tail=True)
    second = first_cells(split.chunks[1], 40)  # cells 64..103
    image = assemble_state([split.chunks[0], second], lg.tokens, v_trans=v_trans)
    assert bytes(image) == ref_file(lg.prefix(104), v_trans=v_trans)
    assert first_cells(split.chunks[1], 64) is split.chunks[1]
    with pytest.raises(ValueError):
        first_cells(split.chunks[1], 0)


async def test_a_prompt_sharing_part_of_a_chunk_restores_those_cells() -> None:
    """A system prompt that ends mid-chunk: the next conversation restores it to within a step."""
    store = memory_store()
    first, other = logical(200, seed=7), logical(200, seed=8)
    await kvflow.store_state(store, NS, state_of(first))
    prompt = np.asarray(first.tokens[:100] + other.tokens[100:180], np.int32)  # shares 100 tokens
    found = await kvflow.find_prefix(store, NS, prompt)
    assert found.chunks.matched_tokens == 64 and found.n_tokens == 96
    got = await kvflow.fetch_prefix(store, NS, found)
    assert got.n_tokens == 96 and got.tail is None  # a reference is no tail of the new context
    assert bytes(assemble_state(got.payloads, prompt, v_trans=False)) == ref_file(first.prefix(96))
    # The same within the first chunk: nothing full matches, 48 of 50 shared tokens come back.
    short = np.asarray(first.tokens[:50] + other.tokens[50:120], np.int32)
    got = await kvflow.fetch_prefix(store, NS, await kvflow.find_prefix(store, NS, short))
    assert got.n_tokens == 48
    assert bytes(assemble_state(got.payloads, short, v_trans=False)) == ref_file(first.prefix(48))


async def test_a_reference_to_a_value_never_stored_or_gone_restores_nothing_more() -> None:
    store = memory_store()
    lg = logical(200, seed=9)
    await kvflow.store_state(store, NS, state_of(lg))
    prompt = np.asarray(lg.tokens[:100] + [5] * 50, np.int32)
    found = await kvflow.find_prefix(store, NS, prompt)
    assert found.tail is not None and found.n_tokens == 96
    # Overwrite the reference with one whose value was never stored (the chunk's last token differs).
    chain = prefix_chain(NS, lg.tokens, 3)
    forged = prefixrefs.prefix_refs(chain[0], np.asarray(lg.tokens[64:127] + [lg.tokens[127] + 1], np.int32),
                                    prefixrefs.REF_CHUNK)
    await store.store_tails(NS, forged)
    got = await kvflow.fetch_prefix(store, NS, found)
    assert got.n_tokens == 64 and len(got.payloads) == 1
    # A reference to a value that is gone: the chunks alone.
    await kvflow.store_state(store, NS, state_of(lg))  # nothing new: the references stay forged
    other = Namespace("e" * 32, chunk_tokens=C)
    await kvflow.store_state(store, other, state_of(lg))
    found = await kvflow.find_prefix(store, other, prompt)
    await store.delete_everywhere([f"kvtier:{other.id}:c:{prefix_chain(other, lg.tokens, 2)[1].hex()}".encode()])
    got = await kvflow.fetch_prefix(store, other, found)
    assert got.n_tokens == 64


async def _answered_and_saving(table: SlotTable, tokens: np.ndarray) -> Lease:
    """A slot that answered ``tokens``, whose save runs."""
    lease = await table.acquire(tokens)
    table.set_tokens(lease.slot, tokens)
    table.slots[lease.slot].saving = True
    return lease


def _saved(table: SlotTable, lease: Lease) -> None:
    table.slots[lease.slot].saving = False
    lease.release()


async def test_a_next_turn_waits_for_its_own_slots_save_and_blocks_no_one() -> None:
    table = SlotTable(2)
    history = np.arange(100, dtype=np.int32)
    first = await _answered_and_saving(table, history)
    next_turn = asyncio.create_task(table.acquire(np.arange(120, dtype=np.int32)))
    await asyncio.sleep(0)
    assert not next_turn.done() and table.queue_depth == 1  # the idle slot holds nothing of it
    other = await asyncio.wait_for(table.acquire(np.arange(500, 600, dtype=np.int32)), 1)  # not held up
    assert other.slot != first.slot
    _saved(table, first)
    lease = await asyncio.wait_for(next_turn, 1)
    assert (lease.slot, lease.cached_tokens) == (first.slot, 100)


async def test_a_saving_slot_is_waited_for_only_when_taking_it_is_worth_more_than_a_free_one() -> None:
    # A new conversation that shares a header with the one just answered takes a free slot at once,
    # as on llama-server alone: waiting would put it behind that save's write (0.66 s at 8B sizes)
    # and overwrite a live conversation. One that reuses more than it overwrites (another question
    # on the same document) waits for that slot, as the next turn does.
    table = SlotTable(3)
    history = np.arange(100, dtype=np.int32)
    first = await _answered_and_saving(table, history)
    header = np.concatenate([history[:10], np.arange(500, 600, dtype=np.int32)])
    new = await asyncio.wait_for(table.acquire(header), 1)
    assert new.slot != first.slot and new.cached_tokens == 0
    sibling = asyncio.create_task(table.acquire(np.concatenate([history[:90], np.arange(700, 720, dtype=np.int32)])))
    await asyncio.sleep(0)
    assert not sibling.done() and table.queue_depth == 1  # a free slot is left, but it holds nothing of it
    _saved(table, first)
    lease = await asyncio.wait_for(sibling, 1)
    assert (lease.slot, lease.cached_tokens) == (first.slot, 90)


async def test_a_slot_kvtier_lost_track_of_is_erased_before_another_tenant_uses_it() -> None:
    table = SlotTable(1)
    lease = await table.acquire(np.arange(50, dtype=np.int32), owner="a")
    table.set_tokens(lease.slot, np.arange(50, dtype=np.int32), owner="a")
    table.forget(lease.slot)  # tenant a's request failed: llama-server may still hold its KV
    lease.release()
    other = await table.acquire(np.arange(50, dtype=np.int32), owner="b")
    assert other.foreign and other.cached_tokens == 0
    other.release()
    same = await table.acquire(np.arange(50, dtype=np.int32), owner="a")
    assert not same.foreign and same.cached_tokens == 0  # nothing counts as cached, even for a
    same.release()
    table.set_tokens(0, np.zeros(0, np.int32), owner="b")  # known empty (erased, or a restarted server)
    assert not (await table.acquire(np.arange(5, dtype=np.int32), owner="a")).foreign


async def test_a_held_save_waits_for_another_slots_write_then_for_a_quiet_moment() -> None:
    table = SlotTable(3)
    a, b = await table.acquire(np.arange(10, dtype=np.int32)), await table.acquire(np.arange(100, 110, dtype=np.int32))
    table.begin_save(a.slot, None)
    table.begin_save(b.slot, None)  # both answered: neither computes
    assert table.beside(a.slot) == 0
    table.begin_write(b.slot)  # b's save goes first
    assert (table.beside(a.slot), table.beside(b.slot)) == (1, 0)
    alone = asyncio.create_task(table.until_alone(a.slot, 5))
    await asyncio.sleep(0.01)
    assert not alone.done()
    table.end_write(b.slot)
    await asyncio.wait_for(alone, 1)
    quiet = asyncio.create_task(table.until_busy(a.slot, 5))
    await asyncio.sleep(0.01)
    assert not quiet.done()
    await table.acquire(np.arange(200, 210, dtype=np.int32))  # a request starts on the third slot
    assert await asyncio.wait_for(quiet, 1)
    assert table.beside(b.slot) == 1  # the third slot computes; a's save neither computes nor writes


@pytest.mark.parametrize("quiet", [0.03, 0.3])
async def test_a_held_save_goes_after_a_quiet_moment_as_long_as_its_pause(quiet: float) -> None:
    table = SlotTable(2)
    mine, other = await table.acquire(np.arange(10, dtype=np.int32)), await table.acquire(np.arange(50, 60, dtype=np.int32))
    table.begin_save(mine.slot, None)  # answered; the other slot still computes

    async def nothing_to_lift() -> None:
        pass

    held = asyncio.create_task(held_beside(table, mine.slot, 5.0, lambda: False, nothing_to_lift, quiet))
    await asyncio.sleep(0.05)
    other.release()  # the other request ends...
    await asyncio.sleep(0.15)
    assert held.done() == (quiet < 0.1)  # a 30 ms quiet moment is over by now: that save went
    if held.done():
        return
    again = await table.acquire(np.arange(50, 60, dtype=np.int32))  # ...and its client asks again 0.15 s later
    await asyncio.sleep(0.1)
    assert not held.done()
    again.release()
    waited = await asyncio.wait_for(held, 2)
    assert waited >= 0.25 + quiet  # it waited for the second request, then for a whole quiet moment after it


async def _nothing_to_lift() -> None:
    pass


@pytest.mark.parametrize(("left", "write", "at_half"), [(5.0, 0.01, True), (0.05, 0.01, False), (5.0, None, False)])
async def test_a_held_save_goes_at_half_its_wait_beside_a_prompt_with_ten_writes_left(
        left: float, write: float | None, at_half: bool) -> None:
    """Past half its wait, a held save goes beside a prompt with at least ten times its write left to
    compute (llama-server writes it between that prompt's batches), not at the end of the wait into
    whatever comes then. Beside a prompt with less left, or with its write not known yet, it waits on."""
    table = SlotTable(2)
    mine, other = await table.acquire(np.arange(10, dtype=np.int32)), await table.acquire(np.arange(50, 60, dtype=np.int32))
    table.begin_save(mine.slot, None)
    table.computes(other.slot, left)
    waited = await asyncio.wait_for(held_beside(table, mine.slot, 1.0, lambda: False, _nothing_to_lift, 0.03, write), 3)
    assert (0.5 <= waited < 0.9) if at_half else waited >= 1.0


async def test_a_long_prompt_that_starts_past_half_the_wait_lets_a_held_save_go() -> None:
    table = SlotTable(3)
    mine, other = await table.acquire(np.arange(10, dtype=np.int32)), await table.acquire(np.arange(50, 60, dtype=np.int32))
    table.computes(other.slot, 5.0)
    other.release()
    await table.acquire(np.arange(50, 60, dtype=np.int32), want=other.slot)  # a follow-up: its prompt's size not known
    table.begin_save(mine.slot, None)
    assert not table.prefilling_beside(mine.slot, 0.1)  # the new grant forgot the last request's prompt
    held = asyncio.create_task(held_beside(table, mine.slot, 2.0, lambda: False, _nothing_to_lift, 0.03, 0.01))
    await asyncio.sleep(1.2)
    assert not held.done()  # half the wait is over, but nothing long computes beside
    long = await table.acquire(np.arange(100, 110, dtype=np.int32))
    table.computes(long.slot, 5.0)
    waited = await asyncio.wait_for(held, 1)
    assert 1.2 <= waited < 1.6
