"""Saves: read a slot's state after an answer and store what no tier holds yet (chunks, tail, session)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import numpy as np

from integrations.flows import SaveMarks
from integrations.kvflow import Publisher, save_session, store_state
from integrations.statefile import SeqState
from tiers.errors import KVTierError
from tiers.keys import Namespace
from tiers.pending import PendingSaves
from tiers.sessions import Manifest, SessionStore
from tiers.store import TieredStore

from .costmodel import CostModel
from .metrics import Metrics
from .slotfiles import SlotFiles
from .slotrecord import SavedSlot
from .slots import SlotTable

log = logging.getLogger("kvtier.engine")


class Saver:
    """Saves slots into the tiers (the flows of ``integrations.kvflow`` and ``integrations.flows``) and tells
    the slot table what they read and stored."""

    def __init__(self, store: TieredStore, sessions: SessionStore, files: SlotFiles, metrics: Metrics,
                 cost: CostModel, *, node_id: str, events: Publisher | None = None,
                 pending: PendingSaves | None = None):
        self.store = store
        self.cost = cost  # learns how soon a save is readable; marks tell other nodes
        self.sessions = sessions
        self.files = files
        self.metrics = metrics
        self.node_id = node_id
        self.events = events
        self.pending = pending
        # Tell other nodes that a save of the prompt just answered is coming, and when Redis should
        # hold it (from this node's past saves): their next turn of it may wait for it.
        self.marks = SaveMarks(pending, node_id, expected=cost.expected_readable)
        self._warned_unsplittable = False
        self._storing: dict[int, asyncio.Lock] = {}  # per slot: its stores in order

    def expected_write(self, n_tokens: int) -> float | None:
        """Seconds llama-server should take to write a slot of ``n_tokens`` (the stall of its
        other slots a save causes); None before it has saved one this node can learn from."""
        nbytes = self.files.bytes_about(n_tokens)
        return self.cost.expected_slot_write(nbytes) if nbytes else None

    async def readable(self, answered: float, n_tokens: int) -> None:
        """Wait until Redis holds what was stored so far, a save of ``n_tokens``; observe the time
        since ``answered`` (``perf_counter()`` at the end of the answer)."""
        if self.pending is None:
            return
        if await self.store.written(timeout=60):
            seconds = time.perf_counter() - answered
            self.metrics.save_readable_seconds.observe(seconds)
            self.cost.observe_readable(n_tokens, seconds)

    async def save_prompt_end(self, table: SlotTable, slot: int, namespace: Namespace, tokens: np.ndarray, *,
                              owner: str = "") -> bool:
        """Compute ``tokens`` but the last into ``slot`` and store that state: the state a next
        prompt continues when it keeps this prompt but not its answer (thinking models whose
        templates drop earlier reasoning). A state with a rest holds one position only (its
        window, its recurrent state), so the state after the answer serves no such prompt. The
        last token is left to the request itself, which then reuses all the rest (llama-server
        always computes a prompt's last token). False when it could not be done (counted; the
        request goes on as without it)."""
        try:
            held, computed = await self.files.client.prefill(slot, tokens[:-1])
            self.metrics.tokens_recomputed.inc(computed)
            if held != tokens.size - 1:
                raise KVTierError(f"llama-server holds {held} tokens after a prefill of {tokens.size - 1}")
            await self.save_slot(table, slot, namespace, owner=owner)
            # Kept when the answer's state is stored: that one does not replace it for a next
            # prompt that drops the answer (store_state deletes the tail it supersedes).
            table.drop_tail(slot)
        except Exception as exc:  # best-effort: the request goes on, its prompt computed as ever
            self.metrics.prompt_end_saves.labels("failed").inc()
            log.warning("slot %d: the state at the prompt's end was not saved: %s", slot, exc)
            table.forget(slot)  # what it holds now is not known for sure
            return False
        self.metrics.prompt_end_saves.labels("stored").inc()
        return True

    def start_save(self, table: SlotTable, slot: int, namespace: Namespace, *, owner: str = "",
                   read: Callable[[], None] | None = None, grant: int | None = None) -> asyncio.Task[SeqState]:
        """``save_slot`` as a task, its write known to the table from now on (``SlotTable.begin_write``),
        not from the task's first step: another save that comes due meanwhile waits for it."""
        began = False

        async def save() -> SeqState:
            nonlocal began
            began = True  # from here ``_write`` ends the write, however it ends
            return await self.save_slot(table, slot, namespace, owner=owner, read=read, grant=grant)

        def ended(_: asyncio.Task[SeqState]) -> None:
            # Cancelled before its first step: no ``_write`` ran. Never later: by then the slot may be
            # written by the next request's save (handed over), which this must not end.
            if not began:
                table.end_write(slot)

        table.begin_write(slot)
        task = asyncio.get_running_loop().create_task(save())
        task.add_done_callback(ended)
        return task

    async def save_slot(self, table: SlotTable, slot: int, namespace: Namespace, *, owner: str = "",
                        read: Callable[[], None] | None = None, grant: int | None = None) -> SeqState:
        """Save ``slot``, store its new chunks and its partial tail, and record what it holds.

        ``read`` is called once llama-server has written the state and kvtier has read it: the slot
        may serve its next request from then on (llama-server alone would), while its chunks are
        split and stored from the bytes read. Stores of one slot run one after the other.
        ``grant``: as in ``SlotTable.record_saved`` (a slot handed over meanwhile records nothing).
        """
        t0 = time.perf_counter()
        state = await self._write(table, slot, "save", namespace)
        saved = table.record_saved(slot, state.tokens.tokens.copy(), owner, grant)
        if read is not None:
            read()
        async with self._storing.setdefault(slot, asyncio.Lock()):
            if state.store_reason is None:
                await self._store(table, slot, namespace, state, saved)
            elif state.n_tokens and not self._warned_unsplittable:
                # Prefix restore needs chunks; such states are kept only by explicit session saves.
                self._warned_unsplittable = True
                log.warning("slot states cannot be split into prefix chunks (%s): automatic restore is off",
                            state.store_reason)
        self.metrics.save_seconds.observe(time.perf_counter() - t0)
        return state

    async def _write(self, table: SlotTable, slot: int, kind: str, namespace: Namespace) -> SeqState:
        """llama-server writes ``slot``'s state and kvtier reads it; the table knows it meanwhile
        (``SlotTable.begin_write``: saves held back beside other slots wait for it)."""
        table.begin_write(slot)
        try:
            return await self.files.save(slot, kind, table.held_about(slot), namespace)
        finally:
            table.end_write(slot)

    async def _store(self, table: SlotTable, slot: int, namespace: Namespace, state: SeqState,
                     saved: SavedSlot) -> None:
        stored = await store_state(self.store, namespace, state, events=self.events, previous=saved.previous_tail,
                                   previous_tokens=saved.previous)
        if stored.chunks is not None:
            self.metrics.bytes_saved.inc(stored.chunks.bytes_encoded)
        if stored.tail_error is not None:  # the chunks are stored: a hop recomputes the tail, no more
            self.metrics.cache_errors.labels("save").inc()
            log.warning("storing slot %d's partial tail failed: %s", slot, stored.tail_error)
        table.record_tail(slot, saved, stored)
        if stored.tail_stored:
            self.metrics.tails.labels("stored").inc()
        if stored.tail_deleted:
            self.metrics.tails.labels("deleted").inc()

    async def save_session(self, table: SlotTable, slot: int, namespace: Namespace, session_id: str, *,
                           owner: str = "", read: Callable[[], None] | None = None) -> Manifest:
        """Save ``slot`` as session ``session_id``: its chunks, its partial tail, its manifest
        (``read`` as in ``save_slot``)."""
        t0 = time.perf_counter()
        state = await self._write(table, slot, "session", namespace)
        table.set_tokens(slot, state.tokens.tokens.copy(), owner=owner, stored=True)
        if read is not None:
            read()
        manifest = await save_session(self.sessions, namespace, session_id, state, node=self.node_id,
                                      events=self.events)
        self.metrics.save_seconds.observe(time.perf_counter() - t0)
        return manifest
