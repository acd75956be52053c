"""The sidecar's routes, declared once.

``ROUTES`` feeds aiohttp's router (``route_defs``), the ``Allow`` header of a 405 (``allowed_methods``),
the bearer-token decision of the front middleware (``auth_policy``) and ``/openapi.json``. Every path
no route claims is passed through to llama-server unchanged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web

from . import openapi
from .cache_admin import cache_purge, cache_usage
from .completion import handle_completion
from .middlewares import AuthPolicy, Handler, canonical_path, json_error
from .probes import healthz, metrics_endpoint, readyz
from .proxy import COMPLETION_KINDS, checked_passthrough, passthrough
from .sessions_api import delete_session, get_session, list_sessions, restore_session, save_session
from .slotsview import slots_view
from .tenants import names_tenant

# open: never needs the bearer token (the probes); admin: needs it whenever one is set (the
# sessions API); api: needs it only with --auth-all.
Access = Literal["open", "admin", "api"]


@dataclass(frozen=True, slots=True)
class Route:
    """One of kvtier's own endpoints."""

    method: str
    path: str  # aiohttp's pattern: /v1/sessions/{id}
    handler: Handler
    access: Access
    summary: str
    doc: Mapping[str, Any] | None  # the OpenAPI operation's parameters, body and answers; None: undescribed
    # A llama-server path kvtier serves on the way: its other methods go to llama-server, not a 405.
    relayed: bool = False

    def definition(self) -> web.RouteDef:
        if self.method == "GET":
            return web.get(self.path, self.handler)  # and HEAD
        return web.route(self.method, self.path, self.handler)

    @property
    def prefix(self) -> str:
        """The path up to its first parameter: ``/v1/sessions/`` for ``/v1/sessions/{id}``."""
        return self.path.partition("{")[0]


async def openapi_json(request: web.Request) -> web.Response:
    return web.Response(text=_OPENAPI_TEXT, content_type="application/json")


def _completion_summary(path: str, kind: str) -> str:
    # llama-server serves its own completion API at /completion(s), OpenAI's under /v1 and at /chat.
    if kind == "chat":
        return "OpenAI chat completions through the KV flow"
    if path.startswith("/v1/"):
        return "OpenAI completions through the KV flow"
    return "llama-server completion through the KV flow (X-Session-Id, X-KVTier-Salt)"


ROUTES: tuple[Route, ...] = (
    Route("GET", "/healthz", healthz, "open", "The process is alive", openapi.HEALTHZ),
    Route("GET", "/readyz", readyz, "open",
          "llama-server healthy and slot dir writable (Redis reported, not required)", openapi.READYZ),
    Route("GET", "/metrics", metrics_endpoint, "api", "Prometheus metrics", openapi.METRICS),
    Route("GET", "/openapi.json", openapi_json, "admin", "This description", None),
    Route("GET", "/v1/sessions", list_sessions, "admin", "List sessions", openapi.LIST_SESSIONS),
    Route("GET", "/v1/sessions/{id}", get_session, "admin", "A session's manifest and where its chunks live",
          openapi.GET_SESSION),
    Route("PUT", "/v1/sessions/{id}", save_session, "admin",
          "Save a session from the slot that served it (or the given slot)", openapi.SAVE_SESSION),
    Route("DELETE", "/v1/sessions/{id}", delete_session, "admin", "Delete a session (its shared chunks stay)",
          openapi.DELETE_SESSION),
    Route("POST", "/v1/sessions/{id}/restore", restore_session, "admin",
          "Restore a session into a slot of this node", openapi.RESTORE_SESSION),
    Route("GET", "/v1/cache", cache_usage, "admin", "What the shared tier holds, by namespace, and this node's tiers",
          openapi.CACHE_USAGE),
    Route("POST", "/v1/cache/purge", cache_purge, "admin",
          "Delete cached KV: everything, a namespace, a tenant or one conversation, on every node",
          openapi.CACHE_PURGE),
    *(Route("POST", path, handle_completion, "api", _completion_summary(path, kind), openapi.RELAYED, relayed=True)
      for path, kind in COMPLETION_KINDS.items()),
)


@dataclass(frozen=True, slots=True)
class Relayed:
    """A llama-server endpoint kvtier passes through with a rule of its own (docs/security.md)."""

    method: str
    path: str  # the endpoint and everything under it
    rule: Literal["admin", "slots", "untenanted"]
    why: str


# admin: changes llama-server for every client, so it needs the token whenever one is set.
# slots: llama-server's slot actions; kvtier owns the slots, so they are refused (403) unless an
# operator passes them on (--allow-slot-actions), and then they are admin.
# untenanted: runs a prompt on a slot llama-server picks by prefix similarity, outside the KV
# flow and its tenant rules: refused (403) for a request that names a tenant (X-KVTier-Salt).
LLAMA_SERVER_RULES: tuple[Relayed, ...] = (
    Relayed("POST", "/slots", "slots", "save, restore or erase a slot: another conversation's KV, kvtier's files"),
    Relayed("GET", "/slots", "admin", "every slot's state (kvtier leaves out what they hold: slotsview.py)"),
    Relayed("POST", "/lora-adapters", "admin", "LoRA scales of every later request"),
    Relayed("POST", "/props", "admin", "default generation settings (with llama-server's --props)"),
    Relayed("POST", "/models", "admin", "router mode: load, unload or add models"),
    Relayed("DELETE", "/models", "admin", "router mode: remove a model"),
    Relayed("POST", "/tools", "admin", "server-side tools (with llama-server's --tools)"),
    Relayed("POST", "/cors-proxy", "admin", "fetches other URLs (with llama-server's --webui-mcp-proxy)"),
    Relayed("GET", "/cors-proxy", "admin", "fetches other URLs (with llama-server's --webui-mcp-proxy)"),
    Relayed("DELETE", "/v1/stream", "untenanted", "ends a resumable stream by conversation id"),
    Relayed("GET", "/v1/stream", "untenanted", "reads a resumable stream by conversation id"),
    Relayed("POST", "/v1/streams/lookup", "untenanted", "looks resumable streams up by conversation id"),
    *(Relayed("POST", path, "untenanted", "a prompt on a slot llama-server picks")
      for path in ("/infill", "/v1/responses", "/responses", "/v1/messages", "/embedding", "/embeddings",
                   "/v1/embeddings", "/rerank", "/reranking", "/v1/rerank", "/v1/reranking",
                   "/v1/audio/transcriptions", "/audio/transcriptions", "/v1/chat/completions/control")),
)
_UNTENANTED = frozenset((r.method, r.path) for r in LLAMA_SERVER_RULES if r.rule == "untenanted")

_OPENAPI_TEXT = json.dumps(openapi.document(ROUTES))
_METHOD_ORDER = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def _pattern(path: str) -> re.Pattern[str]:
    # As aiohttp matches a {name}: one non-empty path segment.
    return re.compile(re.sub(r"\\\{\w+\\\}", "[^{}/]+", re.escape(path)))


def _allow_table(routes: tuple[Route, ...]) -> tuple[tuple[re.Pattern[str], str], ...]:
    methods: dict[str, set[str]] = {}
    for route in routes:
        if not route.relayed:
            methods.setdefault(route.path, set()).update({route.method, "HEAD"} if route.method == "GET"
                                                          else {route.method})
    return tuple((_pattern(path), ", ".join(m for m in _METHOD_ORDER if m in allowed))
                 for path, allowed in methods.items())


_ALLOW = _allow_table(ROUTES)
# Paths under these are kvtier's: one no route matches is a 404, never passed to llama-server.
_OWN_PREFIXES = tuple(dict.fromkeys(r.prefix for r in ROUTES if not r.relayed and r.prefix != r.path))


def allowed_methods(path: str) -> str | None:
    """The methods of one of kvtier's own paths (a 405's ``Allow``), None for every other path."""
    for pattern, allowed in _ALLOW:
        if pattern.fullmatch(path):
            return allowed
    return None


def auth_policy(token: str | None, protect_all: bool, *, allow_slot_actions: bool = False) -> AuthPolicy:
    """Which paths need ``token``: the admin routes' (and anything under them), llama-server's
    state-changing actions and slot list, completions that save a session (``X-Session-Id``),
    every path but the open ones with ``protect_all``; which actions are refused whatever the
    token (the slot actions, unless ``allow_slot_actions``)."""
    slots = frozenset((r.method, r.path) for r in LLAMA_SERVER_RULES if r.rule == "slots")
    return AuthPolicy(
        token=token,
        open_paths=frozenset(r.path for r in ROUTES if r.access == "open"),
        token_prefixes=tuple(dict.fromkeys(r.prefix.rstrip("/") for r in ROUTES if r.access == "admin")),
        protect_all=protect_all,
        admin_actions=frozenset((r.method, r.path) for r in LLAMA_SERVER_RULES if r.rule == "admin")
        | (slots if allow_slot_actions else frozenset()),
        refused_actions=frozenset() if allow_slot_actions else slots,
        session_paths=frozenset(COMPLETION_KINDS),
    )


def untenanted(method: str, path: str) -> bool:
    """Whether llama-server runs this request's prompt outside the KV flow (and its tenant rules)."""
    path = canonical_path(path)
    return any(method == m and (path == p or path.startswith(p + "/")) for m, p in _UNTENANTED)


async def catch_all(request: web.Request) -> web.StreamResponse:
    """Everything that is not kvtier's own goes to llama-server unchanged."""
    allowed = allowed_methods(request.path)
    if allowed is not None:
        response = json_error(405, f"{request.method} {request.path} is not part of the kvtier API")
        response.headers["Allow"] = allowed
        return response
    if request.path.startswith(_OWN_PREFIXES):
        return json_error(404, f"{request.path} is not part of the kvtier API")
    if request.method in ("GET", "HEAD") and canonical_path(request.path) == "/slots":
        return await slots_view(request)  # without what the slots hold: tenants share them
    if untenanted(request.method, request.path):
        if names_tenant(request.headers):
            return json_error(403, f"{request.method} {request.path} runs outside kvtier's tenant rules "
                                   "(llama-server picks its slot); send tenants' requests to the completion routes")
        if request.method == "POST":
            return await checked_passthrough(request)  # its prompt, grammar and schemas reach llama-server
    return await passthrough(request)


def route_defs() -> list[web.RouteDef]:
    """``ROUTES`` for ``app.add_routes``, then the catch-all that relays the rest."""
    return [*(route.definition() for route in ROUTES), web.route("*", "/{tail:.*}", catch_all)]
