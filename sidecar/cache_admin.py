"""The cache admin API (its paths are in ``routes.py``): what the shared tier holds, and purges.

``GET /v1/cache`` lists every namespace in Redis (keys by kind, bytes) and this node's tiers.
``POST /v1/cache/purge`` deletes cached KV: everything (``{"all": true}``), one namespace
(``{"namespace": id}``), one tenant (``{"salt": s}``: its namespace under every recorded model),
or one conversation (``{"session": id}``, ``{"tokens": [...]}``, ``{"prompt": text}`` or
``{"messages": [...]}``, with ``"salt"`` for a tenant's). On this node it also drops the values
from RAM and the shared directory, erases the idle slots that hold them, removes kept restore
files; it deletes from Redis (SCAN + UNLINK, ``tiers.purge``) and tells every other node with a
``cache_purged`` event, on which they do the same (``follow_purges``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web

from integrations.llama_server import LlamaServerError
from tiers import purge
from tiers.base import TierRole
from tiers.errors import KVTierError
from tiers.events import Event, EventBus
from tiers.keys import Namespace, as_token_array, common_prefix, events_channel, session_tail_key
from tiers.redis_conn import RedisConnection
from tiers.sessions import SessionDamaged, SessionNotFound

from .appkeys import ENGINE, EVENTS, REDIS, STORE
from .engine import KVEngine
from .sessions_api import ApiError, read_json_object, sessions_errors

log = logging.getLogger("kvtier.cache_admin")

MAX_BODY = 8 << 20  # a token list of ~1M tokens
MAX_TOKENS = 1 << 20
FLUSH_TIMEOUT_S = 10.0  # queued background writes land before a purge, so none lands after it
REGISTER_EVERY_S = 300.0  # the model record is written again this often (a Redis that lost it)
CONVERSATION_FIELDS = ("session", "tokens", "prompt", "messages")
FIELDS = frozenset({"all", "namespace", "salt", *CONVERSATION_FIELDS})

SlotMatch = Callable[[np.ndarray, str], bool]  # (what an idle slot holds, its tenant) -> erase it


@dataclass(frozen=True, slots=True)
class Scope:
    """What one purge deletes: whole namespaces (ids, or ``purge.ALL``), or one conversation's keys."""

    kind: str  # all | namespace | tenant | conversation
    namespaces: tuple[str, ...] = ()
    keys: tuple[bytes, ...] = ()
    conversation_ns: str = ""
    slots: SlotMatch | None = None


@dataclass(frozen=True, slots=True)
class LocalPurge:
    values: int  # deleted from this node's tiers
    slots_erased: int
    slots_busy: int  # matching slots serving a request now: not erased (they are saved after it)


def _redis(request: web.Request) -> RedisConnection | None:
    tier = request.app[REDIS]
    return tier.connection if tier is not None else None


async def _models(conn: RedisConnection | None, engine: KVEngine) -> list[purge.ModelRecord]:
    """The recorded models, with this node's own (recorded or not)."""
    found = await purge.models(conn) if conn is not None else []
    target = engine.target
    if target is not None and all(m.namespace != target.namespace.id for m in found):
        ns = target.namespace
        found.append(purge.ModelRecord(ns.id, ns.fingerprint, ns.chunk_tokens))
    return found


# -- this node ------------------------------------------------------------------------------------

async def erase_slots(engine: KVEngine, match: SlotMatch) -> tuple[int, int]:
    """Erase every idle slot whose content ``match`` names; (erased, busy)."""
    table = engine.slots
    if table is None:
        return 0, 0
    erased = busy = 0
    for record in table.slots:
        if (record.tokens.size == 0 and not record.unknown) or not match(record.tokens, record.owner):
            continue
        lease = table.try_acquire(record.id)
        if lease is None:
            busy += 1
            continue
        try:
            await engine.client.erase_slot(record.id)
            table.set_tokens(record.id, np.zeros(0, np.int32), owner=record.owner)
            erased += 1
        except LlamaServerError as exc:
            log.warning("purge: slot %d not erased: %s", record.id, exc)
            table.forget(record.id)
            busy += 1
        finally:
            lease.release()
    return erased, busy


async def purge_here(engine: KVEngine, scope: Scope) -> LocalPurge:
    """Drop ``scope`` from this node: its tiers, its idle slots, the kept restore files."""
    store = engine.store
    values = 0
    for ns in scope.namespaces:
        values += await store.purge_local(prefix=purge.namespace_keys_prefix(ns))
    if scope.keys:
        values += await store.purge_local(keys=scope.keys)
    erased = busy = 0
    if scope.slots is not None:
        erased, busy = await erase_slots(engine, scope.slots)
    await engine.files.drop_kept()  # restore files of earlier restores: written again when needed
    return LocalPurge(values, erased, busy)


def _namespace_match(engine: KVEngine, ids: tuple[str, ...]) -> SlotMatch:
    def match(tokens: np.ndarray, owner: str) -> bool:
        target = engine.target
        return purge.ALL in ids or (target is not None and target.namespace_for(owner).id in ids)

    return match


# -- the request's scope --------------------------------------------------------------------------

async def _scope(request: web.Request, data: dict[str, Any]) -> Scope:
    engine = request.app[ENGINE]
    given = [f for f in ("all", "namespace", *CONVERSATION_FIELDS) if f in data]
    salt = data.get("salt", "")
    if not isinstance(salt, str) or len(salt) > 256:
        raise ApiError(400, "invalid_request", "salt must be a string of at most 256 characters")
    if len(given) > 1 or (not given and "salt" not in data):
        raise ApiError(400, "invalid_request", "give one of all, namespace, salt, session, tokens, prompt, messages "
                                               "(salt may come with a conversation)")
    if given[:1] == ["all"]:
        if data["all"] is not True or "salt" in data:
            raise ApiError(400, "invalid_request", "all must be true, and comes alone")
        return Scope("all", (purge.ALL,), slots=_namespace_match(engine, (purge.ALL,)))
    if given[:1] == ["namespace"]:
        if "salt" in data:
            raise ApiError(400, "invalid_request", "namespace comes alone (a tenant is its salt)")
        try:
            ns_id = purge.validate_namespace_id(data["namespace"])
        except ValueError as exc:
            raise ApiError(400, "invalid_request", str(exc)) from None
        return Scope("namespace", (ns_id,), slots=_namespace_match(engine, (ns_id,)))
    if not given:
        if not salt:
            raise ApiError(400, "invalid_request", "salt must name a tenant (not be empty); "
                                                   "the unsalted namespace is a model's: purge it by its id")
        ids = tuple(sorted({m.salted(salt).id for m in await _models(_redis(request), engine)}))
        if not ids:
            raise ApiError(503, "unavailable", "no model is known yet: llama-server is not ready and Redis "
                                               "records none")
        return Scope("tenant", ids, slots=lambda tokens, owner: owner == salt)
    return await _conversation(request, engine, given[0], data, salt)


async def _conversation(request: web.Request, engine: KVEngine, field: str, data: dict[str, Any],
                        salt: str) -> Scope:
    if not await engine.ensure_ready() or engine.target is None:
        raise ApiError(503, "unavailable", f"llama-server is not ready: {engine.last_error}")
    ns = engine.target.namespace_for(salt)
    extra: list[bytes] = []
    if field == "session":
        tokens, extra = await _session(engine, ns, data["session"])
    elif field == "tokens":
        tokens = _tokens(data["tokens"])
    else:
        kind, body = ("completion", {"prompt": data[field]}) if field == "prompt" else ("chat", {"messages": data[field]})
        if not isinstance(data[field], str if field == "prompt" else list):
            raise ApiError(400, "invalid_request", f"{field} must be {'a string' if field == 'prompt' else 'a list'}")
        try:
            prompt = await engine.prompts.prompt_for(kind, body)
        except LlamaServerError as exc:
            raise ApiError(400, "invalid_request", f"llama-server could not read the {field}: {exc}") from None
        if prompt is None:
            raise ApiError(400, "invalid_request", f"{field} cannot be turned into tokens (media, or not plain text)")
        tokens = prompt.tokens
    tokens = _as_held(engine, tokens, salt)
    keys = (*extra, *purge.conversation_keys(ns, tokens))
    first = min(ns.chunk_tokens, int(tokens.size))
    return Scope("conversation", keys=keys, conversation_ns=ns.id,
                 slots=lambda held, owner: owner == salt and first > 0 and common_prefix(held, tokens) >= first)


async def _session(engine: KVEngine, ns: Namespace, session_id: object) -> tuple[np.ndarray, list[bytes]]:
    """A session's tokens and tail key; its manifest is deleted here (404 when there is none)."""
    if not isinstance(session_id, str):
        raise ApiError(400, "invalid_request", "session must be a session id")
    try:
        manifest = await engine.sessions.load(ns, session_id)
    except ValueError as exc:
        raise ApiError(400, "invalid_request", str(exc)) from None
    except SessionDamaged:
        await engine.sessions.delete(ns, session_id)
        return np.zeros(0, np.int32), []
    extra = [session_tail_key(ns, session_id, bytes.fromhex(manifest.tail_hash))] if manifest.tail_hash else []
    if not await engine.sessions.delete(ns, session_id):
        raise SessionNotFound(f"no session {session_id!r}")
    return manifest.tokens, extra


def _as_held(engine: KVEngine, tokens: np.ndarray, salt: str) -> np.ndarray:
    """The longest tokens a slot of the tenant holds that continue ``tokens``: what was saved
    after a prompt holds its answer too, and the tail stored then is keyed by all of it."""
    table = engine.slots
    for record in table.slots if table is not None else ():
        held = record.tokens
        if record.owner == salt and held.size > tokens.size and common_prefix(held, tokens) == tokens.size:
            tokens = held.copy()
    return tokens


def _tokens(value: object) -> np.ndarray:
    if not isinstance(value, list) or not value or len(value) > MAX_TOKENS \
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ApiError(400, "invalid_request", f"tokens must be a list of 1..{MAX_TOKENS} token ids")
    try:
        return as_token_array(value)
    except ValueError as exc:
        raise ApiError(400, "invalid_request", str(exc)) from None


# -- the handlers ---------------------------------------------------------------------------------

@sessions_errors
async def cache_usage(request: web.Request) -> web.Response:
    """``GET /v1/cache[?namespace=id]``."""
    engine = request.app[ENGINE]
    conn = _redis(request)
    ns = request.query.get("namespace") or None
    try:
        listed = await purge.usage(conn, ns) if conn is not None else []
    except ValueError as exc:
        raise ApiError(400, "invalid_request", str(exc)) from None
    target = engine.target
    local = {t.name: {"entries": st.entries, "bytes": st.bytes_used}
             for t in request.app[STORE].tiers if t.role is not TierRole.REMOTE for st in [t.stats()]}
    return web.json_response({
        "shared": conn is not None, "namespaces": [u.public() for u in listed],
        "this_node": {"namespace": target.namespace.id if target is not None else None, "tiers": local},
    })


@sessions_errors
async def cache_purge(request: web.Request) -> web.Response:
    """``POST /v1/cache/purge``."""
    data = await read_json_object(request, MAX_BODY, FIELDS)
    engine = request.app[ENGINE]
    scope = await _scope(request, data)
    conn = _redis(request)
    await engine.store.flush(FLUSH_TIMEOUT_S)  # what this node queued lands first, so the purge takes it
    here = await purge_here(engine, scope)
    redis_keys = 0
    if conn is not None:
        try:
            for ns in scope.namespaces:
                redis_keys += await purge.purge_namespace(conn, ns)
            if scope.keys:
                redis_keys += await purge.purge_keys(conn, scope.keys)
            await announce(request.app[EVENTS], await _models(conn, engine), scope)
        except KVTierError as exc:
            raise ApiError(503, "unavailable", f"purged on this node only; Redis: {exc}") from None
    namespaces = list(scope.namespaces or (scope.conversation_ns,))
    log.warning("cache purge (%s) of %s: %d Redis keys, %d local values, %d slots erased", scope.kind,
                ", ".join(namespaces), redis_keys, here.values, here.slots_erased)
    return web.json_response({
        "scope": scope.kind, "namespaces": namespaces, "redis_keys_deleted": redis_keys,
        "local_values_deleted": here.values, "slots_erased": here.slots_erased, "slots_busy": here.slots_busy,
        "shared": conn is not None})


async def announce(events: EventBus | None, known: list[purge.ModelRecord], scope: Scope) -> None:
    """Tell every node serving a recorded model: each follows its model's channel."""
    if events is None:
        return
    for model in known:
        channel = events_channel(model.salted())
        for ns in scope.namespaces:
            await events.publish_cache_purged(channel, ns)
        if scope.keys:
            await events.publish_cache_purged(channel, scope.conversation_ns, scope.keys)


# -- other nodes' purges --------------------------------------------------------------------------

async def follow_purges(engine: KVEngine, conn: RedisConnection, events: EventBus) -> None:
    """Keep this node's model recorded (``register_forever``) and drop what other nodes or the
    CLI purge, as their ``cache_purged`` events on the model's channel say."""
    registrar = asyncio.get_running_loop().create_task(register_forever(engine, conn), name="kvtier-model-record")
    try:
        while not await engine.watcher.ensure_ready():  # not a request's wait (kvtier_server_checks_seconds)
            await asyncio.sleep(2)
        target = engine.target
        assert target is not None
        async for event in events.events(events_channel(target.namespace)):
            if event.get("type") == "reconnected":  # Redis may have restarted empty: record the model again
                await _register(conn, target.namespace)
            elif event.get("type") == "cache_purged":
                try:
                    await _drop(engine, event)
                except Exception:  # the next purge must still be followed
                    log.warning("purge announced by %s not applied here", event.get("node"), exc_info=True)
    finally:
        registrar.cancel()


async def register_forever(engine: KVEngine, conn: RedisConnection) -> None:
    """Record the model this node serves (``tiers.purge.register_model``) once it is known, then
    every ``REGISTER_EVERY_S`` (a model that changed, a Redis that lost the record)."""
    while True:
        if not await engine.watcher.ensure_ready() or engine.target is None:
            await asyncio.sleep(2)
            continue
        await asyncio.sleep(REGISTER_EVERY_S if await _register(conn, engine.target.namespace) else 10.0)


async def _register(conn: RedisConnection, namespace: Namespace) -> bool:
    try:
        await purge.register_model(conn, namespace)
    except KVTierError as exc:
        log.info("model record not written (%s); tenants' purges from the CLI need it", exc)
        return False
    return True


async def _drop(engine: KVEngine, event: Event) -> None:
    ns = event.get("namespace")
    keys = event.get("keys")
    try:
        if isinstance(keys, list):
            purge.validate_namespace_id(ns)
            scope = Scope("conversation", keys=tuple(k.encode() for k in keys if isinstance(k, str)))
        else:
            ids = (ns if ns == purge.ALL else purge.validate_namespace_id(ns),)
            scope = Scope("namespace", ids, slots=_namespace_match(engine, ids))
    except ValueError:
        return  # not a purge of ours
    here = await purge_here(engine, scope)
    log.info("purge announced by %s: %d local values, %d slots erased", event.get("node"), here.values,
             here.slots_erased)
