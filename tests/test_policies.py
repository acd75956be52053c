"""Eviction policies and the memory tier's budget, on a skewed multi-session trace."""

from __future__ import annotations

import random

import pytest

from tiers.base import parse_size
from tiers.errors import ConfigError
from tiers.memory import MemoryTier
from tiers.policies import LRUPolicy, S3FIFOPolicy, make_policy


def simulate(policy_name: str, trace: list[list[bytes]], capacity_entries: int, size: int = 100) -> float:
    """Hit rate (per chunk, prefix semantics) of a MemoryTier of ``capacity_entries`` chunks."""
    tier = MemoryTier(capacity_entries * size, policy=policy_name)
    hits = total = 0
    for chain in trace:
        found = tier.get_many_sync(chain)
        # a prefix lookup stops at the first gap
        n = next((i for i, k in enumerate(chain) if k not in found), len(chain))
        hits += n
        total += len(chain)
        tier.put_many_sync({k: b"x" * size for k in chain[n:]})
    return hits / total


def multi_session_trace(seed: int = 7, requests: int = 4000) -> list[list[bytes]]:
    """Zipf-popular system prompts with growing conversations, plus one-off single requests."""
    rng = random.Random(seed)
    prompts = [[f"sys{p}-{i}".encode() for i in range(4)] for p in range(20)]
    weights = [1 / (r + 1) ** 1.1 for r in range(len(prompts))]
    sessions: dict[int, list[bytes]] = {}
    trace = []
    for n in range(requests):
        if rng.random() < 0.45:  # one-hit wonder: a long document read once
            trace.append([f"once{n}-{i}".encode() for i in range(6)])
            continue
        sid = rng.randrange(60)
        if sid not in sessions:
            p = rng.choices(range(len(prompts)), weights)[0]
            sessions[sid] = list(prompts[p])
        sessions[sid].append(f"s{sid}-{len(sessions[sid])}".encode())
        if len(sessions[sid]) > 14:
            del sessions[sid]
            continue
        trace.append(list(sessions[sid]))
    return trace


def test_s3fifo_beats_lru_on_a_skewed_multi_session_trace() -> None:
    trace = multi_session_trace()
    results = {(p, c): simulate(p, trace, c) for p in ("lru", "s3fifo") for c in (100, 200, 400)}
    for c in (100, 200, 400):
        assert results[("s3fifo", c)] > results[("lru", c)], results


def test_lru_order_and_prefix_awareness() -> None:
    tier = MemoryTier(300, policy="lru")
    tier.put_many_sync({b"root": b"x" * 100, b"child": b"x" * 100, b"grandchild": b"x" * 100})
    tier.put_many_sync({b"other": b"x" * 100})
    # all three were equally cold; the deepest goes first
    assert set(tier._data) == {b"root", b"child", b"other"}
    tier.get_many_sync([b"root", b"child"])
    tier.put_many_sync({b"new": b"x" * 100})
    assert b"other" not in tier._data and b"root" in tier._data


def test_memory_tier_budget_and_stats() -> None:
    tier = MemoryTier(1000, policy="s3fifo")
    tier.put_many_sync({f"k{i}".encode(): b"v" * 100 for i in range(30)})
    st = tier.stats()
    assert st.bytes_used <= 1000 and st.entries <= 10 and st.evictions >= 20
    assert tier.put_many_sync({b"huge": b"v" * 2000}) == 0  # larger than the tier: not cached
    tier.put_many_sync({b"k": b"a" * 100})
    tier.put_many_sync({b"k": b"b" * 50})  # overwrite adjusts the accounting
    assert tier.get_many_sync([b"k"])[b"k"] == b"b" * 50
    assert tier.stats().bytes_used == sum(len(v) for v in tier._data.values())


def test_policy_and_size_errors() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("random", 100)
    with pytest.raises(ConfigError):
        MemoryTier(0)
    with pytest.raises(ValueError):
        S3FIFOPolicy(0)
    assert isinstance(make_policy("lru", 1), LRUPolicy)
    assert parse_size("2G") == 2 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5k") == 1536
    assert parse_size(42) == 42
    for bad in ["-1G", "two gigs", "", "1X", "1e99G", True, 1.5, -5]:
        with pytest.raises(ConfigError):
            parse_size(bad)  # type: ignore[arg-type]
