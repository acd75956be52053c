"""The Tier contract, run once against every tier: memory, shared files, Valkey, Valkey Cluster."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tiers.base import Tier, TierRole, TierStats
from tiers.codec import BlobCodec
from tiers.keys import Namespace, prefix_chain
from tiers.memory import MemoryTier
from tiers.redis_tier import RedisTier
from tiers.shared import SharedTier
from tiers.store import TieredStore

CAPACITY = 64 << 20
KINDS = ["memory", "shared", "redis", "redis_cluster"]


@pytest.fixture(params=KINDS)
async def tier(request: pytest.FixtureRequest, shm_dir: Path) -> AsyncIterator[Tier]:
    kind = request.param
    t: Tier
    if kind == "memory":
        t = MemoryTier(CAPACITY)
    elif kind == "shared":
        t = SharedTier(shm_dir, CAPACITY)
    elif kind == "redis":
        srv = request.getfixturevalue("redis_srv")
        t = RedisTier(srv.url, ttl=600)
        assert await t.ping()
        await t.connection.client.flushdb()  # each test starts from an empty store
    else:
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        t = RedisTier(cluster.url, ttl=600)
    yield t
    await t.aclose()


def key(i: int | str) -> bytes:
    return f"kvtier:0123456789abcdef:c:{i}".encode()


def value(i: int, size: int = 1000) -> bytes:
    seed = hashlib.blake2b(str(i).encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


async def test_is_a_tier(tier: Tier) -> None:
    assert isinstance(tier, Tier)
    assert isinstance(tier.name, str) and tier.name
    assert isinstance(tier.stats(), TierStats)
    assert isinstance(tier.role, TierRole) and isinstance(tier.write_behind, bool)
    # Only remote tiers are written behind the request; names stay what stats and headers show.
    assert tier.write_behind == (tier.role is TierRole.REMOTE)
    assert tier.name == {TierRole.LOCAL: "memory", TierRole.NODE: "shared", TierRole.REMOTE: "redis"}[tier.role]


class Remote(MemoryTier):
    """A remote tier by role, whatever its name."""

    role = TierRole.REMOTE
    write_behind = True


async def test_the_store_writes_behind_by_role_not_by_name() -> None:
    ns = Namespace("fp-roles", chunk_tokens=4)
    chain = prefix_chain(ns, list(range(8)))
    named_redis = MemoryTier(CAPACITY, name="redis")  # a local tier, whatever its name
    remote = Remote(CAPACITY, name="far")
    store = TieredStore([named_redis, remote], BlobCodec("none"))
    result = await store.store(ns, chain, lambda i: bytes([i]) * 100)
    assert result.chunks_written == 2  # written in the request: the synchronous tier
    assert named_redis.stats().puts == 2
    assert remote.stats().puts == 0  # queued: the request did not wait for it
    assert await store.flush(5)
    assert remote.stats().puts == 2
    await store.aclose()


async def test_miss_is_an_absent_key(tier: Tier) -> None:
    assert await tier.get_many([key("nope")]) == {}
    assert await tier.contains_many([key("nope")]) == [False]
    assert await tier.delete([key("nope")]) == 0


async def test_empty_inputs(tier: Tier) -> None:
    assert await tier.get_many([]) == {}
    assert await tier.put_many({}) == 0
    assert await tier.contains_many([]) == []
    assert await tier.delete([]) == 0


async def test_put_then_get_contains_delete(tier: Tier) -> None:
    items = {key(i): value(i) for i in range(3)}
    assert await tier.put_many(items) == 3
    got = await tier.get_many([key(0), key("gap"), key(1), key(2)])
    assert set(got) == set(items)
    assert all(bytes(got[k]) == v for k, v in items.items())
    assert await tier.contains_many([key(2), key("gap"), key(0)]) == [True, False, True]
    assert await tier.delete([key(1), key("gap")]) == 1
    assert await tier.contains_many([key(0), key(1), key(2)]) == [True, False, True]
    assert set(await tier.get_many(list(items))) == {key(0), key(2)}


async def test_expire_lets_keys_go_within_the_time_given(tier: Tier) -> None:
    await tier.put_many({key(i): value(i) for i in range(3)})
    assert await tier.expire([key(0), key("gap"), key(1)], 1) == 2
    # A remote tier keeps them readable until then (another node may be fetching one); the
    # others, read on this node alone, let them go at once.
    assert await tier.contains_many([key(0), key(1), key(2)]) == [tier.write_behind, tier.write_behind, True]
    deadline = asyncio.get_running_loop().time() + 3
    while any(await tier.contains_many([key(0), key(1)])):
        assert asyncio.get_running_loop().time() < deadline, "still held past its expiry"
        await asyncio.sleep(0.05)
    assert await tier.contains_many([key(2)]) == [True]
    assert await tier.expire([], 1) == 0


async def test_overwrite_replaces_the_value(tier: Tier) -> None:
    await tier.put_many({key("k"): b"first" * 100})
    await tier.put_many({key("k"): b"second" * 10})
    got = await tier.get_many([key("k")])
    assert bytes(got[key("k")]) == b"second" * 10


async def test_keys_are_exact_bytes(tier: Tier) -> None:
    odd = [b"a", b"a\x00", b"A", b"../../etc/passwd", b"x/y:z{tag}", "ключ".encode(), b"\xff\xfe" * 80]
    assert await tier.put_many({k: k * 3 for k in odd}) == len(odd)
    got = await tier.get_many(odd)
    assert {k: bytes(v) for k, v in got.items()} == {k: k * 3 for k in odd}


async def test_large_values(tier: Tier) -> None:
    big = {key(f"big{i}"): os.urandom(6 << 20) for i in range(2)}
    assert await tier.put_many(big) == 2
    got = await tier.get_many(list(big))
    for k, v in big.items():
        assert len(got[k]) == len(v)
        assert hashlib.blake2b(got[k]).digest() == hashlib.blake2b(v).digest()


async def test_many_keys(tier: Tier) -> None:
    items = {key(i): value(i, 200) for i in range(2000)}
    assert await tier.put_many(items) == 2000
    probe = [key(i) for i in range(0, 4000, 3)]  # every third, half of them beyond the stored range
    got = await tier.get_many(probe)
    assert set(got) == {k for k in probe if k in items}
    assert all(bytes(got[k]) == items[k] for k in got)
    assert await tier.contains_many(probe) == [k in items for k in probe]
    assert await tier.delete(list(items)[:500]) == 500
    assert sum(await tier.contains_many(list(items))) == 1500


async def test_concurrent_calls(tier: Tier) -> None:
    async def worker(w: int) -> None:
        items = {key(f"w{w}-{i}"): value(w * 100 + i) for i in range(20)}
        assert await tier.put_many(items) == 20
        got = await tier.get_many(list(items))
        assert {k: bytes(v) for k, v in got.items()} == items

    await asyncio.gather(*(worker(w) for w in range(8)))


async def test_stats_counters_move(tier: Tier) -> None:
    before = tier.stats()
    await tier.put_many({key(1): value(1, 500), key(2): value(2, 300)})
    await tier.get_many([key(1), key(2), key("missing")])
    after = tier.stats()
    assert after.tier == tier.name
    assert after.puts - before.puts == 2
    assert after.bytes_in - before.bytes_in == 800
    assert after.hits - before.hits == 2
    assert after.misses - before.misses == 1
    assert after.bytes_out - before.bytes_out == 800
    assert after.errors == before.errors == 0
    assert after.available
    assert 0 < after.hit_rate <= 1
