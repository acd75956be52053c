"""``bench capacity``'s replay on small synthetic traces: the ceiling, zero budgets, the prefix
rule, the real eviction policies behind the RAM tier, two levels, the trace reader and the CLI."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from bench.__main__ import BENCHMARKS
from bench.capacity import GIB, Setup, main, run_setup
from bench.trace_replay import (
    Level,
    RamLevel,
    RedisLevel,
    ReplayResult,
    Request,
    UnboundedLevel,
    load_trace,
    replay,
    trace_facts,
)


def chains(*blocks: Sequence[int]) -> list[Request]:
    """One request per chain, one token per block, a millisecond apart."""
    return [Request.of(t, len(ids), ids, block_tokens=1) for t, ids in enumerate(blocks)]


def run(requests: Sequence[Request], *levels: Level) -> ReplayResult:
    return asyncio.run(replay(requests, levels))


def conversations(seed: int = 3, n: int = 40, turns: int = 6, block_tokens: int = 8) -> list[Request]:
    """Conversations over a few shared system prompts, turns interleaved at random; a block id names
    its whole prefix (as the trace's ids do), and the last block of a turn is often partial."""
    rng = random.Random(seed)
    ids: dict[tuple[int, ...], int] = {}
    convs = [[rng.randrange(4)] * rng.randint(1, 3) for _ in range(n)]  # system prompt blocks
    pending = [(c, t) for c in range(n) for t in range(turns)]
    rng.shuffle(pending)
    pending.sort(key=lambda ct: ct[1])  # every turn after the one before it
    out = []
    for ts, (c, _) in enumerate(pending):
        convs[c] += [rng.randrange(1000) for _ in range(rng.randint(1, 3))]
        blocks = [ids.setdefault(tuple(convs[c][:i + 1]), len(ids)) for i in range(len(convs[c]))]
        tokens = len(blocks) * block_tokens - rng.randrange(block_tokens)
        out.append(Request.of(ts, tokens, blocks, block_tokens))
    return out


def test_an_unbounded_cache_hits_exactly_the_repeats_and_so_does_any_big_enough_budget() -> None:
    trace = conversations()
    facts = trace_facts(trace)
    assert 0.2 < facts.repeat_fraction < 0.8
    ceiling = run(trace, UnboundedLevel())
    assert (ceiling.hit_blocks, ceiling.hit_tokens) == (facts.repeat_blocks, facts.repeat_tokens)
    assert ceiling.held_blocks == ceiling.hit_blocks  # ids name prefixes: nothing is held past a gap
    assert (ceiling.blocks, ceiling.tokens) == (facts.blocks, facts.tokens)
    assert ceiling.written_tokens == (facts.distinct_tokens,)
    for level in (RamLevel(facts.distinct_tokens, "s3fifo"), RamLevel(facts.distinct_tokens, "lru"),
                  RedisLevel(facts.distinct_tokens)):
        assert run(trace, level) == ceiling, level.name
    smaller = [run(trace, RamLevel(facts.distinct_tokens // 4, p)).hit_blocks for p in ("s3fifo", "lru")]
    assert all(0 < hits < ceiling.hit_blocks for hits in smaller)


def test_a_zero_budget_hits_nothing() -> None:
    trace = conversations()
    for setup in (Setup("ram", ram_gib=0), Setup("redis", redis_gib=0), Setup("ram", ram_gib=1e-9)):
        assert setup.levels(8) == []
        result = run_setup(trace, setup, 8)
        assert (result.hit_blocks, result.hit_tokens, result.held_blocks) == (0, 0, 0)
        assert result.blocks == trace_facts(trace).blocks
    assert run(trace, RedisLevel(0)).hit_blocks == 0  # a budget below one block keeps nothing


def test_a_block_counts_only_when_every_block_before_it_hit() -> None:
    # Block 9 was never seen, so 2 and 3 behind it are held but cannot be restored.
    result = run(chains([1, 2, 3], [9, 2, 3], [1, 2, 5]), UnboundedLevel())
    assert (result.hit_blocks, result.held_blocks) == (0 + 0 + 2, 0 + 2 + 2)
    assert result.hit_tokens == 2 and result.held_tokens == 4
    assert result.hit_rate == pytest.approx(2 / 9) and result.held_rate == pytest.approx(4 / 9)


def test_the_ram_tier_evicts_by_its_real_policy() -> None:
    # A block used twice, then a scan of ten one-off blocks through a ten-block tier: LRU drops the
    # hot block; S3-FIFO promoted it to its main queue on its second use and keeps it.
    trace = chains([100], [100], *([i] for i in range(10)), [100])
    lru, s3fifo = (run(trace, RamLevel(10, p)) for p in ("lru", "s3fifo"))
    assert lru.hit_blocks == 1 and s3fifo.hit_blocks == 2


def test_a_ram_tier_in_front_of_redis_takes_redis_hits_up_and_hides_its_own_from_redis() -> None:
    ram, redis = RamLevel(2, "lru"), RedisLevel(100)
    # 1 leaves the 2-token RAM tier; Redis serves it and it is copied up, so next time RAM does.
    result = run(chains([1], [2], [3], [1], [1]), ram, redis)
    assert result.served_tokens == (1, 1) and result.hit_blocks == 2
    assert result.written_tokens == (3 + 1, 3)  # the copy up is a write into RAM, not into Redis
    assert asyncio.run(ram.holds([b"\1" + bytes(7)])) == [True]
    # Redis alone: reading 1 makes it more recent than 2, which goes when 3 arrives.
    keys = [k for r in chains([1], [2], [3]) for k in r.keys]
    redis = RedisLevel(2)
    run(chains([1], [2], [1], [3]), redis)
    assert asyncio.run(redis.holds(keys)) == [True, False, True]
    # Behind a RAM tier, that read never reaches Redis, whose LRU evicts the block RAM serves.
    ram, redis = RamLevel(100, "lru"), RedisLevel(2)
    run(chains([1], [2], [1], [3]), ram, redis)
    assert asyncio.run(redis.holds(keys)) == [False, True, True]


def test_load_trace_orders_by_time_and_sizes_the_partial_last_block(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 20, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
            {"timestamp": 10, "input_length": 1024, "output_length": 5, "hash_ids": [0, 3]},
            {"timestamp": 20, "input_length": 10, "output_length": 5, "hash_ids": [4]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    trace = load_trace(path)
    assert [r.blocks for r in trace] == [(0, 3), (0, 1, 2), (4,)]
    assert [r.sizes for r in trace] == [(512, 512), (512, 512, 76), (10,)]
    facts = trace_facts(trace)
    assert (facts.repeat_blocks, facts.duration_s, facts.reuse_gap_s) == (1, 0.01, (0.01, 0.01, 0.01))
    for bad in ('{"timestamp": 1}', "not json", '{"timestamp": 1, "input_length": 100, "hash_ids": [1, 2]}',
                '{"timestamp": 1, "input_length": 100, "hash_ids": ["a"]}', '[1]',
                '{"timestamp": 1, "input_length": 100, "hash_ids": [1e30]}',
                '{"timestamp": 1, "input_length": 100, "hash_ids": [100000000000000000000000]}'):
        path.write_text(json.dumps(rows[0]) + "\n" + bad + "\n")
        with pytest.raises(ValueError, match="trace.jsonl line 2: not a trace request"):
            load_trace(path)


def test_python_m_bench_capacity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert BENCHMARKS["capacity"] is main
    for bad in (["--budgets", "-1"], ["--jobs", "0"], ["--bytes-per-token", "0"], ["--policies", "fifo"]):
        with pytest.raises(SystemExit) as exc:
            main(bad)
        assert exc.value.code == 2
    assert main(["--trace", str(tmp_path / "absent.jsonl")]) == 2
    assert "no trace at" in capsys.readouterr().err
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": len(r.blocks) * 512 - 100,
                                         "hash_ids": list(r.blocks)}) + "\n" for r in conversations()))
    out = tmp_path / "capacity.json"
    # 4 KiB per token: a 512-token block is 2 MiB, so these budgets hold 8 and 32 blocks.
    assert main(["--trace", str(trace), "--bytes-per-token", "4096", "--budgets", "0.015625", "0.0625",
                 "--ram", "0.015625", "--jobs", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    names = [r["setup"] for r in doc["rows"]]
    assert names == ["unbounded", "ram s3fifo", "ram lru", "redis lru", "ram s3fifo", "ram lru", "redis lru",
                     "ram 0.015625 GiB s3fifo + redis lru"]
    assert doc["rows"][0]["hit_rate"] == doc["trace"]["repeat_fraction"] > 0
    assert all(0 < r["of_ceiling"] <= 1 for r in doc["rows"])
    assert "Hit rates on 240 requests" in capsys.readouterr().out
    # Only budget / bytes-per-token matters: 2.5x the KV and 2.5x the GiB give the same hits.
    requests = conversations(block_tokens=512)
    assert run_setup(requests, Setup("r", ram_gib=0.25), 4096) == run_setup(requests, Setup("r", ram_gib=0.625), 10240)
    assert GIB == 1 << 30
