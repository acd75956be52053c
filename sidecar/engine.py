"""Automatic mode: the KV flow around one completion request, as the parts it is made of see it.

    prompt tokens (prompts) -> a slot (slots: the table, a lease bound to it)
      -> what the tiers hold and whether to restore it (planner) -> fetch + load into the slot (restorer)
      -> the request is forwarded and answered (proxy)
      -> after the answer: save the slot, store its new chunks and tail, announce them (saver)

``ServerWatcher`` (watcher) knows the llama-server behind all of it: slots, KV layout, the model's
identity, and notices when it changes. Every cache step is best-effort: any failure is logged and
counted, and the request goes on as an ordinary recompute (llama-server compares the slot's tokens
with the prompt itself, so a slot that holds less than we hoped only costs time, never correctness).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from integrations.llama_server import LlamaServerClient, LlamaServerError, Timings
from integrations.memkind import MemoryKind
from tiers.base import TierRole
from tiers.errors import KVTierError
from tiers.events import EventBus
from tiers.keys import Namespace
from tiers.pending import PendingSaves
from tiers.sessions import Manifest, SessionNotFound, SessionStore
from tiers.store import FetchResult, TieredStore

from .config import Settings
from .costmodel import CostModel
from .metrics import Metrics
from .planner import EarlyLookup, RestorePlanner, WaitBudget
from .prompts import Prompt, PromptTokens
from .restorer import Restored, RestoreWriter
from .saver import Saver
from .slotfiles import SlotFiles
from .slots import FOLLOW_UP_MAX_CHARS, Asked, Lease, SlotTable
from .watcher import ServerWatcher, Target, Witness

log = logging.getLogger("kvtier.engine")

SAVE_DELAY_S = 0.01  # between delivering an answer and saving its slot
NO_TOKENS = np.zeros(0, np.int32)
NO_TOKENS.flags.writeable = False


@dataclass(slots=True)
class RequestPlan:
    """One request's cache work: its tokens, its slot, and what was restored."""

    tokens: np.ndarray
    lease: Lease
    namespace: Namespace
    salt: str = ""
    session_id: str | None = None
    prompt: Prompt | None = None  # checked against the tokens llama-server saves
    restored_tokens: int = 0
    restore_tier: str = ""
    restore_ms: float = 0.0
    overhead_ms: float = 0.0
    fetched: FetchResult | None = None  # promoted into the local tiers after the answer
    asked: Asked = ()  # what the request asked, remembered with its slot (follow-ups)
    follow_up: bool = False  # sent to the slot holding what it continues, without tokens
    # A session restored for this request: the save after the answer records its use (a touch
    # when there is none), so the restore does not wait for a manifest write.
    restored_session: Manifest | None = None
    # The llama-server identity it was planned in (``ServerWatcher.generation``): a slot read after
    # another process answers there is not stored.
    generation: int = 0
    sharing: int = 0  # other slots computing when it got its slot (the prefill rate is learned by it)

    def took(self, restored: Restored) -> None:
        self.restored_tokens, self.restore_tier, self.restore_ms = restored.n_tokens, restored.tier, restored.ms


def _session_tier(store: TieredStore, sessions: SessionStore) -> str:
    """Where a session's chunks are read from, for the cost model: the remote tier when manifests
    are shared (any node may have saved it), else this node's fastest."""
    remote = [t.name for t in store.tiers if t.role is TierRole.REMOTE]
    return remote[0] if sessions.shared and remote else store.tiers[0].name


class KVEngine:
    """The sidecar's cache: composes the watcher, planner, restorer and saver around each request."""

    def __init__(self, settings: Settings, client: LlamaServerClient, store: TieredStore, metrics: Metrics,
                 sessions: SessionStore, *, events: EventBus | None = None,
                 witness: Callable[[], Witness | None] | None = None, pending: PendingSaves | None = None):
        self.settings = settings
        self.client = client
        self.store = store
        self.metrics = metrics
        self.cost = CostModel(settings.prefill_tps_prior, settings.restore_gbps_prior,
                              min_tokens=settings.restore_min_tokens)
        self.files = SlotFiles(client, Path(settings.slot_dir or "."), settings.keep_restore_files)
        self.prompts = PromptTokens(client, metrics, in_process=settings.local_tokenizer != "off")
        self.watcher = ServerWatcher(settings, client, self.files, self.prompts, witness)
        self.sessions = sessions
        self.planner = RestorePlanner(store, self.cost, metrics, pending=pending, save_wait=settings.save_wait)
        self.restorer = RestoreWriter(store, self.sessions, self.files, self.cost, metrics)
        self.saver = Saver(store, self.sessions, self.files, metrics, self.cost, node_id=settings.node_id, events=events,
                           pending=pending)
        self.session_slots: dict[str, int] = {}  # session id -> the slot that served it last
        self._session_tier = _session_tier(store, sessions)
        self._pending: set[asyncio.Task[None]] = set()

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
        return await self.watcher.ensure_ready()

    # -- before the request -----------------------------------------------------------------------

    def follow_up(self, body: Mapping[str, Any], asked: Asked, *, want_slot: int | None = None, salt: str = "",
                  since: float | None = None) -> RequestPlan | None:
        """A plan for a request that continues what an idle slot answered last, or None.

        Such a request (``slots.continues``: a chat with another last message, or with one answer
        and one new message; a text prompt with another end) needs nothing from the tiers: they
        hold no more of it than the slot, unless this very request already ran on another node, and
        then only its short new end (at most ``FOLLOW_UP_MAX_CHARS`` characters, cheap to compute).
        So it goes to that slot as it is, without rendering, tokenizing or a lookup.
        """
        target, table = self.watcher.target, self.watcher.slots
        if table is None or target is None:
            return None
        if isinstance(asked, tuple) and len(body["messages"][-1]["content"]) > FOLLOW_UP_MAX_CHARS:
            return None
        lease = table.follow_up(asked, want=want_slot, owner=salt)
        if lease is None:
            return None
        plan = RequestPlan(NO_TOKENS, lease, target.namespace_for(salt), salt, asked=asked, follow_up=True,
                           generation=self.watcher.generation, sharing=table.computing - 1)
        plan.overhead_ms = (time.perf_counter() - since) * 1000 if since is not None else 0.0
        self.metrics.overhead_seconds.observe(plan.overhead_ms / 1000)
        self.metrics.follow_ups.inc()
        return plan

    async def prepare(self, prompt: Prompt, *, want_slot: int | None = None, salt: str = "",
                      timeout: float | None = None, session_id: str | None = None,
                      since: float | None = None, asked: Asked = (), prompt_end: bool = False,
                      early: EarlyLookup | None = None) -> RequestPlan:
        """Take a slot for ``prompt``'s tokens and restore the longest worthwhile prefix into it.

        The slot is released by ``finish`` (after the answer and its save), or here when this
        fails or is cancelled.

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
                               generation=self.watcher.generation, sharing=table.computing - 1)
            if session_id is not None:
                self.session_slots[session_id] = lease.slot
            t1 = time.perf_counter()
            await self._restore(plan, target, early)
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

    async def _restore(self, plan: RequestPlan, target: Target, early: EarlyLookup | None = None) -> None:
        """Restore the request's session, else the longest worthwhile prefix; failures recompute."""
        lease = plan.lease
        try:
            if lease.foreign:
                # Another tenant's tokens: llama-server would reuse their common prefix by itself,
                # and the faster answer would tell this tenant what the other one asked.
                await self.client.erase_slot(lease.slot)
                lease.table.set_tokens(lease.slot, NO_TOKENS, owner=plan.salt)
            # One request waits at most --save-wait for saves in flight, its session's and its prefix's together.
            budget = WaitBudget(self.settings.save_wait)
            if plan.session_id is not None and await self._restore_session_prefix(plan, target, budget):
                return
            # No session, or it could not be restored: the longest prefix the tiers hold, as for any
            # request (with Redis down, the local tiers may hold it).
            found = await self.planner.plan(plan.namespace, plan.tokens, lease.cached_tokens, target, lease.slot,
                                            early, budget)
            if found is None:
                return
            restored = await self.restorer.restore_prefix(lease, plan.namespace, found, plan.tokens, target,
                                                          owner=plan.salt)
            if restored is None:
                return
            plan.took(restored)
            plan.fetched = restored.fetched
        except Exception as exc:  # best-effort: the request goes on as a recompute
            self.metrics.cache_errors.labels("restore").inc()
            log.warning("restore into slot %d failed, recomputing: %s", lease.slot, exc)
            lease.table.forget(lease.slot)

    async def _restore_session_prefix(self, plan: RequestPlan, target: Target, budget: WaitBudget) -> bool:
        """Restore the request's session when it is a prefix of the prompt and worth it."""
        assert plan.session_id is not None
        lease = plan.lease
        try:
            manifest = await self.planner.find_session(self.sessions, plan.namespace, plan.session_id, plan.tokens,
                                                       lease.cached_tokens, target, lease.slot, budget)
            if not self.planner.session_worth(manifest, plan.tokens, lease.cached_tokens, target,
                                              self._session_tier, lease.slot):
                return False
            restored = await self.restorer.restore_session(lease, plan.namespace, manifest, target,
                                                           owner=plan.salt, cached=lease.cached_tokens)
        except SessionNotFound:
            return False
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
        """Save the slot in the background and release it; the answer (its end, for streams) is
        read for its timings there too, after it has been delivered.

        ``cut``: the client left while llama-server answered. The slot still holds the prompt (and
        part of an answer), which a re-prompt with the same start reuses on llama-server alone: it
        is saved and stored too, as what the slot holds (never as a session's turn).
        """
        plan.lease.table.begin_save(plan.lease.slot, (plan.tokens, plan.salt) if ok else None)
        answered = time.perf_counter()
        task = asyncio.get_running_loop().create_task(self._save_then_release(plan, ok, answer, answered, cut))
        self._pending.add(task)
        self.metrics.pending_saves.set(len(self._pending))
        task.add_done_callback(self._pending.discard)

    async def _save_then_release(self, plan: RequestPlan, ok: bool, answer: bytes | None, answered: float,
                                 cut: bool = False) -> None:
        lease = plan.lease

        def free() -> None:
            """The slot may serve its next request (once: a next request may take it at once)."""
            lease.table.end_save(lease)

        # Other nodes learn first that this save is coming: a next turn of this conversation that
        # reaches one of them may wait for it rather than recompute (saver.in_flight). The slot is
        # free again once its state is read; the markers stay until Redis holds what was stored.
        async with self.saver.in_flight(plan.namespace, plan.tokens if ok else NO_TOKENS):
            try:
                stored = await self._save(plan, ok, answer, free, cut=cut and plan.session_id is None)
            except Exception as exc:
                # A failed save (a full slot dir, an unreachable tier) leaves the slot as it was:
                # what the table knows of it (what was restored or saved last) is still a prefix of it.
                self.metrics.cache_errors.labels("save").inc()
                log.warning("saving slot %d failed: %s", lease.slot, exc)
                return
            finally:
                free()
                self.metrics.pending_saves.set(max(len(self._pending) - 1, 0))
                if plan.fetched is not None:  # after the slot is free: no one waits on this copy
                    fetched, plan.fetched = plan.fetched, None
                    await self.store.promote(fetched)
            if stored:
                await self.saver.readable(answered, int(plan.tokens.size))

    async def _save(self, plan: RequestPlan, ok: bool, answer: bytes | None, free: Callable[[], None], *,
                    cut: bool = False) -> bool:
        """Learn from the answer, then save the slot's state; False when nothing was stored.
        ``free`` gives the slot back as soon as its state is read (or nothing is to be read);
        ``cut`` as in ``finish``."""
        lease = plan.lease
        table = lease.table
        # Let the answer's last bytes reach the client first: on a small host the save (llama-server
        # writing the slot file, kvtier splitting it) would compete for the CPU with its delivery.
        await asyncio.sleep(SAVE_DELAY_S)
        expected = max(plan.restored_tokens, plan.lease.cached_tokens)
        target = self.watcher.target
        if answer is not None and not self.planner.learn(
                Timings.from_answer(answer), int(plan.tokens.size), expected, lease.slot, follow_up=plan.follow_up,
                restored=plan.restored_tokens, layout=target.memory_kind if target is not None else MemoryKind.KV,
                sharing=plan.sharing):
            self.watcher.doubt()  # a restart it has not noticed yet? Check before the next request
        if not ok and not cut:
            # Nothing from a failed request is cached; what the slot holds now is unknown.
            table.forget(lease.slot)
            free()
            if plan.restored_session is not None:  # no save records the session's use
                await self.sessions.touch(plan.namespace, plan.restored_session)
            await self._server_changed(plan)  # counted when a restart broke the answer off
            return False
        if await self._server_changed(plan):
            table.forget(lease.slot)
            return False

        def read() -> None:
            # After the save set the slot's tokens (and so forgot what it answered).
            if ok:
                table.record_asked(lease.slot, plan.asked)
            free()

        if plan.session_id is not None:
            manifest = await self.save_session(lease, plan.namespace, plan.session_id, owner=plan.salt, read=read)
            self.prompts.check(plan.prompt, manifest.tokens)
        else:
            state = await self.saver.save_slot(table, lease.slot, plan.namespace, owner=plan.salt, read=read)
            if ok:  # a cut answer's slot may hold part of the prompt only
                self.prompts.check(plan.prompt, state.tokens.tokens)
        return True

    async def _server_changed(self, plan: RequestPlan) -> bool:
        """Whether another llama-server process answers now than the one ``plan`` was planned for
        (it restarted or changed since; counted). What its slot holds then may be another model's
        KV, which must never go under this namespace. Noticing the same process again (the health
        loop, a closed witness) changes nothing here."""
        if await self.watcher.ensure_ready() and self.watcher.generation == plan.generation:
            return False
        self.metrics.cache_errors.labels("server_changed").inc()
        log.warning("slot %d: llama-server changed during the request; its state is not stored", plan.lease.slot)
        return True

    async def drain(self, timeout: float) -> bool:
        """Wait for pending saves (graceful shutdown)."""
        if not self._pending:
            return True
        _, pending = await asyncio.wait(set(self._pending), timeout=timeout)
        return not pending
