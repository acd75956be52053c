"""To llama-server: requests passed on as they came, and the completion body's checks.

Completions go through the KV flow (``sidecar/completion.py``), which sends them here pinned to
their slot; everything else is passed on unchanged. Answers are relayed as they arrive
(``sidecar/http/relay.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from integrations.llama_server import LlamaServerError

from .appkeys import BACKGROUND, ENGINE, SETTINGS, UPSTREAM
from .bodyguard import BodyLimits, grammar_problem, shape_problem
from .config import Settings
from .http.headers import SLOT, for_llama_server
from .http.relay import MAX_CAPTURE, Relay, relay
from .http.upstream import UpstreamError
from .middlewares import json_error, read_body

log = logging.getLogger("kvtier.proxy")

COMPLETION_KINDS = {"/completion": "completion", "/completions": "completion", "/v1/completions": "completion",
                    "/v1/chat/completions": "chat", "/chat/completions": "chat"}
# Characters a prompt token stands for, at most, in the default --max-prompt-chars (the slots'
# context times this): English averages about 4, long runs of spaces or symbols in code reach 16
# in common vocabularies; a longer prompt cannot fit the context, and tokenizing it would cost
# ~35 bytes of memory per character first.
MAX_CHARS_PER_TOKEN = 32
# Larger bodies have their shape counted off the event loop: a scan costs ~15 ms per MB (numpy,
# which lets the loop run meanwhile: a 31 MB one held it 360 ms inline, at most 65 ms in a thread).
THREAD_SCAN_BYTES = 1 << 20
UTF8_BOM = b"\xef\xbb\xbf"
_NO_TOKENS = np.zeros(0, np.int32)
_MEDIA_KEYS = frozenset({"image_url", "input_audio", "file", "multimodal_data"})  # not prompt text
_NO_HEADERS: Mapping[str, str] = {}


async def passthrough(request: web.Request, body: bytes | None = None) -> web.StreamResponse:
    """Forward the request unchanged and relay the answer."""
    return await to_llama_server(request, body if body is not None else await read_body(request), Relay())


async def checked_passthrough(request: web.Request) -> web.StreamResponse:
    """A llama-server prompt endpoint outside the KV flow (``/infill``, ``/v1/responses``, ...):
    passed on unchanged, but a JSON body within a completion's bounds only, since llama-server
    reads grammars and schemas there too (a deep grammar sent to ``/v1/responses`` crashed it
    as one sent to ``/completion`` did). Other bodies (multipart audio) go on as they came."""
    raw = await read_body(request)
    text = raw.removeprefix(UTF8_BOM)  # skipped by llama-server's parser too
    if text.lstrip()[:1] == b"{":
        # Parsed whole (its shape first): a key may be written with escapes ("gr\u0061mmar").
        refused = await read_completion(text, body_limits(request.app[SETTINGS]))
        if isinstance(refused, str):
            return json_error(400, refused)
    return await passthrough(request, raw)


async def to_llama_server(request: web.Request, body: bytes, out: Relay, *,
                          headers: Mapping[str, str] = _NO_HEADERS, capture: bool = False) -> web.StreamResponse:
    """Send ``body`` to llama-server (the request's method, path and end-to-end headers, none of
    kvtier's own) and relay its answer, recording the outcome in ``out``; ``headers`` are added
    to the answer's."""
    try:
        answer = await request.app[UPSTREAM].request(request.method, request.raw_path,
                                                      for_llama_server(request.headers.items()), body)
    except ValueError as exc:  # nothing llama-server could be sent
        return json_error(400, f"request not forwardable: {exc}")
    except (TimeoutError, UpstreamError, OSError) as exc:
        log.warning("llama-server unreachable: %s", exc)
        return json_error(502, "llama-server unreachable", "bad_gateway")
    try:
        return await relay(request, answer, out, headers=headers, capture=capture, whole_max=MAX_CAPTURE)
    except UpstreamError as exc:
        # Cut short by llama-server: the client's connection is closed too (a clean end would
        # pass a truncated answer off as whole).
        log.warning("llama-server's answer broke off: %s", exc)
        raise


async def pinned_passthrough(request: web.Request, body: dict[str, Any], want: int | None,
                              salt: str) -> web.StreamResponse:
    """A completion kvtier does not cache (``cache_prompt: false``, several prompts, media), sent
    as it came but to a slot kvtier chose for its tenant: another tenant's slot is erased first,
    and the slot is erased after it, since kvtier does not learn what it then holds."""
    engine = request.app[ENGINE]
    table = engine.slots
    assert table is not None  # after ensure_ready()
    lease = await table.acquire(_NO_TOKENS, want=want, owner=salt)
    try:
        if lease.foreign:
            await engine.client.erase_slot(lease.slot)
        forwarded = {k: v for k, v in body.items() if k != "cache_salt"}
        forwarded["id_slot"] = lease.slot
        return await to_llama_server(request, orjson.dumps(forwarded), Relay(), headers={SLOT: str(lease.slot)})
    finally:
        request.app[BACKGROUND].start(_erase_then_release(engine, lease))


async def _erase_then_release(engine: Any, lease: Any) -> None:
    try:
        await engine.client.erase_slot(lease.slot)
    except (LlamaServerError, OSError) as exc:
        log.info("slot %d: not erased after a pass-through (%s)", lease.slot, exc)
    finally:
        lease.table.forget(lease.slot)
        lease.release()


async def read_completion(raw: bytes, limits: BodyLimits) -> dict[str, Any] | str:
    """A completion body as a JSON object, or why it is refused.

    Its shape (values, nesting) is checked before it is parsed (``bodyguard``: parsing builds
    every value), its grammar after. orjson refuses a little more that llama-server reads (NaN,
    numbers past a double's range, lone surrogates); no completion needs those.
    """
    if len(raw) > THREAD_SCAN_BYTES:
        too_big = await asyncio.to_thread(shape_problem, raw, limits)
    else:
        too_big = shape_problem(raw, limits)
    if too_big is not None:
        return too_big
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return f"request body is not JSON kvtier can read: {str(exc)[:200]}"
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    return grammar_problem(body, limits) or body


def body_limits(settings: Settings) -> BodyLimits:
    return BodyLimits(settings.max_json_values, settings.max_json_depth, settings.max_grammar_chars,
                      settings.max_grammar_depth)


def prompt_too_long(request: web.Request, raw: bytes, body: Mapping[str, Any]) -> str | None:
    """Why the request's prompt text is over ``--max-prompt-chars``; None when it is not.

    Checked before anything is rendered or tokenized: tokenizing costs ~35 bytes per character.
    A body no larger than the limit cannot hold more characters than it has bytes.
    """
    settings = request.app[SETTINGS]
    n_ctx = request.app[ENGINE].target.n_ctx_slot  # type: ignore[union-attr]
    limit = settings.max_prompt_chars or n_ctx * MAX_CHARS_PER_TOKEN
    if not limit or len(raw) <= limit:
        return None
    chars = prompt_chars(body)
    if chars <= limit:
        return None
    return (f"prompt too long: {chars} characters, over the limit of {limit} (max_prompt_chars; this server's "
            f"slots hold {n_ctx} tokens)")


def prompt_chars(body: Mapping[str, Any]) -> int:
    """Characters of prompt text in a completion body: its prompt, messages and tools (media
    data aside); a token id counts as one."""
    total = 0
    stack: list[Any] = [body.get(key) for key in ("prompt", "messages", "tools")]
    while stack:  # iterative: a body may nest a thousand levels deep
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(v for k, v in item.items() if k not in _MEDIA_KEYS)
        elif isinstance(item, int):
            total += 1
    return total


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

