"""The sidecar's own read-only endpoints: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable
from typing import Any, TypeVar

from aiohttp import web

from integrations.llama_server import LlamaServerError

from .appkeys import ENGINE, METRICS, REDIS

# Each readiness check answers within this, and they run side by side: /readyz answers within
# about a second and a half, below the chart's readiness probe timeout (3 s). A frozen Redis
# or llama-server is reported as not answering instead of holding the probe past its timeout.
CHECK_TIMEOUT_S = 1.5
T = TypeVar("T")


async def _bounded(check: Awaitable[T]) -> T:
    # Shielded: a check that takes longer goes on in the background (getting kvtier ready must
    # not be cut short by every probe), it only stops holding up the answer.
    task = asyncio.ensure_future(check)
    task.add_done_callback(_retrieve)
    return await asyncio.wait_for(asyncio.shield(task), CHECK_TIMEOUT_S)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # one that failed after its probe answered is not "never retrieved"


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    redis = request.app[REDIS]
    checks: dict[str, Any] = {"slot_dir": _dir_writable(str(engine.files.slot_dir))}

    async def llama_server() -> None:
        try:
            await _bounded(engine.client.health())
            checks["llama_server"] = "ok"
        except LlamaServerError as exc:
            checks["llama_server"] = str(exc)
        except TimeoutError:
            checks["llama_server"] = f"no answer within {CHECK_TIMEOUT_S:g} s"

    async def kv_cache() -> None:
        try:
            # The watcher's own: a readiness poll is not a request held by a check (that metric's job).
            ready = await _bounded(engine.watcher.ensure_ready())
            checks["kv_cache"] = "ok" if ready else f"not ready: {engine.last_error}"
        except TimeoutError:
            checks["kv_cache"] = f"not ready: still learning llama-server after {CHECK_TIMEOUT_S:g} s"

    async def redis_ping() -> None:
        assert redis is not None
        try:
            up = await _bounded(redis.ping())
        except TimeoutError:
            up = False
        checks["redis"] = "ok" if up else "unavailable (serving from local tiers)"

    await asyncio.gather(llama_server(), kv_cache(), *([redis_ping()] if redis is not None else []))
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
