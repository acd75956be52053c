"""``/openapi.json``: the sidecar's own API (the proxied llama-server API is described by name only)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tiers.sessions import SESSION_ID_RE

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
AUTH = [{"bearer": []}]

SPEC: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "kvtier sidecar", "version": "1",
             "description": "KV-cache sidecar for llama-server. Completion endpoints go through the KV flow; every "
                            "other path is passed through to llama-server unchanged."},
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {"Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["code", "message"],
            "properties": {"code": {"type": "integer"}, "message": {"type": "string"}, "type": {"type": "string"}},
        }}}},
    },
    "paths": {
        "/healthz": {"get": {"summary": "The process is alive", "responses": {"200": _json({"type": "object"})}}},
        "/readyz": {"get": {"summary": "llama-server healthy and slot dir writable (Redis reported, not required)",
                            "responses": {"200": _json({"type": "object"}), "503": _json({"type": "object"}, "Not ready")}}},
        "/metrics": {"get": {"summary": "Prometheus metrics",
                             "responses": {"200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/v1/sessions": {"get": {
            "summary": "List sessions", "security": AUTH,
            "parameters": [
                {"name": "prefix", "in": "query", "schema": {"type": "string", "maxLength": 128}},
                {"name": "after", "in": "query", "schema": {"type": "string", "maxLength": 128}},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
            ],
            "responses": {"200": _json({"type": "object", "required": ["sessions", "shared"], "properties": {
                "sessions": {"type": "array", "items": MANIFEST}, "shared": {"type": "boolean"},
                "next": {"type": "string"}}}), **_errors(400, 401, 503)},
        }},
        "/v1/sessions/{id}": {
            "parameters": [SESSION_ID],
            "get": {"summary": "A session's manifest and where its chunks live", "security": AUTH,
                    "responses": {"200": _json({"allOf": [MANIFEST, {"type": "object", "properties": {
                        "shared": {"type": "boolean"}, "chunks_available": {"type": "integer"},
                        "chunks_by_tier": {"type": "object", "additionalProperties": {"type": "integer"}}}}]}),
                        **_errors(400, 401, 404, 503)}},
            "put": {"summary": "Save a session from the slot that served it (or the given slot)", "security": AUTH,
                    "requestBody": SLOT_BODY,
                    "responses": {"200": _json({"type": "object", "required": ["id", "slot", "tokens", "chunks", "bytes", "ms"],
                                                "properties": {"id": {"type": "string"}, "slot": {"type": "integer"},
                                                               "tokens": {"type": "integer"}, "chunks": {"type": "integer"},
                                                               "tail_tokens": {"type": "integer"}, "bytes": {"type": "integer"},
                                                               "shared": {"type": "boolean"}, "ms": {"type": "number"}}}),
                                  **_errors(400, 401, 403, 409, 413, 502, 503)}},
            "delete": {"summary": "Delete a session (its shared chunks stay)", "security": AUTH,
                       "responses": {"200": _json({"type": "object"}), **_errors(400, 401, 404, 503)}},
        },
        "/v1/sessions/{id}/restore": {
            "parameters": [SESSION_ID],
            "post": {"summary": "Restore a session into a slot of this node", "security": AUTH, "requestBody": SLOT_BODY,
                     "responses": {"200": _json({"type": "object", "required": ["id", "slot", "n_restored", "tier", "ms"],
                                                 "properties": {"id": {"type": "string"}, "slot": {"type": "integer"},
                                                                "n_restored": {"type": "integer"}, "tier": {"type": "string"},
                                                                "ms": {"type": "number"}}}),
                                   **_errors(400, 401, 404, 409, 410, 413, 502, 503)}},
        },
        "/completion": {"post": {"summary": "llama-server completion through the KV flow (X-Session-Id, X-KVTier-Salt)",
                                 "responses": {"200": {"description": "llama-server's answer, relayed"}}}},
        "/v1/completions": {"post": {"summary": "OpenAI completions through the KV flow",
                                     "responses": {"200": {"description": "llama-server's answer, relayed"}}}},
        "/v1/chat/completions": {"post": {"summary": "OpenAI chat completions through the KV flow",
                                          "responses": {"200": {"description": "llama-server's answer, relayed"}}}},
    },
}


async def openapi_handler(request: web.Request) -> web.Response:
    return web.json_response(SPEC)
