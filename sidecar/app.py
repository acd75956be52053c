"""``create_app(settings)``: the sidecar as an aiohttp application."""

from __future__ import annotations

import asyncio
import gc
import glob
import json
import logging
import os
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from integrations.flows import pending_of, sessions_of
from integrations.llama_server import KEEPALIVE_S, LlamaServerClient
from tiers import stack
from tiers.codec import BlobCodec
from tiers.pace import PACE, tell_busy
from tiers.redis_backend import RedisBackend
from tiers.store import TieredStore

from .appkeys import BACKGROUND, ENGINE, EVENTS, FORWARDER, METRICS, REDIS, SETTINGS, STORE, UPSTREAM
from .background import Background
from .cache_admin import follow_purges
from .config import Settings
from .engine import KVEngine
from .fleet import Fleet
from .forward import Forwarder, ForwardMetrics
from .http.upstream import Upstream
from .http.witness import Witness
from .logs import MalformedRequestFilter
from .metrics import Metrics, watch_loop_lag
from .middlewares import front_middleware
from .prewarm import prewarm_forever
from .routes import auth_policy, route_defs

log = logging.getLogger("kvtier.app")

# What aiohttp's request handler logs (requests it cannot parse, handlers that fail past the
# middlewares): malformed requests as one line, not an ERROR with a traceback.
HTTP_LOG = logging.getLogger("kvtier.http")
HTTP_LOG.addFilter(MalformedRequestFilter())

HEALTH_INTERVAL_S = 2.0
SERVER_OPTIONS = {
    # A client that goes away cancels its handler: a request waiting for a slot leaves the queue,
    # a relayed one closes its llama-server connection (llama-server stops a streamed generation).
    "handler_cancellation": True,
    # After an answer given before the whole body arrived (408, 413, 401), aiohttp reads and drops
    # the rest for at most this long, then closes (its default, 10 s, holds a slow sender longer).
    "lingering_time": 2.0,
    "logger": HTTP_LOG,
}


def build_store(settings: Settings) -> tuple[TieredStore, RedisBackend | None]:
    """The tiered store and, with ``redis_url``, the Redis behind its last tier (manifests, events)."""
    codec = BlobCodec(settings.compress, mac_key=settings.chunk_key.encode() if settings.chunk_key else None)
    return stack.build_store(
        codec, settings.cache_size, eviction=settings.eviction, shared_dir=settings.shared_dir,
        shared_bytes=settings.shared_size, redis_url=settings.redis_url, redis_ttl=settings.ttl or None,
        node_id=settings.node_id, queue_limit=settings.queue_limit, window_bytes=settings.stream_window,
        redis_options={"username": settings.redis_username, "password": settings.redis_password},
    )


def _remove_stale_files(slot_dir: str) -> None:
    """Files a crashed kvtier left in the slot dir (only its own, by prefix)."""
    for path in glob.glob(os.path.join(slot_dir, "kvtier-*.bin")):
        try:
            os.unlink(path)
        except OSError:
            pass


async def _resources(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    _remove_stale_files(settings.slot_dir or ".")
    # kvtier's own calls (slot actions, tokenize, props) go through aiohttp; relayed requests
    # through the leaner Upstream (why two pools, and their keep-alives: sidecar/http/upstream.py).
    session = aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=None),
        connector=aiohttp.UnixConnector(settings.llama_socket, keepalive_timeout=KEEPALIVE_S, limit=256)
        if settings.llama_socket is not None else aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S, limit=256),
    )
    upstream = Upstream(settings.llama_url, unix_socket=settings.llama_socket)
    witness = Witness(upstream)
    store, redis = build_store(settings)
    metrics = app[METRICS]
    metrics.attach_store(store)
    metrics.attach_pace(PACE)
    client = LlamaServerClient(settings.llama_url, session, unix_socket=settings.llama_socket)
    engine = KVEngine(settings, client, store, metrics,
                      sessions_of(store, redis), events=redis.events if redis is not None else None,
                      witness=witness.current, pending=pending_of(redis))
    metrics.attach_cost(engine.cost)
    # The table of the moment: the watcher replaces it when llama-server restarts.
    metrics.attach_queue(lambda: engine.slots.queue_depth if engine.slots is not None else 0)
    app[UPSTREAM] = upstream
    app[STORE] = store
    app[REDIS] = redis.tier if redis is not None else None
    app[EVENTS] = redis.events if redis is not None else None
    app[ENGINE] = engine
    loop = asyncio.get_running_loop()
    # The witness first: the first probe takes the chain that was open before it began.
    tasks = [loop.create_task(witness.keep_forever(), name="kvtier-witness"),
             loop.create_task(engine.watcher.watch_forever(HEALTH_INTERVAL_S), name="kvtier-health"),
             loop.create_task(watch_loop_lag(metrics.loop_lag_seconds), name="kvtier-loop-lag")]
    if redis is not None:  # purges done elsewhere (another node, the CLI) reach this node's tiers
        tasks.append(loop.create_task(follow_purges(engine, redis.connection, redis.events), name="kvtier-purges"))
    if settings.prewarm and redis is not None:
        tasks.append(loop.create_task(prewarm_forever(engine.watcher, redis.events, store, metrics),
                                      name="kvtier-prewarm"))
    # The save's work keeps to its share of a core while requests compute (``--save-cpu-share``);
    # no longer once shutdown begins, so that the last saves drain at full speed.
    stop_telling = tell_busy(lambda: engine.slots is not None and engine.slots.computing > 0)
    try:
        yield
    finally:
        stop_telling()
        for task in tasks:
            task.cancel()
        if not await app[BACKGROUND].drain(settings.shutdown_timeout):
            log.warning("shutdown: background tasks did not finish in %.0fs", settings.shutdown_timeout)
        drained = await engine.drain(settings.shutdown_timeout)
        if not drained:
            log.warning("shutdown: pending slot saves did not finish in %.0fs", settings.shutdown_timeout)
        engine.prompts.close()
        engine.files.remove_kept()
        await store.aclose(drain_timeout=settings.shutdown_timeout)
        upstream.close()
        await session.close()


async def fleet_resources(app: web.Application) -> AsyncIterator[None]:
    """The fleet heartbeat and the forwarder (``cleanup_ctx``), with Redis and either
    ``--advertise-url`` or ``--forward``; nothing otherwise."""
    settings, redis = app[SETTINGS], app[REDIS]
    if redis is None or not (settings.advertise_url or settings.forward):
        yield
        return
    engine = app[ENGINE]
    fleet = Fleet(redis.connection, settings.node_id, settings.advertise_url, engine.watcher,
                  mac_key=settings.chunk_key.encode() if settings.chunk_key else None, read_peers=settings.forward)
    forwarder = Forwarder(fleet, engine.store, engine.cost, ForwardMetrics(app[METRICS].registry),
                          enabled=settings.forward, connect_timeout=settings.forward_timeout,
                          first_byte_timeout=settings.forward_first_byte_timeout,
                          total_timeout=settings.forward_total_timeout)
    app[FORWARDER] = forwarder
    heartbeat = asyncio.get_running_loop().create_task(fleet.run_forever(), name="kvtier-fleet")
    try:
        yield
    finally:
        heartbeat.cancel()
        await fleet.withdraw()
        await forwarder.aclose()


def create_app(settings: Settings) -> web.Application:
    """The sidecar: KV flow on completion routes, health/metrics, everything else passed through."""
    auth = auth_policy(settings.auth_token, settings.auth_all, allow_slot_actions=settings.allow_slot_actions)
    app = web.Application(middlewares=[front_middleware(auth)], client_max_size=settings.max_body,
                          handler_args=SERVER_OPTIONS)
    app[SETTINGS] = settings
    app[METRICS] = Metrics()
    app[BACKGROUND] = Background()
    app.cleanup_ctx.append(_resources)
    app[FORWARDER] = None
    app.cleanup_ctx.append(fleet_resources)  # after _resources: it needs the engine and Redis
    app.add_routes(route_defs())
    return app


def run(settings: Settings) -> None:
    host, port = settings.host_port
    # What start-up created (modules, classes, the app: ~2/3 of the objects a serving process
    # tracks) lives as long as the process; frozen, full collections (29 ms pauses seen
    # mid-request) no longer scan it.
    gc.collect()
    gc.freeze()
    web.run_app(create_app(settings), host=host, port=port, shutdown_timeout=settings.shutdown_timeout,
                access_log=None, print=None, loop=new_event_loop())


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (a dependency on Linux: every proxied request is two HTTP
    exchanges, and uvloop's are cheaper), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def effective_config(settings: Settings) -> str:
    return json.dumps(settings.redacted(), sort_keys=True)
