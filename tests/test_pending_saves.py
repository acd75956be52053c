"""A next turn that reaches another node before the last turn's save is readable there.

Node A answers a turn; its client sends the next turn at once, to node B. A marks in Redis, before
it saves, the prefixes its save will store; B's lookup finds the mark and waits for the save
(bounded by ``--save-wait`` and the cost model) instead of recomputing the history. A save whose
node dies releases its waiters when its marks expire; a mark left by someone else holds a request
no longer than the bound.

Real llama-servers, a real Valkey, SmolLM2; node A is a ``kvtier serve`` process, so it can be killed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

import pytest
import pytest_asyncio
import redis

from integrations.pendingflow import pending_marks
from launch import Node
from sidecar.config import Settings
from tests.servers import DEFAULT_LLAMA_ARGS, LlamaServer, RedisProc, llama_server, smollm2_path
from tests.sidecars import Sidecar, post, post_stream, run_sidecar, stream_text
from tiers.pending import PendingMark

pytestmark = pytest.mark.llama

CHUNK = 64
DOC = " ".join(f"Entry {i}: the {['red', 'blue', 'green', 'white'][i % 4]} box in room {i} holds {i * 5} keys."
               for i in range(45))


def chat(history: list[dict[str, str]], question: str) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": "Answer from these entries. " + DOC}, *history,
                         {"role": "user", "content": question}], "max_tokens": 8, "temperature": 0}


def pending_keys(r: redis.Redis) -> list[bytes]:
    return list(r.scan_iter(match=b"kvtier:*:p:*", count=1000))


@pytest.fixture(scope="module")
def node_a(redis_srv: RedisProc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    node = Node("a", tmp_path_factory.mktemp("pending-a"), smollm2_path(), [*DEFAULT_LLAMA_ARGS, "-np", "2"],
                redis_srv.url, CHUNK)
    node.start(with_sidecar=True)
    try:
        yield node
    finally:
        node.stop()


@pytest_asyncio.fixture(scope="module")
async def node_b(redis_srv: RedisProc, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[
        tuple[LlamaServer, Sidecar]]:
    with llama_server(tmp_path_factory.mktemp("pending-b"), "-np", "2") as llama:
        settings = Settings(llama_url=llama.url, slot_dir=str(llama.slot_dir), redis_url=redis_srv.url, node_id="b",
                            chunk_tokens=CHUNK, cache_size=512 << 20, prefill_tps_prior=100.0, save_wait=10.0)
        async with run_sidecar(settings) as sc:
            assert await sc.engine.ensure_ready()
            yield llama, sc


async def test_the_next_turn_on_another_node_waits_for_the_save(node_a: Node,
                                                               node_b: tuple[LlamaServer, Sidecar]) -> None:
    _, b = node_b
    first = await post(node_a.sidecar_url + "/v1/chat/completions", chat([], "What does room 3 hold?"))
    assert first.status == 200 and first.prompt_n > 10 * CHUNK
    history = [{"role": "user", "content": "What does room 3 hold?"}, {"role": "assistant", "content": first.content}]
    # At once, to the other node: node A is still saving the first turn.
    second = await post(b.url + "/v1/chat/completions", chat(history, "And room 8?"))
    assert second.status == 200
    # Only the new turn is computed, the history restored from what node A's save stored.
    waits = {o: b.metric("kvtier_save_waits_total", outcome=o) for o in ("landed", "failed", "timeout", "skipped")}
    assert second.restored >= first.prompt_n - CHUNK and second.prompt_n < CHUNK, (
        # Failed once in ~15 CI runs. No wait counted would mean B looked before A's marks landed (a
        # 4-10 ms margin on a quiet host: docs/architecture.md); a wait counted, that the save failed.
        second.prompt_n, second.headers, b.decisions(), waits)
    assert b.metric("kvtier_save_waits_total", outcome="landed") == 1
    assert b.metric("kvtier_save_wait_seconds_sum") < 5


async def test_a_session_turn_at_once_on_another_node_waits_for_the_save(
        node_a: Node, node_b: tuple[LlamaServer, Sidecar]) -> None:
    _, b = node_b
    await b.engine.drain(30)
    landed = b.metric("kvtier_save_waits_total", outcome="landed")
    session = {"X-Session-Id": "agent-7"}
    body = {**chat([], "Which box is in room 9?"),
            "messages": [{"role": "system", "content": "Inventory. " + DOC.replace("keys", "coins")},
                         {"role": "user", "content": "Which box is in room 9?"}]}
    for turn, url in enumerate([node_a.sidecar_url, b.url, node_a.sidecar_url]):
        ans = await post(url + "/v1/chat/completions", body, headers=session)
        assert ans.status == 200
        if turn:  # each turn at once on the other node: only the new turn is computed
            assert ans.prompt_n < CHUNK, (turn, ans.prompt_n, ans.headers)
        body["messages"] += [{"role": "assistant", "content": ans.content},  # type: ignore[operator]
                             {"role": "user", "content": f"And room {10 + turn}?"}]
    assert b.metric("kvtier_save_waits_total", outcome="landed") == landed + 1


async def test_a_save_whose_node_dies_releases_its_waiters(node_a: Node, node_b: tuple[LlamaServer, Sidecar],
                                                           redis_srv: RedisProc) -> None:
    _, b = node_b
    assert node_a.sidecar is not None and node_a.sidecar.proc is not None
    pid = node_a.sidecar.proc.pid
    # A conversation of its own, long enough that its save takes a while to store.
    body = {**chat([], "How many keys in all?"),
            "messages": [{"role": "system", "content": "Other records. " + DOC.replace("Entry", "Item") * 2},
                         {"role": "user", "content": "How many keys in all?"}]}
    prompt = await b.engine.prompts.prompt_for("chat", body)
    assert prompt is not None and b.engine.target is not None
    waited_before = b.metric("kvtier_save_wait_seconds_sum")
    first_mark = pending_marks(b.engine.target.namespace, prompt.tokens)[0][0]
    await b.engine.drain(30)
    with redis.Redis(port=redis_srv.port) as r:
        # Streamed: the answer's last bytes are sent before node A marks its save.
        ask = asyncio.create_task(post_stream(node_a.sidecar_url + "/v1/chat/completions", body))
        # Node A dies the moment its marks are set: its save never ends.
        deadline = time.monotonic() + 120
        while not r.exists(first_mark):
            assert time.monotonic() < deadline, "node A never marked its save"
            assert not ask.done() or ask.result()[0] == 200, ask.result()
            await asyncio.sleep(0.0005)
        os.kill(pid, signal.SIGKILL)
        status, events, _ = await ask
        assert status == 200 and events[-1] == "[DONE]"
        assert r.exists(first_mark)  # left behind by the dead node, until it expires
    body["messages"] += [{"role": "assistant", "content": stream_text(events)},  # type: ignore[operator]
                         {"role": "user", "content": "And in room 2?"}]
    second = await post(b.url + "/v1/chat/completions", body)
    assert second.status == 200
    assert b.metric("kvtier_save_waits_total", outcome="failed") == 1
    assert b.metric("kvtier_save_waits_total", outcome="timeout") == 0
    # The marks live 2 s unless renewed: the wait ends when they expire, long before the 10 s bound.
    assert b.metric("kvtier_save_wait_seconds_sum") - waited_before < 3
    node_a.stop()
    node_a.start(with_sidecar=True)


async def _answer_under_mark(sc: Sidecar, redis_srv: RedisProc, room: int, ready_at: float) -> float:
    """Answer a fresh conversation while a mark, as a save of it would set on its last full chunk,
    stands there written by someone else with no expiry (and garbage under the mark of its first
    chunk); the seconds the answer took."""
    body = {**chat([], f"What does room {room} hold?"),
            "messages": [{"role": "system", "content": f"Rows {room}. " + DOC.replace("Entry", "Row")},
                         {"role": "user", "content": f"What does room {room} hold?"}]}
    prompt = await sc.engine.prompts.prompt_for("chat", body)
    assert prompt is not None
    tokens = prompt.tokens
    marks = [key for key, n in pending_marks(sc.engine.target.namespace, tokens) if n % CHUNK == 0]
    with redis.Redis(port=redis_srv.port) as r:
        r.set(marks[-1], PendingMark(int(tokens.size), "nobody", ready_at).encode())
        r.set(marks[0], b"\xff" * 40)
        t0 = time.monotonic()
        ans = await post(sc.url + "/v1/chat/completions", body)
        took = time.monotonic() - t0
        r.delete(marks[-1], marks[0])
    assert ans.status == 200
    return took


async def test_a_mark_nobody_clears_holds_a_request_no_longer_than_the_bound(
        node_b: tuple[LlamaServer, Sidecar], redis_srv: RedisProc) -> None:
    _, b = node_b  # its llama-server, with a sidecar that waits at most 1 s
    async with run_sidecar(replace(b.settings, save_wait=1.0, node_id="b2")) as sc:
        assert await sc.engine.ensure_ready()
        took = await _answer_under_mark(sc, redis_srv, 30, ready_at=0.0)  # no estimate: wait to the bound
        assert sc.metric("kvtier_save_waits_total", outcome="timeout") == 1
        assert 1.0 <= sc.metric("kvtier_save_wait_seconds_sum") < 1.5
        assert took >= 1.0


async def test_a_save_expected_later_than_the_bound_is_not_waited_for(
        node_b: tuple[LlamaServer, Sidecar], redis_srv: RedisProc) -> None:
    _, b = node_b
    async with run_sidecar(replace(b.settings, save_wait=1.0, node_id="b3")) as sc:
        assert await sc.engine.ensure_ready()
        # Its node says Redis will hold it in a minute: a wait could only time out.
        await _answer_under_mark(sc, redis_srv, 31, ready_at=time.time() + 60)
        assert sc.metric("kvtier_save_waits_total", outcome="skipped") == 1
        assert sc.metric("kvtier_save_wait_seconds_count") == 0
        # Expected within the bound (here: due already): waited for, to the bound, as before.
        await _answer_under_mark(sc, redis_srv, 32, ready_at=time.time())
        assert sc.metric("kvtier_save_waits_total", outcome="timeout") == 1
        assert sc.metric("kvtier_save_waits_total", outcome="skipped") == 1


async def test_the_pending_saves_gauge_is_zero_once_concurrent_saves_end(node_b: tuple[LlamaServer, Sidecar]) -> None:
    """Two answers ending together on both slots: their saves overlap (one waits for Redis while the
    other still saves), and the gauge counts each save once, back to 0 when both are done."""
    _, b = node_b
    for rnd in range(3):
        answers = await asyncio.gather(*(post(b.url + "/v1/chat/completions", chat([], f"Round {rnd}: room {k}?"))
                                         for k in (11, 12)))
        assert [a.status for a in answers] == [200, 200]
        assert await b.engine.drain(30) and await b.store.flush(30)
        assert b.metric("kvtier_pending_saves") == 0, rnd
    assert b.metric("kvtier_save_seconds_count") >= 6
