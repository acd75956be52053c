"""Hardening of the storage side: forged chunks, the keyed MAC, damaged manifests, sessions while
Redis is down, a small slot dir, damaged tails and the breaker after a long outage."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import redis

from integrations.kvflow import fetch_prefix, find_prefix
from sidecar.app import build_store
from sidecar.config import Settings
from tests.servers import DEFAULT_LLAMA_ARGS, LlamaServer, RedisProc, llama_server, redis_server, smollm2_path
from tests.sidecars import Answer, Sidecar, post, run_sidecar
from tests.test_sessions_api import AUTH, TOKEN, call
from tiers.codec import BlobCodec, Flags
from tiers.keys import Namespace, chunk_key, prefix_chain, session_key, tail_hash_after, tail_key
from tiers.memory import MemoryTier
from tiers.redis_conn import RedisConnection
from tiers.redis_tier import RedisTier
from tiers.store import TieredStore

pytestmark = pytest.mark.llama

CHUNK = 64
KV_BYTES_PER_TOKEN = 23040  # SmolLM2-135M, f16 K and V
DOC = " ".join(f"Entry {i}: the {['red', 'blue', 'green', 'grey'][i % 4]} box holds {i * 7} coins." for i in range(40))


def settings(llama: LlamaServer, redis_url: str | None, node: str, **kw: object) -> Settings:
    base = Settings(llama_url=llama.url, slot_dir=str(llama.slot_dir), redis_url=redis_url, node_id=node,
                    chunk_tokens=CHUNK, cache_size=256 << 20, auth_token=TOKEN, prefill_tps_prior=100.0)
    return replace(base, **kw)  # type: ignore[arg-type]


def completion(text: str, n: int = 4) -> dict[str, object]:
    return {"prompt": text, "n_predict": n, "temperature": 0}


@dataclass
class Pair:
    a: Sidecar
    b: Sidecar
    redis: RedisProc

    def raw(self) -> redis.Redis:
        return redis.Redis(port=self.redis.port)


@pytest_asyncio.fixture(scope="module")
async def pair(redis_srv: RedisProc, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pair]:
    tmp: Path = tmp_path_factory.mktemp("hardening")
    with llama_server(tmp) as la, llama_server(tmp) as lb:
        async with run_sidecar(settings(la, redis_srv.url, "a")) as a, run_sidecar(settings(lb, redis_srv.url, "b")) as b:
            for node in (a, b):  # these tests are of what a restore does: every one here is worth it
                node.pin_prefill_rate(100.0)
            yield Pair(a, b, redis_srv)


async def settle(node: Sidecar) -> None:
    await node.engine.drain(60)
    await node.store.flush(30)


def forge(r: redis.Redis, ns: Namespace, chain: list[bytes], victim: int, source: int, ttl: int = 100) -> bytes:
    """Put chunk ``source``'s cells under chunk ``victim``'s key, with a valid checksum (as anyone
    who can write to Redis can); returns the victim's key."""
    codec = BlobCodec("none")
    payload = codec.decode(r.get(chunk_key(ns, chain[source]))).payload  # type: ignore[arg-type]
    key = chunk_key(ns, chain[victim])
    r.set(key, codec.encode(payload, chunk_hash=chain[victim], namespace_id=ns.digest[:8], n_tokens=CHUNK), ex=ttl)
    return key


# -- 5: a chunk whose cells are not the ones its key names ---------------------------------------


async def test_a_forged_chunk_is_deleted_counted_and_the_chunks_before_it_restored(pair: Pair) -> None:
    a, b = pair.a, pair.b
    prompt = completion("Forgery test. " + DOC[:900] + "\nQuestion: which box holds 49 coins?\nAnswer:")
    first = await post(a.url + "/completion", prompt)
    assert first.status == 200
    await settle(a)
    ns = a.engine.target.namespace
    chain = prefix_chain(ns, a.engine.slots.tokens(int(first.headers["X-KVTier-Slot"])))
    assert len(chain) >= 4
    r = pair.raw()
    key = forge(r, ns, chain, victim=2, source=3)
    errors = b.metric("kvtier_cache_errors_total", stage="restore")
    corrupt = b.store.counters.corrupt
    on_b = await post(b.url + "/completion", prompt)
    assert on_b.status == 200
    assert on_b.restored == 2 * CHUNK, on_b.headers  # the chunks before the forged one
    assert b.store.counters.corrupt == corrupt + 1 and not r.exists(key)
    assert b.metric("kvtier_cache_errors_total", stage="restore") == errors  # not a failed restore


async def test_a_forged_session_chunk_is_deleted_and_counted(pair: Pair) -> None:
    a, b = pair.a, pair.b
    sid = "forged-" + uuid.uuid4().hex[:6]
    first = await post(a.url + "/completion", completion("Session forgery. " + DOC[200:1300] + "\nAnswer:"),
                       headers={**AUTH, "X-Session-Id": sid})
    assert first.status == 200
    await settle(a)
    status, shown = await call("GET", a.url + f"/v1/sessions/{sid}")
    assert status == 200 and shown["chunks"] >= 3, shown
    ns = a.engine.target.namespace
    manifest = await a.engine.sessions.load(ns, sid)
    chain = prefix_chain(ns, manifest.tokens, manifest.chunks)
    r = pair.raw()
    key = forge(r, ns, chain, victim=1, source=2)
    corrupt = b.store.counters.corrupt
    status, body = await call("POST", b.url + f"/v1/sessions/{sid}/restore")
    assert status == 410, body  # incomplete: a chunk is gone (before: a 502 from assembling it)
    assert b.store.counters.corrupt == corrupt + 1 and not r.exists(key)


async def test_a_value_that_fails_verification_keeps_its_ttl() -> None:
    """A read that rejects a value does not extend its life (here DEL is disabled, so only the TTL
    can end it)."""
    ns = Namespace("ttl-test", "", CHUNK)
    with redis_server("--rename-command", "DEL", '""') as srv:
        store = TieredStore([RedisTier(srv.url, ttl=86400)], BlobCodec("none"))
        r = redis.Redis(port=srv.port)
        chain = prefix_chain(ns, np.arange(CHUNK, dtype=np.int32))
        key = chunk_key(ns, chain[0])
        blob = bytearray(BlobCodec("none").encode(b"x" * 1000, chunk_hash=chain[0], namespace_id=ns.digest[:8],
                                                  n_tokens=CHUNK))
        blob[-1] ^= 1
        r.set(key, bytes(blob), ex=100)
        got = await store.fetch(ns, chain)
        assert got.n_chunks == 0 and store.counters.corrupt == 1
        assert 0 < r.ttl(key) <= 100
        good = {chunk_key(ns, chain[0]): BlobCodec("none").encode(b"y" * 10, chunk_hash=chain[0],
                                                                  namespace_id=ns.digest[:8], n_tokens=CHUNK)}
        r.set(key, good[key], ex=100)
        assert (await store.fetch(ns, chain)).n_chunks == 1
        assert r.ttl(key) > 100  # a verified read does refresh it
        await store.aclose()


# -- 5: the keyed MAC ----------------------------------------------------------------------------


async def test_keyed_values_are_read_only_with_the_key(redis_srv: RedisProc, tmp_path: Path) -> None:
    ns = Namespace("mac-test", "", CHUNK)
    chain = prefix_chain(ns, np.arange(2 * CHUNK, dtype=np.int32))
    secret = b"a shared secret of the fleet"
    r = redis.Redis(port=redis_srv.port)

    def store(key: bytes | None) -> TieredStore:
        return TieredStore([RedisTier(redis_srv.url)], BlobCodec("none", mac_key=key))

    writer = store(secret)
    await writer.store(ns, chain, lambda i: bytes([i]) * 4096)
    assert await writer.flush(10)
    same = store(secret)
    assert (await same.fetch(ns, chain)).payloads == [b"\x00" * 4096, b"\x01" * 4096]
    # A reader without the key, or with another, gets nothing it cannot check (and drops it).
    unkeyed, other = store(None), store(b"another secret, same length!")
    assert (await unkeyed.fetch(ns, chain)).n_chunks == 0 and unkeyed.counters.corrupt == 2
    await writer.store(ns, chain, lambda i: bytes([i]) * 4096)
    assert await writer.flush(10)
    assert (await other.fetch(ns, chain)).n_chunks == 0 and other.counters.corrupt == 2
    # Someone who can write to Redis but has no key: a value with a valid checksum is still refused.
    await writer.store(ns, chain, lambda i: bytes([i]) * 4096)
    assert await writer.flush(10)
    key0 = chunk_key(ns, chain[0])
    r.set(key0, BlobCodec("none").encode(b"\x07" * 4096, chunk_hash=chain[0], namespace_id=ns.digest[:8],
                                         n_tokens=CHUNK))
    keyed = store(secret)
    assert (await keyed.fetch(ns, chain)).n_chunks == 0 and keyed.counters.corrupt == 1 and not r.exists(key0)
    for s in (writer, same, unkeyed, other, keyed):
        await s.aclose()
    # kvtier serve's --chunk-key-file reaches the codec.
    secret_file = tmp_path / "chunk.key"
    secret_file.write_text("from a file, long enough\n")
    from sidecar.config import load_settings

    loaded = load_settings(["--slot-dir", str(tmp_path), "--chunk-key-file", str(secret_file)], env={})
    built, _ = build_store(loaded)
    assert built.codec.keyed and not build_store(replace(loaded, chunk_key=None))[0].codec.keyed
    assert loaded.redacted()["chunk_key"] == "***"
    await built.aclose()


# -- 6: a damaged session manifest ---------------------------------------------------------------


async def test_a_damaged_manifest_is_reported_skipped_deleted_and_saved_over(pair: Pair) -> None:
    a = pair.a
    run = uuid.uuid4().hex[:6]
    ids = [f"dmg{run}-{i}" for i in range(3)]
    for i, sid in enumerate(ids):
        ans = await post(a.url + "/completion", completion(f"Damage test {i}. " + DOC[i * 50: i * 50 + 300]),
                         headers={**AUTH, "X-Session-Id": sid})
        assert ans.status == 200
        await settle(a)
    ns = a.engine.target.namespace
    r = pair.raw()
    r.set(session_key(ns, ids[1]), b'{"version": 1, "id": "broken')
    status, body = await call("GET", a.url + f"/v1/sessions/{ids[1]}")
    assert status == 410 and "manifest" in body["error"]["message"], body  # reported, not a 502
    status, body = await call("POST", a.url + f"/v1/sessions/{ids[1]}/restore")
    assert status == 410, body
    status, listed = await call("GET", a.url + f"/v1/sessions?prefix=dmg{run}")
    assert status == 200 and [s["id"] for s in listed["sessions"]] == [ids[0], ids[2]], listed
    assert listed["damaged"] == [ids[1]]  # the listing says what it skipped
    page = await a.engine.sessions.list_page(ns, f"dmg{run}")
    assert page.damaged == [ids[1]]
    # Another node's manifest under this id is damage too.
    r.set(session_key(ns, ids[2]), r.get(session_key(ns, ids[0])))  # type: ignore[arg-type]
    assert (await call("GET", a.url + f"/v1/sessions/{ids[2]}"))[0] == 410
    # A request of the session recomputes, and its save writes a good manifest over the damaged one.
    errors = a.metric("kvtier_cache_errors_total", stage="save")
    ans = await post(a.url + "/completion", completion("Damage test 1. " + DOC[50:350] + " More."),
                     headers={**AUTH, "X-Session-Id": ids[1]})
    assert ans.status == 200
    await settle(a)
    assert a.metric("kvtier_cache_errors_total", stage="save") == errors
    status, shown = await call("GET", a.url + f"/v1/sessions/{ids[1]}")
    assert status == 200 and shown["n_tokens"] > 0
    # An explicit save over it works as well, and so does deleting a damaged one.
    status, saved = await call("PUT", a.url + f"/v1/sessions/{ids[2]}", json_body={"slot": 0})
    assert status == 200, saved
    r.set(session_key(ns, ids[0]), b"\xff not json")
    status, deleted = await call("DELETE", a.url + f"/v1/sessions/{ids[0]}")
    assert status == 200 and deleted["deleted"] is True and not r.exists(session_key(ns, ids[0]))


async def session_then_another_prompt(node: Sidecar, sid: str, text: str) -> Answer:
    """``text`` answered and saved as session ``sid`` on ``node``, whose slot then serves another prompt."""
    first = await post(node.url + "/completion", completion(text), headers={**AUTH, "X-Session-Id": sid})
    assert first.status == 200
    await settle(node)
    other = await post(node.url + "/completion", completion("Something else entirely."))  # the slot forgets it
    assert other.status == 200
    await settle(node)
    return first


async def test_a_session_restored_where_it_was_saved_loads_the_file_its_save_left(pair: Pair) -> None:
    """While the file a session's save left in the slot dir is there, a restore of that session on
    the same node loads it as it is: nothing fetched, no restore file written."""
    a = pair.a
    sid = "file-" + uuid.uuid4().hex[:6]
    text = "Saved file test. " + DOC[500:1300] + "\nQuestion: which box holds 63 coins?\nAnswer:"
    first = await session_then_another_prompt(a, sid, text)
    loaded = a.metric("kvtier_restores_total", tier="file", outcome="ok")
    manifest = await a.engine.sessions.load(a.engine.target.namespace, sid)
    follow = completion(text + first.content + "\nQuestion: and which holds 77?\nAnswer:")
    on_a = await post(a.url + "/completion", follow, headers={**AUTH, "X-Session-Id": sid})
    assert on_a.status == 200 and on_a.headers["X-KVTier-Restore-Tier"] == "file", (on_a.headers, a.decisions())
    assert on_a.restored == manifest.n_tokens
    assert a.metric("kvtier_restores_total", tier="file", outcome="ok") == loaded + 1
    assert on_a.prompt_n < int(on_a.headers["X-KVTier-Prompt-Tokens"]) - on_a.restored + 8
    await settle(a)


# -- 7: a session while Redis is down ------------------------------------------------------------


async def test_a_session_restores_from_the_local_tiers_while_redis_is_down(pair: Pair) -> None:
    a = pair.a
    sid = "down-" + uuid.uuid4().hex[:6]
    text = "Outage test. " + DOC[300:1100] + "\nQuestion: which box holds 70 coins?\nAnswer:"
    first = await session_then_another_prompt(a, sid, text)
    pair.redis.stop()
    try:
        follow = completion(text + first.content + "\nQuestion: and which holds 77?\nAnswer:")
        on_a = await post(a.url + "/completion", follow, headers={**AUTH, "X-Session-Id": sid})
        assert on_a.status == 200
        # From this node's own copies: the RAM tier, or the file its save left in the slot dir.
        assert on_a.restored > 0 and on_a.headers["X-KVTier-Restore-Tier"] in ("memory", "file"), (on_a.headers,
                                                                                                  a.decisions())
        assert on_a.prompt_n < int(on_a.headers["X-KVTier-Prompt-Tokens"]) - on_a.restored + 8
        await a.engine.drain(60)
        # This node's copy follows its own saves: the next turn restores the longer session.
        manifest = await a.engine.sessions.load(a.engine.target.namespace, sid)
        assert manifest.n_tokens > on_a.restored
    finally:
        pair.redis.start()


async def test_an_unknown_session_with_redis_down_still_restores_what_the_tiers_hold(pair: Pair) -> None:
    """A session this node never saved cannot be looked up while Redis is down: the request is then
    served like one without the header, from the prefix the local tiers hold."""
    a = pair.a
    text = "Unknown session test. " + DOC[200:1000] + "\nQuestion: which box holds 21 coins?\nAnswer:"
    assert (await post(a.url + "/completion", completion(text))).status == 200
    await settle(a)
    assert (await post(a.url + "/completion", completion("Something else again."))).status == 200
    await settle(a)
    pair.redis.stop()
    try:
        ans = await post(a.url + "/completion", completion(text + " And 28?"),
                         headers={**AUTH, "X-Session-Id": "never-" + uuid.uuid4().hex[:6]})
        assert ans.status == 200
        # From this node's own copies: the RAM tier, or the file its save left in the slot dir.
        assert ans.restored > 0 and ans.headers["X-KVTier-Restore-Tier"] in ("memory", "file"), (ans.headers,
                                                                                                a.decisions())
    finally:
        pair.redis.start()


# -- 9: a small slot dir -------------------------------------------------------------------------


@pytest.fixture
def small_slot_dir(tmp_path: Path) -> Iterator[Path]:
    """A 20 MiB tmpfs (as a small /dev/shm slot dir would be); mounting needs root."""
    path = tmp_path / "slots"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> None:
    """Write zeros into ``path`` until its file system is full."""
    try:
        with open(path, "wb") as f:
            f.write(b"\0" * free_bytes(path.parent))
    except OSError:
        pass  # ENOSPC: full


async def settled_free(slot_dir: Path, timeout: float = 20.0) -> None:
    """Wait until ``slot_dir``'s file system holds no more than the files it lists (no removed
    file's pages held by a process still: a mapping, an open file)."""
    st = os.statvfs(slot_dir)
    deadline = time.monotonic() + timeout
    while True:
        listed = sum(-(-p.stat().st_size // st.f_frsize) * st.f_frsize for p in slot_dir.iterdir())
        held = st.f_blocks * st.f_frsize - free_bytes(slot_dir) - listed
        if held <= 64 << 10:
            return
        assert time.monotonic() < deadline, (f"{held} bytes held beyond the files listed", [
            line for line in Path("/proc/self/maps").read_text().splitlines() if str(slot_dir) in line])
        gc.collect()
        await asyncio.sleep(0.1)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


async def test_kept_restore_files_yield_to_saves(small_slot_dir: Path) -> None:
    llama = LlamaServer(smollm2_path(), list(DEFAULT_LLAMA_ARGS), small_slot_dir)
    llama.start()
    try:
        async with run_sidecar(settings(llama, None, "small")) as node:
            big = "Slot dir test. " + DOC  # over half the dir's free space as a state file
            small = "Another topic. " + DOC[:600]  # a state file kept after its restore
            held = {}
            for text in (big, small):
                ans = await post(node.url + "/completion", completion(text))
                assert ans.status == 200
                await node.engine.drain(60)
                held[text] = node.engine.slots.tokens(int(ans.headers["X-KVTier-Slot"])).size * KV_BYTES_PER_TOKEN
            assert 10.5e6 < held[big] < 19e6 and held[small] < 8e6, held

            def save_errors() -> float:
                return node.metric("kvtier_cache_errors_total", stage="save")

            # A restore file over half the free space at start is not kept: the save after it fits.
            back = await post(node.url + "/completion", completion(big + " Which box?"))
            await node.engine.drain(60)
            assert back.status == 200 and back.restored > 0, back.headers
            assert save_errors() == 0
            assert not any(p.name.startswith("kvtier-restore") for p in small_slot_dir.iterdir())
            # A kept one gives way when a save does not fit beside it. The filler is sized once the
            # dir holds only the files it lists: in a loaded run of this module, ~13 MB (the size of
            # the restore file or the save just done) stayed in use for a while after the answer,
            # its name gone (not found: no mapping of ours; see settled_free).
            await settled_free(small_slot_dir)
            filler = small_slot_dir / "filler"
            filler.write_bytes(b"\0" * (free_bytes(small_slot_dir) - int(held[small] * 1.5)))
            again = await post(node.url + "/completion", completion(small + " Which box?"))
            await node.engine.drain(60)
            assert again.status == 200 and again.restored > 0, again.headers
            assert save_errors() == 0
            left = {p.name: p.stat().st_size for p in small_slot_dir.iterdir()}
            assert not any(name.startswith("kvtier-restore") for name in left), (
                left, free_bytes(small_slot_dir), held, Path("/proc/self/maps").read_text().count("kvtier-save"))
            # A save that cannot fit at all fails, and the slot table keeps what it knew of the slot.
            slot = int(again.headers["X-KVTier-Slot"])
            known = node.engine.slots.tokens(slot).copy()
            fill(small_slot_dir / "filler2")
            last = await post(node.url + "/completion", completion(small + " Which box? Tell me."))
            await node.engine.drain(60)
            assert last.status == 200
            assert save_errors() == 1
            held = node.engine.slots.tokens(slot)
            assert held.size >= known.size > 0 and np.array_equal(held[:known.size], known)
            # One that fails after a shorter prompt, which shares only a start with what the slot
            # held: the table holds that prompt now (what it knew before is no prefix of the slot).
            # The failed save removed the spare its predecessor left: fill that room too.
            fill(small_slot_dir / "filler3")
            other = small[:300] + " A different ending."
            shorter = await post(node.url + "/completion", completion(other))
            await node.engine.drain(60)
            assert shorter.status == 200 and int(shorter.headers["X-KVTier-Slot"]) == slot
            assert save_errors() == 2
            asked = await post(llama.url + "/tokenize", {"content": other, "add_special": True})
            assert np.array_equal(node.engine.slots.tokens(slot), np.asarray(asked.body["tokens"])), (
                node.engine.slots.tokens(slot).size, len(asked.body["tokens"]))
    finally:
        llama.stop()


# -- 11: a damaged tail is logged; the breaker after a long outage -------------------------------


async def test_a_damaged_tail_is_logged_deleted_and_counted(redis_srv: RedisProc,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    ns = Namespace("tail-log", "", CHUNK)
    tokens = np.arange(CHUNK + 10, dtype=np.int32)
    tier = RedisTier(redis_srv.url)
    store = TieredStore([MemoryTier(1 << 20), tier], BlobCodec("none"))
    h = tail_hash_after(ns.digest, tokens[:10])
    key = tail_key(ns, h)
    blob = bytearray(BlobCodec("none").encode(b"t" * 500, chunk_hash=h, namespace_id=ns.digest[:8], n_tokens=10,
                                              flags=Flags.TAIL))
    blob[-3] ^= 0xFF
    r = redis.Redis(port=redis_srv.port)
    r.set(key, bytes(blob))
    found = await find_prefix(store, ns, tokens[:10 + 5])
    assert found.tail is not None and found.tail.n_tokens == 10
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        got = await fetch_prefix(store, ns, found)
    assert got.n_tokens == 0 and store.counters.corrupt == 1 and not r.exists(key)
    assert any(key.decode() in rec.getMessage() and "damaged" in rec.getMessage() for rec in caplog.records)
    await store.aclose()


async def test_the_breaker_probes_a_recovered_redis_soon_after_a_long_outage() -> None:
    now = [1000.0]
    with redis_server() as srv:
        conn = RedisConnection(srv.url, retries=0, connect_timeout=0.2, socket_timeout=0.2, clock=lambda: now[0])
        tier = RedisTier(conn)
        await tier.put_many({b"k": b"v"})
        srv.stop()
        # A long outage: every probe fails and the window doubles up to its 60 s cap.
        for _ in range(12):
            now[0] += 61
            await tier.get_many([b"k"])  # the probe of each window fails
        now[0] += 1  # the open window has almost all of its 60 s left
        assert conn.breaker.stats().retry_in >= 59
        srv.start()
        await tier.put_many({b"k": b"v"})  # skipped: Redis is back, the breaker does not know yet
        now[0] += 5.0  # one breaker_reset later, far from the end of the window
        deadline = asyncio.get_running_loop().time() + 5
        while not conn.breaker.closed and asyncio.get_running_loop().time() < deadline:
            await tier.get_many([b"k"])  # skipped, and a background probe sees Redis back
            await asyncio.sleep(0.05)
        assert conn.breaker.closed
        assert await tier.put_many({b"k": b"v"}) == 1 and await tier.get_many([b"k"]) == {b"k": b"v"}
        await tier.aclose()

