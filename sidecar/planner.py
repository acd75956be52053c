"""Restore or recompute: what the tiers hold of a prompt, and whether fetching it beats computing it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from integrations.flows import find_prefix_waiting
from integrations.kvflow import PrefixFound, restorable_tokens
from integrations.llama_server import Timings, prefix_reused
from integrations.memkind import MemoryKind
from integrations.pendingflow import PendingSave, Waited, wait_for_pending
from tiers.base import TierRole
from tiers.keys import Namespace, common_prefix
from tiers.pending import PendingSaves
from tiers.redis_conn import deadline_past
from tiers.sessions import Manifest, SessionNotFound, SessionStore
from tiers.store import LookupResult, TieredStore

from .costmodel import CostModel
from .metrics import Metrics
from .watcher import Target

log = logging.getLogger("kvtier.engine")

NOTHING_FOUND = PrefixFound(LookupResult(0, [], []), None)  # what a lookup of no stored chunk finds
WASTED_LIMIT = 3  # restores in a row llama-server throws away before restores stop for that layout
# How old a lookup made before the slot was taken (the route check) may be and still be planned
# with. Older (the request waited for a slot), a save may have landed and cleared its marks since.
EARLY_LOOKUP_S = 0.05


def redis_wait_s(cost: CostModel, tokens: int, sharing: int = 0) -> float:
    """How long a request that would compute ``tokens`` may wait for Redis, all its lookups and its
    restore together (``redis_conn.request_deadline``; the forwarding check's lookups alike): past
    recomputing them, no restore pays, and a hung server's timeouts and retries would cost seconds."""
    return deadline_past(cost.recompute_s(max(0, tokens), sharing))


@dataclass(frozen=True, slots=True)
class EarlyLookup:
    """What the tiers held of a prompt when the route check looked, before a slot was taken."""

    namespace: Namespace
    found: PrefixFound
    at: float  # time.perf_counter() of the lookup

    def fresh_for(self, namespace: Namespace) -> PrefixFound | None:
        """The lookup, when it was of ``namespace`` and is recent enough to plan with."""
        if self.namespace != namespace or time.perf_counter() - self.at > EARLY_LOOKUP_S:
            return None
        return self.found


class WaitBudget:
    """The time one request may still spend waiting for other nodes' saves, all its waits
    together: a session's and then its prefix's lookup wait at most ``--save-wait`` in all.
    ``ended``: a save one of them waited for has ended (what it stored is readable now)."""

    __slots__ = ("ended", "left")

    def __init__(self, seconds: float):
        self.left = max(0.0, seconds)
        self.ended = False

    def spend(self, seconds: float, *, ended: bool = False) -> None:
        self.left = max(0.0, self.left - seconds)
        self.ended = self.ended or ended


class RestorePlanner:
    """Looks up the longest stored prefix of a prompt and asks the cost model whether to restore it."""

    def __init__(self, store: TieredStore, cost: CostModel, metrics: Metrics, *,
                 pending: PendingSaves | None = None, save_wait: float = 0.0):
        self.store = store
        self.cost = cost
        self.metrics = metrics
        self.pending = pending  # markers of other nodes' saves in flight (Redis), or None
        self.save_wait = save_wait  # the longest wait for one (settings.save_wait)
        self._wasted: dict[str, int] = {}  # restores in a row llama-server threw away, by memory layout
        self.off: set[str] = set()  # layouts restores are off for, until kvtier restarts

    async def plan(self, namespace: Namespace, tokens: np.ndarray, cached: int, target: Target,
                   slot: int, early: EarlyLookup | None = None, budget: WaitBudget | None = None,
                   sharing: int = 0) -> PrefixFound | None:
        """The prefix worth restoring into a slot that holds ``cached`` tokens of ``tokens``, or None.
        ``early``: the route check's lookup of the same tokens, planned with while it is fresh.
        ``budget``: what the request may still wait for saves in flight (default: ``save_wait``).
        ``sharing``: other slots computing (a restore waits behind their batches; ``CostModel``)."""
        C = namespace.chunk_tokens
        if target.memory_kind in self.off:
            return None
        limit = restorable_tokens(int(tokens.size), target.n_ctx_slot)
        # The slot holds every full chunk a restore could bring; a whole state (a rest in its
        # tail) may be shorter than a chunk, so for those only the whole restorable length counts.
        if (limit if target.memory_kind.has_rest else limit // C * C) <= cached:
            return None
        if not self.cost.could_restore(limit - cached, limit, target.bytes_per_token):
            # No prefix the tiers could hold would be restored: spare the lookup's round trips to
            # Redis (a conversation's next turn in the slot that holds it, the common case).
            self.metrics.decisions.labels("spared").inc()
            return None
        budget = budget if budget is not None else WaitBudget(self.save_wait)
        after = await find_prefix_waiting(
            self.store, self.pending if budget.left > 0 else None, namespace, tokens, target.shape, have=cached,
            limit=lambda save, have: self._wait_bound(save, have, target, slot, budget.left),
            found=early.fresh_for(namespace) if early is not None else None)
        found = after.found
        if after.waited is not None:
            self._waited(after.waited, slot, budget)
            if after.waited.ended:
                self.waited_for(after.before, found.n_tokens)
        gain = found.n_tokens - cached
        if gain <= 0:
            return None
        if not self._decide(gain, found.bytes_by_tier(C, target.bytes_per_token), slot, sharing):
            return None
        return found

    async def wait_for_save(self, namespace: Namespace, tokens: np.ndarray, found: PrefixFound, have: int,
                            target: Target, slot: int, budget: WaitBudget | None = None) -> bool | None:
        """When another node is saving more of ``tokens`` than ``have`` (what the tiers or a
        session hold, or the slot), wait for that save while waiting beats computing the
        difference, at most what is left of ``budget`` (default: ``save_wait``), which the wait
        spends. None when there was nothing to wait for; True when the
        save ended, False when the wait timed out (look up again either way: part of it may be
        stored). A save whose node died ends the wait when its marks expire.

        ``found`` is what a lookup of ``tokens`` found: only the marks past it are read.
        """
        budget = budget if budget is not None else WaitBudget(self.save_wait)
        if self.pending is None or budget.left <= 0:
            return None
        waited = await wait_for_pending(self.pending, namespace, tokens, found, have,
                                        lambda save: self._wait_bound(save, have, target, slot, budget.left),
                                        n_ctx=target.n_ctx_slot)
        if waited is None:
            return None
        self._waited(waited, slot, budget)
        return waited.ended

    def _waited(self, waited: Waited, slot: int, budget: WaitBudget) -> None:
        """Spend a wait's time from ``budget``; count and log it."""
        budget.spend(waited.seconds, ended=waited.ended)
        self.metrics.save_wait_seconds.observe(waited.seconds)
        if not waited.ended:
            self.metrics.save_waits.labels("timeout").inc()
        log.info("slot %d: waited %.0f ms for %s's save of %d tokens (%s)", slot, waited.seconds * 1e3,
                 waited.save.mark.node or "another node", waited.save.mark.covers,
                 "it ended" if waited.ended else "timeout")

    def waited_for(self, before: int, after: int) -> None:
        """Count what a wait that ended brought: more than ``before`` tokens (landed) or not (failed)."""
        self.metrics.save_waits.labels("landed" if after > before else "failed").inc()

    def _wait_bound(self, save: PendingSave, have: int, target: Target, slot: int, left: float) -> float:
        """Seconds a wait for ``save`` may last and still beat recomputing what it would add, at
        most ``left`` (of the request's ``save_wait``); 0 (no wait) when its node expects it to land later than that: such a
        wait could only time out, adding its length to the turn (counted as ``skipped``)."""
        gain = save.n_tokens - have
        remote = [t.name for t in self.store.tiers if t.role is TierRole.REMOTE]
        tier = remote[0] if remote else self.store.tiers[-1].name
        decision = self.cost.decide(gain, {tier: gain * target.bytes_per_token})
        bound = min(left, decision.predicted_recompute_s - decision.predicted_restore_s)
        if save.mark.ready_at:
            expected: float | None = save.mark.ready_at - time.time()
        else:  # its node has no estimate yet: this node's own, as if the save had just begun
            expected = self.cost.expected_readable(save.mark.covers)
        if bound > 0 and expected is not None and expected > bound:
            self.metrics.save_waits.labels("skipped").inc()
            log.info("slot %d: not waiting for %s's save of %d tokens: expected in %.0f ms, recomputing %d tokens "
                     "is faster (%.0f ms)", slot, save.mark.node or "another node", save.mark.covers, expected * 1e3,
                     gain, bound * 1e3)
            return 0.0
        return bound

    async def find_session(self, sessions: SessionStore, namespace: Namespace, session_id: str, tokens: np.ndarray,
                           cached: int, target: Target, slot: int, budget: WaitBudget | None = None) -> Manifest:
        """Session ``session_id``; when another node is still saving a longer version of it (the
        turn before this one, or its first), after that save, as ``wait_for_save`` bounds it
        (spending ``budget``: a prefix lookup after it waits only for what is left).

        Raises:
            SessionNotFound, KVTierError: as ``SessionStore.load``.
        """
        try:
            manifest: Manifest | None = await sessions.load(namespace, session_id)
        except SessionNotFound:
            manifest = None  # its first save may be the one in flight
        have = int(manifest.tokens.size) if manifest is not None else 0
        ended = await self.wait_for_save(namespace, tokens, NOTHING_FOUND, max(have, cached), target, slot, budget)
        if ended is None and manifest is not None:
            return manifest
        manifest = await sessions.load(namespace, session_id)
        if ended:
            self.waited_for(have, int(manifest.tokens.size))
        return manifest

    def session_worth(self, manifest: Manifest, tokens: np.ndarray, cached: int, target: Target,
                      tier: str, slot: int, sharing: int = 0) -> bool:
        """Whether to restore session ``manifest`` for a prompt: it must be a prefix of ``tokens``,
        longer than what the slot holds, shorter than the prompt, and faster to restore (from
        ``tier``) than to compute."""
        m_tokens = manifest.tokens
        if target.memory_kind in self.off:
            return False
        if not (cached < m_tokens.size < tokens.size and common_prefix(m_tokens, tokens) == m_tokens.size):
            return False
        gain = int(m_tokens.size) - cached
        return self._decide(gain, {tier: gain * target.bytes_per_token}, slot, sharing)

    def learn(self, timings: Timings | None, prompt_tokens: int, expected: int, slot: int, *,
              follow_up: bool = False, restored: int = 0, layout: str = MemoryKind.KV, sharing: int = 0) -> bool:
        """Learn from an answer's timings (the prefill rate, begun beside ``sharing`` other
        computing slots); False when llama-server reused less
        than the ``expected`` tokens (the slot held less than kvtier thought, or it threw a restore
        away), which is counted and logged.

        A restore of ``restored`` tokens llama-server threw away is also counted by memory
        ``layout`` (``kvtier_restores_wasted_total``); after ``WASTED_LIMIT`` in a row, restores
        for that layout stop until kvtier restarts: each one costs its fetch and gives nothing.
        """
        if timings is None:
            return True
        self.metrics.tokens_recomputed.inc(timings.prompt_n)
        if follow_up:  # sent untokenized: what its slot held of it is known only now
            self.metrics.tokens_slot_reused.inc(timings.cache_n)
        self.cost.observe_prefill(timings.prompt_n, timings.prompt_ms, sharing)
        if restored and prefix_reused(timings, prompt_tokens, restored):
            self._wasted[layout] = 0
        elif restored:
            self._waste(layout, restored, timings)
        if not expected or prefix_reused(timings, prompt_tokens, expected):
            return True
        self.metrics.reuse_failures.inc()
        log.warning("slot %d: expected %d tokens reused but the server recomputed %d of %d",
                    slot, expected, timings.prompt_n, prompt_tokens)
        return False

    def _waste(self, layout: str, restored: int, timings: Timings) -> None:
        self.metrics.restores_wasted.labels(layout).inc()
        self._wasted[layout] = n = self._wasted.get(layout, 0) + 1
        if n >= WASTED_LIMIT and layout not in self.off:
            self.off.add(layout)
            log.warning("llama-server threw away %d restores in a row of memory layout %r (the last: %d tokens "
                        "restored, %d recomputed): restoring is off for it until kvtier restarts",
                        n, layout, restored, timings.prompt_n)

    def _decide(self, gain: int, bytes_by_tier: dict[str, int], slot: int, sharing: int) -> bool:
        decision = self.cost.decide(gain, bytes_by_tier, sharing)
        self.metrics.decisions.labels("restore" if decision.restore else "recompute").inc()
        if not decision.restore:
            log.info("slot %d: recompute %d tokens (%s: %.0f ms vs %.0f ms)", slot, gain, decision.reason,
                     decision.predicted_recompute_s * 1e3, decision.predicted_restore_s * 1e3)
        return decision.restore
