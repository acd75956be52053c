"""The sidecar's own read-only endpoints: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import tempfile
from typing import Any

from aiohttp import web

from integrations.llama_server import LlamaServerError

from .appkeys import ENGINE, METRICS, REDIS


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
