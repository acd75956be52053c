"""A restart is one change: llama-server restarted before every turn, turns long enough for the
health loop to notice the restart again while they run, and clients that leave at the last byte.

- Each turn lands on a llama-server that was just restarted (down long enough for the sidecar's
  health loop to see it down: a rolling update, an OOM-killed container under a sidecar that stays
  up), on one node and on two. Every hop computes only its new turn, and what the slot holds grows
  turn by turn: no save is lost, however long the turn, though the request path and the health
  loop both notice each restart.
- A restart *during* a long prefill: that request's state is not stored (counted), and the next turn
  restores the turn before.
- A client that closes its connection right after ``data: [DONE]``: the answer is saved.

Real llama-servers, a real Valkey; a generated model with Llama-3-8B's KV shape (128 KiB per
token) on one thread (prefill of the first turn over 5 s), Gemma 3 270M (sliding window) with and
without ``--swa-full``, and SmolLM2 while other processes keep both cores busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from sidecar import app as app_module
from sidecar.config import Settings
from tests.ggufgen import ModelShape, write_random_llama
from tests.servers import LlamaServer, RedisProc, gemma3_path, llama_server, smollm2_path
from tests.sidecars import Sidecar, post, run_sidecar

pytestmark = pytest.mark.llama

CHUNK = 64
SLACK = 16  # tokens a hop may compute beyond its new ones (llama-server recomputes the last one)
# Llama-3-8B's KV: 32 layers, 8 KV heads of 128: 128 KiB per token in f16.
SHAPE_8B = ModelShape(n_layer=32, n_embd=256, n_head=8, n_head_kv=8, head_dim=128, n_ff=512)
QUESTIONS = ["What does shelf 3 hold?", "And shelf 7?", "Which jar is on shelf 12?", "And on shelf 20?",
             "How many beads are on shelf 30?", "And shelf 31?"]


def document(n_records: int) -> str:
    return " ".join(f"Record {i}: the {['amber', 'teal', 'grey', 'plum'][i % 4]} jar on shelf {i} holds {i * 3} "
                    f"beads." for i in range(n_records))


def settings_for(llama: LlamaServer, redis_url: str, node: str) -> Settings:
    return Settings(llama_url=llama.url, slot_dir=str(llama.slot_dir), redis_url=redis_url, node_id=node,
                    chunk_tokens=CHUNK, cache_size=1 << 30, prefill_tps_prior=50.0)


def chat(system: str, history: list[dict[str, str]], question: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "Answer from these records. " + system}, *history,
                         {"role": "user", "content": question}], "max_tokens": 8, "temperature": 0}


async def settle(sc: Sidecar) -> None:
    await sc.engine.drain(120)
    assert await sc.store.flush(120)


async def restart(llama: LlamaServer) -> None:
    """Stop llama-server, leave it down past a health check of its sidecar, start it again; the
    sidecar's event loop runs all along (the stop and start wait in threads)."""
    await asyncio.to_thread(llama.stop)
    await asyncio.sleep(app_module.HEALTH_INTERVAL_S + 0.5)
    await asyncio.to_thread(llama.start)


@contextlib.asynccontextmanager
async def nodes(tmp: Path, redis_srv: RedisProc, n: int, model: str, *args: str) -> AsyncIterator[
        list[tuple[LlamaServer, Sidecar]]]:
    """``n`` nodes on an empty Redis (the tests of this module share it, and a model)."""
    with redis.Redis(port=redis_srv.port) as r:
        r.flushall()
    redis_url = redis_srv.url
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for i in range(n):
            llama = stack.enter_context(llama_server(tmp / f"node{i}", *args, model=model))
            out.append((llama, await stack.enter_async_context(
                run_sidecar(settings_for(llama, redis_url, f"node{i}")))))
        yield out


async def converse(pairs: Sequence[tuple[LlamaServer, Sidecar]], system: str, turns: int = 5) -> list[dict[str, int]]:
    """``turns`` turns of one chat, turn t on node t % n, each node's llama-server restarted before
    its turn (after the last turn's save was stored). Returns each turn's timings."""
    history: list[dict[str, str]] = []
    rows = []
    for t in range(turns):
        llama, sc = pairs[t % len(pairs)]
        await restart(llama)
        t0 = time.perf_counter()
        ans = await post(sc.url + "/v1/chat/completions", chat(system, history, QUESTIONS[t]))
        assert ans.status == 200, ans.text
        timings = ans.body["timings"]
        rows.append({"prompt_n": timings["prompt_n"], "cache_n": timings["cache_n"],
                     "restored": ans.restored, "seconds": time.perf_counter() - t0})
        history += [{"role": "user", "content": QUESTIONS[t]}, {"role": "assistant", "content": ans.content}]
        await settle(sc)
    print("turn: prompt_n / cache_n, seconds:", "; ".join(  # shown with pytest -s
        f"{t + 1}: {r['prompt_n']} / {r['cache_n']}, {r['seconds']:.1f}" for t, r in enumerate(rows)))
    return rows


def assert_only_new_turns(rows: list[dict[str, int]]) -> None:
    """Every hop after the first computes at most its new tokens (+ SLACK), and the cached part
    grows turn by turn."""
    for before, now in itertools.pairwise(rows):
        new = now["prompt_n"] + now["cache_n"] - (before["prompt_n"] + before["cache_n"])
        assert now["prompt_n"] <= new + SLACK, rows
        assert now["cache_n"] > before["cache_n"], rows


def saves_skipped(pairs: Sequence[tuple[LlamaServer, Sidecar]]) -> float:
    return sum(sc.metric("kvtier_cache_errors_total", stage="server_changed") for _, sc in pairs)


@pytest.fixture(scope="module")
def model_8b(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_random_llama(tmp_path_factory.mktemp("model8b") / "kv8b.gguf", smollm2_path(), SHAPE_8B))


@pytest.mark.parametrize("n_nodes", [1, 2])
async def test_slow_turns_after_restarts_compute_only_the_new_turn(
        redis_srv: RedisProc, model_8b: str, tmp_path: Path, n_nodes: int) -> None:
    async with nodes(tmp_path, redis_srv, n_nodes, model_8b, "-t", "1", "-np", "2", "-c", "6144") as pairs:
        # ~2,400 tokens, -c 6144 to hold them in a slot: the first turn's prefill takes over 5 s on one
        # thread (8.9 s on an "AMD EPYC" VM). 70 records (~1,390 tokens) took 4.8 s in a CI run on an
        # idle machine, and 85 (~1,690) 4.7 s on that faster one: both under the bar.
        rows = await converse(pairs, document(120))
        assert rows[0]["seconds"] >= 5.0, rows  # long enough for the health loop to look twice
        assert_only_new_turns(rows)
        assert saves_skipped(pairs) == 0


@pytest.mark.parametrize("flags", [(), ("--swa-full",)], ids=["default", "swa-full"])
async def test_sliding_window_turns_after_restarts_compute_only_the_new_turn(
        redis_srv: RedisProc, tmp_path: Path, flags: tuple[str, ...]) -> None:
    async with nodes(tmp_path, redis_srv, 2, gemma3_path(), "-np", "2", "-c", "8192", *flags) as pairs:
        rows = await converse(pairs, document(40))
        assert rows[0]["cache_n"] == 0 and rows[0]["prompt_n"] > 512, rows  # past the 512-token window
        assert_only_new_turns(rows)
        assert saves_skipped(pairs) == 0


def _spin(until: float) -> None:
    while time.monotonic() < until:
        pass


@contextlib.contextmanager
def busy_cores(n: int, seconds: float) -> Iterator[None]:
    """``n`` processes that keep a core busy each, for at most ``seconds``."""
    until = time.monotonic() + seconds
    procs = [multiprocessing.get_context("spawn").Process(target=_spin, args=(until,), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
            p.join(5)


async def test_turns_after_restarts_on_a_loaded_machine(redis_srv: RedisProc, tmp_path: Path) -> None:
    async with nodes(tmp_path, redis_srv, 1, smollm2_path(), "-np", "2") as pairs:
        with busy_cores(2, 600):
            rows = await converse(pairs, document(40))
        assert_only_new_turns(rows)
        assert saves_skipped(pairs) == 0


async def test_a_restart_during_a_long_prefill_skips_that_save_only(
        redis_srv: RedisProc, model_8b: str, tmp_path: Path) -> None:
    async with nodes(tmp_path, redis_srv, 1, model_8b, "-t", "1", "-np", "2") as pairs:
        (llama, sc), = pairs
        system = document(20)
        first = await post(sc.url + "/v1/chat/completions", chat(system, [], QUESTIONS[0]))
        assert first.status == 200
        await settle(sc)
        history = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": first.content}]
        skipped = saves_skipped(pairs)
        # The second turn carries a long new message: its prefill runs for seconds, and llama-server
        # is restarted in the middle of it.
        long_question = "Here are more records. " + document(60)[len(system):] + " What does shelf 50 hold?"
        second = asyncio.create_task(post(sc.url + "/v1/chat/completions", chat(system, history, long_question)))
        await wait_computing(llama)
        await restart(llama)
        answer = await second
        assert answer.status != 200 or "timings" not in (answer.body or {})  # that answer did not come
        await settle(sc)
        assert saves_skipped(pairs) == skipped + 1
        # The next turn (the client tries again) restores the first turn's state, computes the rest.
        again = await post(sc.url + "/v1/chat/completions", chat(system, history, long_question))
        assert again.status == 200
        first_total = first.body["timings"]["prompt_n"] + first.body["timings"]["cache_n"]
        assert again.restored >= first_total - CHUNK and again.body["timings"]["cache_n"] >= again.restored - 1


async def wait_computing(llama: LlamaServer, timeout: float = 30.0) -> None:
    """Until a slot of ``llama`` computes a prompt, and a second more."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            async with s.get(llama.url + "/slots") as r:
                if any(info.get("is_processing") for info in await r.json()):
                    await asyncio.sleep(1.0)
                    return
            await asyncio.sleep(0.1)
    raise TimeoutError("no slot started computing")


async def test_an_answer_read_to_done_is_saved_when_the_client_leaves_at_once(
        redis_srv: RedisProc, tmp_path: Path) -> None:
    """The OpenAI client closes its connection right after ``data: [DONE]``: each such answer is
    taken as finished, as one read to the end of the stream would be: saved, or its save skipped
    because the next question on the same document already waited for the slot (a skip needs a
    finished answer too; an answer taken as cut would be neither)."""
    async with nodes(tmp_path, redis_srv, 1, smollm2_path(), "-np", "2") as pairs:
        (_, sc), = pairs
        saves = sc.metric("kvtier_save_seconds_count") + sc.metric("kvtier_saves_skipped_total")
        n = 12
        for i in range(n):
            body = {**chat(document(8), [], f"What does shelf {i} hold? Answer in a word."), "stream": True}
            await leave_after_done(sc.url + "/v1/chat/completions", body)
        # The client is gone before the sidecar has finished with the last request: wait until it
        # has counted every one (its save is registered with it), then for the saves.
        deadline = time.monotonic() + 30
        while sum(sc.metric("kvtier_requests_total", path="chat", outcome=outcome)
                  for outcome in ("ok", "client_gone", "cancelled", "upstream_error")) < n:
            assert time.monotonic() < deadline, "the sidecar never finished with a request"
            await asyncio.sleep(0.05)
        await settle(sc)
        assert sc.metric("kvtier_save_seconds_count") + sc.metric("kvtier_saves_skipped_total") == saves + n
        assert sc.metric("kvtier_cache_errors_total", stage="save") == 0


async def leave_after_done(url: str, body: dict[str, Any]) -> None:
    """Stream ``body`` and drop the connection the moment ``data: [DONE]`` arrives."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:
        r = await s.post(url, json=body)
        seen = b""
        async for piece in r.content.iter_any():
            seen += piece
            if b"data: [DONE]" in seen:
                break
        assert b"data: [DONE]" in seen
        r.close()  # closes the connection, not waiting for the rest of the response
