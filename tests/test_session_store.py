"""SessionStore directly, with manifests in a real Valkey (shared by two nodes) and in the process:
save, load, fetch, touch, delete and list, tails replaced and removed, damage reported."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import redis

from tests.servers import RedisProc
from tests.test_redis_tier import FakeClock
from tiers.base import Tier
from tiers.codec import BlobCodec
from tiers.errors import TierUnavailable
from tiers.keys import Namespace, chunk_key, prefix_chain, session_key, session_tail_key
from tiers.memory import MemoryTier
from tiers.redis_backend import RedisBackend
from tiers.redis_manifests import RedisManifests
from tiers.redis_tier import RedisTier
from tiers.sessions import SessionError, SessionIncomplete, SessionNotFound, SessionStore
from tiers.store import REPLACED_GRACE_S, TieredStore

NS = Namespace("fp-session-store", chunk_tokens=4)
MB = 1 << 20


def payload(tokens: np.ndarray) -> bytes:
    """Bytes that depend only on the tokens (so equal prefixes have equal chunks, as real KV does)."""
    seed = hashlib.blake2b(tokens.astype("<i4").tobytes()).digest()
    return seed * 8


def chunk_payloads(tokens: np.ndarray) -> list[bytes]:
    C = NS.chunk_tokens
    return [payload(tokens[i * C:(i + 1) * C]) for i in range(tokens.size // C)]


def tail_payload(tokens: np.ndarray) -> bytes | None:
    cut = tokens.size // NS.chunk_tokens * NS.chunk_tokens
    return payload(tokens[cut:]) + b"tail" if tokens.size > cut else None


@dataclass
class Node:
    sessions: SessionStore
    store: TieredStore
    clock: FakeClock

    async def save(self, sid: str, tokens: list[int]) -> None:
        toks = np.asarray(tokens, dtype="<i4")
        chunks = chunk_payloads(toks)
        await self.sessions.save(NS, sid, toks, lambda i: chunks[i], tail_payload(toks), node="n")

    async def holds(self, key: bytes) -> bool:
        """Whether any tier holds ``key`` (after the background writes)."""
        await self.store.flush(5)
        return any([(await t.contains_many([key]))[0] for t in self.store.tiers])

    async def restored(self, sid: str) -> list[bytes]:
        manifest = await self.sessions.load(NS, sid)
        payloads, _ = await self.sessions.fetch(NS, manifest)
        return [bytes(p) for p in payloads]


def expected(tokens: list[int]) -> list[bytes]:
    toks = np.asarray(tokens, dtype="<i4")
    tail = tail_payload(toks)
    return chunk_payloads(toks) + ([tail] if tail is not None else [])


@pytest.fixture
def flushed(redis_srv: RedisProc) -> Iterator[RedisProc]:
    with redis.Redis(port=redis_srv.port) as r:
        r.flushdb()
    yield redis_srv


async def make_node(url: str | None) -> tuple[Node, RedisBackend | None]:
    clock = FakeClock()
    backend = RedisBackend.open(url, ttl=600) if url else None
    tiers: list[Tier] = [MemoryTier(16 * MB), *([backend.tier] if backend else [])]
    store = TieredStore(tiers, BlobCodec("none"))
    return Node(SessionStore(store, backend.manifests if backend else None, clock=clock), store, clock), backend


@pytest.fixture(params=["redis", "local"])
async def node(request: pytest.FixtureRequest) -> AsyncIterator[Node]:
    url = request.getfixturevalue("flushed").url if request.param == "redis" else None
    n, _ = await make_node(url)
    yield n
    await n.store.aclose()


@pytest.fixture
async def peer(flushed: RedisProc) -> AsyncIterator[Node]:
    """Another node on the same Valkey (its own memory tier)."""
    n, _ = await make_node(flushed.url)
    yield n
    await n.store.aclose()


TOKENS = list(range(100, 110))  # two chunks of 4 and a tail of 2


async def test_save_load_fetch(node: Node) -> None:
    await node.save("s1", TOKENS)
    m = await node.sessions.load(NS, "s1")
    assert (m.id, m.n_tokens, m.chunks, m.tail_tokens, m.chunk_tokens) == ("s1", 10, 2, 2, 4)
    assert m.tokens.tolist() == TOKENS and m.created == m.last_used == 1000.0 and m.node == "n"
    assert await node.restored("s1") == expected(TOKENS)
    assert node.sessions.shared == isinstance(node.sessions.manifests, RedisManifests)


async def test_a_session_of_whole_chunks_has_no_tail(node: Node) -> None:
    await node.save("even", TOKENS[:8])
    m = await node.sessions.load(NS, "even")
    assert m.tail_tokens == 0 and m.tail_hash == ""
    assert await node.restored("even") == expected(TOKENS[:8])


async def test_another_node_restores_a_session(node: Node, peer: Node) -> None:
    await node.save("hop", TOKENS)
    if node.sessions.shared:
        payloads, tier = await peer.sessions.fetch(NS, await peer.sessions.load(NS, "hop"))
        assert tier == "redis"  # the slowest tier it came from; promoted into the peer's memory since
        assert [bytes(p) for p in payloads] == expected(TOKENS)
        assert await peer.restored("hop") == expected(TOKENS)
    else:
        with pytest.raises(SessionNotFound):  # local manifests: this node only
            await peer.sessions.load(NS, "hop")


async def test_manifest_is_json_under_its_key_with_the_ttl(flushed: RedisProc, peer: Node) -> None:
    await peer.save("json", TOKENS)
    with redis.Redis(port=flushed.port) as r:
        raw = r.get(session_key(NS, "json"))
        assert raw is not None and raw.startswith(b'{"version":1,') and 590 <= r.ttl(session_key(NS, "json")) <= 600
        m = await peer.sessions.load(NS, "json")
        assert r.exists(session_tail_key(NS, "json", bytes.fromhex(m.tail_hash)))


async def test_saving_again_replaces_the_tail_and_keeps_created(node: Node) -> None:
    await node.save("s", TOKENS)
    first = await node.sessions.load(NS, "s")
    node.clock.now += 5
    longer = TOKENS + [7]
    await node.save("s", longer)
    second = await node.sessions.load(NS, "s")
    assert (second.created, second.last_used, second.n_tokens) == (1000.0, 1005.0, 11)
    assert second.tail_hash != first.tail_hash
    old_tail = session_tail_key(NS, "s", bytes.fromhex(first.tail_hash))
    assert await node.store.flush(5)
    # This node's tiers let the old tail go at once; Redis after a grace (another node may be
    # fetching it under the manifest it loaded before), then it is gone.
    assert [(await t.contains_many([old_tail]))[0] for t in node.store.tiers] == [t.write_behind for t in node.store.tiers]
    for t in node.store.tiers:
        if isinstance(t, RedisTier):
            assert 0 < await t.connection.client.ttl(old_tail) <= REPLACED_GRACE_S
    assert await node.restored("s") == expected(longer)


async def test_touch_records_a_use_but_never_brings_a_session_back(node: Node) -> None:
    await node.save("t", TOKENS)
    m = await node.sessions.load(NS, "t")
    node.clock.now += 30
    await node.sessions.touch(NS, m)
    assert (await node.sessions.load(NS, "t")).last_used == 1030.0
    assert await node.sessions.delete(NS, "t")
    await node.sessions.touch(NS, m)
    with pytest.raises(SessionNotFound):
        await node.sessions.load(NS, "t")


async def test_delete_removes_the_manifest_and_tail_not_the_chunks(node: Node) -> None:
    await node.save("d", TOKENS)
    await node.save("d2", TOKENS)  # shares the chunks
    m = await node.sessions.load(NS, "d")
    assert await node.sessions.delete(NS, "d")
    assert not await node.sessions.delete(NS, "d")
    with pytest.raises(SessionNotFound):
        await node.sessions.load(NS, "d")
    tail = session_tail_key(NS, "d", bytes.fromhex(m.tail_hash))
    assert not await node.holds(tail)
    assert await node.restored("d2") == expected(TOKENS)


async def test_list_sorts_filters_and_pages(node: Node) -> None:
    for sid in ("b-2", "a-1", "b-1", "b-3", "c"):
        await node.save(sid, TOKENS[:5])
    other = Namespace("fp-other", chunk_tokens=4)
    await node.sessions.save(other, "b-0", TOKENS[:4], lambda i: b"x" * 32, None)

    async def ids(prefix: str = "", after: str = "", limit: int = 100) -> list[str]:
        return [m.id for m in await node.sessions.list(NS, prefix, after=after, limit=limit)]

    assert await ids() == ["a-1", "b-1", "b-2", "b-3", "c"]
    assert await ids("b-") == ["b-1", "b-2", "b-3"]
    assert await ids("b-", after="b-1", limit=1) == ["b-2"]
    assert await ids("zz") == []
    with pytest.raises(ValueError):
        await ids("b*")


async def test_a_lost_chunk_or_tail_is_reported(node: Node) -> None:
    await node.save("lost", TOKENS)
    m = await node.sessions.load(NS, "lost")
    await node.store.delete_everywhere([session_tail_key(NS, "lost", bytes.fromhex(m.tail_hash))])
    with pytest.raises(SessionIncomplete, match="tail"):
        await node.sessions.fetch(NS, m)
    await node.save("lost", TOKENS)
    await node.store.delete_everywhere([chunk_key(NS, prefix_chain(NS, TOKENS)[1])])
    with pytest.raises(SessionIncomplete, match="1 of 2 chunks"):
        await node.sessions.fetch(NS, await node.sessions.load(NS, "lost"))


async def test_bad_input_and_damaged_manifests(node: Node) -> None:
    with pytest.raises(ValueError):
        await node.save("-bad", TOKENS)
    with pytest.raises(ValueError, match="tail"):
        await node.sessions.save(NS, "s", TOKENS, lambda i: b"x", None)
    await node.sessions.manifests.set(session_key(NS, "junk"), b"{not json")
    with pytest.raises(SessionError, match="not JSON"):
        await node.sessions.load(NS, "junk")


async def test_unreachable_redis_is_not_a_missing_session(flushed: RedisProc, peer: Node) -> None:
    await peer.save("up", TOKENS)
    other, _ = await make_node(flushed.url)
    flushed.stop()
    try:
        with pytest.raises(TierUnavailable):  # a node without a copy cannot tell
            await other.sessions.load(NS, "up")
        assert (await peer.sessions.load(NS, "up")).n_tokens == len(TOKENS)  # the copy of the node that saved it
    finally:
        flushed.start()
        await other.store.aclose()
