"""SharedTier: safe file names, atomic replace, mmap lifetime, eviction, and real processes racing."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from tiers.codec import BlobCodec
from tiers.errors import CodecError, ConfigError
from tiers.shared import SharedTier, file_name

MB = 1 << 20


def key(i: int | str) -> bytes:
    return f"kvtier:0123456789abcdef:c:{i}".encode()


# -- names and settings ---------------------------------------------------------------------------


def test_file_names_are_safe_and_distinct() -> None:
    keys = [b"kvtier:ns:c:00ff", b"../../etc/passwd", b"/abs/path", b"a\x00b", b".tmp-1-2", b"", b"x" * 120,
            b"x" * 121, b"x" * 1000, b"y" * 1000]
    names = [file_name(k) for k in keys]
    assert len(set(names)) == len(names)
    for name in names:
        assert "/" not in name and name not in ("", ".", "..") and not name.startswith(".")
        assert len(name) <= 241
    assert file_name(b"kvtier:ns:c:00ff") == b"kvtier:ns:c:00ff".hex()
    with pytest.raises(TypeError):
        file_name("not bytes")  # type: ignore[arg-type]


async def test_hostile_keys_stay_inside_the_directory(shm_dir: Path) -> None:
    tier = SharedTier(shm_dir / "tier", MB)
    hostile = [b"../escape", b"../../../../tmp/kvtier-escape", b"/tmp/kvtier-abs", b"sub/dir"]
    assert await tier.put_many({k: b"v" for k in hostile}) == len(hostile)
    assert sorted(p.parent for p in (shm_dir / "tier").iterdir()) == [shm_dir / "tier"] * len(hostile)
    assert list(shm_dir.iterdir()) == [shm_dir / "tier"]
    assert not Path("/tmp/kvtier-abs").exists()


@pytest.mark.parametrize("capacity", [0, -1, "-1G", "lots", "1.5 parsecs", True])
def test_bad_capacity(shm_dir: Path, capacity: object) -> None:
    with pytest.raises(ConfigError):
        SharedTier(shm_dir, capacity)  # type: ignore[arg-type]


def test_bad_paths_and_settings(shm_dir: Path) -> None:
    (shm_dir / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a directory|cannot be created"):
        SharedTier(shm_dir / "file", MB)
    with pytest.raises(ConfigError, match="cannot be created"):
        SharedTier(shm_dir / "file" / "below", MB)
    with pytest.raises(ConfigError):
        SharedTier(shm_dir, MB, rescan_interval=0)
    assert SharedTier(shm_dir, "2M").capacity == 2 * MB


# -- sharing, atomicity, lifetime -----------------------------------------------------------------


async def test_two_instances_share_the_directory(shm_dir: Path) -> None:
    a, b = SharedTier(shm_dir, 8 * MB), SharedTier(shm_dir, 8 * MB)
    await a.put_many({key(1): b"from a" * 1000})
    assert bytes((await b.get_many([key(1)]))[key(1)]) == b"from a" * 1000
    assert await b.delete([key(1)]) == 1
    assert await a.get_many([key(1)]) == {}


async def test_mapped_value_survives_replace_and_eviction(shm_dir: Path) -> None:
    tier = SharedTier(shm_dir, 4 * MB)
    old = os.urandom(MB)
    await tier.put_many({key("m"): old})
    view = (await tier.get_many([key("m")]))[key("m")]
    assert isinstance(view, memoryview)  # mapped, not copied
    await tier.put_many({key("m"): b"n" * MB})  # replaced under the reader
    assert bytes(view) == old
    await tier.put_many({key(i): os.urandom(MB) for i in range(6)})  # evicts the new "m" as well
    assert bytes(view) == old
    await tier.delete([key("m")])
    assert bytes(view) == old
    assert not list(shm_dir.glob(".tmp-*"))


async def test_small_values_are_read_not_mapped(shm_dir: Path) -> None:
    tier = SharedTier(shm_dir, MB)
    await tier.put_many({key("s"): b"small"})
    got = (await tier.get_many([key("s")]))[key("s")]
    assert got == b"small" and isinstance(got, bytes)


# -- budget and eviction --------------------------------------------------------------------------


async def test_budget_evicts_least_recently_used(shm_dir: Path) -> None:
    tier = SharedTier(shm_dir, 10 * MB)
    for i in range(8):
        await tier.put_many({key(i): os.urandom(MB)})
    await tier.get_many([key(0)])  # 0 is now the most recently used
    for i in range(8, 12):
        await tier.put_many({key(i): os.urandom(MB)})
    present = await tier.contains_many([key(i) for i in range(12)])
    assert present[0], "a value read recently must survive"
    assert not present[1] and not present[2], "the least recently used go first"
    assert all(present[8:])
    used = sum(p.stat().st_size for p in shm_dir.iterdir())
    assert used <= 10 * MB
    st = tier.stats()
    assert st.evictions >= 2 and st.bytes_used == used and st.capacity == 10 * MB
    assert st.entries == sum(present)


async def test_a_chain_keeps_its_root(shm_dir: Path) -> None:
    tier = SharedTier(shm_dir, 10 * MB)
    chain = {key(f"c{i}"): os.urandom(MB) for i in range(6)}
    await tier.put_many(chain)  # root first in the mapping: the root gets the newest time
    await tier.put_many({key(f"other{i}"): os.urandom(MB) for i in range(6)})
    present = await tier.contains_many(list(chain))
    assert present[0] and not present[-1], present
    assert present == sorted(present, reverse=True), "evicted from the deep end of the chain"


async def test_a_batch_larger_than_the_budget_keeps_its_leading_chunks(shm_dir: Path) -> None:
    tier = SharedTier(shm_dir, 3 * MB)
    chain = {key(i): os.urandom(MB) for i in range(5)}
    assert await tier.put_many(chain) == 3
    assert await tier.contains_many(list(chain)) == [True, True, True, False, False]


async def test_files_vanishing_and_stale_temps_are_tolerated(shm_dir: Path) -> None:
    tier = SharedTier(shm_dir, 4 * MB, rescan_interval=0.01)
    await tier.put_many({key(i): os.urandom(MB) for i in range(3)})
    for p in list(shm_dir.iterdir())[:2]:
        p.unlink()  # another process evicted them
    stale = shm_dir / ".tmp-999999-dead"
    stale.write_bytes(b"x" * 1000)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    fresh = shm_dir / ".tmp-999999-live"
    fresh.write_bytes(b"x" * 1000)
    await asyncio.sleep(0.02)
    assert await tier.put_many({key(9): os.urandom(MB)}) == 1
    assert not stale.exists() and fresh.exists()  # a live writer's temp file is left alone
    assert tier.stats().bytes_used == 2 * MB + 1000
    assert len(await tier.get_many([key(0), key(1), key(2)])) == 1  # the vanished ones are misses
    assert tier.stats().errors == 0


# -- real processes -------------------------------------------------------------------------------

CODEC = BlobCodec("none")
HASH = bytes(range(16))
NS = b"nsnsnsns"
KEYS = [key(f"race{i}") for i in range(4)]


def _blob(writer: int, n: int) -> bytes:
    size = 64 * 1024 * (1 + (writer + n) % 6)  # 64-384 KB: mapped, and of varying sizes
    payload = bytes([(writer * 31 + n) % 251]) * size
    return CODEC.encode(payload, chunk_hash=HASH, namespace_id=NS, n_tokens=n)


def _race_worker(path: str, role: str, ident: int, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    reads = writes = bad = errors = 0
    try:
        tier = SharedTier(path, MB, rescan_interval=0.05)  # small budget: evictions race the readers
        deadline = time.monotonic() + seconds
        n = 0
        while time.monotonic() < deadline:
            n += 1
            if role == "writer":
                items = {KEYS[n % len(KEYS)]: _blob(ident, n), KEYS[(n + 1) % len(KEYS)]: _blob(ident, n + 1)}
                writes += tier.put_many_sync(items)
            for value in tier.get_many_sync(KEYS).values():
                try:
                    blob = CODEC.decode(value, chunk_hash=HASH, namespace_id=NS)
                    if bytes(blob.payload[:1]) * len(blob.payload) != bytes(blob.payload):
                        raise CodecError("mixed payload")
                    reads += 1
                except CodecError:
                    bad += 1
        errors = tier.stats().errors
    except Exception as exc:
        errors = -1
        bad = f"{type(exc).__name__}: {exc}"  # type: ignore[assignment]
    out.put((role, ident, reads, writes, bad, errors))


def test_processes_racing_never_see_a_torn_value(shm_dir: Path) -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    roles = [("writer", 0), ("writer", 1), ("reader", 2), ("reader", 3)]
    procs = [ctx.Process(target=_race_worker, args=(str(shm_dir), role, i, 2.0, out)) for role, i in roles]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    codes = [p.exitcode for p in procs]
    assert codes == [0] * len(procs), f"workers died (a negative code is a signal, -7 SIGBUS): {codes}"
    results = [out.get(timeout=10) for _ in procs]
    total_reads = sum(r[2] for r in results)
    assert sum(r[3] for r in results) > 50, results
    assert total_reads > 100, results
    assert all(r[4] == 0 for r in results), f"torn or damaged values read: {results}"
    assert all(r[5] == 0 for r in results), results
    assert sum(p.stat().st_size for p in shm_dir.iterdir()) <= 2 * MB
