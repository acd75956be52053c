"""Explicit mode: the HTTP sessions API (its paths are in ``routes.py``).

Save a session from a slot (the one that served it, or ``{"slot": n}``), restore it into a slot of
this node (``{"slot": n}`` optional), show its manifest and where its chunks live, list sessions
(``?prefix=&after=&limit=``), delete one (its manifest and tail; shared chunks stay).

A slot another request is using is waited for up to ``wait_s`` (body field, default 10 s, at
most 120 s); then the answer is 409. Session ids never reach the filesystem: slot files are named
by kvtier.

Each Redis call of a save, restore, show or delete, other than moving chunk values, waits at most
``SESSION_CALL_S`` (``redis_conn.call_budget``): with Redis hung, an operation fails with 503 in
seconds, and a slot it holds is not kept from the requests waiting for it through Redis's
timeouts and retries.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import numpy as np
from aiohttp import web

from tiers.errors import KVTierError, TierUnavailable
from tiers.redis_conn import SESSION_CALL_S, call_budget
from tiers.sessions import SessionIncomplete, SessionNotFound, validate_session_id

from .appkeys import ENGINE, METRICS
from .middlewares import Handler, json_error, read_body
from .tenants import tenant_salt

MAX_BODY = 64 * 1024
DEFAULT_WAIT_S = 10.0
MAX_WAIT_S = 120.0


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


def sessions_errors(handler: Handler) -> Handler:
    """The sessions API's typed errors as JSON with the right status."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return json_error(exc.status, exc.message, exc.kind)
        except SessionNotFound as exc:
            return json_error(404, str(exc), "not_found")
        except SessionIncomplete as exc:
            return json_error(410, str(exc), "gone")
        except TierUnavailable as exc:
            return json_error(503, str(exc), "unavailable")
        except KVTierError as exc:
            return json_error(502, str(exc), "cache_error")

    return wrapped


def redis_bounded(handler: Handler) -> Handler:
    """Each Redis call of the operation waits at most ``SESSION_CALL_S`` (bulk transfers aside). Not
    for listing and purging: one of their calls walks the keyspace."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        with call_budget(SESSION_CALL_S):
            return await handler(request)

    return wrapped


async def read_json_object(request: web.Request, max_body: int, fields: frozenset[str]) -> dict[str, Any]:
    """The body as a JSON object of only ``fields`` ({} for an empty body), else an ``ApiError``."""
    if request.content_length is not None and request.content_length > max_body:
        raise ApiError(413, "payload_too_large", f"request body over {max_body} bytes")
    try:
        raw = await read_body(request, max_body)  # all of it, however many pieces it comes in
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, "payload_too_large", f"request body over {max_body} bytes") from None
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deep
        raise ApiError(400, "invalid_request", "request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_request", "request body must be a JSON object")
    unknown = set(data) - fields
    if unknown:
        raise ApiError(400, "invalid_request", f"unknown field(s): {', '.join(sorted(unknown))[:200]}")
    return data


async def _body(request: web.Request) -> dict[str, Any]:
    return await read_json_object(request, MAX_BODY, frozenset({"slot", "wait_s"}))


def _slot_field(data: dict[str, Any], n_slots: int) -> int | None:
    if "slot" not in data:
        return None
    slot = data["slot"]
    if not isinstance(slot, int) or isinstance(slot, bool):
        raise ApiError(400, "invalid_request", "slot must be an integer")
    if not 0 <= slot < n_slots:
        raise ApiError(400, "invalid_request", f"slot must be in 0..{n_slots - 1}")
    return slot


def _wait_field(data: dict[str, Any]) -> float:
    wait = data.get("wait_s", DEFAULT_WAIT_S) if "wait_s" in data else DEFAULT_WAIT_S
    if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 <= wait <= MAX_WAIT_S:
        raise ApiError(400, "invalid_request", f"wait_s must be a number in 0..{MAX_WAIT_S:g}")
    return float(wait)


def _session_id(request: web.Request) -> str:
    try:
        return validate_session_id(request.match_info["id"])
    except ValueError as exc:
        raise ApiError(400, "invalid_request", str(exc)) from None


async def _engine_ready(request: web.Request):  # type: ignore[no-untyped-def]
    engine = request.app[ENGINE]
    if not await engine.ensure_ready():
        raise ApiError(503, "unavailable", f"llama-server is not ready: {engine.last_error}")
    return engine


def _namespace(request: web.Request, engine: Any):  # type: ignore[no-untyped-def]
    try:
        salt = tenant_salt(request.headers)
    except ValueError as exc:
        raise ApiError(400, "invalid_request", str(exc)) from None
    return (engine.target.namespace.salted(salt) if salt else engine.target.namespace), salt


async def _acquire(engine: Any, tokens: np.ndarray, slot: int | None, wait: float, salt: str):  # type: ignore[no-untyped-def]
    try:
        return await engine.slots.acquire(tokens, want=slot, timeout=wait, owner=salt)
    except TimeoutError:
        raise ApiError(409, "conflict", f"slot {slot if slot is not None else '(any)'} stayed busy for {wait:g} s") from None


@sessions_errors
@redis_bounded
async def save_session(request: web.Request) -> web.Response:
    session_id = _session_id(request)
    data = await _body(request)
    engine = await _engine_ready(request)
    slot = _slot_field(data, engine.target.n_slots)
    wait = _wait_field(data)
    if slot is None:
        slot = engine.session_slots.get(session_id)
        if slot is None:
            raise ApiError(400, "invalid_request",
                           "no slot is known to have served this session here; pass {\"slot\": n}")
    ns, salt = _namespace(request, engine)
    t0 = time.perf_counter()
    with await _acquire(engine, np.zeros(0, np.int32), slot, wait, salt) as lease:
        if lease.foreign:
            raise ApiError(403, "forbidden", "that slot holds another tenant's conversation")
        if lease.table.tokens(slot).size == 0:
            raise ApiError(409, "conflict", f"slot {slot} holds no conversation")
        # The slot is free once its state is read: requests waiting for it do not wait for Redis.
        manifest = await engine.save_session(lease, ns, session_id, owner=salt, read=lease.release)
    return web.json_response({
        "id": session_id, "slot": slot, "tokens": manifest.n_tokens, "chunks": manifest.chunks,
        "tail_tokens": manifest.tail_tokens, "bytes": manifest.bytes, "shared": engine.sessions.shared,
        "ms": round((time.perf_counter() - t0) * 1000, 2),
    })


@sessions_errors
@redis_bounded
async def restore_session(request: web.Request) -> web.Response:
    session_id = _session_id(request)
    data = await _body(request)
    engine = await _engine_ready(request)
    slot = _slot_field(data, engine.target.n_slots)
    wait = _wait_field(data)
    ns, salt = _namespace(request, engine)
    manifest = await engine.sessions.load(ns, session_id)
    if manifest.n_tokens > engine.target.n_ctx_slot > 0:
        raise ApiError(400, "invalid_request", f"session has {manifest.n_tokens} tokens; slots hold {engine.target.n_ctx_slot}")
    with await _acquire(engine, manifest.tokens, slot, wait, salt) as lease:
        restored = await engine.restore_session(lease, manifest, ns, salt=salt)
    request.app[METRICS].requests.labels("session_restore", "ok").inc()
    return web.json_response({"id": session_id, "slot": lease.slot, "n_restored": restored.n_tokens,
                              "tier": restored.tier, "ms": round(restored.ms, 2)})


@sessions_errors
@redis_bounded
async def get_session(request: web.Request) -> web.Response:
    session_id = _session_id(request)
    engine = await _engine_ready(request)
    ns, _ = _namespace(request, engine)
    manifest = await engine.sessions.load(ns, session_id)
    found = await engine.store.lookup(ns, manifest.tokens, manifest.chunks)
    where: dict[str, int] = {}
    for tier in found.tiers:
        where[tier] = where.get(tier, 0) + 1
    return web.json_response({**manifest.public(), "shared": engine.sessions.shared,
                              "chunks_available": found.n_chunks, "chunks_by_tier": where})


@sessions_errors
async def list_sessions(request: web.Request) -> web.Response:
    engine = await _engine_ready(request)
    q = request.query
    prefix = q.get("prefix", "")
    after = q.get("after", "")
    if len(after) > 128:
        raise ApiError(400, "invalid_request", "after must be a session id (at most 128 characters)")
    try:
        limit = int(q.get("limit", "100"))
    except ValueError:
        raise ApiError(400, "invalid_request", "limit must be an integer") from None
    if not 1 <= limit <= 1000:
        raise ApiError(400, "invalid_request", "limit must be in 1..1000")
    ns, _ = _namespace(request, engine)
    try:
        page = await engine.sessions.list_page(ns, prefix, after=after, limit=limit)
    except ValueError as exc:
        raise ApiError(400, "invalid_request", str(exc)) from None
    items = page.manifests
    body: dict[str, Any] = {"sessions": [m.public() for m in items], "shared": engine.sessions.shared}
    if page.damaged:  # skipped: their manifests cannot be read (GET or DELETE them, or save over them)
        body["damaged"] = page.damaged
    if len(items) == limit:
        body["next"] = items[-1].id
    return web.json_response(body)


@sessions_errors
@redis_bounded
async def delete_session(request: web.Request) -> web.Response:
    session_id = _session_id(request)
    engine = await _engine_ready(request)
    ns, _ = _namespace(request, engine)
    if not await engine.sessions.delete(ns, session_id):
        raise SessionNotFound(f"no session {session_id!r}")
    engine.session_slots.pop(session_id, None)
    return web.json_response({"id": session_id, "deleted": True})
