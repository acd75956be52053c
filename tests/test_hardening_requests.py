"""Requests that crashed llama-server behind kvtier, bloated kvtier's memory, or made it answer 500 or
log a traceback, against a real sidecar, llama-server and Valkey (docs/security.md)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from sidecar.config import Settings
from sidecar.proxy import COMPLETION_KINDS
from tests.servers import LlamaServer, RedisProc, llama_server
from tests.sidecars import Node, peak_rss, peak_rss_reset, post, run_sidecar

pytestmark = pytest.mark.llama



def settings_for(llama: LlamaServer, redis_url: str, **kw: Any) -> Settings:
    return replace(Settings(llama_url=llama.url, slot_dir=str(llama.slot_dir), redis_url=redis_url,
                            node_id="requests", chunk_tokens=64, cache_size=256 << 20), **kw)


@pytest_asyncio.fixture(scope="module")
async def node(redis_srv: RedisProc, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Node]:
    tmp: Path = tmp_path_factory.mktemp("requests")
    with llama_server(tmp, "-np", "2") as llama:
        async with run_sidecar(settings_for(llama, redis_srv.url)) as sc:
            assert await sc.engine.ensure_ready()
            yield Node(sc, llama, redis_srv)


def _chat(**kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Answer yes or no: is the sky blue?"}], "max_tokens": 4,
            "temperature": 0, **kw}


def _completion(**kw: Any) -> dict[str, Any]:
    return {"prompt": "Q: Is the sky blue? Answer yes or no.\nA:", "n_predict": 4, "temperature": 0, **kw}


# -- 15: malformed HTTP ----------------------------------------------------------------------------------------

MALFORMED = {
    "request line": b"GET / HTTP/9.Z\r\nHost: x\r\n\r\n",
    "header without colon": b"GET /healthz HTTP/1.1\r\nHost: x\r\nnocolon\r\n\r\n",
    "space in header name": b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
    "NUL in header": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n",
    "Content-Length": b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    "chunk size": b"POST /completion HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n0\r\n\r\n",
    "chunk end": b"PUT /v1/sessions/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXX0\r\n\r\n",
    "chunked and length": b"POST /props HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n"
                          b"3\r\nabc\r\n0\r\n\r\n",
    "long line": b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
}


async def _send_raw(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    try:
        async with asyncio.timeout(5):
            return await reader.read()
    finally:
        writer.close()


async def test_malformed_http_gets_400_and_one_line_without_a_traceback(node: Node,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for name, data in MALFORMED.items():
        caplog.clear()
        answer = await _send_raw(node.sc.url, data)
        assert answer.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request"), (name, answer[:200])
        await asyncio.sleep(0.05)
        seen = [r for r in caplog.records if r.levelno >= logging.INFO and r.name.startswith(("aiohttp", "kvtier.http"))]
        assert len(seen) <= 1, (name, [r.getMessage() for r in seen])
        bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
        assert not bad, (name, [(r.name, r.levelname, r.getMessage()) for r in bad])
    ok = await post(node.sc.url + "/completion", _completion(n_predict=1))
    assert ok.status == 200, ok.text[:300]
    await node.sc.engine.drain(30)


# -- 14: the queue gauge after waiters leave --------------------------------------------------------------------


async def _queue_gauge(url: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("kvtier_slot_queue_depth ")))


async def test_the_queue_gauge_falls_when_waiting_clients_leave(node: Node) -> None:
    """Two long generations hold both slots; three more requests wait and give up: the gauge shows
    them while they wait and 0 once they are gone (it kept its peak before)."""
    async def request(give_up_s: float) -> None:
        body = {"prompt": "Once upon a time", "n_predict": 2000, "ignore_eos": True, "temperature": 0}
        try:
            async with asyncio.timeout(give_up_s), aiohttp.ClientSession() as s, \
                    s.post(node.sc.url + "/completion", json=body) as r:
                await r.read()
        except TimeoutError:
            pass

    holders = [asyncio.create_task(request(8)) for _ in range(2)]
    await asyncio.sleep(1.0)
    waiters = [asyncio.create_task(request(1.5)) for _ in range(3)]
    await asyncio.sleep(0.7)
    assert await _queue_gauge(node.sc.url) == 3
    await asyncio.gather(*waiters)
    await asyncio.sleep(0.2)
    assert node.sc.engine.slots.queue_depth == 0
    assert await _queue_gauge(node.sc.url) == 0
    for task in holders:
        task.cancel()
    await asyncio.gather(*holders, return_exceptions=True)
    await node.sc.engine.drain(30)


# -- 2: a body that is mostly junk values ---------------------------------------------------------------------



async def test_a_body_of_junk_values_is_refused_before_it_is_parsed(node: Node) -> None:
    """31 MB, nearly all of it a list of empty objects: parsed, ~750 MB (orjson: 72 bytes each). It is
    refused on its value count, and one request, or four at once, cost kvtier a few times the body."""
    junk = b'{"prompt": "Hello", "n_predict": 1, "junk": [' + b"{}," * 10_333_000 + b'{}]}'
    peak_rss_reset()
    base = peak_rss()
    ans = await post(node.sc.url + "/completion", None, raw=junk)
    assert ans.status == 400 and "max_json_values" in ans.body["error"]["message"], ans.text[:300]
    one = peak_rss() - base
    peak_rss_reset()
    base = peak_rss()
    answers = await asyncio.gather(*(post(node.sc.url + path, None, raw=junk)
                                     for path in ("/completion", "/v1/completions", "/v1/chat/completions",
                                                  "/completion")))
    four = peak_rss() - base
    assert all(a.status == 400 for a in answers), [a.text[:200] for a in answers]
    # The body itself is read whole (aiohttp's buffer and its copy): about twice its size each.
    assert one < 4 * len(junk), one / len(junk)
    assert four < 12 * len(junk), four / len(junk)
    ok = await post(node.sc.url + "/completion", {"prompt": "Hello", "n_predict": 1, "logit_bias": [[1, -1.0]] * 1000})
    assert ok.status == 200, ok.text[:300]
    await node.sc.engine.drain(30)


# -- 3: JSON nested deeper than kvtier re-encodes ---------------------------------------------------------------


async def test_deep_json_gets_400_on_every_completion_route(node: Node, caplog: pytest.LogCaptureFixture) -> None:
    """Bodies nesting 254 to 1023 levels (orjson reads 1024 but writes only 254) are refused on every
    completion route, however kvtier would have handled them: cached, passed through, re-encoded."""
    caplog.set_level(logging.INFO)
    for depth in (254, 500, 1023):
        nest = "[" * depth + "]" * depth
        for path, kind in COMPLETION_KINDS.items():
            base = _chat() if kind == "chat" else _completion()
            for body in (base, {**base, "cache_prompt": False}, {**base, "cache_salt": "t"},
                         {**base, "prompt": [base.get("prompt", "")]}):
                raw = json.dumps(body)[:-1] + ', "x": ' + nest + "}"
                ans = await post(node.sc.url + path, None, raw=raw.encode())
                assert ans.status == 400 and "max_json_depth" in ans.body["error"]["message"], \
                    (depth, path, list(body), ans.text[:300])
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], \
        [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    nest = "[" * 100 + "]" * 100  # within the limit: answered
    for path, body in (("/completion", _completion(cache_prompt=False)), ("/v1/chat/completions", _chat())):
        ans = await post(node.sc.url + path, None, raw=(json.dumps(body)[:-1] + ', "x": ' + nest + "}").encode())
        assert ans.status == 200, ans.text[:300]
    await node.sc.engine.drain(30)


# -- 1: grammars and schemas that crash llama-server's parser ---------------------------------------------


async def llama_healthy(llama: LlamaServer) -> bool:
    try:
        async with aiohttp.ClientSession() as s, s.get(llama.url + "/health") as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


def _deep_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


async def test_deep_grammars_are_refused_and_llama_server_stays_up(node: Node) -> None:
    """A grammar nesting 20,000 groups crashed llama-server (llama.cpp #26600); kvtier refuses it, and
    schemas nested past max_json_depth, while real grammars and schemas still constrain the answer."""
    url = node.sc.url
    deep = "root ::= " + "(" * 20_000 + '"yes"' + ")" * 20_000
    responses = {"input": "Is the sky blue? Answer yes or no.", "max_output_tokens": 4, "temperature": 0}
    # llama-server's prompt endpoints outside the KV flow read grammars too: /v1/responses crashed.
    for path, body in (("/completion", _completion(grammar=deep)), ("/v1/chat/completions", _chat(grammar=deep)),
                       ("/completion", _completion(grammar="root ::= " + '"a" ' * 300_000)),
                       ("/v1/responses", {**responses, "grammar": deep}),
                       ("/infill", {"input_prefix": "def f(", "input_suffix": ")", "grammar": deep})):
        ans = await post(url + path, body)
        assert ans.status == 400 and ans.body["error"]["type"] == "invalid_request", (path, ans.text[:300])
        assert "max_grammar" in ans.body["error"]["message"], ans.text[:300]
    escaped = json.dumps({**responses, "grammar": deep}).replace('"grammar"', '"gr\\u0061mmar"')  # the same key
    ans = await post(url + "/v1/responses", None, raw=escaped.encode())
    assert ans.status == 400 and "max_grammar_depth" in ans.body["error"]["message"], ans.text[:300]
    schema = _deep_schema(100)  # 201 levels of JSON inside the body
    for path, body in (("/completion", _completion(json_schema=schema)),
                       ("/v1/chat/completions", _chat(response_format={"type": "json_schema",
                                                                       "json_schema": {"schema": schema}}))):
        ans = await post(url + path, body)
        assert ans.status == 400 and "max_json_depth" in ans.body["error"]["message"], (path, ans.text[:300])
    assert await llama_healthy(node.llama)
    # What real requests carry still works: a grammar with groups, literals holding parentheses, a
    # comment, and a JSON schema.
    real = 'root ::= (("yes") | "no") ( "(" [)(] ")" )? # a comment with ((( in it'
    for path, body in (("/completion", _completion(grammar=real)), ("/v1/chat/completions", _chat(grammar=real))):
        ans = await post(url + path, body)
        assert ans.status == 200 and re.fullmatch(r"(yes|no)(\([()]\))?", ans.content), (path, ans.text[:300])
    ans = await post(url + "/v1/responses", {**responses, "grammar": real})
    assert ans.status == 200, ans.text[:300]
    boolean = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    for path, body in (("/completion", _completion(n_predict=40, json_schema=boolean)),
                       ("/v1/chat/completions", _chat(max_tokens=40, response_format={
                           "type": "json_schema", "json_schema": {"schema": boolean}}))):
        ans = await post(url + path, body)
        assert ans.status == 200 and isinstance(json.loads(ans.content)["a"], bool), (path, ans.text[:300])
    async with run_sidecar(replace(node.sc.settings, max_grammar_depth=1)) as sc:  # the operator's limit
        ans = await post(sc.url + "/completion", _completion(grammar=real))
        assert ans.status == 400 and "max_grammar_depth" in ans.body["error"]["message"], ans.text[:300]
    assert await llama_healthy(node.llama)
    await node.sc.engine.drain(30)
