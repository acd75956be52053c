"""A completion through the KV flow, as a sequence of stages.

::

    parse ─▶ caller ─▶ follow-up of an idle slot? ──────────────yes──────────────┐
                              │ no                                               │
                              ▼                                                  ▼
                           prompt ─▶ route ─▶ plan + restore (KVEngine.prepare) ─▶ relay ─▶ save

Each stage is a function with one way in and one way out: it returns what the next needs, or
raises ``Answered`` when it answers the request itself (refused, passed on as it came, or served
by a peer). ``handle_completion`` is the sequence; the engine's calls (``follow_up``, ``prepare``,
``finish``) are each made from one stage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from integrations.llama_server import LlamaServerError
from tiers.sessions import validate_session_id

from .appkeys import ENGINE, FORWARDER, METRICS, SETTINGS
from .asked import Asked
from .forward import route_or_none
from .http import headers as h
from .http.relay import Relay
from .middlewares import client_gone, json_error, read_body
from .planner import EarlyLookup
from .prompts import Prompt, asked_of
from .proxy import (
    COMPLETION_KINDS,
    UTF8_BOM,
    body_limits,
    pinned_passthrough,
    prompt_too_long,
    read_completion,
    to_llama_server,
    upstream_body,
)
from .requestplan import RequestPlan
from .tenants import several_slots, tenant_salt

log = logging.getLogger("kvtier.proxy")


@dataclass(frozen=True, slots=True)
class Ask:
    """A completion request, parsed and within bounds (``parse``)."""

    kind: str  # "completion" or "chat"
    raw: bytes  # the body as it came (a byte-order mark left out)
    body: dict[str, Any]
    started: float  # perf_counter() once it was found valid: kvtier's overhead counts from here


@dataclass(frozen=True, slots=True)
class Caller:
    """Who asks (``caller``): the tenant, the session, the slot asked for, and whether a peer sent it."""

    salt: str
    session_id: str | None
    want: int | None  # the body's id_slot, when it names one of the slots
    from_peer: bool  # forwarded here by a peer: served here, never sent on


class Answered(Exception):
    """A stage answered the request itself; ``outcome`` labels it in ``kvtier_requests`` (None:
    not counted)."""

    outcome: str | None = None

    async def respond(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError


class Refused(Answered):
    def __init__(self, response: web.Response, outcome: str | None = "invalid") -> None:
        self.response, self.outcome = response, outcome

    async def respond(self, request: web.Request) -> web.StreamResponse:
        return self.response


class PassedOn(Answered):
    """Not cached by kvtier: sent as it came, to a slot of its tenant's (``pinned_passthrough``)."""

    outcome = "passthrough"

    def __init__(self, body: dict[str, Any], caller: Caller) -> None:
        self.body, self.caller = body, caller

    async def respond(self, request: web.Request) -> web.StreamResponse:
        return await pinned_passthrough(request, self.body, self.caller.want, self.caller.salt)


class Forwarded(Answered):
    """A peer served it; its answer, relayed."""

    outcome = "forwarded"

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    async def respond(self, request: web.Request) -> web.StreamResponse:
        return self.response


async def handle_completion(request: web.Request) -> web.StreamResponse:
    """``/completion``, ``/v1/completions``, ``/v1/chat/completions`` through the KV flow."""
    kind = COMPLETION_KINDS[request.path]
    metrics = request.app[METRICS]
    try:
        try:
            ask = await parse(request, kind)
            caller = identify(request, ask)
            asked = asked_of(kind, ask.body)
            plan = await follow_up(request, ask, caller, asked)
            if plan is None:
                prompt = await prompt_of(request, ask, caller)
                early = await route(request, ask, caller, prompt)
                plan = await prepare(request, ask, caller, prompt, asked, early)
        except Answered as done:
            if done.outcome is not None:
                metrics.requests.labels(kind, done.outcome).inc()
            return await done.respond(request)
        relay = Relay()
        try:
            return await answer(request, ask, plan, relay)
        finally:
            save(request, plan, relay)
    except asyncio.CancelledError:
        # Gone while its slot was awaited (it left the queue) or while answered (llama-server's
        # connection was closed, which stops the generation); or cut by a shutdown.
        metrics.requests.labels(kind, "client_gone" if client_gone(request) else "cancelled").inc()
        raise


async def parse(request: web.Request, kind: str) -> Ask:
    """The body, parsed and checked; refused when kvtier cannot take it (or is not ready)."""
    engine = request.app[ENGINE]
    raw = await read_body(request)
    raw = raw.removeprefix(UTF8_BOM)  # llama-server's parser (nlohmann::json) skips a BOM too
    body = await read_completion(raw, body_limits(request.app[SETTINGS]))
    if isinstance(body, str):
        # Never passed on as it came: llama-server would run it on a slot of its own choosing,
        # around the tenant rules.
        raise Refused(json_error(400, body))
    if not await engine.ensure_ready():
        # Without its slot table kvtier cannot keep tenants apart: no request goes past it.
        unready = json_error(503, f"kvtier is not ready: {engine.last_error}")
        unready.headers["Retry-After"] = "2"
        raise Refused(unready, "unavailable")
    too_long = prompt_too_long(request, raw, body)
    if too_long is not None:
        raise Refused(json_error(400, too_long))
    return Ask(kind, raw, body, time.perf_counter())


def identify(request: web.Request, ask: Ask) -> Caller:
    """Who asks; refused for an ambiguous tenant or several completions at once, passed on as it
    came with ``cache_prompt: false``."""
    forwarder = request.app[FORWARDER]
    from_peer = forwarder is not None and forwarder.received(request.headers)
    want = ask.body.get("id_slot")
    n_slots = request.app[ENGINE].target.n_slots  # type: ignore[union-attr]  # after ensure_ready()
    want = want if isinstance(want, int) and not isinstance(want, bool) and 0 <= want < n_slots else None
    try:
        salt = tenant_salt(request.headers, ask.body)
    except ValueError as exc:
        raise Refused(json_error(400, str(exc))) from None
    if (several := several_slots(ask.body)) is not None:
        raise Refused(json_error(400, several))
    caller = Caller(salt, request.headers.get(h.SESSION_ID), want, from_peer)
    if ask.body.get("cache_prompt") is False:
        raise PassedOn(ask.body, caller)
    return caller


async def follow_up(request: web.Request, ask: Ask, caller: Caller, asked: Asked | None) -> RequestPlan | None:
    """The plan of a request that continues what a slot answered last (no tokens, no lookup), or
    None. A session's request always takes the full path (its save needs tokens)."""
    if asked is None or caller.session_id is not None:
        return None
    return await request.app[ENGINE].follow_up(ask.body, asked, want_slot=caller.want, salt=caller.salt,
                                               since=ask.started)


async def prompt_of(request: web.Request, ask: Ask, caller: Caller) -> Prompt:
    """The prompt's tokens; passed on as it came when they cannot be known (or there are none),
    refused for a malformed ``X-Session-Id``."""
    try:
        prompt = await request.app[ENGINE].prompts.prompt_for(ask.kind, ask.body, scope=caller.salt)
    except LlamaServerError as exc:
        log.info("not cacheable (%s); passing through", exc)
        prompt = None
    if prompt is None or prompt.tokens.size == 0:
        raise PassedOn(ask.body, caller)
    if caller.session_id is not None:
        try:
            validate_session_id(caller.session_id)
        except ValueError as exc:
            raise Refused(json_error(400, f"{h.SESSION_ID}: {exc}")) from None
    return prompt


async def route(request: web.Request, ask: Ask, caller: Caller, prompt: Prompt) -> EarlyLookup | None:
    """Serve here or at a peer (``--forward``), decided before a slot is taken: a peer holding
    the prompt hot may answer it sooner. Raises ``Forwarded`` with the peer's answer; returns
    what the local tiers hold of the prompt when they were looked up."""
    forwarder = request.app[FORWARDER]
    if forwarder is None or not forwarder.enabled or caller.from_peer:
        return None
    response, early = await route_or_none(forwarder, request, ask.raw, prompt.tokens, caller.salt)
    if response is not None:
        raise Forwarded(response)
    return early


async def prepare(request: web.Request, ask: Ask, caller: Caller, prompt: Prompt, asked: Asked | None,
                  early: EarlyLookup | None) -> RequestPlan:
    """A slot for the prompt, with the longest worthwhile prefix restored into it."""
    # A LoRA chosen per request would not be the one the state at the prompt's end is computed with.
    prompt_end = request.app[SETTINGS].save_prompt_end and "lora" not in ask.body
    return await request.app[ENGINE].prepare(prompt, want_slot=caller.want, salt=caller.salt,
                                             session_id=caller.session_id, since=ask.started, asked=asked or (),
                                             prompt_end=prompt_end, early=early)


async def answer(request: web.Request, ask: Ask, plan: RequestPlan, relay: Relay) -> web.StreamResponse:
    """llama-server's answer on the plan's slot, relayed; what kvtier did, in its headers."""
    headers = {
        h.SLOT: str(plan.lease.slot),
        h.RESTORED_TOKENS: str(plan.restored_tokens),
        h.RESTORE_TIER: plan.restore_tier or "none",
    }
    if not plan.follow_up:  # a follow-up's tokens are not computed: its timings tell them
        headers[h.PROMPT_TOKENS] = str(plan.tokens.size)
        headers[h.SLOT_CACHED_TOKENS] = str(plan.lease.cached_tokens)
    answering = time.perf_counter()
    response = await to_llama_server(request, upstream_body(ask.raw, ask.body, plan.lease.slot), relay,
                                     headers=headers, capture=True)
    request.app[METRICS].requests.labels(ask.kind, "ok" if relay.ok else "upstream_error").inc()
    if relay.ok and (forwarder := request.app[FORWARDER]) is not None:
        forwarder.fleet.observe_service(time.perf_counter() - answering)  # published: peers' wait estimates
    return response


def save(request: web.Request, plan: RequestPlan, relay: Relay) -> None:
    """Save the slot in the background and release it (``KVEngine.finish``).

    Saved when llama-server finished its answer, even if the client (or a shutdown) cut the last
    bytes short: the slot then holds a complete, valid state.
    """
    request.app[ENGINE].finish(plan, ok=relay.ok, answer=bytes(relay.tail) if relay.ok else None,
                               cut=relay.client_left and relay.status == 200)
    if (forwarder := request.app[FORWARDER]) is not None:
        forwarder.fleet.nudge()  # peers see the slot's new prompt before its save has read it
