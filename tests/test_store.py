"""TieredStore over memory + shared files + real Valkey: lookup, fetch, promotion, dedup, the
write-behind queue, damaged values, and Redis dying mid-fetch and mid-store."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.servers import RedisProc, redis_server
from tiers.base import TierRole, TierStats
from tiers.codec import HEADER_SIZE, BlobCodec, Flags
from tiers.keys import ChunkHash, Namespace, chunk_key, prefix_chain, sequence_key, whole_key
from tiers.memory import MemoryTier
from tiers.redis_tier import RedisTier
from tiers.shared import SharedTier
from tiers.store import TieredStore

NS = Namespace("fp-store-tests", chunk_tokens=16)
PAYLOAD_BYTES = 40_000
MB = 1 << 20


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tokens(seed: int, n_chunks: int, shared_with: list[int] | None = None, shared_chunks: int = 0) -> list[int]:
    """``n_chunks`` chunks of tokens; the first ``shared_chunks`` copied from ``shared_with``."""
    own = [(seed * 7919 + i) % 50_000 for i in range(n_chunks * NS.chunk_tokens)]
    if shared_with is not None:
        cut = shared_chunks * NS.chunk_tokens
        own[:cut] = shared_with[:cut]
    return own


class Payloads:
    """``payloads(i)`` for a token sequence, counting its calls (what the store had to encode)."""

    def __init__(self, toks: list[int]):
        self.toks = toks
        self.calls: list[int] = []

    def expected(self, i: int) -> bytes:
        chunk = self.toks[i * NS.chunk_tokens : (i + 1) * NS.chunk_tokens]
        seed = hashlib.blake2b(repr(chunk).encode()).digest()
        return (seed * (PAYLOAD_BYTES // len(seed) + 1))[:PAYLOAD_BYTES]

    def __call__(self, i: int) -> bytes:
        self.calls.append(i)
        return self.expected(i)


def chain_of(toks: list[int]) -> list[ChunkHash]:
    return prefix_chain(NS, toks)


def keys_of(chain: Sequence[ChunkHash]) -> list[bytes]:
    return [chunk_key(NS, h) for h in chain]


def make_store(url: str, shm: Path, *, clock: FakeClock | None = None, **redis_settings: object) -> TieredStore:
    settings: dict[str, object] = {"ttl": 600, "retries": 1, "backoff_base": 0.01, "backoff_cap": 0.05, "socket_timeout": 2.0}
    settings.update(redis_settings)
    if clock is not None:
        settings["clock"] = clock
    return TieredStore(
        [MemoryTier(64 * MB), SharedTier(shm, 64 * MB), RedisTier(url, **settings)],  # type: ignore[arg-type]
        BlobCodec("none"),
    )


def tier(store: TieredStore, name: str) -> object:
    return next(t for t in store.tiers if t.name == name)


@pytest.fixture
async def store(redis_srv: RedisProc, shm_dir: Path) -> AsyncIterator[TieredStore]:
    with redis.Redis(port=redis_srv.port) as r:
        r.flushdb()
    s = make_store(redis_srv.url, shm_dir / "a")
    yield s
    await s.aclose()


@pytest.fixture
async def fresh(redis_srv: RedisProc, shm_dir: Path) -> AsyncIterator[TieredStore]:
    """A second store on the same Redis with empty local tiers: another node."""
    s = make_store(redis_srv.url, shm_dir / "b")
    yield s
    await s.aclose()


def raw(srv: RedisProc) -> redis.Redis:
    return redis.Redis(port=srv.port)


# -- lookup, fetch, promotion ---------------------------------------------------------------------


async def test_store_lookup_fetch_roundtrip(store: TieredStore) -> None:
    toks = tokens(1, 5) + [1, 2, 3]  # a partial tail gets no key
    chain = chain_of(toks)
    payloads = Payloads(toks)
    result = await store.store(NS, chain, payloads)
    assert (result.chunks_total, result.chunks_written) == (5, 5)
    assert await store.flush(5)
    found = await store.lookup(NS, toks)
    assert (found.matched_tokens, found.n_chunks, found.tiers) == (80, 5, ["memory"] * 5)
    got = await store.fetch(NS, found.chunks)
    assert [bytes(p) for p in got.payloads] == [payloads.expected(i) for i in range(5)]
    assert got.n_tokens == 80 and got.tiers == ["memory"] * 5


async def test_lookup_stops_at_the_first_gap(store: TieredStore, redis_srv: RedisProc) -> None:
    toks = tokens(2, 5)
    chain = chain_of(toks)
    await store.store(NS, chain, Payloads(toks))
    assert await store.flush(5)
    await store.delete_everywhere([keys_of(chain)[2]])
    found = await store.lookup(NS, toks)
    assert found.n_chunks == 2 and found.matched_tokens == 32
    got = await store.fetch(NS, chain)
    assert got.n_chunks == 2 and got.n_tokens == 32


async def test_a_prefix_may_span_tiers(store: TieredStore, redis_srv: RedisProc) -> None:
    toks = tokens(12, 5)
    chain = chain_of(toks)
    keys = keys_of(chain)
    await store.store(NS, chain, Payloads(toks))
    assert await store.flush(5)
    r = raw(redis_srv)
    await tier(store, "memory").delete(keys[1:])  # type: ignore[attr-defined]
    await tier(store, "shared").delete([keys[0], *keys[2:]])  # type: ignore[attr-defined]
    r.delete(keys[0], keys[1])
    found = await store.lookup(NS, toks)
    assert found.tiers == ["memory", "shared", "redis", "redis", "redis"]
    got = await store.fetch(NS, chain, promote=False)
    assert got.tiers == ["memory", "shared", "redis", "redis", "redis"]

    r.set(keys[2], r.get(keys[3]))  # a valid blob of another chunk: lookup sees a key, fetch a foreigner
    assert (await store.lookup(NS, toks)).n_chunks == 5
    got = await store.fetch(NS, chain)
    assert got.n_chunks == 2 and store.counters.corrupt == 1 and not r.exists(keys[2])


async def test_fetch_promotes_lower_tier_hits(store: TieredStore, fresh: TieredStore) -> None:
    toks = tokens(3, 4)
    chain = chain_of(toks)
    payloads = Payloads(toks)
    await store.store(NS, chain, payloads)
    assert await store.flush(5)
    got = await fresh.fetch(NS, chain)
    assert got.tiers == ["redis"] * 4
    assert [bytes(p) for p in got.payloads] == [payloads.expected(i) for i in range(4)]
    assert fresh.counters.promotions == 8  # into memory and into shared
    assert (await fresh.lookup(NS, toks)).tiers == ["memory"] * 4
    await tier(fresh, "memory").delete(keys_of(chain))  # type: ignore[attr-defined]
    again = await fresh.fetch(NS, chain)
    assert again.tiers == ["shared"] * 4
    assert fresh.counters.promotions == 12  # shared hits go up into memory only
    assert (await fresh.fetch(NS, chain)).tiers == ["memory"] * 4


async def test_promotion_can_wait_until_the_payloads_are_used(store: TieredStore, fresh: TieredStore) -> None:
    toks = tokens(5, 3)
    chain = chain_of(toks)
    await store.store(NS, chain, Payloads(toks))
    assert await store.flush(5)
    got = await fresh.fetch(NS, chain, promote=False)  # what a restore does: nothing copied yet
    assert got.tiers == ["redis"] * 3 and fresh.counters.promotions == 0
    assert (await fresh.lookup(NS, toks)).tiers == ["redis"] * 3
    await fresh.promote(got)  # after the answer
    assert fresh.counters.promotions == 6 and (await fresh.lookup(NS, toks)).tiers == ["memory"] * 3
    # The RAM tier keeps the very buffers the fetch read: a restore's state is not held twice.
    held = await tier(fresh, "memory").get_many(got.keys)
    assert all(np.shares_memory(np.frombuffer(held[k], np.uint8), np.frombuffer(b, np.uint8))
               for k, b in zip(got.keys, got.blobs))


# -- dedup ----------------------------------------------------------------------------------------


async def test_a_shared_prefix_is_encoded_and_sent_once(store: TieredStore, fresh: TieredStore,
                                                         redis_srv: RedisProc) -> None:
    r = raw(redis_srv)
    r.config_resetstat()
    a = tokens(4, 4)
    b = tokens(5, 4, shared_with=a, shared_chunks=2)
    chain_a, chain_b = chain_of(a), chain_of(b)
    assert chain_a[:2] == chain_b[:2] and chain_a[2] != chain_b[2]
    pa, pb = Payloads(a), Payloads(b)
    await store.store(NS, chain_a, pa)
    assert await store.flush(5)
    result = await store.store(NS, chain_b, pb)
    assert await store.flush(5)
    assert sorted(pa.calls) == [0, 1, 2, 3]
    assert sorted(pb.calls) == [2, 3], "the shared chunks must not be split or encoded again"
    assert result.chunks_written == 2
    assert r.dbsize() == 6
    assert r.info("commandstats")["cmdstat_set"]["calls"] == 6

    # Another node storing the same prefix encodes it for its own local tiers, but Redis already
    # holds it: nothing is sent again.
    pa2 = Payloads(a)
    await fresh.store(NS, chain_a, pa2)
    assert await fresh.flush(5)
    assert sorted(pa2.calls) == [0, 1, 2, 3]
    assert r.info("commandstats")["cmdstat_set"]["calls"] == 6


# -- the background queue -------------------------------------------------------------------------


class GatedTier(MemoryTier):
    """A remote tier whose writes wait for a gate: a slow or hung Redis."""

    role = TierRole.REMOTE
    write_behind = True

    def __init__(self) -> None:
        super().__init__(64 * MB, name="redis")
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()

    async def put_many(self, items: Mapping[bytes, bytes]) -> int:
        self.entered.set()
        await self.gate.wait()
        return await super().put_many(items)


class CutPayloads(Payloads):
    """A saved state's chunks, cut by windows (``prepare(first, end)``); the cut of any window after
    the first waits until the background tier holds the first window."""

    def __init__(self, toks: list[int], first_sent: asyncio.Event):
        super().__init__(toks)
        self.first_sent = first_sent
        self.windows: list[tuple[int, int]] = []

    def size_of(self, i: int) -> int:
        return PAYLOAD_BYTES

    async def prepare(self, first: int, end: int) -> None:
        self.windows.append((first, end))
        if first > 0:
            await asyncio.wait_for(self.first_sent.wait(), 5)


class WatchedTier(MemoryTier):
    """A remote tier that tells when it holds a given key."""

    role = TierRole.REMOTE
    write_behind = True

    def __init__(self, watch: bytes, seen: asyncio.Event) -> None:
        super().__init__(64 * MB, name="redis")
        self.watch, self.seen = watch, seen

    async def put_many(self, items: Mapping[bytes, bytes]) -> int:
        stored = await super().put_many(items)
        if self.watch in items:
            self.seen.set()
        return stored


@pytest.mark.parametrize("window_bytes", [2 * PAYLOAD_BYTES, PAYLOAD_BYTES // 2])  # a chunk larger than it: 2
async def test_a_large_store_sends_each_window_while_the_next_is_cut(window_bytes: int) -> None:
    """Redis gets a save's first window before the rest is cut: the cut of the second window here
    waits for it (and would time out if every chunk were cut before any was sent)."""
    toks = tokens(700, 5)
    chain = chain_of(toks)
    sent = asyncio.Event()
    far = WatchedTier(keys_of(chain)[1], sent)
    s = TieredStore([MemoryTier(64 * MB), far], BlobCodec("none"), window_bytes=window_bytes)
    payloads = CutPayloads(toks, sent)
    result = await s.store(NS, chain, payloads)
    assert result.chunks_written == 5 and payloads.windows == [(0, 2), (2, 4), (4, 5)]
    assert await s.flush(5)
    assert all(await far.contains_many(keys_of(chain)))
    assert sorted(payloads.calls) == [0, 1, 2, 3, 4]  # each chunk encoded once for both tiers
    await s.aclose()


async def test_full_queue_drops_the_oldest_pending_write() -> None:
    slow = GatedTier()
    s = TieredStore([MemoryTier(64 * MB), slow], BlobCodec("none"), queue_limit=2)
    seqs = [tokens(100 + i, 2) for i in range(5)]
    await s.store(NS, chain_of(seqs[0]), Payloads(seqs[0]))
    await asyncio.wait_for(slow.entered.wait(), 2)  # the writer holds job 0 and hangs
    for toks in seqs[1:]:
        await s.store(NS, chain_of(toks), Payloads(toks))  # never waits on the hung tier
    assert s.counters.dropped_writes == 2 and s.queue_depth == 2
    assert not await s.flush(0.1)
    slow.gate.set()
    assert await s.flush(5)
    held = [all(await slow.contains_many(keys_of(chain_of(t)))) for t in seqs]
    assert held == [True, False, False, True, True]  # jobs 1 and 2 were the oldest pending
    await s.aclose()


async def test_written_waits_for_the_writes_queued_before_it_only() -> None:
    """``written()`` is what a save waits on before its pending-save marks go: every background
    write queued before it is done (True), or one of them failed or was dropped (False)."""
    slow = GatedTier()
    s = TieredStore([MemoryTier(64 * MB), slow], BlobCodec("none"), queue_limit=3)
    first, later = tokens(300, 2), tokens(301, 2)
    await s.store(NS, chain_of(first), Payloads(first))
    await asyncio.wait_for(slow.entered.wait(), 2)
    waiting = asyncio.ensure_future(s.written(5))
    await s.store(NS, chain_of(later), Payloads(later))  # queued after: not waited for
    await asyncio.sleep(0.05)
    assert not waiting.done()
    slow.gate.set()
    assert await waiting
    assert all(await slow.contains_many(keys_of(chain_of(first))))
    # A queue so full that the writes before the barrier are dropped: False.
    slow.gate.clear()
    slow.entered.clear()
    seqs = [tokens(310 + i, 2) for i in range(3)]
    await s.store(NS, chain_of(seqs[0]), Payloads(seqs[0]))
    await asyncio.wait_for(slow.entered.wait(), 2)
    await s.store(NS, chain_of(seqs[1]), Payloads(seqs[1]))
    waiting = asyncio.ensure_future(s.written(5))
    for toks in [seqs[2], *(tokens(320 + i, 2) for i in range(3))]:
        await s.store(NS, chain_of(toks), Payloads(toks))  # pushes job 1 and the barrier out
    assert await waiting is False
    slow.gate.set()
    assert await s.flush(5)
    assert await s.written(5)  # nothing failed since
    await s.aclose()


# -- damaged and foreign values -------------------------------------------------------------------


async def test_damaged_or_foreign_blobs_are_deleted_and_never_returned(
    store: TieredStore, fresh: TieredStore, redis_srv: RedisProc
) -> None:
    r = raw(redis_srv)
    toks = tokens(6, 4)
    chain = chain_of(toks)
    keys = keys_of(chain)
    payloads = Payloads(toks)
    await store.store(NS, chain, payloads)
    assert await store.flush(5)
    flipped = r.getrange(keys[1], HEADER_SIZE + 100, HEADER_SIZE + 100)
    r.setrange(keys[1], HEADER_SIZE + 100, bytes([flipped[0] ^ 0x01]))
    got = await fresh.fetch(NS, chain)
    assert got.n_chunks == 1 and [bytes(p) for p in got.payloads] == [payloads.expected(0)]
    assert fresh.counters.corrupt == 1
    assert r.exists(keys[1]) == 0, "a damaged value is deleted"
    assert (await fresh.lookup(NS, toks)).n_chunks == 1

    r.set(keys[3], r.get(keys[2]))  # a valid blob, but of another chunk
    await tier(fresh, "memory").delete(keys)  # type: ignore[attr-defined]
    await tier(fresh, "shared").delete(keys)  # type: ignore[attr-defined]
    got = await fresh.fetch(NS, chain[2:])  # chunk 2 is intact, chunk 3 holds chunk 2's blob
    assert got.n_chunks == 1 and fresh.counters.corrupt == 2 and r.exists(keys[3]) == 0


async def test_a_damaged_local_copy_falls_back_to_redis(store: TieredStore, shm_dir: Path) -> None:
    toks = tokens(7, 3)
    chain = chain_of(toks)
    payloads = Payloads(toks)
    await store.store(NS, chain, payloads)
    assert await store.flush(5)
    await tier(store, "memory").delete(keys_of(chain))  # type: ignore[attr-defined]
    from tiers.shared import file_name

    path = shm_dir / "a" / file_name(keys_of(chain)[1])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    got = await store.fetch(NS, chain)
    assert got.tiers == ["shared", "redis", "shared"]
    assert [bytes(p) for p in got.payloads] == [payloads.expected(i) for i in range(3)]
    assert store.counters.corrupt == 1
    assert bytes((await tier(store, "shared").get_many([keys_of(chain)[1]]))[keys_of(chain)[1]]) != bytes(data)  # type: ignore[attr-defined]


# -- whole states ---------------------------------------------------------------------------------


async def test_whole_state_store_and_fetch(store: TieredStore, fresh: TieredStore, redis_srv: RedisProc) -> None:
    """A whole, unsplit state under the key of its exact token sequence (the format ``purge`` still
    deletes): stored encoded on one node, read back verified on another, refused once damaged."""
    toks = list(range(700))
    state = bytes(range(256)) * 4096  # 1 MB
    h = sequence_key(NS, toks)
    key = whole_key(NS, h)
    await store.put_raw(key, store.codec.encode(state, chunk_hash=h, namespace_id=NS.digest[:8],
                                                n_tokens=len(toks), flags=Flags.WHOLE))
    assert await store.flush(5)
    found = await fresh.read_verified(key, h, NS)
    assert found is not None and bytes(found.payload) == state and found.tier == "redis"
    shorter = sequence_key(NS, toks[:-1])
    assert await fresh.read_verified(whole_key(NS, shorter), shorter, NS) is None
    r = raw(redis_srv)
    assert r.exists(key)
    r.setrange(key, HEADER_SIZE, b"\x00\x00\x00")
    other = make_store(redis_srv.url, Path(str(tier(fresh, "shared").path) + "-c"))  # type: ignore[attr-defined]
    assert await other.read_verified(key, h, NS) is None
    assert other.counters.corrupt == 1 and not r.exists(key)
    await other.aclose()


async def test_partial_tails_are_found_by_the_prompts_that_continue_them(
        store: TieredStore, fresh: TieredStore, redis_srv: RedisProc) -> None:
    toks = tokens(9, 3)
    chain = chain_of(toks)
    parent = chain[-1]
    short, long = [5, 6, 7], [5, 6, 7, 8, 9, 10]
    key_short = await store.store_tail(NS, parent, short, b"s" * 100)
    assert await store.flush(5)
    # Another node (empty local tiers) finds it in Redis; a longer one in its own RAM wins.
    key_long = await fresh.store_tail(NS, parent, long, b"l" * 100)
    hit = await fresh.lookup_tail(NS, parent, [5, 6, 7, 8, 9, 10, 11, 12])
    assert hit is not None and (hit.n_tokens, hit.key, hit.tier) == (6, key_long, "memory")
    found = await fresh.read_verified(hit.key, hit.hash, NS)
    assert found is not None and bytes(found.payload) == b"l" * 100
    # A prompt that continues only the short one, or neither, or after another chunk.
    hit = await fresh.lookup_tail(NS, parent, [5, 6, 7, 99, 9, 10, 11])
    assert hit is not None and (hit.n_tokens, hit.key, hit.tier) == (3, key_short, "redis")
    assert await fresh.lookup_tail(NS, parent, [5, 6]) is None
    assert await fresh.lookup_tail(NS, parent, [4, 6, 7, 8]) is None
    assert await fresh.lookup_tail(NS, chain[-2], [5, 6, 7, 8]) is None
    assert await fresh.lookup_tail(NS, parent, []) is None
    # A damaged tail is deleted, counted, and never returned.
    raw(redis_srv).setrange(key_short, HEADER_SIZE, b"\x00\x01")
    await tier(fresh, "memory").delete([key_short])  # type: ignore[attr-defined]
    await tier(fresh, "shared").delete([key_short])  # type: ignore[attr-defined]
    hit = await fresh.lookup_tail(NS, parent, [5, 6, 7, 0])
    assert hit is not None and await fresh.read_verified(hit.key, hit.hash, NS) is None
    assert fresh.counters.corrupt == 1 and not raw(redis_srv).exists(key_short)



async def test_a_replaced_tail_stays_in_redis_until_its_successor_is_written_and_a_grace_after(
        store: TieredStore, fresh: TieredStore, redis_srv: RedisProc) -> None:
    """A node's next save replaces its last tail with a longer one, which reaches Redis in the
    background. Until it has, and ``grace`` seconds after, Redis keeps the old one: another node
    that looked it up may still be fetching the chunks before it (when it was deleted at once,
    such a hop restored the chunks alone and recomputed the tail)."""
    parent = chain_of(tokens(10, 3))[-1]
    old = await store.store_tail(NS, parent, [5, 6, 7], b"o" * 100)
    assert await store.flush(5)
    hit = await fresh.lookup_tail(NS, parent, [5, 6, 7, 8, 9, 10])  # the other node looks it up
    assert hit is not None and hit.key == old
    raw(redis_srv).client_pause(10_000, all=False)  # EXISTS answers, SET waits
    try:
        new = await store.store_tail(NS, parent, [5, 6, 7, 8, 9], b"n" * 100)
        await store.delete_everywhere([old], grace=2)
        await wait_until(lambda: held_by_pause(redis_srv, "set"))
        assert raw(redis_srv).ttl(old) > 60 and not raw(redis_srv).exists(new)
        mine = await store.lookup_tail(NS, parent, [5, 6, 7, 8, 9, 10])  # this node: gone from its RAM
        assert mine is not None and (mine.key, mine.tier) == (new, "memory")
    finally:
        raw(redis_srv).client_unpause()
    assert await store.flush(5)
    assert raw(redis_srv).exists(new) and 0 < raw(redis_srv).ttl(old) <= 2
    again = await fresh.lookup_tail(NS, parent, [5, 6, 7, 8, 9, 10])  # a lookup from now on finds the new one
    assert again is not None and again.key == new
    got = await fresh.read_verified(hit.key, hit.hash, NS)  # the fetch after the first lookup finds the old
    assert got is not None and bytes(got.payload) == b"o" * 100
    # Read, it is kept as any value read is (its TTL renewed); unread, it goes after the grace.
    assert raw(redis_srv).ttl(old) > 60

# -- Redis dying ----------------------------------------------------------------------------------


async def wait_until(predicate: object, timeout: float = 5.0, poll: float = 0.01) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():  # type: ignore[operator]
        assert loop.time() < deadline, "condition not met"
        await asyncio.sleep(poll)


def held_by_pause(srv: RedisProc, command: str) -> bool:
    """Redis holds a client's ``command`` back (CLIENT PAUSE): it was sent and waits for its answer."""
    return any("b" in c["flags"] and c["cmd"] == command for c in raw(srv).client_list())


def redis_stats(store: TieredStore) -> TierStats:
    return store.stats()["redis"]


async def test_redis_killed_during_a_fetch(shm_dir: Path) -> None:
    clock = FakeClock()
    with redis_server() as srv:
        writer = make_store(srv.url, shm_dir / "w")
        toks = tokens(8, 6)
        chain = chain_of(toks)
        payloads = Payloads(toks)
        await writer.store(NS, chain, payloads)
        assert await writer.flush(5)
        reader = make_store(srv.url, shm_dir / "r", clock=clock)
        raw(srv).client_pause(10_000, all=False)  # GETEX ... EX is a write: the fetch hangs in Redis
        task = asyncio.create_task(reader.fetch(NS, chain))
        await wait_until(lambda: held_by_pause(srv, "getex"))
        assert not task.done()
        srv.stop()  # killed while the pipeline waits for its answer
        got = await asyncio.wait_for(task, 10)
        assert got.n_chunks == 0 and got.payloads == []
        assert redis_stats(reader).errors >= 1
        assert (await reader.lookup(NS, toks)).n_chunks == 0  # no exception either

        srv.start()  # same port, empty (no persistence)
        clock.now += 60  # past any breaker window
        await writer.store(NS, chain, payloads)  # local tiers have it; Redis gets it again
        assert await writer.flush(5)
        got = await reader.fetch(NS, chain)
        assert got.n_chunks == 6 and got.tiers == ["redis"] * 6
        assert redis_stats(reader).available
        await writer.aclose()
        await reader.aclose()


async def test_redis_killed_during_a_store(shm_dir: Path) -> None:
    clock = FakeClock()
    with redis_server() as srv:
        s = make_store(srv.url, shm_dir / "s", clock=clock)
        toks = tokens(9, 6)
        chain = chain_of(toks)
        payloads = Payloads(toks)
        assert await tier(s, "redis").ping()  # type: ignore[attr-defined]
        raw(srv).client_pause(10_000, all=False)  # EXISTS answers, SET hangs
        result = await asyncio.wait_for(s.store(NS, chain, payloads), 2)  # never waits on Redis
        assert result.chunks_written == 6
        await wait_until(lambda: held_by_pause(srv, "set"))
        assert s.queue_depth == 0 and not await s.flush(0.01)  # the writer is stuck in the SET pipeline
        srv.stop()
        assert await s.flush(10)
        assert s.counters.background_errors >= 1
        assert redis_stats(s).errors >= 1
        assert (await s.fetch(NS, chain)).tiers == ["memory"] * 6  # local tiers still serve it

        srv.start()
        clock.now += 60
        payloads.calls.clear()
        await s.store(NS, chain, payloads)
        assert await s.flush(5)
        assert sorted(payloads.calls) == list(range(6))  # encoded again, for Redis only
        assert raw(srv).dbsize() == 6
        assert redis_stats(s).available
        await s.aclose()


async def test_an_unreachable_redis_costs_misses_not_time(shm_dir: Path) -> None:
    from tests.servers import free_port

    s = make_store(f"redis://127.0.0.1:{free_port()}/0", shm_dir / "d", retries=0, connect_timeout=0.2)
    toks = tokens(10, 3)
    chain = chain_of(toks)
    for _ in range(5):
        await s.store(NS, chain, Payloads(toks))
        assert await s.flush(5)
        await tier(s, "memory").delete(keys_of(chain))  # type: ignore[attr-defined]
        await tier(s, "shared").delete(keys_of(chain))  # type: ignore[attr-defined]
        assert (await s.fetch(NS, chain)).n_chunks == 0
    st = redis_stats(s)
    assert not st.available and st.errors == 3  # the breaker opened after 3 failures
    assert tier(s, "redis").breaker_stats().skipped > 0  # type: ignore[attr-defined]
    await s.aclose()


async def test_aclose_drains_the_write_in_flight(redis_srv: RedisProc, shm_dir: Path) -> None:
    with redis.Redis(port=redis_srv.port) as r:
        r.flushdb()
        s = make_store(redis_srv.url, shm_dir / "c")
        toks = tokens(11, 3)
        await s.store(NS, chain_of(toks), Payloads(toks))
        await wait_until(lambda: s.queue_depth == 0, poll=0)  # the writer takes the job
        assert r.dbsize() == 0  # the write is not done
        await asyncio.wait_for(s.aclose(), 10)
        assert r.dbsize() == 3


class SizedPayloads(Payloads):
    """A payload source that tells each chunk's size before it is made (as a save's cut does), and
    records how full the RAM tier was when the store asked for the first one."""

    def __init__(self, toks: list[int], tier: MemoryTier):
        super().__init__(toks)
        self.tier = tier
        self.used_at_first: int | None = None

    def size_of(self, i: int) -> int:
        return PAYLOAD_BYTES + HEADER_SIZE

    def __call__(self, i: int) -> bytes:
        if self.used_at_first is None:
            self.used_at_first = self.tier.stats().bytes_used
        return super().__call__(i)


async def test_the_ram_tier_makes_room_before_a_save_is_cut() -> None:
    """A full RAM tier evicts what a save's chunks displace before they are cut, not after: the
    process holds the tier's budget and the new chunks, never the old values and the new ones."""
    value = PAYLOAD_BYTES + HEADER_SIZE
    ram = MemoryTier(10 * value)
    s = TieredStore([ram], BlobCodec("none"))
    old, new = tokens(300, 8), tokens(301, 6)
    await s.store(NS, chain_of(old), Payloads(old))
    assert ram.stats().bytes_used == 8 * value
    sized = SizedPayloads(new, ram)
    await s.store(NS, chain_of(new), sized)
    assert sized.used_at_first is not None and sized.used_at_first <= 4 * value  # room for 6 was made first
    assert all(await ram.contains_many(keys_of(chain_of(new))))
    assert ram.stats().bytes_used <= 10 * value
    await s.aclose()


async def test_room_made_before_a_fetch_spares_the_fetch_s_own_chunks() -> None:
    """Before a fetch whose chunks come from below the RAM tier (promoted there after the answer),
    the RAM tier evicts what they will displace, but never the chunks of that same prefix it holds."""
    value = PAYLOAD_BYTES + HEADER_SIZE
    ram = MemoryTier(10 * value)
    s = TieredStore([ram], BlobCodec("none"))
    own, other = tokens(310, 3), tokens(311, 6)
    await s.store(NS, chain_of(own), Payloads(own))  # the oldest: the first victims
    await s.store(NS, chain_of(other), Payloads(other))
    keep = keys_of(chain_of(own))
    s.make_room({"memory": 3 * value, "redis": 5 * value}, keep=keep)  # 5 chunks to come from Redis
    assert all(await ram.contains_many(keep))
    assert ram.stats().bytes_used <= 5 * value  # 4 of the other prefix's went, not the fetch's 3
    assert sum(await ram.contains_many(keys_of(chain_of(other)))) == 2
    ram.make_room(100 * value, keep=keep)  # more than the budget: all but the kept
    assert ram.stats().bytes_used == 3 * value
    await s.aclose()
