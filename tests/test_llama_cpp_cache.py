"""kvtier as llama-cpp-python's cache: one real SmolLM2 ``Llama``, real Valkey, a real llama-server.

Every completion is greedy. "Evaluated" counts the tokens the prompt step hands to ``Llama.eval``
(its first call in a completion); a restore must leave exactly the suffix to it. References are
completions of the same prompt by the same ``Llama`` without any cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import llama_cpp
import numpy as np
import pytest
import redis

from integrations.chunkassemble import assemble_state
from integrations.chunksplit import split_state
from integrations.fingerprint import layout_fingerprint, model_identity
from integrations.llama_cpp_cache import KVTierCache, SyncStore, restore_session, save_session
from integrations.llama_cpp_state import image_from_llama_state, load_seq_image, read_seq_image
from integrations.llama_server import LlamaServerClient
from integrations.pendingflow import pending_save
from integrations.prefixrefs import REF_STEP
from integrations.stateparse import parse_state
from tests.inprocess import counting_llama
from tests.servers import RedisProc, llama_server, smollm2_path
from tiers.codec import BlobCodec
from tiers.errors import KVTierError
from tiers.keys import Namespace, chunk_key, prefix_chain, session_key
from tiers.redis_tier import RedisTier
from tiers.store import TieredStore

pytestmark = pytest.mark.llama

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 64
N_PREDICT = 8
FACTS = " ".join(f"Fact {i}: the {['red', 'green', 'blue', 'white'][i % 4]} box {i} holds {i * 7} marbles."
                 for i in range(16))
OTHER = " ".join(f"Note {i}: shelf {i} stores {i * 3} jars of {['jam', 'honey', 'tea'][i % 3]}." for i in range(16))


@pytest.fixture(scope="module")
def llm() -> Iterator[llama_cpp.Llama]:
    model = counting_llama(smollm2_path())
    yield model
    model.set_cache(None)
    model.close()


def tokens_of(llm: llama_cpp.Llama, doc: str, question: str) -> list[int]:
    return llm.tokenize(f"{doc}\nQuestion: {question}\nAnswer:".encode())


def complete(llm: llama_cpp.Llama, prompt: list[int]) -> tuple[str, list[int], int]:
    """A greedy completion from a context that holds nothing of ``prompt``.

    Returns (text, every token the context evaluated, tokens the prompt step evaluated).
    """
    llm.reset()
    llm.evals.clear()  # type: ignore[attr-defined]
    out = llm.create_completion(prompt, max_tokens=N_PREDICT, temperature=0)
    evaluated = llm.evals[0]  # type: ignore[attr-defined]
    return out["choices"][0]["text"], llm.input_ids[: llm.n_tokens].tolist(), evaluated


@pytest.fixture(scope="module")
def reference(llm: llama_cpp.Llama) -> Callable[[list[int]], tuple[str, list[int]]]:
    """The same Llama's answer without any cache (memoised per prompt)."""
    memo: dict[tuple[int, ...], tuple[str, list[int]]] = {}

    def ref(prompt: list[int]) -> tuple[str, list[int]]:
        key = tuple(prompt)
        if key not in memo:
            saved, llm.cache = llm.cache, None
            try:
                text, ids, evaluated = complete(llm, prompt)
            finally:
                llm.cache = saved
            assert evaluated == len(prompt)
            memo[key] = (text, ids)
        return memo[key]

    return ref


@pytest.fixture
def flushed(redis_srv: RedisProc) -> RedisProc:
    with redis.Redis(port=redis_srv.port) as r:
        r.flushall()
    return redis_srv


@contextlib.contextmanager
def cached(llm: llama_cpp.Llama, url: str | None = None, **kwargs: Any) -> Iterator[KVTierCache]:
    """A fresh cache (empty memory tier) set on ``llm``; unset and closed afterwards."""
    opts = {"socket_timeout": 0.5, "connect_timeout": 0.5, "retries": 0}
    cache = KVTierCache(llm, redis_url=url, chunk_tokens=CHUNK, redis_options=opts if url else None, **kwargs)
    llm.set_cache(cache)
    try:
        yield cache
    finally:
        llm.set_cache(None)
        cache.close()


def redis_keys(port: int, namespace: Namespace, kind: str = "c") -> list[bytes]:
    with redis.Redis(port=port) as r:
        return sorted(r.keys(f"kvtier:{namespace.id}:{kind}:*"))


# -- the cache in one process ---------------------------------------------------------------------


def test_probe_learns_the_layout_and_leaves_the_context_empty(llm: llama_cpp.Llama) -> None:
    llm.reset()
    with KVTierCache(llm, chunk_tokens=CHUNK) as cache:
        assert llm.n_tokens == 0
        assert cache.info.n_stream == 1 and cache.info.v_trans  # n_seq_max 1; no flash attention
        assert cache.info.layout.n_layer == 30 and cache.info.layout.bytes_per_token == 23040
        assert cache.info.arch_header == b"\x05\x00\x00\x00llama"
        # The sidecar's namespace for a llama-server of this model and KV layout.
        assert cache.namespace == Namespace(layout_fingerprint(model_identity(smollm2_path()), cache.info.layout),
                                            chunk_tokens=CHUNK)
        assert cache.lookup(list(range(500))) == 0 and list(range(500)) not in cache
        with pytest.raises(KeyError):
            cache[list(range(500))]
        llm.set_cache(cache)
    assert llm.cache is None  # close() unsets it: a closed cache never answers


def test_prefix_hit_gives_identical_tokens_and_evaluates_only_the_suffix(llm: llama_cpp.Llama, reference: Any) -> None:
    first, second = tokens_of(llm, FACTS, "How many marbles does box 3 hold?"), tokens_of(
        llm, FACTS, "What colour is box 5?")
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    # Whole chunks, then the first cells of the chunk the prompts part in (a prefix reference).
    restorable = min(shared, len(second) - 1) // REF_STEP * REF_STEP
    assert restorable >= 3 * CHUNK and restorable % CHUNK
    want_text, want_ids = reference(second)
    with cached(llm) as cache:
        complete(llm, first)
        assert cache.counters.chunks_written == llm.n_tokens // CHUNK
        assert second in cache and cache.lookup(second) == restorable
        text, ids, evaluated = complete(llm, second)
        assert evaluated == len(second) - restorable
        assert (text, ids) == (want_text, want_ids)
        assert cache.counters.hits == 1 and cache.counters.tokens_restored == restorable
        # The stored payloads are the llama-server path's chunks of this sequence, byte for byte.
        state = parse_state(read_seq_image(llm))
        expect = split_state(state, CHUNK).chunks
        chain = prefix_chain(cache.namespace, state.tokens.tokens)
        got = cache.store.call(cache.store.store.fetch(cache.namespace, chain))
        assert got.n_chunks == len(expect) and all(bytes(a) == bytes(b) for a, b in zip(got.payloads, expect))
        # A context that already holds the prefix gets nothing from the cache (llama-cpp-python reuses it).
        llm.evals.clear()  # type: ignore[attr-defined]
        with pytest.raises(KeyError):
            cache[second]


def test_explicit_restore_sets_the_bookkeeping(llm: llama_cpp.Llama, reference: Any) -> None:
    prompt = tokens_of(llm, FACTS, "Which box holds 70 marbles?")
    want_text, want_ids = reference(prompt)
    with cached(llm) as cache:
        complete(llm, prompt)
        llm.reset()
        restored = cache.restore(prompt)
        assert restored == (len(prompt) - 1) // REF_STEP * REF_STEP
        assert llm.n_tokens == restored and llm.input_ids[:restored].tolist() == prompt[:restored]
        llm.set_cache(None)  # the Llama's own prefix reuse takes it from here
        llm.evals.clear()  # type: ignore[attr-defined]
        out = llm.create_completion(prompt, max_tokens=N_PREDICT, temperature=0)
        assert llm.evals[0] == len(prompt) - restored  # type: ignore[attr-defined]
        assert (out["choices"][0]["text"], llm.input_ids[: llm.n_tokens].tolist()) == (want_text, want_ids)


# -- two processes, one Redis ---------------------------------------------------------------------

PROCESS_ONE = r"""
import json, sys
import llama_cpp
import numpy as np
from integrations.llama_cpp_cache import KVTierCache
from tests.servers import smollm2_path

url, prompt = sys.argv[1], json.loads(sys.argv[2])
llm = llama_cpp.Llama(smollm2_path(), n_ctx=2048, n_threads=2, n_batch=512, seed=7, verbose=False)
with KVTierCache(llm, redis_url=url, chunk_tokens=64) as cache:
    llm.set_cache(cache)
    out = llm.create_completion(prompt, max_tokens=8, temperature=0)
    print(json.dumps({"namespace": cache.namespace.id, "flushed": cache.flush(60),
                      "chunks": cache.counters.chunks_written, "text": out["choices"][0]["text"]}))
"""


def test_second_process_restores_what_the_first_computed(llm: llama_cpp.Llama, flushed: RedisProc,
                                                         reference: Any) -> None:
    first, second = tokens_of(llm, OTHER, "How many jars are on shelf 4?"), tokens_of(
        llm, OTHER, "What does shelf 2 store?")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", PROCESS_ONE, flushed.url, json.dumps(first)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    one = json.loads(proc.stdout.strip().splitlines()[-1])
    assert one["flushed"] and one["chunks"] >= 3
    assert one["text"] == reference(first)[0]
    with cached(llm, flushed.url) as cache:
        assert one["namespace"] == cache.namespace.id
        assert len(redis_keys(flushed.port, cache.namespace)) == one["chunks"]
        text, ids, evaluated = complete(llm, second)
        restored = cache.counters.tokens_restored
        assert restored >= 3 * CHUNK and evaluated == len(second) - restored
        assert (text, ids) == reference(second)
        assert cache.stats()["tiers"]["redis"]["hits"] >= restored // CHUNK


def test_a_restore_waits_for_a_save_in_flight_on_another_node(llm: llama_cpp.Llama, flushed: RedisProc,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Node A has computed a prompt and marked its save (the marks of ``pendingflow.pending_save``) but
    its chunks are not in Redis yet; node B's restore of that prompt waits for the save, and only
    with ``save_wait`` 0 does it give up at once. It never waits longer than evaluating the prompt
    would take: priced at 0.1 s, it gives up before the save lands."""
    prompt = tokens_of(llm, FACTS, "Which box holds the most marbles?")
    price = {"s": 60.0}  # B's context is priced, whatever this host computes: the wait is the point here
    monkeypatch.setattr("integrations.llama_cpp_cache.prefill_seconds", lambda _llm, _n: price["s"])
    other = llama_cpp.Llama(smollm2_path(), n_ctx=2048, n_threads=2, n_batch=512, seed=7, verbose=False)
    try:
        other.eval(prompt)  # node A's context: it just computed the prompt
        with cached(other, flushed.url) as a:
            saving, release = threading.Event(), threading.Event()

            async def in_flight() -> None:
                async with pending_save(a.store.pending, a.namespace, np.asarray(prompt, np.int32), "a"):
                    saving.set()
                    while not release.is_set():
                        await asyncio.sleep(0.01)

            for save_wait, priced, expect in ((0.0, 60.0, 0), (10.0, 60.0, (len(prompt) - 1) // CHUNK * CHUNK),
                                              (10.0, 0.1, 0)):
                price["s"] = priced
                marks = threading.Thread(target=a.store.call, args=(in_flight(),))
                marks.start()
                assert saving.wait(10)
                llm.reset()  # B's context holds nothing of the prompt (the last case restored into it)
                with cached(llm, flushed.url, save_wait=save_wait) as b:
                    restored: list[int] = []
                    restoring = threading.Thread(target=lambda: restored.append(b.restore(prompt)))  # noqa: B023
                    restoring.start()
                    time.sleep(0.3)
                    assert a.save() is not None and a.flush(10)  # A's save, in Redis now
                    release.set()
                    restoring.join(20)
                    assert restored == [expect], (save_wait, priced, restored)
                    # A wait given up is a miss, not a failure of the cache or of Redis.
                    assert b.counters.errors == 0 and b.stats()["tiers"]["redis"]["errors"] == 0
                marks.join(5)
                saving.clear()
                release.clear()
                with redis.Redis(port=flushed.port) as r:
                    r.flushall()
    finally:
        other.close()


# -- in-process <-> llama-server ------------------------------------------------------------------


@pytest.mark.parametrize("flash_attn", ["off", "on"])
async def test_prefixes_cross_between_llama_cpp_python_and_llama_server(
    llm: llama_cpp.Llama, flushed: RedisProc, reference: Any, tmp_path: Path, flash_attn: str
) -> None:
    """``-fa off``: the server's V layout is the Llama's; ``-fa on``: chunks are transposed on assembly."""
    first = tokens_of(llm, FACTS, "How many marbles does box 11 hold?")
    second = tokens_of(llm, FACTS, "How many marbles does box 9 hold?")
    third = tokens_of(llm, OTHER, "Which shelf stores honey?")

    async def complete_on(server: LlamaServerClient, prompt: list[int]) -> dict[str, Any]:
        return await server.completion({"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, "id_slot": 0,
                                        "cache_prompt": True, "return_tokens": True})

    sidecar = TieredStore([RedisTier(flushed.url)], BlobCodec())  # what a sidecar reads and writes
    with llama_server(tmp_path, "-fa", flash_attn) as srv:
        server = LlamaServerClient(srv.url)
        try:
            # The server's own state gives the same namespace (the sidecar's probe).
            await complete_on(server, first[:4])
            await server.save_slot(0, "probe.bin")
            probe = parse_state((srv.slot_dir / "probe.bin").read_bytes())
            with cached(llm, flushed.url) as cache:
                ns = cache.namespace
                assert Namespace(layout_fingerprint(model_identity(smollm2_path()), probe.layout),
                                 chunk_tokens=CHUNK) == ns
                assert probe.v_trans == (flash_attn == "off")

                # 1. In-process computes a prefix; llama-server restores it and computes only the suffix.
                # (In a thread: a blocked loop would miss llama-server closing idle keep-alive connections.)
                await asyncio.to_thread(complete, llm, first)
                assert cache.flush(30)
            await server.erase_slot(0)
            fresh = await complete_on(server, second)
            assert fresh["timings"]["prompt_n"] == len(second)
            await server.erase_slot(0)
            found = await sidecar.lookup_chain(ns, prefix_chain(ns, second, (len(second) - 1) // CHUNK))
            assert found.n_chunks >= 3 and found.tiers == ["redis"] * found.n_chunks
            fetched = await sidecar.fetch(ns, found.chunks)
            image = assemble_state(fetched.payloads, second, v_trans=bool(probe.v_trans), n_stream=probe.n_stream)
            (srv.slot_dir / "kvtier-restore.bin").write_bytes(image)
            assert (await server.restore_slot(0, "kvtier-restore.bin")).n_tokens == fetched.n_tokens
            restored = await complete_on(server, second)
            assert restored["timings"]["prompt_n"] == len(second) - fetched.n_tokens
            assert restored["tokens"] == fresh["tokens"] and restored["content"] == fresh["content"]

            # 2. llama-server computes a prefix; the sidecar's split goes to Redis; in-process restores it.
            await server.erase_slot(0)
            await complete_on(server, third)
            await server.save_slot(0, "saved.bin")
            saved = parse_state((srv.slot_dir / "saved.bin").read_bytes())
            split = split_state(saved, CHUNK)
            await sidecar.store(ns, prefix_chain(ns, saved.tokens.tokens), lambda i: split.chunks[i])
            assert await sidecar.flush(30)
        finally:
            await server.aclose()
            await sidecar.aclose()
    follow_up = tokens_of(llm, OTHER, "Which shelf stores tea?")
    with cached(llm, flushed.url) as cache:
        text, ids, evaluated = complete(llm, follow_up)
        restored_tokens = cache.counters.tokens_restored
        assert restored_tokens >= 3 * CHUNK and evaluated == len(follow_up) - restored_tokens
        assert (text, ids) == reference(follow_up)


# -- failures: the completion always succeeds, by recompute ---------------------------------------


def test_damaged_chunk_ends_the_prefix(llm: llama_cpp.Llama, flushed: RedisProc, reference: Any) -> None:
    first, second = tokens_of(llm, FACTS, "What colour is box 2?"), tokens_of(llm, FACTS, "What colour is box 7?")
    with cached(llm, flushed.url) as cache:
        complete(llm, first)
        assert cache.flush(30)
        ns = cache.namespace
    chain = prefix_chain(ns, second, 3)
    victim = chunk_key(ns, chain[1])
    with redis.Redis(port=flushed.port) as r:
        value = bytearray(r.get(victim))
        value[-100] ^= 0xFF  # one flipped byte in the KV rows
        r.set(victim, bytes(value))
    with cached(llm, flushed.url) as cache:
        text, ids, evaluated = complete(llm, second)
        assert cache.counters.tokens_restored == CHUNK  # chunk 0 only: the prefix ends at the damage
        assert evaluated == len(second) - CHUNK
        assert (text, ids) == reference(second)
        assert cache.store.store.counters.corrupt == 1
        assert cache.flush(30)
    with redis.Redis(port=flushed.port) as r:
        healed = r.get(victim)  # the damaged value was deleted; the recomputed chunk took its place
    assert healed != bytes(value)
    BlobCodec().decode(healed, chunk_hash=chain[1], namespace_id=ns.digest[:8])


def test_redis_down_recomputes(llm: llama_cpp.Llama, flushed: RedisProc, reference: Any) -> None:
    prompt = tokens_of(llm, OTHER, "How many jars are on shelf 6?")
    with cached(llm, flushed.url) as cache:
        complete(llm, prompt)
        assert cache.flush(30)
    flushed.stop()
    try:
        with cached(llm, flushed.url) as cache:
            text, ids, evaluated = complete(llm, prompt)
            assert evaluated == len(prompt) and cache.counters.tokens_restored == 0
            assert (text, ids) == reference(prompt)
            assert not cache.stats()["tiers"]["redis"]["available"] or cache.stats()["tiers"]["redis"]["errors"]
            # What it computed is still served from this process's memory tier.
            text2, _, evaluated2 = complete(llm, prompt)
            assert evaluated2 < len(prompt) and text2 == text
    finally:
        flushed.start()


def test_wrong_model_never_restores(llm: llama_cpp.Llama, flushed: RedisProc, reference: Any) -> None:
    prompt = tokens_of(llm, FACTS, "How many marbles does box 13 hold?")
    with cached(llm, flushed.url) as cache:
        complete(llm, prompt)
        assert cache.flush(30)
        ours = cache.namespace
    # Another model (identity) reads the same Redis: its namespace differs, so nothing matches...
    with cached(llm, flushed.url, model_id="some-other-model") as other:
        assert other.namespace.id != ours.id
        # ...even when our chunks are copied under its keys: they carry our key and namespace.
        with redis.Redis(port=flushed.port) as r:
            for a, b in zip(prefix_chain(ours, prompt), prefix_chain(other.namespace, prompt)):
                r.set(chunk_key(other.namespace, b), r.get(chunk_key(ours, a)))
        text, ids, evaluated = complete(llm, prompt)
        assert evaluated == len(prompt) and other.counters.tokens_restored == 0
        assert (text, ids) == reference(prompt)
        assert other.store.store.counters.corrupt >= 1


# -- sessions -------------------------------------------------------------------------------------


def test_session_round_trip_through_redis(llm: llama_cpp.Llama, flushed: RedisProc) -> None:
    prompt = tokens_of(llm, OTHER, "What does shelf 9 store?")
    follow = llm.tokenize(b" And shelf 10?\nAnswer:", add_bos=False)
    # Like with like: the same turns, the second continuing the first's context, without kvtier.
    llm.set_cache(None)
    complete(llm, prompt)
    held = llm.input_ids[: llm.n_tokens].tolist()
    llm.evals.clear()  # type: ignore[attr-defined]
    want = llm.create_completion(held + follow, max_tokens=N_PREDICT, temperature=0)["choices"][0]["text"]
    assert llm.evals[0] == len(follow)  # type: ignore[attr-defined]

    with cached(llm, flushed.url) as cache:
        complete(llm, prompt)
        manifest = save_session(llm, "user-42:chat")
        assert manifest.n_tokens == len(held) and manifest.tail_tokens == len(held) % CHUNK > 0
        ns = cache.namespace
    with redis.Redis(port=flushed.port) as r:
        stored = json.loads(r.get(session_key(ns, "user-42:chat")))  # the sidecar's JSON manifest
    assert stored["n_tokens"] == len(held) and stored["namespace"] == ns.id
    llm.reset()
    llm._ctx.kv_cache_clear()
    with cached(llm, flushed.url) as cache:
        assert restore_session(llm, "user-42:chat") == len(held)
        assert llm.input_ids[: llm.n_tokens].tolist() == held
        llm.evals.clear()  # type: ignore[attr-defined]
        got = llm.create_completion(held + follow, max_tokens=N_PREDICT, temperature=0)["choices"][0]["text"]
        assert llm.evals[0] == len(follow) and got == want  # type: ignore[attr-defined]
        with pytest.raises(KVTierError):
            cache.restore_session("no-such-session")


async def test_sessions_cross_with_the_sidecar(llm: llama_cpp.Llama, flushed: RedisProc, tmp_path: Path) -> None:
    """A session saved in-process is restored by the sidecar's API into llama-server, and the reverse."""
    from sidecar.config import Settings
    from tests.sidecars import post, run_sidecar

    prompt = tokens_of(llm, FACTS, "Which box holds 35 marbles?")
    follow = llm.tokenize(b" And box 6?\nAnswer:", add_bos=False)
    with llama_server(tmp_path, "-fa", "off") as srv:
        settings = Settings(llama_url=srv.url, slot_dir=str(srv.slot_dir), redis_url=flushed.url, node_id="sidecar",
                            chunk_tokens=CHUNK, cache_size=64 << 20, prefill_tps_prior=100.0)
        async with run_sidecar(settings) as sidecar:
            # In-process -> sidecar -> llama-server. (llm work in a thread: the sidecar shares this loop.)
            with cached(llm, flushed.url):
                await asyncio.to_thread(complete, llm, prompt)
                manifest = await asyncio.to_thread(save_session, llm, "inproc-1")
            held = manifest.tokens.tolist()
            restored = await post(sidecar.url + "/v1/sessions/inproc-1/restore", {"slot": 0})
            assert restored.status == 200 and restored.body["n_restored"] == len(held), restored.text
            out = await post(srv.url + "/completion", {"prompt": held + follow, "n_predict": N_PREDICT, "temperature": 0,
                                                       "id_slot": 0, "cache_prompt": True})
            assert out.body["timings"]["prompt_n"] == len(follow)

            # llama-server -> sidecar session -> in-process.
            other = tokens_of(llm, OTHER, "What does shelf 5 store?")
            answer = await post(sidecar.url + "/completion", {"prompt": other, "n_predict": N_PREDICT, "temperature": 0})
            assert answer.status == 200, answer.text
            slot = int(answer.headers["X-KVTier-Slot"])
            async with aiohttp.ClientSession() as http, http.put(sidecar.url + "/v1/sessions/srv-1",
                                                                 json={"slot": slot}) as r:
                assert r.status == 200, await r.text()
                n_saved = (await r.json())["tokens"]
    assert n_saved >= len(other)

    def resume() -> tuple[int, list[int], int]:
        llm.reset()
        llm._ctx.kv_cache_clear()
        with cached(llm, flushed.url) as cache:
            n = cache.restore_session("srv-1")
            ids = llm.input_ids[:n].tolist()
            llm.evals.clear()  # type: ignore[attr-defined]
            llm.create_completion(ids + follow, max_tokens=2, temperature=0)
            return n, ids, llm.evals[0]  # type: ignore[attr-defined]

    n, ids, evaluated = await asyncio.to_thread(resume)
    assert n == n_saved and ids[: len(other)] == other and evaluated == len(follow)


# -- plumbing -------------------------------------------------------------------------------------


def test_seq_image_round_trip(llm: llama_cpp.Llama) -> None:
    llm.reset()
    llm._ctx.kv_cache_clear()
    llm.eval(llm.tokenize(b"One two three four five six seven."))
    image = read_seq_image(llm)
    state = parse_state(image)
    assert state.splittable and state.n_tokens == llm.n_tokens and state.tokens.tokens.tolist() == \
        llm.input_ids[: llm.n_tokens].tolist()
    copy = bytes(image)
    n = llm.n_tokens
    # A whole-context state (what Llama.save_state hands a cache) holds the same memory bytes.
    whole = llm.save_state()
    arch = b"\x05\x00\x00\x00llama"
    assert bytes(whole.llama_state[: len(arch)]) == arch
    assert bytes(image_from_llama_state(whole, arch)) == copy
    llm.reset()
    llm._ctx.kv_cache_clear()
    assert load_seq_image(llm, bytearray(copy)) == n and llm.n_tokens == n
    assert bytes(read_seq_image(llm)) == copy


def test_sync_store_lifecycle() -> None:
    store = SyncStore(memory_bytes="1M")
    thread = store._thread
    assert thread.is_alive() and store.flush(1)
    store.close()
    store.close()
    assert not thread.is_alive() and store.closed
    with pytest.raises(KVTierError):
        store.call(store.store.flush(1))
