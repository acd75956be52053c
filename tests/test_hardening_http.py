"""Hostile clients against a real sidecar, llama-server and Valkey: unreadable bodies, slot actions,
bodies in pieces or trickled, clients that give up, huge prompts, a frozen Redis (docs/security.md)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from sidecar.config import Settings
from sidecar.proxy import COMPLETION_KINDS
from sidecar.routes import LLAMA_SERVER_RULES, ROUTES
from tests.servers import LlamaServer, RedisProc, llama_server
from tests.sidecars import Node, peak_rss, peak_rss_reset, post, run_sidecar

pytestmark = pytest.mark.llama

TOKEN = "hardening-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
# About 140 tokens tenant A and tenant B's guess share, then A's private end.
SHARED = " ".join(f"Record {i}: account {i * 7919 % 1000} holds {i * 13} credits." for i in range(12))
PRIVATE = SHARED + "\nPrivate note of tenant A: the vault code is 4711.\nSummary:"
GUESS = SHARED + "\nPrivate note of tenant A: the vault code is 1234.\nSummary:"



def settings_for(llama: LlamaServer, redis_url: str, **kw: Any) -> Settings:
    return replace(Settings(llama_url=llama.url, slot_dir=str(llama.slot_dir), redis_url=redis_url, node_id="hard",
                            chunk_tokens=64, cache_size=256 << 20, auth_token=TOKEN), **kw)


@pytest_asyncio.fixture(scope="module")
async def node(redis_srv: RedisProc, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Node]:
    tmp: Path = tmp_path_factory.mktemp("hardening")
    with llama_server(tmp, "-np", "2") as llama:
        async with run_sidecar(settings_for(llama, redis_srv.url)) as sc:
            assert await sc.engine.ensure_ready()
            yield Node(sc, llama, redis_srv)


async def slots_idle(llama: LlamaServer) -> bool:
    async with aiohttp.ClientSession() as s, s.get(llama.url + "/slots") as r:
        return not any(slot.get("is_processing") for slot in await r.json())


async def raw_exchange(url: str, head: str, pieces: list[bytes], gap_s: float, read_timeout: float) -> tuple[bytes, float]:
    """Send ``head`` then ``pieces`` ``gap_s`` apart on a real socket; what came back until the
    server closed (or ``read_timeout``), and when the first byte came."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    t0 = time.monotonic()
    writer.write(head.encode())
    answer = b""
    first = -1.0

    async def trickle() -> None:
        for piece in pieces:
            await asyncio.sleep(gap_s)
            if writer.is_closing():
                return
            writer.write(piece)
            try:
                await writer.drain()
            except ConnectionError:
                return

    sender = asyncio.create_task(trickle())
    try:
        async with asyncio.timeout(read_timeout):
            while data := await reader.read(65536):
                if first < 0:
                    first = time.monotonic() - t0
                answer += data
    except (TimeoutError, ConnectionError):
        pass
    finally:
        sender.cancel()
        writer.close()
    return answer, first


# -- 2: a body kvtier cannot read never goes around the tenant rules --------------------------------------


async def test_tenant_guess_in_a_body_kvtier_cannot_read_reuses_nothing(node: Node) -> None:
    """Tenant B guesses tenant A's prompt in bodies kvtier's parser used to refuse (and forward as
    they came, to a slot llama-server picked by similarity: A's). A BOM is read as llama-server
    reads it; the rest is refused; a body kvtier reads but does not cache is sent to B's own slot."""
    url = node.sc.url + "/completion"
    first = await post(url, {"prompt": PRIVATE, "n_predict": 2, "temperature": 0}, headers={"X-KVTier-Salt": "a"})
    assert first.status == 200, first.text
    await node.sc.engine.drain(30)
    b = {"X-KVTier-Salt": "b", "Content-Type": "application/json"}
    guess = {"prompt": GUESS, "n_predict": 2, "temperature": 0}
    for raw in (b"\xef\xbb\xbf" + json.dumps(guess).encode(),  # a UTF-8 BOM before the JSON
                json.dumps({**guess, "prompt": [GUESS]}).encode(),  # a prompt list: not cached, still pinned
                json.dumps({**guess, "cache_prompt": False}).encode()):
        ans = await post(url, None, raw=raw, headers=b)
        assert ans.status == 200, ans.text
        assert ans.body["timings"]["cache_n"] == 0, (raw[:40], ans.body["timings"])
        await node.sc.engine.drain(30)
    deep = b'{"prompt": "x", "n_predict": 1, "nest": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    for raw in (deep, b'{"prompt": "x", "temperature": NaN}', b'["x"]', b'{"prompt": "\xff\xfe"}', b"{", b"",
                b'{"prompt": "x", "seed": 1e400}'):
        for path in COMPLETION_KINDS:
            ans = await post(node.sc.url + path, None, raw=raw, headers=b)
            assert ans.status == 400 and ans.body["error"]["code"] == 400, (path, raw[:40], ans.text[:200])
    assert node.sc.metric("kvtier_requests_total", path="completion", outcome="invalid") >= 7
    # A malformed X-Session-Id: refused before a slot is taken, and counted like any invalid request.
    invalid = node.sc.metric("kvtier_requests_total", path="completion", outcome="invalid")
    ans = await post(url, guess, headers={**b, **BEARER, "X-Session-Id": "../escape"})
    assert ans.status == 400 and "X-Session-Id" in ans.body["error"]["message"], ans.text
    assert node.sc.metric("kvtier_requests_total", path="completion", outcome="invalid") == invalid + 1
    # A tenant that names itself to an endpoint outside the KV flow is refused, not sent to A's slot.
    infill = await post(node.sc.url + "/infill", {"input_prefix": GUESS, "n_predict": 1}, headers=b)
    assert infill.status == 403 and infill.body["error"]["type"] == "forbidden"


# -- 3: llama-server's slot actions and state-changing endpoints ------------------------------------------


async def test_slot_actions_are_refused_and_state_changes_need_the_token(node: Node) -> None:
    async with aiohttp.ClientSession() as s:
        for action in ("erase", "save", "restore"):
            for headers in ({}, BEARER):
                async with s.post(f"{node.sc.url}/slots/0?action={action}", json={"filename": "kvtier-restore-0.bin"},
                                  headers=headers) as r:
                    assert r.status == 403, (action, headers, await r.text())
                    assert (await r.json())["error"]["type"] == "forbidden"
        for path in ("//slots/0?action=erase", "/slots/./0?action=erase", "/slots/%30?action=erase"):
            async with s.post(node.sc.url + path) as r:
                assert r.status in (403, 404), (path, r.status)
        for method, path in (("POST", "/lora-adapters"), ("POST", "/props"), ("POST", "/models/load")):
            async with s.request(method, node.sc.url + path, json=[]) as r:
                assert r.status == 401, (path, r.status)
        async with s.post(node.sc.url + "/lora-adapters", json=[], headers=BEARER) as r:
            assert r.status == 200, await r.text()  # passed on with the token (this server has no adapters)
        async with s.get(node.sc.url + "/slots") as r:
            assert r.status == 401  # it lists every tenant's slots (without their prompts: test_hardening_tenants.py)
        async with s.get(node.sc.url + "/slots", headers=BEARER) as r:
            assert r.status == 200
    allowed = settings_for(node.llama, node.redis.url, allow_slot_actions=True)
    async with run_sidecar(allowed) as sc, aiohttp.ClientSession() as s:
        async with s.post(f"{sc.url}/slots/1?action=erase") as r:
            assert r.status == 401
        async with s.post(f"{sc.url}/slots/1?action=erase", headers=BEARER) as r:
            assert r.status == 200, await r.text()


# -- 4: sessions API bodies in pieces -----------------------------------------------------------------------


async def test_sessions_api_reads_a_body_sent_in_two_pieces(node: Node) -> None:
    body = b'{"slot": 0, "wait_s": 1}'
    head = (f"POST /v1/sessions/never-saved/restore HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    answer, _ = await raw_exchange(node.sc.url, head, [body[:9], body[9:]], gap_s=0.3, read_timeout=10)
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 404 " in status_line, answer[:300]  # read whole: the session is unknown, the body was fine
    assert b"not valid JSON" not in rest


# -- 8, 11: clients that give up ----------------------------------------------------------------------------


async def _give_up(node: Node, n: int) -> None:
    """``n`` long generations (half streamed) whose clients leave after 2 s."""
    async def impatient(i: int) -> None:
        body = {"prompt": f"Story {i}: once upon a time", "n_predict": 1500, "ignore_eos": True,
                "temperature": 0, "stream": i % 2 == 0}
        async with aiohttp.ClientSession() as s:
            try:
                async with asyncio.timeout(2):
                    async with s.post(node.sc.url + "/completion", json=body) as r:
                        await r.read()
            except TimeoutError:
                pass

    await asyncio.gather(*(impatient(i) for i in range(n)))


async def test_clients_that_give_up_leave_the_queue_and_are_counted(node: Node,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Eight long generations on two slots, every client gone after 2 s: none is answered as ok, all
    eight are counted as client_gone, the queue is empty, no disconnect is logged as an error, and
    llama-server stops the two it was running."""
    caplog.set_level(logging.INFO)
    before_ok = node.sc.metric("kvtier_requests_total", path="completion", outcome="ok")
    before_gone = node.sc.metric("kvtier_requests_total", path="completion", outcome="client_gone")
    await _give_up(node, 8)
    for _ in range(50):
        if node.sc.metric("kvtier_requests_total", path="completion", outcome="client_gone") - before_gone == 8:
            break
        await asyncio.sleep(0.1)
    assert node.sc.metric("kvtier_requests_total", path="completion", outcome="client_gone") - before_gone == 8
    assert node.sc.metric("kvtier_requests_total", path="completion", outcome="ok") == before_ok
    assert node.sc.engine.slots.queue_depth == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    # The two that were running were stopped: kvtier closed their connections, which llama-server
    # checks once its results queue has been quiet for a second (any result, even of a /slots call,
    # restarts that second: hence the slow polling here). Left running they need another ~15 s.
    t0 = time.monotonic()
    while not await slots_idle(node.llama):
        assert time.monotonic() - t0 < 5, "llama-server still generates for clients that left"
        await asyncio.sleep(1.5)
    await node.sc.engine.drain(30)


# -- 10: one request, bounded memory ------------------------------------------------------------------------



async def test_a_huge_prompt_is_refused_before_it_is_tokenized(node: Node) -> None:
    prompt = "word " * (1_600_000)  # 8 MB: ~1.6 M tokens, far past the slots' 2,048
    raw = json.dumps({"prompt": prompt, "n_predict": 1}).encode()
    del prompt
    tokenized = node.sc.metric("kvtier_prompt_seconds_count", way="in_process") + \
        node.sc.metric("kvtier_prompt_seconds_count", way="llama_server")
    peak_rss_reset()
    base = peak_rss()
    t0 = time.monotonic()
    ans = await post(node.sc.url + "/completion", None, raw=raw)
    assert ans.status == 400 and "max_prompt_chars" in ans.body["error"]["message"], ans.text[:300]
    assert time.monotonic() - t0 < 5
    assert peak_rss() - base < 8 * len(raw), (peak_rss() - base) / len(raw)  # a few times its size
    assert node.sc.metric("kvtier_prompt_seconds_count", way="in_process") + \
        node.sc.metric("kvtier_prompt_seconds_count", way="llama_server") == tokenized
    # The same prompt as chat messages, and a limit set by the operator.
    chat = {"messages": [{"role": "user", "content": "word " * 20_000}], "max_tokens": 1}
    async with run_sidecar(settings_for(node.llama, node.redis.url, max_prompt_chars=50_000)) as sc:
        ans = await post(sc.url + "/v1/chat/completions", chat)
        assert ans.status == 400 and "50000" in ans.body["error"]["message"], ans.text[:300]


# -- 11: readiness within the probe's timeout, slow bodies ----------------------------------------------------


async def test_readyz_answers_within_the_probe_timeout_with_redis_frozen(node: Node) -> None:
    proc = node.redis.process
    assert proc is not None and proc.proc is not None
    os.kill(proc.proc.pid, signal.SIGSTOP)
    try:
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            async with s.get(node.sc.url + "/readyz") as r:
                body = await r.json()
            took = time.monotonic() - t0
        assert took < 2.5, took  # the chart's readiness probe times out after 3 s
        assert r.status == 200 and body["checks"]["redis"].startswith("unavailable"), body
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)


async def test_a_trickled_body_is_cut_off(node: Node) -> None:
    async with run_sidecar(settings_for(node.llama, node.redis.url, body_timeout=1.0)) as sc:
        for path in ("/completion", "/v1/sessions/x/restore", "/props"):
            head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                    "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
            t0 = time.monotonic()
            answer, first = await raw_exchange(sc.url, head, [b" "] * 100, gap_s=0.2, read_timeout=8)
            assert answer.startswith(b"HTTP/1.1 408"), (path, answer[:200])
            assert 0.9 < first < 2.0, first
            assert time.monotonic() - t0 < 5.5, "the connection was held open after the 408"


# -- every endpoint, hostile input ----------------------------------------------------------------------------

HOSTILE = {
    "bom": b'\xef\xbb\xbf{"slot": 0}',
    "deep": b"[" * 5000 + b"]" * 5000,
    "nan": b'{"x": NaN}',
    "not-utf8": b'{"x": "\xff"}',
    "not-json": b"\x00\x01 hello",
    "truncated": b'{"messages": [',
}


def _every_path() -> list[tuple[str, str]]:
    own = [(r.method if r.method != "GET" else "POST", r.path.replace("{id}", "s-1")) for r in ROUTES]
    own += [(r.method, r.path.replace("{id}", "s-1")) for r in ROUTES if r.method != "GET"]
    relayed = [(r.method, r.path + ("/0" if r.path == "/slots" else "")) for r in LLAMA_SERVER_RULES]
    other = [("POST", p) for p in ("/tokenize", "/detokenize", "/apply-template", "/health", "/nowhere")]
    return sorted(set(own + relayed + other))


async def test_hostile_bodies_on_every_endpoint_get_an_answer_never_a_crash(node: Node, caplog: pytest.LogCaptureFixture) -> None:
    """Each body on each path kvtier serves or passes on: kvtier's own answers are JSON 4xx, llama-server's
    are relayed, nothing is a kvtier 500, and the sidecar serves normally afterwards."""
    caplog.set_level(logging.ERROR)
    async with aiohttp.ClientSession() as s:
        for method, path in _every_path():
            for name, raw in HOSTILE.items():
                for headers in ({}, {**BEARER, "X-KVTier-Salt": "b"}):
                    async with s.request(method, node.sc.url + path, data=raw,
                                         headers={"Content-Type": "application/json", **headers}) as r:
                        text = await r.text()
                    what = (method, path, name, r.status, text[:200])
                    assert "X-Request-Id" in r.headers, what
                    if r.status >= 500:
                        assert r.status != 500 or "kvtier" not in text, what
                    if path in COMPLETION_KINDS or path.startswith(("/v1/sessions", "/v1/cache")):
                        assert 400 <= r.status < 500 and json.loads(text)["error"]["code"] == r.status, what
    assert not [r for r in caplog.records if r.name.startswith(("aiohttp", "kvtier"))], \
        [r.getMessage() for r in caplog.records]
    ok = await post(node.sc.url + "/completion", {"prompt": "Hello", "n_predict": 2, "temperature": 0})
    assert ok.status == 200, ok.text
