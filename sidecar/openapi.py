"""``/openapi.json``: the sidecar's own API, described from the route table (``routes.py``).

The llama-server API kvtier passes through is described by name only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from tiers.sessions import SESSION_ID_RE


class Operation(Protocol):
    """What the description needs of a route (``routes.Route``)."""

    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def access(self) -> str: ...
    @property
    def summary(self) -> str: ...
    @property
    def doc(self) -> Mapping[str, Any] | None: ...


ERROR = {"$ref": "#/components/schemas/Error"}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {400: "Bad request", 401: "Missing or wrong bearer token", 403: "Another tenant's slot", 404: "No such session",
            409: "Slot busy or empty", 410: "Chunks of the session are gone", 413: "Body too large",
            502: "Cache error", 503: "llama-server or Redis not ready"}
    return {str(c): _json(ERROR, text[c]) for c in codes}


SESSION_ID = {"name": "id", "in": "path", "required": True,
              "schema": {"type": "string", "pattern": SESSION_ID_RE.pattern, "maxLength": 128}}
SLOT_BODY = {
    "required": False,
    "content": {"application/json": {"schema": {
        "type": "object", "additionalProperties": False,
        "properties": {"slot": {"type": "integer", "minimum": 0}, "wait_s": {"type": "number", "minimum": 0, "maximum": 120}},
    }}},
}
MANIFEST = {
    "type": "object",
    "required": ["id", "namespace", "chunk_tokens", "n_tokens", "chunks", "tail_tokens", "bytes", "node", "created",
                 "last_used"],
    "properties": {
        "id": {"type": "string"}, "namespace": {"type": "string"}, "chunk_tokens": {"type": "integer"},
        "n_tokens": {"type": "integer"}, "chunks": {"type": "integer"}, "tail_tokens": {"type": "integer"},
        "tail_hash": {"type": "string"}, "bytes": {"type": "integer"}, "node": {"type": "string"},
        "created": {"type": "number"}, "last_used": {"type": "number"},
    },
}
AUTH: list[dict[str, list[str]]] = [{"bearer": []}]
PATH_PARAMETERS = {"id": SESSION_ID}  # by the name a route's path gives them ({id})

# Each operation's parameters, body and answers; the route table gives its method, path, summary
# and whether it needs the bearer token.
HEALTHZ = {"responses": {"200": _json({"type": "object"})}}
READYZ = {"responses": {"200": _json({"type": "object"}), "503": _json({"type": "object"}, "Not ready")}}
METRICS = {"responses": {"200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}}}
LIST_SESSIONS = {
    "parameters": [
        {"name": "prefix", "in": "query", "schema": {"type": "string", "maxLength": 128}},
        {"name": "after", "in": "query", "schema": {"type": "string", "maxLength": 128}},
        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
    ],
    "responses": {"200": _json({"type": "object", "required": ["sessions", "shared"], "properties": {
        "sessions": {"type": "array", "items": MANIFEST}, "shared": {"type": "boolean"},
        "next": {"type": "string"}, "damaged": {"type": "array", "items": {"type": "string"}}}}),
        **_errors(400, 401, 503)},
}
GET_SESSION = {"responses": {"200": _json({"allOf": [MANIFEST, {"type": "object", "properties": {
    "shared": {"type": "boolean"}, "chunks_available": {"type": "integer"},
    "chunks_by_tier": {"type": "object", "additionalProperties": {"type": "integer"}}}}]}),
    **_errors(400, 401, 404, 503)}}
SAVE_SESSION = {
    "requestBody": SLOT_BODY,
    "responses": {"200": _json({"type": "object", "required": ["id", "slot", "tokens", "chunks", "bytes", "ms"],
                                "properties": {"id": {"type": "string"}, "slot": {"type": "integer"},
                                               "tokens": {"type": "integer"}, "chunks": {"type": "integer"},
                                               "tail_tokens": {"type": "integer"}, "bytes": {"type": "integer"},
                                               "shared": {"type": "boolean"}, "ms": {"type": "number"}}}),
                  **_errors(400, 401, 403, 409, 413, 502, 503)},
}
DELETE_SESSION = {"responses": {"200": _json({"type": "object"}), **_errors(400, 401, 404, 503)}}
RESTORE_SESSION = {
    "requestBody": SLOT_BODY,
    "responses": {"200": _json({"type": "object", "required": ["id", "slot", "n_restored", "tier", "ms"],
                                "properties": {"id": {"type": "string"}, "slot": {"type": "integer"},
                                               "n_restored": {"type": "integer"}, "tier": {"type": "string"},
                                               "ms": {"type": "number"}}}),
                  **_errors(400, 401, 404, 409, 410, 413, 502, 503)},
}
USAGE = {"type": "object", "required": ["namespace", "bytes"], "properties": {
    "namespace": {"type": "string"}, "bytes": {"type": "integer"}, "chunks": {"type": "integer"},
    "tails": {"type": "integer"}, "wholes": {"type": "integer"}, "sessions": {"type": "integer"},
    "session_tails": {"type": "integer"}, "pending": {"type": "integer"}, "model": {"type": "string"},
    "chunk_tokens": {"type": "integer"}}}
CACHE_USAGE = {
    "parameters": [{"name": "namespace", "in": "query", "schema": {"type": "string", "pattern": "^[0-9a-f]{16}$"}}],
    "responses": {"200": _json({"type": "object", "required": ["shared", "namespaces", "this_node"], "properties": {
        "shared": {"type": "boolean"}, "namespaces": {"type": "array", "items": USAGE},
        "this_node": {"type": "object"}}}), **_errors(400, 401, 503)},
}
CACHE_PURGE = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "additionalProperties": False, "minProperties": 1,
        "properties": {"all": {"type": "boolean", "enum": [True]},
                       "namespace": {"type": "string", "pattern": "^[0-9a-f]{16}$"},
                       "salt": {"type": "string", "maxLength": 256},
                       "session": {"type": "string", "pattern": SESSION_ID_RE.pattern},
                       "tokens": {"type": "array", "items": {"type": "integer"}, "minItems": 1},
                       "prompt": {"type": "string"},
                       "messages": {"type": "array", "items": {"type": "object"}}},
    }}}},
    "responses": {"200": _json({"type": "object", "required": ["scope", "namespaces", "redis_keys_deleted"],
                                "properties": {"scope": {"type": "string"},
                                               "namespaces": {"type": "array", "items": {"type": "string"}},
                                               "redis_keys_deleted": {"type": "integer"},
                                               "local_values_deleted": {"type": "integer"},
                                               "slots_erased": {"type": "integer"}, "slots_busy": {"type": "integer"},
                                               "shared": {"type": "boolean"}}}),
                  **_errors(400, 401, 404, 413, 503)},
}
RELAYED = {"responses": {"200": {"description": "llama-server's answer, relayed"}}}

INFO = {"title": "kvtier sidecar", "version": "1",
        "description": "KV-cache sidecar for llama-server. Completion endpoints go through the KV flow; every "
                       "other path is passed through to llama-server unchanged."}
COMPONENTS = {
    "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
    "schemas": {"Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["code", "message"],
        "properties": {"code": {"type": "integer"}, "message": {"type": "string"}, "type": {"type": "string"}},
    }}}},
}


def document(routes: Iterable[Operation]) -> dict[str, Any]:
    """The OpenAPI document of the routes that carry a description."""
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if route.doc is None:
            continue
        item = paths.setdefault(route.path, {})
        parameters = [PATH_PARAMETERS[name] for name in re.findall(r"\{(\w+)\}", route.path)]
        if parameters:
            item["parameters"] = parameters
        operation: dict[str, Any] = {"summary": route.summary}
        if route.access == "admin":
            operation["security"] = AUTH
        item[route.method.lower()] = {**operation, **route.doc}
    return {"openapi": "3.0.3", "info": INFO, "components": COMPONENTS, "paths": paths}
