"""Automatic mode: the KV flow around one completion request, as the parts it is made of see it.

    prompt tokens (prompts) -> a slot (slots: the table, a lease bound to it)
      -> what the tiers hold and whether to restore it (planner) -> fetch + load into the slot (restorer)
      -> the request is forwarded and answered (proxy)
      -> after the answer: save the slot, store its new chunks and tail, announce them (aftercare, saver)

``ServerWatcher`` (watcher) knows the llama-server behind all of it: slots, KV layout, the model's
identity, and notices when it changes. Every cache step is best-effort: any failure is logged and
counted, and the request goes on as an ordinary recompute (llama-server compares the slot's tokens
with the prompt itself, so a slot that holds less than we hoped only costs time, never correctness).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from integrations.llama_server import LlamaServerClient, LlamaServerError
from tiers.base import TierRole
from tiers.errors import KVTierError
from tiers.events import EventBus
from tiers.keys import Namespace
from tiers.pending import PendingSaves
from tiers.redis_conn import request_deadline
from tiers.sessions import Manifest, SessionNotFound, SessionStore
from tiers.store import TieredStore

from .aftercare import Aftercare
from .asked import FOLLOW_UP_MAX_CHARS, Asked
from .config import Settings
from .costmodel import CostModel
from .metrics import Metrics
from .planner import EarlyLookup, RestorePlanner, WaitBudget, redis_wait_s
from .prompts import Prompt, PromptTokens
from .requestplan import NO_TOKENS, RequestPlan
from .restorer import Restored, RestoreWriter
from .saver import Saver
from .slotfiles import SlotFiles
from .slots import Lease, SlotTable
from .watcher import ServerWatcher, Target, Witness

log = logging.getLogger("kvtier.engine")


def _session_tier(store: TieredStore, sessions: SessionStore) -> str:
    """Where a session's chunks are read from, for the cost model: the remote tier when manifests
    are shared (any node may have saved it), else this node's fastest."""
    remote = [t.name for t in store.tiers if t.role is TierRole.REMOTE]
    return remote[0] if sessions.shared and remote else store.tiers[0].name


class KVEngine:
    """The sidecar's cache: composes the watcher, planner, restorer, saver and aftercare around each request."""

    def __init__(self, settings: Settings, client: LlamaServerClient, store: TieredStore, metrics: Metrics,
                 sessions: SessionStore, *, events: EventBus | None = None,
                 witness: Callable[[], Witness | None] | None = None, pending: PendingSaves | None = None):
        self.settings = settings
        self.client = client
        self.store = store
        self.metrics = metrics
        self.cost = CostModel(settings.prefill_tps_prior, settings.restore_gbps_prior,
                              min_tokens=settings.restore_min_tokens)
        self.files = SlotFiles(client, Path(settings.slot_dir or "."), settings.keep_restore_files,
                               observe_write=self.cost.observe_slot_write)
        self.prompts = PromptTokens(client, metrics, in_process=settings.local_tokenizer != "off")
        self.watcher = ServerWatcher(settings, client, self.files, self.prompts, witness)
        self.sessions = sessions
        self.planner = RestorePlanner(store, self.cost, metrics, pending=pending, save_wait=settings.save_wait)
        self.restorer = RestoreWriter(store, self.sessions, self.files, self.cost, metrics, settings.stream_window)
        self.saver = Saver(store, self.sessions, self.files, metrics, self.cost, node_id=settings.node_id, events=events,
                           pending=pending)
        self.session_slots: dict[str, int] = {}  # session id -> the slot that served it last
        self._session_tier = _session_tier(store, sessions)
        self.aftercare = Aftercare(self.watcher, self.planner, self.saver, store, sessions, self.prompts, metrics,
                                   self.session_slots, settings.save_defer)

    # -- the server, as the watcher knows it ------------------------------------------------------

    @property
    def target(self) -> Target | None:
        return self.watcher.target

    @property
    def slots(self) -> SlotTable | None:
        return self.watcher.slots

    @property
    def ready(self) -> bool:
        return self.watcher.target is not None

    @property
    def last_error(self) -> str:
        return self.watcher.last_error

    async def ensure_ready(self) -> bool:
        if self.watcher.confirmed:
            return True
        t0 = time.perf_counter()
        try:
            return await self.watcher.ensure_ready()
        finally:
            self.metrics.server_checks_seconds.observe(time.perf_counter() - t0)

    # -- before the request -----------------------------------------------------------------------

    async def follow_up(self, body: Mapping[str, Any], asked: Asked, *, want_slot: int | None = None,
                        salt: str = "", since: float | None = None) -> RequestPlan | None:
        """A plan for a request that continues what a slot answered last, or None.

        Such a request (``slots.continues``: a chat with another last message, or with one answer
        and one new message; a text prompt with another end or the same) needs nothing from the
        tiers: they hold no more of it than the slot, unless this very request already ran on
        another node, and then only its short new end (at most ``FOLLOW_UP_MAX_CHARS`` characters,
        cheap to compute). So it goes to that slot as it is, without rendering, tokenizing or a
        lookup. The same request again, or a chat's next turn (the answer and one new message),
        while that slot's save has not read it yet (sent the moment the answer ended: an agent's
        next step), waits for the slot, whose save it then makes needless
        (``SlotTable.await_follow_up``), also when that answer was itself a follow-up's.
        """
        target, table = self.watcher.target, self.watcher.slots
        if table is None or target is None:
            return None
        if isinstance(asked, tuple) and len(body["messages"][-1]["content"]) > FOLLOW_UP_MAX_CHARS:
            return None
        lease = table.follow_up(asked, want=want_slot, owner=salt) \
            or await table.await_follow_up(asked, want=want_slot, owner=salt)
        if lease is None:
            return None
        since_answer = table.since_answer(lease.slot)
        plan = RequestPlan(NO_TOKENS, lease, target.namespace_for(salt), salt, asked=asked, follow_up=True,
                           generation=self.watcher.generation, sharing=lease.sharing,
                           step_gap=None if since_answer is None else max(0.0, since_answer - lease.waited_s))
        self._launched(table, lease.slot, None)
        plan.overhead_ms = (time.perf_counter() - since - lease.waited_s) * 1000 if since is not None else 0.0
        self.metrics.overhead_seconds.observe(plan.overhead_ms / 1000)
        self.metrics.follow_ups.inc()
        return plan

    async def prepare(self, prompt: Prompt, *, want_slot: int | None = None, salt: str = "",
                      timeout: float | None = None, session_id: str | None = None,
                      since: float | None = None, asked: Asked = (), prompt_end: bool = False,
                      early: EarlyLookup | None = None) -> RequestPlan:
        """Take a slot for ``prompt``'s tokens and restore the longest worthwhile prefix into it.

        The slot is released by ``finish`` (after the answer and its save), or here on a failure.

        Args:
            prompt: the request's tokens (what kvtier computed of them is checked after the answer).
            since: ``perf_counter()`` when the request's own work began (counted as overhead).
            salt: the tenant; it salts the namespace and only its own slots count as cached.
            session_id: restore this session first when it is a prefix of ``tokens`` (and save
                the request's result under it afterwards).
            asked: what the request asked (``prompts.asked_of``), remembered with the slot after
                the answer for its follow-ups.
            prompt_end: also save the state at the prompt's end (``--save-prompt-end``), for a
                memory with a rest (``Saver.save_prompt_end``).
            early: the route check's lookup of ``tokens``, planned with while fresh (no second
                round trip to the tiers).
        """
        target, table = self.watcher.target, self.watcher.slots
        if target is None or table is None:
            raise RuntimeError("prepare() before ensure_ready()")
        t0 = time.perf_counter() if since is None else since
        tokens = prompt.tokens
        lease: Lease | None = None
        try:
            lease = await table.acquire(tokens, want=want_slot, timeout=timeout, owner=salt)
            plan = RequestPlan(tokens, lease, target.namespace_for(salt), salt, session_id, prompt, asked=asked,
                               generation=self.watcher.generation, sharing=lease.sharing)
            if session_id is not None:
                self.session_slots[session_id] = lease.slot
            t1 = time.perf_counter()
            await self._restore(plan, target, early)
            self._launched(table, lease.slot, tokens)
            table.computes(lease.slot, self.cost.recompute_s(plan.to_compute, lease.sharing))
            if prompt_end and target.memory_kind.has_rest and tokens.size - max(plan.restored_tokens, lease.cached_tokens) > 1:
                await self.saver.save_prompt_end(table, lease.slot, plan.namespace, tokens, owner=salt)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        plan.overhead_ms = ((t1 - t0) - lease.waited_s + (time.perf_counter() - t1)) * 1000
        self.metrics.overhead_seconds.observe(plan.overhead_ms / 1000)
        self.metrics.tokens_slot_reused.inc(lease.cached_tokens)
        return plan

    def _launched(self, table: SlotTable, slot: int, tokens: np.ndarray | None) -> None:
        """Tell the mirror of llama-server's prompt cache that a completion goes to ``slot``; a
        failure there is counted and turns the mirror off (the request goes on)."""
        mirror = self.watcher.llama_cache
        try:
            mirror.launched(table, slot, tokens)
        except Exception as exc:  # best-effort, like every cache step
            self.metrics.cache_errors.labels("llama_cache").inc()
            log.warning("mirror of llama-server's prompt cache failed, off until llama-server restarts: %s", exc)
            mirror.on = False

    async def _restore(self, plan: RequestPlan, target: Target, early: EarlyLookup | None = None) -> None:
        """Restore the request's session, else the longest worthwhile prefix; failures recompute."""
        lease = plan.lease
        try:
            if lease.foreign:
                # Another tenant's tokens: llama-server would reuse their common prefix by itself,
                # and the faster answer would tell this tenant what the other one asked.
                await self.client.erase_slot(lease.slot)
                lease.table.set_tokens(lease.slot, NO_TOKENS, owner=plan.salt)
            # What llama-server would reuse by itself: the slot's common prefix, or an entry of its
            # own prompt cache it loads in the same task (a kvtier restore waits in its queue).
            plan.llama_reused = self.watcher.llama_cache.reused(lease.table.tokens(lease.slot), plan.tokens,
                                                                lease.cached_tokens, plan.salt)
            # For Redis no longer than recomputing would take (a hung server's timeouts and retries take seconds).
            with request_deadline(redis_wait_s(self.cost, int(plan.tokens.size) - plan.llama_reused, lease.sharing)):
                await self._look_up_and_restore(plan, target, early)
        except Exception as exc:  # best-effort: the request goes on as a recompute
            self.metrics.cache_errors.labels("restore").inc()
            log.warning("restore into slot %d failed, recomputing: %s", lease.slot, exc)
            lease.table.forget(lease.slot)

    async def _look_up_and_restore(self, plan: RequestPlan, target: Target, early: EarlyLookup | None) -> None:
        """The session, else the longest worthwhile prefix, restored (saves in flight waited for: --save-wait in all)."""
        lease = plan.lease
        budget = WaitBudget(self.settings.save_wait)
        session = await self._restore_session_prefix(plan, target, budget) \
            if plan.session_id is not None else False
        if session:
            return
        # No session, or it could not be restored: the longest prefix the tiers hold, as for any
        # request (with Redis down, the local tiers may hold it).
        found = await self.planner.plan(plan.namespace, plan.tokens, plan.llama_reused, target, lease.slot,
                                        early, budget, sharing=lease.sharing)
        if session is None and budget.ended and await self._restore_session_prefix(plan, target, budget):
            # The session's first save was not marked yet when its lookup ran, but was by the
            # prefix lookup's, which waited for it: the session (with its tail) is stored now.
            return
        if found is None:
            if plan.llama_reused > lease.cached_tokens:
                self.metrics.decisions.labels("llama_cache").inc()
            return
        restored = await self.restorer.restore_prefix(lease, plan.namespace, found, plan.tokens, target,
                                                      owner=plan.salt)
        if restored is None:
            return
        plan.took(restored)
        plan.fetched = restored.fetched

    async def _restore_session_prefix(self, plan: RequestPlan, target: Target, budget: WaitBudget) -> bool | None:
        """Restore the request's session when it is a prefix of the prompt and worth it; None when
        there is no such session (yet), False when it was not restored."""
        assert plan.session_id is not None
        lease = plan.lease
        try:
            manifest = await self.planner.find_session(self.sessions, plan.namespace, plan.session_id, plan.tokens,
                                                       lease.cached_tokens, target, lease.slot, budget)
            if not self.planner.session_worth(manifest, plan.tokens, plan.llama_reused, target,
                                              self._session_tier, lease.slot, lease.sharing):
                return False
            restored = await self.restorer.restore_session(lease, plan.namespace, manifest, target,
                                                           owner=plan.salt, cached=lease.cached_tokens)
        except SessionNotFound:
            return None
        except LlamaServerError:
            raise  # the slot's state is unknown now: recompute (``_restore``)
        except KVTierError as exc:  # damaged, incomplete, Redis unreachable: nothing reached the slot
            self.metrics.cache_errors.labels("restore").inc()
            log.warning("session %s: not restored (%s); looking up its prefix instead", plan.session_id, exc)
            return False
        plan.took(restored)
        plan.restored_session = manifest
        return True

    # -- the sessions API -------------------------------------------------------------------------

    async def restore_session(self, lease: Lease, manifest: Manifest, namespace: Namespace,
                              salt: str = "") -> Restored:
        """Restore a whole session into a leased slot (``POST /v1/sessions/{id}/restore``)."""
        target = self.watcher.target
        assert target is not None
        restored = await self.restorer.restore_session(lease, namespace, manifest, target, owner=salt)
        self.session_slots[manifest.id] = lease.slot
        await self.sessions.touch(namespace, manifest)
        return restored

    async def save_session(self, lease: Lease, namespace: Namespace, session_id: str, *,
                           owner: str = "", read: Callable[[], None] | None = None) -> Manifest:
        """Save a leased slot as session ``session_id`` (``PUT /v1/sessions/{id}``); ``read`` as in
        ``Saver.save_slot``."""
        manifest = await self.saver.save_session(lease.table, lease.slot, namespace, session_id, owner=owner,
                                                 read=read)
        self.session_slots[session_id] = lease.slot
        return manifest

    # -- after the request ------------------------------------------------------------------------

    def finish(self, plan: RequestPlan, *, ok: bool, answer: bytes | None, cut: bool = False) -> None:
        """Save the slot in the background and release it (``Aftercare.finish``)."""
        self.aftercare.finish(plan, ok=ok, answer=answer, cut=cut)

    async def drain(self, timeout: float) -> bool:
        """Wait for pending saves (graceful shutdown)."""
        return await self.aftercare.drain(timeout)
