"""``create_app(settings)``: the sidecar as an aiohttp application."""

from __future__ import annotations

import asyncio
import gc
import glob
import json
import logging
import os
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from integrations.llama_server import KEEPALIVE_S, LlamaServerClient, LlamaServerError
from tiers.codec import BlobCodec
from tiers.memory import MemoryTier
from tiers.store import TieredStore

from .appkeys import ENGINE, METRICS, REDIS, SETTINGS, STORE, UPSTREAM
from .config import Settings
from .engine import KVEngine
from .metrics import Metrics
from .middlewares import front_middleware, json_error
from .openapi import openapi_handler
from .proxy import COMPLETION_KINDS, handle_completion, passthrough
from .sessions_api import ROUTES as SESSION_ROUTES
from .upstream import Upstream

log = logging.getLogger("kvtier.app")

HEALTH_INTERVAL_S = 2.0
RELAY_KEEPALIVE_S = 4.0  # idle relay connections kept (llama-server closes them after 5 s)


def build_store(settings: Settings) -> tuple[TieredStore, Any]:
    tiers: list[Any] = [MemoryTier(settings.cache_size, policy=settings.eviction)]
    if settings.shared_dir:
        from tiers.shared import SharedTier

        tiers.append(SharedTier(settings.shared_dir, settings.shared_size))
    redis = None
    if settings.redis_url:
        from tiers.redis_tier import RedisTier

        redis = RedisTier(settings.redis_url, username=settings.redis_username, password=settings.redis_password,
                          ttl=settings.ttl or None, node_id=settings.node_id)
        tiers.append(redis)
    store = TieredStore(tiers, BlobCodec(settings.compress), queue_limit=settings.queue_limit)
    return store, redis


def _remove_stale_files(slot_dir: str) -> None:
    """Files a crashed kvtier left in the slot dir (only its own, by prefix)."""
    for path in glob.glob(os.path.join(slot_dir, "kvtier-*.bin")):
        try:
            os.unlink(path)
        except OSError:
            pass


async def _resources(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    _remove_stale_files(settings.slot_dir or ".")
    # kvtier's own calls (slot actions, tokenize, props) go through aiohttp; relayed requests
    # through the leaner Upstream. llama-server drops idle keep-alive connections after 5 s;
    # aiohttp fails a request sent on one it dropped, so it lets them go after 2 s. Upstream
    # retries such a request on a new connection, so it keeps them closer to the limit.
    session = aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=None),
        connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S, limit=256),
    )
    upstream = Upstream(settings.llama_url, keepalive_s=RELAY_KEEPALIVE_S)
    store, redis = build_store(settings)
    metrics = app[METRICS]
    metrics.attach_store(store)
    engine = KVEngine(settings, LlamaServerClient(settings.llama_url, session), store, metrics, events=redis)
    app[UPSTREAM] = upstream
    app[STORE] = store
    app[REDIS] = redis
    app[ENGINE] = engine
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(_watch_llama_server(engine), name="kvtier-health")]
    if settings.prewarm:
        tasks.append(loop.create_task(engine.prewarm_forever(), name="kvtier-prewarm"))
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        drained = await engine.drain(settings.shutdown_timeout)
        if not drained:
            log.warning("shutdown: pending slot saves did not finish in %.0fs", settings.shutdown_timeout)
        engine.prompts.close()
        engine.remove_kept_files()
        await store.aclose(drain_timeout=settings.shutdown_timeout)
        upstream.close()
        await session.close()


async def _watch_llama_server(engine: KVEngine) -> None:
    """Notice a llama-server restart: its slots come back empty, so the slot table is rebuilt."""
    was_up = True
    while True:
        await asyncio.sleep(HEALTH_INTERVAL_S)
        try:
            await engine.client.health()
            up = True
        except LlamaServerError:
            up = False
        try:
            if up and not was_up:
                log.info("llama-server is back: relearning its slots")
                engine.forget_slots()
            if up and engine.ready:
                await engine.check_server()
            if up and not engine.ready:
                await engine.ensure_ready()
        except (LlamaServerError, OSError) as exc:
            log.debug("health watcher: %s", exc)
        was_up = up


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    checks: dict[str, Any] = {}
    try:
        await engine.client.health()
        checks["llama_server"] = "ok"
    except LlamaServerError as exc:
        checks["llama_server"] = str(exc)
    checks["slot_dir"] = _dir_writable(str(engine.slot_dir))
    checks["kv_cache"] = "ok" if await engine.ensure_ready() else f"not ready: {engine.last_error}"
    redis = request.app[REDIS]
    if redis is not None:
        checks["redis"] = "ok" if await redis.ping() else "unavailable (serving from local tiers)"
    ready = checks["llama_server"] == "ok" and checks["slot_dir"] == "ok"
    return web.json_response({"ready": ready, "checks": checks}, status=200 if ready else 503)


def _dir_writable(path: str) -> str:
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix="kvtier-ready-"):
            pass
        return "ok"
    except OSError as exc:
        return f"not writable: {exc.strerror}"


async def metrics_endpoint(request: web.Request) -> web.Response:
    metrics = request.app[METRICS]
    redis = request.app[REDIS]
    if redis is not None:
        metrics.redis_circuit.set(0 if redis.stats().available else 1)
    return web.Response(body=metrics.render(), content_type="text/plain", charset="utf-8")


def _allowed_methods(path: str) -> str | None:
    """The methods of kvtier's own paths (for 405 answers), None for everything else."""
    if path in ("/healthz", "/readyz", "/metrics", "/openapi.json", "/v1/sessions"):
        return "GET, HEAD"
    parts = path.split("/")
    if path.startswith("/v1/sessions/") and len(parts) == 4:
        return "GET, HEAD, PUT, DELETE"
    if path.startswith("/v1/sessions/") and len(parts) == 5 and parts[4] == "restore":
        return "POST"
    return None


async def catch_all(request: web.Request) -> web.StreamResponse:
    """Everything that is not kvtier's own goes to llama-server unchanged."""
    allowed = _allowed_methods(request.path)
    if allowed is not None:
        response = json_error(405, f"{request.method} {request.path} is not part of the kvtier API")
        response.headers["Allow"] = allowed
        return response
    if request.path.startswith("/v1/sessions/"):
        return json_error(404, f"{request.path} is not part of the kvtier API")
    return await passthrough(request)


def create_app(settings: Settings) -> web.Application:
    """The sidecar: KV flow on completion routes, health/metrics, everything else passed through."""
    app = web.Application(middlewares=[front_middleware(settings.auth_token, settings.auth_all)],
                          client_max_size=settings.max_body)
    app[SETTINGS] = settings
    app[METRICS] = Metrics()
    app.cleanup_ctx.append(_resources)
    routes = [web.get("/healthz", healthz), web.get("/readyz", readyz), web.get("/metrics", metrics_endpoint),
              web.get("/openapi.json", openapi_handler), *SESSION_ROUTES]
    routes += [web.post(path, handle_completion) for path in COMPLETION_KINDS]
    routes.append(web.route("*", "/{tail:.*}", catch_all))
    app.add_routes(routes)
    return app


def run(settings: Settings) -> None:
    host, port = settings.host_port
    # What start-up created (modules, classes, the app: ~2/3 of the objects a serving process
    # tracks) lives as long as the process; frozen, full collections (29 ms pauses seen
    # mid-request) no longer scan it.
    gc.collect()
    gc.freeze()
    web.run_app(create_app(settings), host=host, port=port, shutdown_timeout=settings.shutdown_timeout,
                access_log=None, print=None, loop=new_event_loop())


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (a dependency on Linux: every proxied request is two HTTP
    exchanges, and uvloop's are cheaper), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def effective_config(settings: Settings) -> str:
    return json.dumps(settings.redacted(), sort_keys=True)
