"""Forwarding to llama-server: completions through the KV flow, everything else unchanged.

Responses are relayed as they arrive (SSE is never buffered). A client that goes away closes the
upstream connection, which makes llama-server cancel the generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from integrations.llama_server import LlamaServerError
from tiers.sessions import validate_session_id

from .appkeys import ENGINE, METRICS, UPSTREAM
from .middlewares import json_error, request_id
from .prompts import asked_of
from .upstream import UpstreamError, UpstreamResponse

log = logging.getLogger("kvtier.proxy")

HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length", "expect",
}
COMPLETION_KINDS = {"/completion": "completion", "/completions": "completion", "/v1/completions": "completion",
                    "/v1/chat/completions": "chat", "/chat/completions": "chat"}
TAIL_BYTES = 64 * 1024  # enough of a stream's end to find its final timings
MAX_CAPTURE = 16 << 20  # non-streaming answers are parsed for timings up to this size


def _forward_headers(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers.items()
            if (low := k.lower()) not in HOP_BY_HOP and not low.startswith("x-kvtier-")]


@dataclass(slots=True)
class Relay:
    """What a relay got from upstream; readable even when the client went away mid-answer."""

    status: int = 0
    upstream_complete: bool = False  # llama-server sent its whole answer
    tail: bytearray = field(default_factory=bytearray)

    @property
    def ok(self) -> bool:
        return self.upstream_complete and 200 <= self.status < 300


async def passthrough(request: web.Request, body: bytes | None = None) -> web.StreamResponse:
    """Forward the request unchanged and relay the answer."""
    return await _relay(request, body if body is not None else await request.read(), {}, Relay())


async def _relay(request: web.Request, body: bytes, extra_headers: Mapping[str, str], out: Relay,
                 capture: bool = False) -> web.StreamResponse:
    """Send ``body`` upstream and stream the answer back, recording the outcome in ``out``."""
    try:
        upstream = await request.app[UPSTREAM].request(request.method, request.raw_path,
                                                        _forward_headers(request.headers), body)
    except ValueError as exc:  # nothing llama-server could be sent
        return json_error(400, f"request not forwardable: {exc}")
    except (TimeoutError, UpstreamError, OSError) as exc:
        log.warning("llama-server unreachable: %s", exc)
        return json_error(502, "llama-server unreachable", "bad_gateway")
    out.status = upstream.status
    try:
        length = upstream.content_length
        if not _is_stream(upstream) and length is not None and length <= MAX_CAPTURE:
            # A whole answer of known size (llama-server computes it before sending): relayed in
            # one write with its Content-Length rather than in chunks.
            body = await upstream.read()
            out.upstream_complete = True
            if capture:
                out.tail += body
            whole = web.Response(status=upstream.status, reason=upstream.reason, body=body,
                                 headers=CIMultiDict(_forward_headers(upstream.headers)))
            whole.headers.update(extra_headers)
            # Sent by aiohttp once the handler returns: after the caller has registered the slot
            # save (which itself waits SAVE_DELAY_S), so that a client that has its answer never
            # sees the sidecar idle while that save is still to come.
            return whole
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        response.headers.extend(_forward_headers(upstream.headers))
        response.headers.update(extra_headers)
        if request_id.get():  # prepared here, so the middleware cannot add it
            response.headers["X-Request-Id"] = request_id.get()
        await response.prepare(request)
        limit = TAIL_BYTES if _is_stream(upstream) else MAX_CAPTURE
        async for piece in upstream.iter_any():
            await response.write(piece)
            if capture:
                out.tail += piece
                if len(out.tail) > limit:
                    del out.tail[: len(out.tail) - TAIL_BYTES]
        out.upstream_complete = True
        await response.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError, asyncio.CancelledError):
        # The client went away: closing upstream makes llama-server stop generating.
        upstream.close()
        raise
    except UpstreamError as exc:
        # Cut short by llama-server: the client's connection is closed too (a clean end would
        # pass a truncated answer off as whole).
        log.warning("llama-server's answer broke off: %s", exc)
        raise
    finally:
        upstream.release()
    return response


def _is_stream(resp: UpstreamResponse) -> bool:
    return resp.headers.get("Content-Type", "").startswith("text/event-stream")


async def handle_completion(request: web.Request) -> web.StreamResponse:
    """``/completion``, ``/v1/completions``, ``/v1/chat/completions`` through the KV flow."""
    kind = COMPLETION_KINDS[request.path]
    engine = request.app[ENGINE]
    metrics = request.app[METRICS]
    raw = await request.read()
    try:
        # orjson refuses a little more than json (NaN, lone surrogates, numbers beyond float):
        # such bodies go to llama-server as they came, like any body kvtier cannot read.
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    # Anything the KV flow cannot serve goes to llama-server as it came, and gets its answer.
    if not isinstance(body, dict) or body.get("cache_prompt") is False or not await engine.ensure_ready():
        metrics.requests.labels(kind, "passthrough").inc()
        return await passthrough(request, raw)
    started = time.perf_counter()
    session_id = request.headers.get("X-Session-Id")
    want = body.get("id_slot")
    want = want if isinstance(want, int) and not isinstance(want, bool) and 0 <= want < engine.target.n_slots else None  # type: ignore[union-attr]
    salt = _tenant_salt(request, body)
    asked = asked_of(kind, body)
    plan = None
    if asked is not None and session_id is None:
        plan = engine.follow_up(body, asked, want_slot=want, salt=salt, since=started)
    if plan is None:
        try:
            prompt = await engine.prompts.prompt_for(kind, body)
        except LlamaServerError as exc:
            log.info("not cacheable (%s); passing through", exc)
            prompt = None
        if prompt is None or prompt.tokens.size == 0:
            metrics.requests.labels(kind, "passthrough").inc()
            return await passthrough(request, raw)
        if session_id is not None:
            try:
                validate_session_id(session_id)
            except ValueError as exc:
                return json_error(400, f"X-Session-Id: {exc}")
        plan = await engine.prepare(prompt, want_slot=want, salt=salt, session_id=session_id, since=started,
                                    asked=asked or ())
    relay = Relay()
    try:
        headers = {
            "X-KVTier-Slot": str(plan.lease.slot),
            "X-KVTier-Restored-Tokens": str(plan.restored_tokens),
            "X-KVTier-Restore-Tier": plan.restore_tier or "none",
        }
        if not plan.follow_up:  # a follow-up's tokens are not computed: its timings tell them
            headers["X-KVTier-Prompt-Tokens"] = str(plan.tokens.size)
            headers["X-KVTier-Slot-Cached-Tokens"] = str(plan.lease.cached_tokens)
        response = await _relay(request, upstream_body(raw, body, plan.lease.slot), headers, relay, capture=True)
        metrics.requests.labels(kind, "ok" if relay.ok else "upstream_error").inc()
        return response
    finally:
        # Saved when llama-server finished its answer, even if the client (or a shutdown) cut the
        # last bytes short: the slot then holds a complete, valid state.
        engine.finish(plan, ok=relay.ok, answer=bytes(relay.tail) if relay.ok else None)


def upstream_body(raw: bytes, body: Mapping[str, Any], slot: int) -> bytes:
    """The request for llama-server: the client's, pinned to ``slot`` with ``cache_prompt`` on.

    The keys are appended to the client's bytes when nothing else changes (no ``id_slot``, no
    ``cache_salt``, which stays with kvtier, ``cache_prompt`` absent or once and true):
    re-encoding a long prompt would cost a tenth of a millisecond or more.
    """
    text = raw.strip()
    ours = {"id_slot", "cache_prompt", "cache_salt"} & body.keys()
    if text[:1] == b"{" and text[-1:] == b"}":
        if not ours:
            return text[:-1] + (b"," if body else b"") + b'"id_slot":%d,"cache_prompt":true}' % slot
        if ours == {"cache_prompt"} and body["cache_prompt"] is True and text.count(b'"cache_prompt"') == 1:
            return text[:-1] + b',"id_slot":%d}' % slot
    forwarded = {k: v for k, v in body.items() if k != "cache_salt"}
    forwarded.update(id_slot=slot, cache_prompt=True)
    try:
        return orjson.dumps(forwarded)
    except TypeError:  # an integer beyond 64 bits
        return json.dumps(forwarded).encode()


def _tenant_salt(request: web.Request, body: Mapping[str, Any]) -> str:
    salt = request.headers.get("X-KVTier-Salt") or body.get("cache_salt") or ""
    return salt if isinstance(salt, str) else ""
