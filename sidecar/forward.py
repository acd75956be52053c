"""Cache-aware forwarding: serve a completion here, or on the peer whose slots hold its prefix hot.

On a completion whose prompt tokens are known, before a slot is taken, ``Forwarder.route`` asks
the fleet view (``sidecar.fleet``) which live peers hold the prompt's prefix in an idle slot, and
the local tiers how much this node could restore, in parallel (one round trip's latency; a request
served here is planned with that lookup, ``planner.EarlyLookup``). The cost model then compares,
in seconds until the prompt is computed:

    here    = local wait + min(recompute what the slot lacks,
                               restore what the tiers hold + recompute the rest)
    at peer = FORWARD_OVERHEAD_S + the peer's wait (its busy slots, queue, and what this node
              already sent it) + recompute what its slot lacks

each recompute at the prefill rate this node measured beside as many computing slots as that node
has now (``CostModel.prefill_rate``): llama-server batches its slots' work together, so on a CPU
a peer computing two other prompts prefills at about half an idle one's rate, and a restore on
an idle node may win; where the rates barely differ (a GPU's short batches) the hot peer wins.

and forwards when the peer is sooner by at least ``FORWARD_MIN_GAIN_S``. The gain is absolute,
not a ratio: the suffix both nodes compute is the same, and on slow hardware it would hide a
restore's cost in any ratio. A peer's wait counts its queue, so hot conversations do not pile onto
one node: a busy peer loses to a restore here.

A request is forwarded at most once: the forwarded copy carries ``X-KVTier-Forwarded`` and is
always served where it lands. It goes with the client's headers and body as they came (auth,
``X-KVTier-Salt``, ``cache_salt``, ``X-Session-Id``): the peer applies its own rules, exactly as if
the client had sent it there. Its answer streams back unchanged. A peer that cannot be reached,
answers with anything but 2xx, or drops out of the fleet view before its answer starts, leaves the
request to this node (never an error); once the peer's answer has started, it is relayed to the end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
import numpy as np
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, Counter, Histogram

from integrations.kvflow import find_prefix, restorable_tokens
from tiers.errors import KVTierError
from tiers.keys import Namespace, common_prefix, prefix_chain
from tiers.redis_conn import request_deadline
from tiers.store import TieredStore

from .costmodel import CostModel
from .fleet import Fleet, PeerHeat, local_wait_s, sharing
from .http.headers import FORWARDED, FORWARDED_TO, REQUEST_ID, end_to_end
from .http.relay import PeerAnswer, Relay, relay
from .logs import request_id
from .metrics import LATENCY_BUCKETS
from .planner import EarlyLookup, redis_wait_s
from .watcher import Target

log = logging.getLogger("kvtier.forward")

FORWARD_OVERHEAD_S = 0.005  # one more HTTP hop between sidecars (a LAN round trip and a relay)
FORWARD_MIN_GAIN_S = 0.010  # forward only when the peer is predicted at least this much sooner
LIVENESS_CHECK_S = 1.0  # while waiting for a peer's answer to start, how often its entry is checked


class ForwardMetrics:
    """The routing decisions, on the sidecar's registry."""

    def __init__(self, registry: CollectorRegistry):
        self.decisions = Counter(
            "kvtier_route_decisions", "Completions by where they were served: forwarded (to a peer holding "
            "their prefix hot), served_here, fallback (a peer failed or timed out; served here)",
            ["decision"], registry=registry)
        self.received = Counter("kvtier_route_forwarded_in", "Completions peers forwarded to this node",
                                registry=registry)
        self.bytes_not_moved = Counter(
            "kvtier_route_bytes_not_moved", "KV bytes a restore here would have read, not read because the "
            "request was forwarded to the peer holding them", registry=registry)
        self.fallback_seconds = Histogram(
            "kvtier_route_fallback_seconds", "Time a failed forward cost before the request was served here",
            buckets=LATENCY_BUCKETS, registry=registry)
        self.failures = Counter("kvtier_route_forward_failures", "Forwards that fell back to serving here, by "
                                "reason: connect, status, gone (left the fleet view), timeout (no answer within "
                                "--forward-first-byte-timeout, or the answer past --forward-total-timeout), error",
                                ["reason"],
                                registry=registry)


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request goes, and why."""

    peer: PeerHeat | None  # None: serve here
    here_s: float
    peer_s: float
    here_restores: int  # tokens a restore here would bring (0: recompute or the slot holds them)
    bytes_not_moved: int  # what that restore would have read, when forwarded


def choose_route(n_tokens: int, here_cached: int, found_tokens: int, found_bytes: dict[str, int],
                 peers: list[PeerHeat], cost: CostModel, *, local_wait: float = 0.0, local_sharing: int = 0,
                 in_flight: Mapping[str, int] | None = None) -> Route:
    """Serve here (restore or recompute, the planner decides as ever) or forward to one peer.

    Args:
        n_tokens: the prompt's tokens.
        here_cached: what this node's best idle slot already holds of it.
        found_tokens, found_bytes: what the local tiers hold of it, and the bytes per tier.
        peers: live peers holding some of it hot (``Fleet.lookup``).
        local_wait: seconds until a slot is free here.
        local_sharing: requests the prompt would be computed beside here (``fleet.sharing``).
        in_flight: requests already forwarded to each peer and not answered.
    """
    here_restores = 0
    here_s = cost.recompute_s(n_tokens - here_cached, local_sharing)
    gain = found_tokens - here_cached
    if gain > 0:
        decision = cost.decide(gain, found_bytes)
        if decision.restore:
            here_restores = gain
            here_s = decision.predicted_restore_s + cost.recompute_s(n_tokens - found_tokens, local_sharing)
    here_s += local_wait
    best: PeerHeat | None = None
    best_s = float("inf")
    for peer in peers:
        if peer.hot_tokens <= here_cached:
            continue
        extra = (in_flight or {}).get(peer.status.node, 0)
        # Nodes alike: this node's rates stand for theirs.
        peer_s = FORWARD_OVERHEAD_S + peer.status.wait_s(extra) + \
            cost.recompute_s(n_tokens - peer.hot_tokens, peer.status.sharing(extra))
        if peer_s < best_s:
            best, best_s = peer, peer_s
    if best is None or best_s + FORWARD_MIN_GAIN_S > here_s:
        return Route(None, here_s, best_s, here_restores, 0)
    not_moved = sum(found_bytes.values()) if here_restores else 0
    return Route(best, here_s, best_s, here_restores, not_moved)


class Forwarder:
    """Routes completions between this sidecar and its peers; owns the HTTP client to them."""

    def __init__(self, fleet: Fleet, store: TieredStore, cost: CostModel, metrics: ForwardMetrics, *,
                 enabled: bool, connect_timeout: float, first_byte_timeout: float = 120.0,
                 total_timeout: float = 600.0):
        self.fleet = fleet
        self.store = store
        self.cost = cost
        self.metrics = metrics
        self.enabled = enabled
        self.first_byte_timeout = first_byte_timeout
        # total: the whole exchange, the answer's last byte included (aiohttp's timer runs on
        # through the body): a peer that trickles an answer forever is cut off.
        self.session = aiohttp.ClientSession(
            cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=total_timeout, sock_connect=connect_timeout, connect=connect_timeout))

    async def aclose(self) -> None:
        await self.session.close()

    def received(self, headers: Mapping[str, str]) -> bool:
        """Whether a peer forwarded this request here (counted): such a request is served here,
        never sent on."""
        if FORWARDED not in headers:
            return False
        self.metrics.received.inc()
        return True

    async def route(self, target: Target, namespace: Namespace, tokens: np.ndarray, here_cached: int,
                    local_wait: float, local_sharing: int = 0) -> tuple[Route | None, EarlyLookup | None]:
        """Where a request for ``tokens`` (this tenant's ``namespace``) is best served (None when
        no peer holds more of it than this node's slot, or the view cannot be read), and what the
        local tiers hold of it (the planner's lookup, when it is served here)."""
        if not self.fleet.peers:
            return None, None  # nobody to forward to: no lookup at all
        C = namespace.chunk_tokens
        limit = restorable_tokens(int(tokens.size), target.n_ctx_slot)
        chain = prefix_chain(namespace, tokens, limit // C)
        at = time.perf_counter()
        try:  # no longer than recomputing here would take: a hung Redis
            with request_deadline(redis_wait_s(self.cost, int(tokens.size) - here_cached, local_sharing)):
                peers, found = await asyncio.gather(
                    self.fleet.lookup(namespace, tokens[:limit], chain),
                    find_prefix(self.store, namespace, tokens, target.shape))
        except KVTierError as exc:
            log.debug("fleet view not read: %s", exc)
            return None, None
        early = EarlyLookup(namespace, found, at)
        peers = [PeerHeat(p.status, min(p.hot_tokens, limit)) for p in peers]
        if not any(p.hot_tokens > here_cached for p in peers):
            return None, early
        return choose_route(int(tokens.size), here_cached, found.n_tokens,
                            found.bytes_by_tier(C, target.bytes_per_token), peers, self.cost,
                            local_wait=local_wait, local_sharing=local_sharing, in_flight=self.fleet.in_flight), early

    async def forward(self, request: web.Request, raw: bytes, route: Route) -> web.StreamResponse | None:
        """Send the request to ``route.peer`` and relay its answer; None when this node must serve
        it (the peer failed before its answer started; counted)."""
        assert route.peer is not None
        peer = route.peer.status
        headers = CIMultiDict(end_to_end(request.headers.items()))
        headers[FORWARDED] = self.fleet.node_id
        if request_id.get():
            headers[REQUEST_ID] = request_id.get()  # one id in both nodes' logs
        url = peer.peer_url.forward_url(request.raw_path)  # from checked parts, never by joining strings
        with self.fleet.sending(peer.node):
            upstream = await self._answer_start(url, headers, raw, peer.node)
            if upstream is None:
                return None
            if not 200 <= upstream.status < 300:
                self.metrics.failures.labels("status").inc()
                log.warning("peer %s answered %d; serving here", peer.node, upstream.status)
                upstream.release()
                return None
            self.metrics.decisions.labels("forwarded").inc()
            self.metrics.bytes_not_moved.inc(route.bytes_not_moved)
            log.info("forwarded to %s (%d tokens hot there; predicted %.0f ms vs %.0f ms here)", peer.node,
                     route.peer.hot_tokens, route.peer_s * 1e3, route.here_s * 1e3)
            return await self._relay(request, upstream, peer.node)

    async def _answer_start(self, url: str, headers: CIMultiDict[str], raw: bytes,
                            node: str) -> aiohttp.ClientResponse | None:
        """The peer's response once its status and headers arrived; None (counted) when the peer
        cannot be reached, leaves the fleet view (its status stops being renewed) or does not
        start its answer within ``first_byte_timeout`` seconds."""
        async def send() -> aiohttp.ClientResponse:
            return await self.session.post(url, data=raw, headers=headers, allow_redirects=False)

        sending = asyncio.ensure_future(send())
        deadline = time.monotonic() + self.first_byte_timeout
        try:
            while True:
                left = deadline - time.monotonic()
                done, _ = await asyncio.wait({sending}, timeout=max(min(LIVENESS_CHECK_S, left), 0))
                if done:
                    return sending.result()
                if left <= LIVENESS_CHECK_S:
                    _too_late(sending)
                    self.metrics.failures.labels("timeout").inc()
                    log.warning("peer %s did not start its answer within %.0f s; serving here", node,
                                self.first_byte_timeout)
                    return None
                if not await self.fleet.alive(node):
                    _too_late(sending)
                    self.metrics.failures.labels("gone").inc()
                    log.warning("peer %s left the fleet view before answering; serving here", node)
                    return None
        except (aiohttp.ClientConnectionError, TimeoutError, OSError) as exc:
            self.metrics.failures.labels("connect").inc()
            log.warning("peer %s unreachable (%s); serving here", node, exc or type(exc).__name__)
            return None
        except aiohttp.ClientError as exc:
            self.metrics.failures.labels("error").inc()
            log.warning("peer %s failed (%s); serving here", node, exc)
            return None
        finally:
            if not sending.done():
                sending.cancel()  # closes the connection: the peer drops the request

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, node: str) -> web.StreamResponse:
        """Stream the peer's answer back as it came (status, headers, bytes)."""
        try:
            return await relay(request, PeerAnswer(upstream), Relay(), headers={FORWARDED_TO: node}, keep_length=True)
        except (aiohttp.ClientError, TimeoutError) as exc:
            # Cut short by the peer, or past the total timeout, after its answer started: the
            # client's connection is closed too.
            if isinstance(exc, TimeoutError):
                self.metrics.failures.labels("timeout").inc()
            log.warning("peer %s's answer broke off: %s", node, exc or type(exc).__name__)
            raise


def _too_late(sending: asyncio.Future[aiohttp.ClientResponse]) -> None:
    """The peer's answer started just as this node gave up on it: the request is this node's now."""
    if sending.done() and not sending.cancelled() and sending.exception() is None:
        sending.result().close()


def here_cached(target: Target, tokens: np.ndarray, salt: str, slots: list[tuple[np.ndarray, str, bool]]) -> int:
    """What this node's best idle slot of the tenant ``salt`` holds of ``tokens`` (as the slot
    table would choose); ``slots`` are (tokens, owner, idle)."""
    best = 0
    for held, owner, idle in slots:
        if idle and owner == salt:
            best = max(best, common_prefix(held, tokens))
    return min(best, restorable_tokens(int(tokens.size), target.n_ctx_slot))


async def route_or_none(forwarder: Forwarder, request: web.Request, raw: bytes, tokens: np.ndarray,
                        salt: str) -> tuple[web.StreamResponse | None, EarlyLookup | None]:
    """The peer's answer when the request for ``tokens`` (tenant ``salt``) is better served
    there; None: serve it here, with what the local tiers hold of it when they were looked up."""
    target, table = forwarder.fleet.watcher.target, forwarder.fleet.watcher.slots
    if target is None or table is None:
        return None, None
    namespace = target.namespace_for(salt)
    t0 = time.perf_counter()
    cached = here_cached(target, tokens, salt, [(*s.hot(), not s.busy or s.saving) for s in table.slots])
    route, early = await forwarder.route(target, namespace, tokens, cached,
                                         local_wait_s(table, forwarder.fleet.service_s.value),
                                         sharing(table.computing, table.n_slots))
    if route is None or route.peer is None:
        forwarder.metrics.decisions.labels("served_here").inc()
        if route is not None:
            log.info("serving here: predicted %.0f ms, against %.0f ms at the best peer", route.here_s * 1e3,
                     route.peer_s * 1e3)
        return None, early
    log.debug("route decided in %.1f ms", (time.perf_counter() - t0) * 1e3)
    t1 = time.perf_counter()
    answer = await forwarder.forward(request, raw, route)
    if answer is None:
        forwarder.metrics.decisions.labels("fallback").inc()
        forwarder.metrics.fallback_seconds.observe(time.perf_counter() - t1)
    return answer, early
