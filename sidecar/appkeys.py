"""Typed application keys shared by the sidecar's modules."""

from __future__ import annotations

from aiohttp import web

from tiers.events import EventBus
from tiers.redis_tier import RedisTier
from tiers.store import TieredStore

from .background import Background
from .config import Settings
from .engine import KVEngine
from .forward import Forwarder
from .http.upstream import Upstream
from .metrics import Metrics

SETTINGS = web.AppKey("settings", Settings)
METRICS = web.AppKey("metrics", Metrics)
UPSTREAM = web.AppKey("upstream", Upstream)  # relays requests to llama-server
STORE = web.AppKey("store", TieredStore)
ENGINE = web.AppKey("engine", KVEngine)
BACKGROUND = web.AppKey("background", Background)  # tasks requests leave running, drained at shutdown
# The Redis chunk tier (ping, breaker state for readiness and metrics), None without Redis.
REDIS: web.AppKey[RedisTier | None] = web.AppKey("redis")
# The event bus on that Redis (purges are announced on it), None without Redis.
EVENTS: web.AppKey[EventBus | None] = web.AppKey("events")
# Cache-aware forwarding and the fleet view; None without Redis, or with neither --advertise-url nor --forward.
FORWARDER: web.AppKey[Forwarder | None] = web.AppKey("forwarder")
