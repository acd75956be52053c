"""The front middleware on its own: request ids, the bearer token, errors as JSON."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from sidecar.logs import request_id
from sidecar.middlewares import AuthPolicy, front_middleware

TOKEN = "s3cret-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
POLICY = AuthPolicy(TOKEN, open_paths=frozenset({"/healthz"}), token_prefixes=("/v1/sessions", "/openapi.json"))

Client = Callable[..., Awaitable[TestClient[web.Request, web.Application]]]


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"request_id": request_id.get()})


async def boom(request: web.Request) -> web.Response:
    raise RuntimeError("a secret detail of a bug")


async def not_found(request: web.Request) -> web.Response:
    raise web.HTTPNotFound()


async def json_conflict(request: web.Request) -> web.Response:
    raise web.HTTPConflict(text='{"mine": true}', content_type="application/json")


async def echo_body(request: web.Request) -> web.Response:
    return web.Response(body=await request.read())


def app_with(policy: AuthPolicy, max_body: int = 1024**2) -> web.Application:
    app = web.Application(middlewares=[front_middleware(policy)], client_max_size=max_body)
    app.add_routes([web.get("/healthz", ok), web.get("/v1/sessions", ok), web.get("/v1/sessionsX", ok),
                    web.get("/openapi.json", ok), web.get("/props", ok), web.get("/boom", boom),
                    web.get("/missing", not_found), web.get("/conflict", json_conflict),
                    web.post("/echo", echo_body)])
    return app


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[web.Application], Awaitable[TestClient[web.Request, web.Application]]]]:
    clients: list[TestClient[web.Request, web.Application]] = []

    async def start(app: web.Application) -> TestClient[web.Request, web.Application]:
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


@pytest.mark.parametrize(("path", "protect_all", "needs"), [
    ("/healthz", False, False), ("/healthz", True, False),
    ("/v1/sessions", False, True), ("/v1/sessions/x/restore", False, True), ("/v1/sessionsX", False, True),
    ("/openapi.json", False, True),
    ("/completion", False, False), ("/completion", True, True), ("/props", True, True),
])
def test_which_paths_need_the_token(path: str, protect_all: bool, needs: bool) -> None:
    policy = AuthPolicy(TOKEN, POLICY.open_paths, POLICY.token_prefixes, protect_all)
    assert policy.needs_token(path) is needs
    assert not AuthPolicy(None, POLICY.open_paths, POLICY.token_prefixes, protect_all).needs_token(path)


async def test_token_is_checked_on_protected_paths_only(serve: Client) -> None:
    client = await serve(app_with(POLICY))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                    {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}):
        for path in ("/v1/sessions", "/openapi.json", "/v1/sessionsX"):
            r = await client.get(path, headers=headers)
            body = await r.json()
            assert r.status == 401, (path, headers)
            assert body["error"] == {"code": 401, "message": "missing or wrong bearer token", "type": "unauthorized"}
            assert TOKEN not in await r.text()
            assert r.headers["X-Request-Id"]
    assert (await client.get("/v1/sessions", headers=BEARER)).status == 200
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/props")).status == 200


async def test_protect_all_leaves_only_the_open_paths(serve: Client) -> None:
    policy = AuthPolicy(TOKEN, POLICY.open_paths, POLICY.token_prefixes, protect_all=True)
    client = await serve(app_with(policy))
    assert (await client.get("/props")).status == 401
    assert (await client.post("/echo", data=b"x")).status == 401
    assert (await client.get("/props", headers=BEARER)).status == 200
    assert (await client.get("/healthz", headers={"Authorization": "Bearer wrong"})).status == 200


async def test_request_ids_are_kept_when_well_formed_else_new(serve: Client) -> None:
    client = await serve(app_with(AuthPolicy()))
    r = await client.get("/props", headers={"X-Request-Id": "req-1.a_B"})
    assert r.headers["X-Request-Id"] == "req-1.a_B" and (await r.json())["request_id"] == "req-1.a_B"
    seen = set()
    for given in ("", "has space", "x" * 65, "semi;colon"):
        r = await client.get("/props", headers={"X-Request-Id": given} if given else {})
        rid = r.headers["X-Request-Id"]
        assert rid != given and (await r.json())["request_id"] == rid
        seen.add(rid)
    assert len(seen) == 4  # a new one each time
    assert request_id.get() == ""  # reset after each request


async def test_errors_are_json_without_tracebacks(serve: Client) -> None:
    client = await serve(app_with(AuthPolicy(), max_body=2048))
    r = await client.get("/boom")
    assert r.status == 500
    assert await r.json() == {"error": {"code": 500, "message": "internal error in kvtier (see its log)",
                                        "type": "internal"}}
    assert "secret detail" not in await r.text() and r.headers["X-Request-Id"]
    r = await client.get("/missing")
    assert r.status == 404 and (await r.json())["error"]["type"] == "not_found"
    r = await client.get("/conflict")  # an answer already in JSON is the handler's own: kept
    assert r.status == 409 and await r.json() == {"mine": True}
    r = await client.post("/echo", data=b"x" * 4096)
    assert r.status == 413
    assert (await r.json())["error"]["message"] == "request body too large (limit 2048 bytes)"
    r = await client.post("/echo", data=b"x" * 100)
    assert r.status == 200 and await r.read() == b"x" * 100
