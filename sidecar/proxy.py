"""Forwarding to llama-server: completions through the KV flow, everything else unchanged.

Responses are relayed as they arrive (SSE is never buffered). A client that goes away closes the
upstream connection, which makes llama-server cancel the generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from integrations.llama_server import LlamaServerError, Timings
from tiers.sessions import validate_session_id

from .appkeys import ENGINE, HTTP, METRICS, SETTINGS
from .middlewares import json_error

log = logging.getLogger("kvtier.proxy")

HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length",
}
COMPLETION_KINDS = {"/completion": "completion", "/completions": "completion", "/v1/completions": "completion",
                    "/v1/chat/completions": "chat", "/chat/completions": "chat"}
TAIL_BYTES = 64 * 1024  # enough of a stream's end to find its final timings
MAX_CAPTURE = 16 << 20  # non-streaming answers are parsed for timings up to this size


def _forward_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        if k.lower() not in HOP_BY_HOP and not k.lower().startswith("x-kvtier-"):
            out.add(k, v)
    return out


async def passthrough(request: web.Request, body: bytes | None = None) -> web.StreamResponse:
    """Forward the request unchanged and relay the answer."""
    response, _, _ = await _relay(request, body if body is not None else await request.read(), {})
    return response


async def _relay(request: web.Request, body: bytes, extra_headers: Mapping[str, str],
                 capture: bool = False) -> tuple[web.StreamResponse, bool, bytes]:
    """Send ``body`` upstream and stream the answer back. Returns (response, complete+2xx, tail)."""
    settings = request.app[SETTINGS]
    url = settings.llama_url.rstrip("/") + request.rel_url.path_qs
    session = request.app[HTTP]
    try:
        upstream = await session.request(request.method, url, data=body,
                                         headers=_forward_headers(request.headers))
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        log.warning("llama-server unreachable: %s", exc)
        raise web.HTTPBadGateway(text=json.dumps({"error": {"code": 502, "message": "llama-server unreachable"}}),
                                 content_type="application/json") from None
    tail = bytearray()
    complete = False
    try:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        response.headers.update(_forward_headers(upstream.headers))
        response.headers.update(extra_headers)
        await response.prepare(request)
        async for piece in upstream.content.iter_any():
            await response.write(piece)
            if capture:
                tail += piece
                limit = MAX_CAPTURE if not _is_stream(upstream) else TAIL_BYTES
                if len(tail) > limit:
                    del tail[: len(tail) - TAIL_BYTES]
        await response.write_eof()
        complete = 200 <= upstream.status < 300
    except (ConnectionResetError, aiohttp.ClientConnectionResetError, asyncio.CancelledError):
        # The client went away: closing upstream makes llama-server stop generating.
        upstream.close()
        raise
    finally:
        upstream.release()
    return response, complete, bytes(tail)


def _is_stream(resp: aiohttp.ClientResponse) -> bool:
    return resp.headers.get("Content-Type", "").startswith("text/event-stream")


def timings_from(tail: bytes) -> Timings | None:
    """The ``timings`` object of a completion's answer (plain JSON or the last SSE events)."""
    text = tail.decode("utf-8", errors="replace")
    candidates: list[str] = []
    stripped = text.strip()
    if stripped.startswith("{"):
        candidates.append(stripped)
    candidates += [line[5:].strip() for line in reversed(text.splitlines()) if line.startswith("data:")]
    for candidate in candidates:
        if '"timings"' not in candidate:
            continue
        try:
            data = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict):
            return Timings.from_json(data.get("timings"))
    return None


async def handle_completion(request: web.Request) -> web.StreamResponse:
    """``/completion``, ``/v1/completions``, ``/v1/chat/completions`` through the KV flow."""
    kind = COMPLETION_KINDS[request.path]
    engine = request.app[ENGINE]
    metrics = request.app[METRICS]
    raw = await request.read()
    try:
        body: Any = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    # Anything the KV flow cannot serve goes to llama-server as it came, and gets its answer.
    if not isinstance(body, dict) or body.get("cache_prompt") is False or not await engine.ensure_ready():
        metrics.requests.labels(kind, "passthrough").inc()
        return await passthrough(request, raw)
    try:
        tokens = await engine.tokens_for(kind, body)
    except LlamaServerError as exc:
        log.info("not cacheable (%s); passing through", exc)
        tokens = None
    if tokens is None or tokens.size == 0:
        metrics.requests.labels(kind, "passthrough").inc()
        return await passthrough(request, raw)
    session_id = request.headers.get("X-Session-Id")
    if session_id is not None:
        try:
            validate_session_id(session_id)
        except ValueError as exc:
            return json_error(400, f"X-Session-Id: {exc}")
    want = body.get("id_slot")
    want = want if isinstance(want, int) and not isinstance(want, bool) and 0 <= want < engine.target.n_slots else None  # type: ignore[union-attr]
    salt = _tenant_salt(request, body)
    plan = await engine.prepare(tokens, want_slot=want, salt=salt, session_id=session_id)
    ok, timings = False, None
    try:
        forwarded = {k: v for k, v in body.items() if k != "cache_salt"}
        forwarded.update(id_slot=plan.lease.slot, cache_prompt=True)
        headers = {
            "X-KVTier-Slot": str(plan.lease.slot),
            "X-KVTier-Prompt-Tokens": str(tokens.size),
            "X-KVTier-Restored-Tokens": str(plan.restored_tokens),
            "X-KVTier-Restore-Tier": plan.restore_tier or "none",
            "X-KVTier-Slot-Cached-Tokens": str(plan.lease.cached_tokens),
        }
        response, ok, tail = await _relay(request, json.dumps(forwarded).encode(), headers, capture=True)
        timings = timings_from(tail) if ok else None
        metrics.requests.labels(kind, "ok" if ok else "upstream_error").inc()
        return response
    finally:
        engine.finish(plan, ok=ok, timings=timings)


def _tenant_salt(request: web.Request, body: Mapping[str, Any]) -> str:
    salt = request.headers.get("X-KVTier-Salt") or body.get("cache_salt") or ""
    return salt if isinstance(salt, str) else ""
