"""Middlewares: request ids, bearer-token auth, and JSON errors for what the sidecar answers itself."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import posixpath
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .appkeys import SETTINGS
from .http.headers import SESSION_ID
from .logs import request_id

# request_id is the proxy's too.
__all__ = ["AuthPolicy", "Handler", "client_gone", "front_middleware", "json_error", "read_body", "request_id"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

log = logging.getLogger("kvtier.app")

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True, slots=True)
class AuthPolicy:
    """Which paths need the bearer token; ``routes.auth_policy`` builds it from the route table."""

    token: str | None = None  # no token: every path is open
    open_paths: frozenset[str] = frozenset()  # never need it (the probes)
    token_prefixes: tuple[str, ...] = ()  # need it whenever a token is set (the sessions API, admin)
    protect_all: bool = False  # every path but the open ones needs it
    # llama-server's state-changing actions, (method, path): they need it whenever a token is set
    admin_actions: frozenset[tuple[str, str]] = frozenset()
    refused_actions: frozenset[tuple[str, str]] = frozenset()  # (method, path): 403, whatever the token
    # Where a request with X-Session-Id saves a session after its answer (the completion routes):
    # it needs the token whenever one is set, as the sessions API does.
    session_paths: frozenset[str] = frozenset()

    def needs_token(self, path: str, method: str = "GET") -> bool:
        return bool(self.token) and path not in self.open_paths and (
            self.protect_all or path.startswith(self.token_prefixes)
            or _matches(self.admin_actions, method, canonical_path(path)))

    def saves_session(self, path: str, headers: Mapping[str, str]) -> bool:
        """Whether a request would save a session that needs the token (``X-Session-Id`` on a completion)."""
        return bool(self.token) and SESSION_ID in headers and canonical_path(path) in self.session_paths

    def refuses(self, path: str, method: str) -> bool:
        return _matches(self.refused_actions, method, canonical_path(path))


def canonical_path(path: str) -> str:
    """``path`` as a router that folds ``//`` and dot segments sees it (``//slots/./0`` is ``/slots/0``)."""
    return posixpath.normpath(re.sub("/{2,}", "/", path)) if "/." in path or "//" in path else path


def _matches(actions: frozenset[tuple[str, str]], method: str, path: str) -> bool:
    # An action's path names it and everything under it: ("POST", "/slots") is POST /slots/0 too.
    # HEAD is GET without the body: its headers (Content-Length) tell as much as a GET's.
    method = method.upper()
    method = "GET" if method == "HEAD" else method
    return any(method == m and (path == p or path.startswith(p + "/")) for m, p in actions)


def json_error(status: int, message: str, kind: str | None = None) -> web.Response:
    """``{"error": {"code", "message", "type"}}``: llama-server's error shape."""
    kind = kind or {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                    405: "method_not_allowed", 408: "timeout", 409: "conflict", 413: "payload_too_large",
                    502: "bad_gateway", 503: "unavailable"}.get(status, "error")
    return web.json_response({"error": {"code": status, "message": message, "type": kind}}, status=status)


_ID_PREFIX = os.urandom(4).hex()  # per process; a counter after it (uuid4 per request cost ~40 us)
_ID_COUNTER = itertools.count()


def _new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"


def front_middleware(auth: AuthPolicy) -> Any:
    """One middleware for every request (each layer costs a coroutine call on the hot path):

    - a request id (the client's ``X-Request-Id`` if well-formed, else a new one) in every log
      line and on the answer;
    - the bearer token where ``auth`` asks for it;
    - errors as llama-server's JSON shape, never a traceback.
    """
    expected = f"Bearer {auth.token}".encode() if auth.token else b""

    @web.middleware
    async def front(request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get("X-Request-Id", "")
        rid = given if given and _REQUEST_ID_RE.fullmatch(given) else _new_request_id()
        reset = request_id.set(rid)
        try:
            # compare_digest: the time taken does not tell how much of the token matched.
            session = auth.saves_session(request.path, request.headers)
            denied = (session or auth.needs_token(request.path, request.method)) and \
                not hmac.compare_digest(request.headers.get("Authorization", "").encode(), expected)
            response: web.StreamResponse
            if denied:
                response = json_error(401, "missing or wrong bearer token" + (
                    f" ({SESSION_ID} saves a session, which needs it)" if session else ""))
            elif auth.refuses(request.path, request.method):
                response = json_error(403, f"{request.method} {request.path}: kvtier owns llama-server's slots; "
                                           "an operator may pass slot actions on with --allow-slot-actions")
            else:
                response = await _json_errors(request, handler)
            if not response.prepared:
                response.headers["X-Request-Id"] = rid
            return response
        finally:
            request_id.reset(reset)

    return front


DEFAULT_BODY_TIMEOUT_S = 60.0


async def read_body(request: web.Request, limit: int | None = None) -> bytes:
    """The whole request body, however many pieces it comes in.

    Raises 408 when it takes longer than ``body_timeout`` (a sender that trickles it must not
    hold a connection and a handler open), 413 past ``limit`` bytes (default: the app's
    ``client_max_size``), and ``CancelledError`` when the client goes away meanwhile.
    """
    settings = request.app.get(SETTINGS)
    timeout = settings.body_timeout if settings is not None else DEFAULT_BODY_TIMEOUT_S
    try:
        async with asyncio.timeout(timeout):
            if limit is None:
                return await request.read()
            body = bytearray()
            while piece := await request.content.readany():
                body += piece
                if len(body) > limit:
                    raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(body))
            return bytes(body)
    except TimeoutError:
        raise web.HTTPRequestTimeout(reason=f"request body not received within {timeout:g} s") from None
    except ConnectionResetError:  # the client went away while sending it
        raise asyncio.CancelledError from None


def client_gone(request: web.Request) -> bool:
    """Whether the client's connection is closed (or closing)."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
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
    except ConnectionResetError:  # the client went away: nothing to answer, nothing to log as an error
        log.debug("client went away during %s %s", request.method, request.path)
        raise asyncio.CancelledError from None
    except Exception:
        if request.writer is not None and request.writer.output_size > 0:
            raise  # an answer already under way: aiohttp drops the connection, the client sees it cut
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_error(500, "internal error in kvtier (see its log)", "internal")
