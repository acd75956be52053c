"""The route table and the sessions API's HTTP logic, against a stand-in engine (no llama-server).

What the API does with real slots and Valkey is in test_sessions_api.py; here: which paths exist,
which need the token, what a 405 allows, what /openapi.json says, and how the sessions API
validates input and maps its errors.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from sidecar.appkeys import ENGINE, METRICS, REDIS, UPSTREAM
from sidecar.metrics import Metrics
from sidecar.middlewares import front_middleware
from sidecar.openapi import document
from sidecar.proxy import COMPLETION_KINDS
from sidecar.routes import ROUTES, allowed_methods, auth_policy, route_defs
from tiers.errors import KVTierError, TierUnavailable
from tiers.keys import Namespace
from tiers.sessions import Manifest, SessionIncomplete, SessionNotFound, SessionPage

TOKEN = "route-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def manifest(session_id: str, n_tokens: int = 8) -> Manifest:
    tokens = np.arange(n_tokens, dtype="<i4")
    return Manifest(id=session_id, namespace="ns", chunk_tokens=4, n_tokens=n_tokens, chunks=n_tokens // 4,
                    tail_tokens=n_tokens % 4, tail_hash="", bytes=100, node="n1", created=1.0, last_used=2.0,
                    tokens_b64=base64.b64encode(tokens.tobytes()).decode())


@dataclass
class FakeSessions:
    manifests: dict[str, Manifest] = field(default_factory=dict)
    fail: Exception | None = None
    shared: bool = False

    async def load(self, namespace: Namespace, session_id: str) -> Manifest:
        if self.fail is not None:
            raise self.fail
        if session_id not in self.manifests:
            raise SessionNotFound(f"no session {session_id!r}")
        return self.manifests[session_id]

    async def list_page(self, namespace: Namespace, prefix: str = "", *, after: str = "",
                        limit: int = 100) -> SessionPage:
        if "*" in prefix:
            raise ValueError("prefix holds a character a session id cannot")
        ids = sorted(i for i in self.manifests if i.startswith(prefix) and i > after)
        return SessionPage([self.manifests[i] for i in ids[:limit]], [])

    async def delete(self, namespace: Namespace, session_id: str) -> bool:
        return self.manifests.pop(session_id, None) is not None


class FakeStore:
    async def lookup(self, namespace: Namespace, tokens: np.ndarray, n_chunks: int) -> Any:
        return SimpleNamespace(n_chunks=n_chunks, tiers=["memory"] * n_chunks)


class FakeEngine:
    """What the sessions API asks of the engine before it takes a slot."""

    def __init__(self) -> None:
        self.ready = True
        self.last_error = "llama-server unreachable"
        self.target = SimpleNamespace(n_slots=2, n_ctx_slot=64, namespace=Namespace("fingerprint"))
        self.session_slots: dict[str, int] = {}
        self.sessions = FakeSessions()
        self.store = FakeStore()

    async def ensure_ready(self) -> bool:
        return self.ready


class DeadUpstream:
    """llama-server, unreachable: a request passed through answers 502."""

    async def request(self, *args: Any) -> Any:
        raise OSError("connection refused")


@pytest.fixture
async def sidecar() -> AsyncIterator[tuple[TestClient[web.Request, web.Application], FakeEngine]]:
    engine = FakeEngine()
    app = web.Application(middlewares=[front_middleware(auth_policy(TOKEN, False))])
    app[ENGINE] = engine  # type: ignore[misc]
    app[METRICS] = Metrics()
    app[REDIS] = None
    app[UPSTREAM] = DeadUpstream()  # type: ignore[misc]
    app.add_routes(route_defs())
    client = TestClient(TestServer(app))
    await client.start_server()
    yield client, engine
    await client.close()


def test_every_route_is_declared_once() -> None:
    keys = [(r.method, r.path) for r in ROUTES]
    assert len(keys) == len(set(keys))
    assert {r.path for r in ROUTES if r.relayed} == set(COMPLETION_KINDS)
    app = web.Application()
    app.add_routes(route_defs())  # aiohttp accepts the table as it is


@pytest.mark.parametrize(("path", "allowed"), [
    ("/healthz", "GET, HEAD"), ("/readyz", "GET, HEAD"), ("/metrics", "GET, HEAD"), ("/openapi.json", "GET, HEAD"),
    ("/v1/sessions", "GET, HEAD"), ("/v1/sessions/abc", "GET, HEAD, PUT, DELETE"),
    ("/v1/sessions/abc/restore", "POST"), ("/v1/cache", "GET, HEAD"), ("/v1/cache/purge", "POST"),
    ("/v1/sessions/", None), ("/v1/sessions/a/b", None), ("/v1/sessions/a/restore/x", None),
    ("/completion", None), ("/v1/chat/completions", None), ("/props", None), ("/healthz/x", None),
])
def test_allowed_methods_come_from_the_table(path: str, allowed: str | None) -> None:
    assert allowed_methods(path) == allowed


def test_auth_policy_comes_from_the_table() -> None:
    policy = auth_policy(TOKEN, False)
    assert policy.open_paths == {"/healthz", "/readyz"}
    assert set(policy.token_prefixes) == {"/v1/sessions", "/openapi.json", "/v1/cache", "/v1/cache/purge"}
    assert not policy.protect_all and auth_policy(TOKEN, True).protect_all


def test_openapi_describes_each_documented_route() -> None:
    spec = document(ROUTES)
    described = {(method.upper(), path) for path, item in spec["paths"].items() for method in item
                 if method != "parameters"}
    assert described == {(r.method, r.path) for r in ROUTES if r.doc is not None}
    assert "/openapi.json" not in spec["paths"]
    sessions = spec["paths"]["/v1/sessions/{id}"]
    assert sessions["parameters"][0]["name"] == "id"
    for method in ("get", "put", "delete"):
        assert sessions[method]["security"] == [{"bearer": []}]
        assert "401" in sessions[method]["responses"]
    assert "security" not in spec["paths"]["/healthz"]["get"]
    assert "security" not in spec["paths"]["/completion"]["post"]
    assert spec["paths"]["/v1/sessions/{id}/restore"]["post"]["requestBody"]["required"] is False


async def test_openapi_json_is_served_behind_the_token(sidecar: tuple[TestClient[web.Request, web.Application],
                                                                      FakeEngine]) -> None:
    client, _ = sidecar
    assert (await client.get("/openapi.json")).status == 401
    r = await client.get("/openapi.json", headers=AUTH)
    assert r.status == 200 and await r.json() == document(ROUTES)


async def test_wrong_methods_unknown_paths_and_the_rest(sidecar: tuple[TestClient[web.Request, web.Application],
                                                                       FakeEngine]) -> None:
    client, _ = sidecar
    for method, path, allow in [("DELETE", "/healthz", "GET, HEAD"), ("POST", "/v1/sessions", "GET, HEAD"),
                                ("POST", "/v1/sessions/abc", "GET, HEAD, PUT, DELETE"),
                                ("GET", "/v1/sessions/abc/restore", "POST")]:
        r = await client.request(method, path, headers=AUTH)
        body = await r.json()
        assert (r.status, r.headers.get("Allow")) == (405, allow), (method, path)
        assert body["error"]["type"] == "method_not_allowed"
    r = await client.get("/v1/sessions/a/b", headers=AUTH)
    assert r.status == 404 and (await r.json())["error"]["message"] == "/v1/sessions/a/b is not part of the kvtier API"
    assert (await client.get("/v1/sessions/a/b")).status == 401  # kvtier's namespace: the token first
    for method, path in [("GET", "/props"), ("GET", "/completion"), ("DELETE", "/v1/chat/completions")]:
        r = await client.request(method, path)  # llama-server's: passed through, and it is down
        assert r.status == 502 and (await r.json())["error"]["type"] == "bad_gateway", (method, path)
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/metrics")).status == 200


async def test_session_lookups_and_their_errors(sidecar: tuple[TestClient[web.Request, web.Application],
                                                               FakeEngine]) -> None:
    client, engine = sidecar
    engine.sessions.manifests = {i: manifest(i) for i in ("a1", "a2", "b1")}
    r = await client.get("/v1/sessions/a1", headers=AUTH)
    body = await r.json()
    assert r.status == 200 and body["id"] == "a1" and body["chunks_by_tier"] == {"memory": 2}
    assert body["chunks_available"] == 2 and body["shared"] is False and "tokens_b64" not in body
    r = await client.get("/v1/sessions?prefix=a&limit=1", headers=AUTH)
    body = await r.json()
    assert [s["id"] for s in body["sessions"]] == ["a1"] and body["next"] == "a1"
    r = await client.get("/v1/sessions?prefix=a&after=a1&limit=5", headers=AUTH)
    body = await r.json()
    assert [s["id"] for s in body["sessions"]] == ["a2"] and "next" not in body
    for error, status, kind in [(SessionNotFound("no session"), 404, "not_found"),
                                (SessionIncomplete("chunks gone"), 410, "gone"),
                                (TierUnavailable("redis down"), 503, "unavailable"),
                                (KVTierError("damaged"), 502, "cache_error")]:
        engine.sessions.fail = error
        r = await client.get("/v1/sessions/a1", headers=AUTH)
        assert r.status == status and (await r.json())["error"] == {"code": status, "message": str(error),
                                                                    "type": kind}
    engine.sessions.fail = None
    engine.session_slots["a1"] = 1
    r = await client.delete("/v1/sessions/a1", headers=AUTH)
    assert r.status == 200 and await r.json() == {"id": "a1", "deleted": True}
    assert "a1" not in engine.session_slots
    assert (await client.delete("/v1/sessions/a1", headers=AUTH)).status == 404
    engine.ready = False
    r = await client.get("/v1/sessions", headers=AUTH)
    assert r.status == 503
    assert (await r.json())["error"]["message"] == "llama-server is not ready: llama-server unreachable"


@pytest.mark.parametrize("query", ["limit=0", "limit=abc", "limit=1001", "after=" + "a" * 129, "prefix=%2A"])
async def test_bad_list_queries(sidecar: tuple[TestClient[web.Request, web.Application], FakeEngine],
                                query: str) -> None:
    client, _ = sidecar
    r = await client.get("/v1/sessions?" + query, headers=AUTH)
    assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request"


@pytest.mark.parametrize(("method", "suffix", "raw", "status", "message"), [
    ("PUT", "", b"{not json", 400, "request body is not valid JSON"),
    ("PUT", "", b"[1, 2]", 400, "request body must be a JSON object"),
    ("PUT", "", b'{"slot": "zero"}', 400, "slot must be an integer"),
    ("PUT", "", b'{"slot": true}', 400, "slot must be an integer"),
    ("PUT", "", b'{"slot": 2}', 400, "slot must be in 0..1"),
    ("PUT", "", b'{"slot": 0, "evil": 1}', 400, "unknown field(s): evil"),
    ("PUT", "", b'{"slot": 0, "wait_s": 1e9}', 400, "wait_s must be a number in 0..120"),
    ("PUT", "", b'{"slot": 0, "wait_s": false}', 400, "wait_s must be a number in 0..120"),
    ("PUT", "", b"{}", 400, 'no slot is known to have served this session here; pass {"slot": n}'),
    ("PUT", "", b'{"x": "' + b"y" * 70_000 + b'"}', 413, "request body over 65536 bytes"),
    ("POST", "/restore", b'{"slot": 1.5}', 400, "slot must be an integer"),
    ("POST", "/restore", b"", 404, "no session 'ok-id'"),
])
async def test_bad_bodies_are_refused_before_a_slot_is_taken(
        sidecar: tuple[TestClient[web.Request, web.Application], FakeEngine],
        method: str, suffix: str, raw: bytes, status: int, message: str) -> None:
    client, _ = sidecar
    r = await client.request(method, "/v1/sessions/ok-id" + suffix, data=raw,
                             headers={**AUTH, "Content-Type": "application/json"})
    assert r.status == status and (await r.json())["error"]["message"] == message


async def test_a_session_too_long_for_the_slots_is_refused(sidecar: tuple[TestClient[web.Request, web.Application],
                                                                          FakeEngine]) -> None:
    client, engine = sidecar
    engine.sessions.manifests["long"] = manifest("long", n_tokens=100)
    r = await client.post("/v1/sessions/long/restore", headers=AUTH)
    assert r.status == 400 and (await r.json())["error"]["message"] == "session has 100 tokens; slots hold 64"


@pytest.mark.parametrize("session_id", ["..x", "-lead", "x*", "a" * 129, "sp%20ace"])
async def test_hostile_session_ids_are_refused(sidecar: tuple[TestClient[web.Request, web.Application], FakeEngine],
                                               session_id: str) -> None:
    client, _ = sidecar
    for method in ("GET", "PUT", "DELETE"):
        r = await client.request(method, f"/v1/sessions/{session_id}", headers=AUTH)
        assert r.status in (400, 404), (method, session_id)
        assert "error" in await r.json()
