"""Explicit mode: the sessions API, auth, tenants, hostile input, the OpenAPI contract, the docs."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from sidecar.config import Settings
from tests.servers import LlamaServer, RedisProc, llama_server
from tests.sidecars import Sidecar, post, run_sidecar

pytestmark = pytest.mark.llama

TOKEN = "t0k3n-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHUNK = 64
DOC = " ".join(f"Record {i}: city {['Oslo', 'Lima', 'Pune', 'Kobe'][i % 4]} has {i * 13} parks." for i in range(24))


@dataclass
class Nodes:
    a: Sidecar
    b: Sidecar
    llama_a: LlamaServer
    llama_b: LlamaServer
    redis: RedisProc


def settings(llama: LlamaServer, redis_url: str | None, node: str, **kw: object) -> Settings:
    base = Settings(llama_url=llama.url, slot_dir=str(llama.slot_dir), redis_url=redis_url, node_id=node,
                    chunk_tokens=CHUNK, cache_size=256 << 20, auth_token=TOKEN, prefill_tps_prior=100.0)
    return replace(base, **kw)  # type: ignore[arg-type]


@pytest_asyncio.fixture(scope="module")
async def nodes(redis_srv: RedisProc, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Nodes]:
    tmp: Path = tmp_path_factory.mktemp("sessions")
    with llama_server(tmp, "-np", "2") as la, llama_server(tmp, "-np", "2") as lb:
        # B restores sessions of more than two chunks two at a time, each pair written into the
        # restore file while the next is fetched (``prefixstream.stream_session``); A fetches them whole.
        async with run_sidecar(settings(la, redis_srv.url, "a")) as a, \
                run_sidecar(settings(lb, redis_srv.url, "b", stream_window=1)) as b:
            yield Nodes(a, b, la, lb, redis_srv)


async def call(method: str, url: str, *, json_body: object = None, raw: bytes | None = None,
               headers: dict[str, str] | None = None) -> tuple[int, object]:
    async with aiohttp.ClientSession() as s:
        kwargs: dict[str, object] = {"headers": {**AUTH, **(headers or {})}}
        if raw is not None:
            kwargs["data"] = raw
        elif json_body is not None:
            kwargs["json"] = json_body
        async with s.request(method, url, **kwargs) as r:  # type: ignore[arg-type]
            try:
                return r.status, await r.json(content_type=None)
            except ValueError:
                return r.status, await r.text()


def is_error(status: int, body: object, expected: int) -> bool:
    return (status == expected and isinstance(body, dict) and isinstance(body.get("error"), dict)
            and body["error"].get("code") == expected and bool(body["error"].get("message"))
            and re.fullmatch(r"[a-z_]+", str(body["error"].get("type"))) is not None)


def chat(question: str, history: list[dict[str, str]] | None = None) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": DOC}, *(history or []), {"role": "user", "content": question}],
            "max_tokens": 10, "temperature": 0}


async def test_save_show_list_restore_delete_and_migrate(nodes: Nodes) -> None:
    a, b = nodes.a, nodes.b
    first = await post(a.url + "/v1/chat/completions", chat("Which city has 26 parks?"), headers={**AUTH, "X-Session-Id": "mig-1"})
    assert first.status == 200
    await a.engine.drain(30)
    status, saved = await call("PUT", a.url + "/v1/sessions/mig-1")
    assert status == 200 and saved["shared"] is True and saved["tokens"] > 300, saved
    assert saved["tail_tokens"] == saved["tokens"] % CHUNK
    status, shown = await call("GET", b.url + "/v1/sessions/mig-1")
    assert status == 200 and shown["n_tokens"] == saved["tokens"] and shown["node"] == "a"
    assert shown["chunks_available"] == shown["chunks"] and "redis" in shown["chunks_by_tier"]
    status, listed = await call("GET", b.url + "/v1/sessions?prefix=mig&limit=1")
    assert status == 200 and [s["id"] for s in listed["sessions"]] == ["mig-1"]
    # Restore on B (a node that never saw it) into slot 1, then continue there and on A: same tokens.
    streamed = b.metric("kvtier_restore_streams_total", outcome="written")
    status, restored = await call("POST", b.url + "/v1/sessions/mig-1/restore", json_body={"slot": 1})
    assert status == 200 and restored["n_restored"] == saved["tokens"] and restored["slot"] == 1, restored
    assert b.metric("kvtier_restore_streams_total", outcome="written") == streamed + 1
    history = [{"role": "user", "content": "Which city has 26 parks?"}, {"role": "assistant", "content": first.content}]
    nxt = chat("And which has 39?", history)
    on_b = await post(nodes.llama_b.url + "/v1/chat/completions", {**nxt, "id_slot": 1, "cache_prompt": True})
    on_a = await post(nodes.llama_a.url + "/v1/chat/completions",
                      {**nxt, "id_slot": int(first.headers["X-KVTier-Slot"]), "cache_prompt": True})
    assert on_b.content == on_a.content
    assert on_b.prompt_n == on_a.prompt_n  # B recomputed exactly what A did: only the new turn
    assert on_b.prompt_n < 40
    status, deleted = await call("DELETE", a.url + "/v1/sessions/mig-1")
    assert status == 200 and deleted["deleted"] is True
    assert is_error(*await call("GET", b.url + "/v1/sessions/mig-1"), 404)
    assert is_error(*await call("POST", b.url + "/v1/sessions/mig-1/restore"), 404)


async def test_session_header_restores_on_another_node(nodes: Nodes) -> None:
    a, b = nodes.a, nodes.b
    q1 = chat("How many parks has record 5?")
    r1 = await post(a.url + "/v1/chat/completions", q1, headers={**AUTH, "X-Session-Id": "hop-7"})
    assert r1.status == 200
    await a.engine.drain(30)
    history = [{"role": "user", "content": "How many parks has record 5?"}, {"role": "assistant", "content": r1.content}]
    r2 = await post(b.url + "/v1/chat/completions", chat("And record 6?", history), headers={**AUTH, "X-Session-Id": "hop-7"})
    assert r2.status == 200
    await b.engine.drain(30)
    status, manifest = await call("GET", a.url + "/v1/sessions/hop-7")
    # B restored the whole saved session, partial tail included, not just full chunks.
    assert r2.restored > 0 and r2.restored % CHUNK != 0
    assert r2.prompt_n <= int(r2.headers["X-KVTier-Prompt-Tokens"]) - r2.restored + 1
    assert status == 200 and manifest["node"] == "b"  # saved again after B's turn
    # A request that fails after its session was restored saves nothing, but records the use.
    for text in ("Unrelated words.", "Other words, unrelated too."):  # B's two slots hold other things
        assert (await post(b.url + "/completion", {"prompt": text, "n_predict": 1})).status == 200
    await b.engine.drain(30)
    history += [{"role": "user", "content": "And record 6?"}, {"role": "assistant", "content": r2.content}]
    bad = {**chat("And record 7?", history), "max_tokens": "many"}
    r3 = await post(b.url + "/v1/chat/completions", bad, headers={**AUTH, "X-Session-Id": "hop-7"})
    await b.engine.drain(30)
    _, after = await call("GET", a.url + "/v1/sessions/hop-7")
    assert r3.status == 400 and r3.restored == manifest["n_tokens"], r3.headers
    assert after["last_used"] > manifest["last_used"]
    assert {k: v for k, v in after.items() if k != "last_used"} == {k: v for k, v in manifest.items() if k != "last_used"}


async def test_tenant_never_gets_another_tenants_prefix(nodes: Nodes) -> None:
    a, b = nodes.a, nodes.b
    body = {"prompt": "Private notes of tenant one. " + DOC + "\nSummary:", "n_predict": 4, "temperature": 0}
    first = await post(a.url + "/completion", body, headers={"X-KVTier-Salt": "tenant-1"})
    assert first.status == 200
    await a.engine.drain(30)
    await a.store.flush(30)
    other_node = await post(b.url + "/completion", body, headers={"X-KVTier-Salt": "tenant-2"})
    # Another tenant again: tenant 2's own state, which node b is saving now, is tenant 2's to
    # restore (a request waits for a save in flight of its own prefix).
    same_node = await post(a.url + "/completion", {**body, "cache_salt": "tenant-3"})
    prompt_tokens = int(first.headers["X-KVTier-Prompt-Tokens"])
    for ans in (other_node, same_node):
        assert ans.status == 200 and ans.restored == 0
        assert ans.prompt_n >= prompt_tokens - 1  # computed from scratch: nothing of tenant 1 reused
    # the same tenant on the other node does restore
    again = await post(b.url + "/completion", body, headers={"X-KVTier-Salt": "tenant-1"})
    assert again.restored > 0


@pytest.mark.parametrize("session_id", ["..", "..%2F..%2Fetc%2Fpasswd", "%C3%BCnicode", "a" * 129, "-lead",
                                        "sp%20ace", "null%00byte", "x*", "%2e%2e"])
async def test_hostile_session_ids(nodes: Nodes, session_id: str) -> None:
    for method, suffix, body in [("GET", "", None), ("PUT", "", {"slot": 0}), ("DELETE", "", None),
                                 ("POST", "/restore", None)]:
        status, answer = await call(method, f"{nodes.a.url}/v1/sessions/{session_id}{suffix}", json_body=body)
        assert status in (400, 404, 405), (method, session_id, status, answer)
        assert isinstance(answer, dict) and "error" in answer
    assert not [p for p in nodes.llama_a.slot_dir.iterdir() if not p.name.startswith("kvtier-")]


async def test_bad_bodies_and_fields(nodes: Nodes) -> None:
    url = nodes.a.url + "/v1/sessions/ok-id"
    cases: list[tuple[str, str, bytes, int]] = [
        ("PUT", "", b"{not json", 400),
        ("PUT", "", b"[1, 2]", 400),
        ("PUT", "", b'{"slot": "zero"}', 400),
        ("PUT", "", b'{"slot": -1}', 400),
        ("PUT", "", b'{"slot": 99}', 400),
        ("PUT", "", b'{"slot": true}', 400),
        ("PUT", "", b'{"slot": 0, "evil": 1}', 400),
        ("PUT", "", b'{"slot": 0, "wait_s": 1e9}', 400),
        ("PUT", "", b"{}", 400),  # no slot known for this session
        ("POST", "/restore", b'{"slot": 1.5}', 400),
        ("POST", "/restore", b'{"slot": 0}', 404),
        ("PUT", "", b'{"slot": 0, "x": "' + b"y" * 70_000 + b'"}', 413),
    ]
    for method, suffix, raw, expected in cases:
        status, body = await call(method, url + suffix, raw=raw, headers={"Content-Type": "application/json"})
        assert is_error(status, body, expected), (raw[:40], status, body)
    for query in ["limit=0", "limit=abc", "limit=100000", "prefix=%2A", "prefix=" + "a" * 200]:
        status, body = await call("GET", nodes.a.url + "/v1/sessions?" + query)
        assert is_error(status, body, 400), (query, status, body)


async def test_auth_is_enforced(nodes: Nodes) -> None:
    async with aiohttp.ClientSession() as s:
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}]:
            async with s.get(nodes.a.url + "/v1/sessions", headers=headers) as r:
                body = await r.json()
                assert is_error(r.status, body, 401)
                assert TOKEN not in await r.text()
        async with s.get(nodes.a.url + "/healthz") as r:
            assert r.status == 200
        async with s.get(nodes.a.url + "/v1/sessions", headers=AUTH) as r:
            assert r.status == 200


async def test_auth_all_endpoints(nodes: Nodes) -> None:
    async with run_sidecar(settings(nodes.llama_b, None, "b-all", auth_all=True)) as sc:
        assert (await post(sc.url + "/completion", {"prompt": "hi", "n_predict": 1})).status == 401
        ok = await post(sc.url + "/completion", {"prompt": "hi", "n_predict": 1}, headers=AUTH)
        assert ok.status == 200
        status, _ = await call("GET", sc.url + "/readyz", headers={"Authorization": ""})
        assert status == 200


async def test_without_redis_sessions_are_node_local(nodes: Nodes) -> None:
    async with run_sidecar(settings(nodes.llama_b, None, "b-local")) as sc:
        r = await post(sc.url + "/v1/chat/completions", chat("Which city has 0 parks?"), headers={**AUTH, "X-Session-Id": "loc"})
        assert r.status == 200
        await sc.engine.drain(30)
        status, listed = await call("GET", sc.url + "/v1/sessions")
        assert status == 200 and listed["shared"] is False and [s["id"] for s in listed["sessions"]] == ["loc"]
    status, _ = await call("GET", nodes.a.url + "/v1/sessions/loc")
    assert status == 404  # never left that node


async def test_concurrent_deletes_during_restore(nodes: Nodes) -> None:
    a = nodes.a
    r = await post(a.url + "/v1/chat/completions", chat("Name a city."), headers={**AUTH, "X-Session-Id": "race-1"})
    assert r.status == 200
    await a.engine.drain(30)
    ns = a.engine.target.namespace
    manifest = await a.engine.sessions.load(ns, "race-1")
    results = await asyncio.gather(
        *[call("POST", a.url + "/v1/sessions/race-1/restore") for _ in range(3)],
        *[call("DELETE", a.url + "/v1/sessions/race-1") for _ in range(3)],
    )
    statuses = [s for s, _ in results]
    assert all(s in (200, 404, 409, 410) for s in statuses), results
    assert sum(1 for s, body in results[3:] if s == 200) <= 1  # one delete wins
    assert (await call("GET", a.url + "/healthz"))[0] == 200
    # A restore that finishes after the delete records its use without bringing the session back.
    await a.engine.sessions.touch(ns, manifest)
    assert (await call("GET", a.url + "/v1/sessions/race-1"))[0] == 404
    # the prefix chunks, which other sessions share, are intact in Redis
    found = await nodes.b.store.lookup(ns, manifest.tokens, manifest.chunks)
    assert found.n_chunks == manifest.chunks


async def test_openapi_contract_with_schemathesis(nodes: Nodes) -> None:
    """schemathesis fuzzes the sessions API and probes against /openapi.json (in a subprocess)."""
    st = Path(sys.executable).with_name("st")
    proc = await asyncio.create_subprocess_exec(
        str(st), "run", nodes.a.url + "/openapi.json", "--checks", "all", "--max-examples", "25",
        "--include-path-regex", "^/(v1/sessions|healthz|readyz)", "-H", f"Authorization: Bearer {TOKEN}",
        "--seed", "1", "--request-timeout", "30", "--phases", "examples,coverage,fuzzing",
        "--exclude-checks", "positive_data_acceptance,missing_required_header,ignored_auth",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 600)
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        failures = "\n".join(line for line in text.splitlines() if line.startswith(("___", "- ST", "    Unsupported")))
        raise AssertionError(failures + "\n" + text[-6000:])


async def test_docs_curl_examples_run_as_written(nodes: Nodes) -> None:
    doc = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", doc, flags=re.DOTALL)
    assert len(blocks) >= 6
    env = {**os.environ, "KVTIER": nodes.a.url, "TOKEN": TOKEN}
    for block in blocks:
        proc = await asyncio.create_subprocess_exec("bash", "-euo", "pipefail", "-c", block, env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await proc.communicate()
        assert proc.returncode == 0, (block, out.decode())
        await nodes.a.engine.drain(30)
