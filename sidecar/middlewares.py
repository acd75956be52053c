"""Middlewares: request ids, bearer-token auth, and JSON errors for what the sidecar answers itself."""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import logging
import re
import uuid
from typing import Any

from aiohttp import web

log = logging.getLogger("kvtier.app")

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
OPEN_PATHS = ("/healthz", "/readyz")  # probes never need a token
ADMIN_PREFIXES = ("/v1/sessions", "/openapi.json")


class RequestIdFilter(logging.Filter):
    """Adds the current request id to every log record (JSON logs print it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


def json_error(status: int, message: str, kind: str | None = None) -> web.Response:
    """``{"error": {"code", "message", "type"}}``: llama-server's error shape."""
    kind = kind or {400: "invalid_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
                    409: "conflict", 413: "payload_too_large", 502: "bad_gateway", 503: "unavailable"}.get(status, "error")
    return web.json_response({"error": {"code": status, "message": message, "type": kind}}, status=status)


@web.middleware
async def request_id_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    given = request.headers.get("X-Request-Id", "")
    rid = given if _REQUEST_ID_RE.fullmatch(given) else uuid.uuid4().hex[:16]
    token = request_id.set(rid)
    try:
        response = await handler(request)
        if not response.prepared:
            response.headers["X-Request-Id"] = rid
        return response
    finally:
        request_id.reset(token)


def auth_middleware(token: str | None, protect_all: bool) -> Any:
    """Bearer token on the sessions/admin endpoints (or on every endpoint but the probes)."""
    expected = f"Bearer {token}".encode() if token else b""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        path = request.path
        guarded = bool(token) and path not in OPEN_PATHS and (protect_all or path.startswith(ADMIN_PREFIXES))
        if guarded:
            given = request.headers.get("Authorization", "").encode()
            # compare_digest: the time taken does not tell how much of the token matched.
            if not hmac.compare_digest(given, expected):
                return json_error(401, "missing or wrong bearer token")
        return await handler(request)

    return check


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.content_type == "application/json" or exc.status < 400:
            raise
        message = exc.reason
        if exc.status == 413:
            message = f"request body too large (limit {request.app._client_max_size} bytes)"
        return json_error(exc.status, message)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_error(500, "internal error in kvtier (see its log)", "internal")
