"""``GET /slots`` through kvtier: llama-server's slot list without what the slots hold.

llama-server lists each slot's last task: how many prompt tokens it had, were computed and were
cached, how many it generated, its sampling parameters, and (with ``LLAMA_SERVER_SLOTS_DEBUG``)
its prompt and generated text. Tenants share the slots, so kvtier answers with the fields that
say nothing of a prompt: which slots exist, their context, and whether each is computing. An
operator who needs the rest asks llama-server itself, inside the Pod.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from aiohttp import web

from .appkeys import UPSTREAM
from .http.headers import HOP_BY_HOP
from .http.upstream import UpstreamError
from .middlewares import json_error

log = logging.getLogger("kvtier.proxy")

SHOWN_FIELDS = ("id", "n_ctx", "speculative", "is_processing")  # of each slot; the rest is left out


def redact_slots(slots: Any) -> Any:
    """llama-server's slot list with only ``SHOWN_FIELDS`` of each slot; anything else (an error
    object, a list of something else) unchanged."""
    if not isinstance(slots, list):
        return slots
    return [{k: s[k] for k in SHOWN_FIELDS if k in s} if isinstance(s, dict) else None for s in slots]


async def slots_view(request: web.Request) -> web.StreamResponse:
    """``GET /slots`` (query included, e.g. ``?fail_on_no_slot=1``), redacted."""
    # As any request kvtier passes on (llama-server may have an API key of its own), but never a
    # conditional, ranged or compressed one: the answer is read and rewritten here.
    headers = [(k, v) for k, v in request.headers.items()
               if (low := k.lower()) not in HOP_BY_HOP and not low.startswith(("x-kvtier-", "if-", "range", "accept-encoding"))]
    query = request.rel_url.raw_query_string
    try:
        upstream = await request.app[UPSTREAM].request("GET", "/slots" + (f"?{query}" if query else ""), headers)
        try:
            body = await upstream.read()
        finally:
            upstream.release()
    except (TimeoutError, UpstreamError, OSError) as exc:
        log.warning("llama-server unreachable: %s", exc)
        return json_error(502, "llama-server unreachable", "bad_gateway")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return json_error(502, "llama-server's slot list is not JSON", "bad_gateway")
    return web.Response(status=upstream.status, body=orjson.dumps(redact_slots(data)),
                        content_type="application/json")
