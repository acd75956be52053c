"""After the answer: learn from its timings, save the slot, give it back, store what it holds.

``KVEngine.finish`` hands each answered request here; the save runs in the background, one task per
request, which ``drain`` waits for at shutdown. Other nodes are told first that the save is coming
(pending-save marks, ``integrations.flows.SaveMarks``); the slot serves its next request as soon as
its state is read; the marks go once Redis holds what was stored.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from integrations.llama_server import Timings
from integrations.memkind import MemoryKind
from tiers.pending import Lift
from tiers.sessions import SessionStore
from tiers.store import TieredStore
from tiers.threads import in_thread

from .costmodel import CostModel
from .heap import release_holes
from .llamacache import LlamaPromptCache
from .metrics import Metrics
from .planner import RestorePlanner
from .prompts import PromptTokens
from .requestplan import NO_TOKENS, RequestPlan
from .saver import Saver
from .slots import SlotTable
from .watcher import ServerWatcher

log = logging.getLogger("kvtier.engine")

# Between delivering an answer and saving its slot, at least. A request that waits for the slot
# ends the pause: one that repeats or continues the answer skips the save; any other (every slot
# busy) has the save sent now and takes the slot at its hand-over (below), sooner than after the
# pause. One that arrives after the pause waits for the save (or its hand-over). A client's
# next request at once takes well under 10 ms on a quiet 2-core host but often more with a CPU load
# beside it: at 10 ms, 3 of 6 such repeats missed the pause (91-181 ms against 52-58 when caught);
# at 30 ms, 8 of 8 were caught (median 54.5 ms).
SAVE_DELAY_S = 0.03
# A save that will stop llama-server's other slots for longer waits longer (``save_pause``): up
# to this share of llama-server's expected write of the slot, and at most SAVE_PAUSE_MAX_S. A next
# turn of the conversation in that window (an agent's tool call of a few hundred ms) skips the save
# and its stall, and is served at once; one after it waits for the save as before, never longer.
# What it costs: the state reaches the tiers that much later, a fraction of a save that takes
# several times llama-server's write until Redis holds it.
SAVE_PAUSE_SHARE = 0.5
SAVE_PAUSE_MAX_S = 0.5
# An agent's loop: when the answer was a follow-up's that came soon after the answer before it,
# the next step is likely as soon. The save waits FOLLOW_UP_PAUSE_GAPS times that gap, at most
# FOLLOW_UP_PAUSE_MAX_S, so that the next step skips it and the stall of its write (each save
# stops every slot while llama-server writes the whole state: hundreds of MiB at real KV sizes).
# What it costs: the state reaches the tiers that much later; a step that hops to another node
# mid-loop recomputes what the steps since the last save added (docs/scaling.md).
FOLLOW_UP_PAUSE_GAPS = 2.0
FOLLOW_UP_PAUSE_MAX_S = 2.0
# A pause whose end the event loop reached this late was held up (the host's CPU busy): requests
# that came meanwhile get LATE_GRACE_S to be read and ask for the slot before the save goes on.
LATE_S = 0.02
LATE_GRACE_S = 0.05
# Longest a save waits after its answer while other slots compute (``--save-defer``): llama-server's
# write of the slot stops every slot, and kvtier's work on it takes CPU from them. A new ~480-token
# prompt on another slot beside the save of a 1,900-token answer (8B-shaped KV, 235 MB, 2 cores)
# took 1.9x as long as on llama-server alone.
SAVE_DEFER_S = 10.0
# A held save's quiet moment (``held_beside``) is at least this long, whatever its pause: it has
# waited seconds already, and the next request after an answer often comes within it (an agent's
# tool call, 50-300 ms in ``bench chatsteps``; a new conversation 0.1 s after another's answer in
# ``due_together``: it went behind the write in 2 of 5 reps once writes learned fast made the
# pause 0.06-0.1 s).
HELD_QUIET_S = 0.25
# A held save past half its wait (``held_beside``) also goes while another slot computes a prompt with
# at least this many times the save's expected write left: llama-server writes it between that prompt's
# batches, costing it a tenth at most, rather than at the end of the wait, into whatever comes then (a
# client's repeat at once took 450 ms instead of 40 behind such a write and its store, loaded).
LONG_PROMPT_WRITES = 10.0
# How long a save's request is in flight before its slot may go to a request that waits for it
# (``Aftercare._hand_over_when_wanted``): by then llama-server has queued the save.
HANDOVER_AFTER_S = 0.05


def save_pause(write_s: float | None, step_gap: float | None = None) -> float:
    """Seconds to hold a save back after its answer, when llama-server is expected to take
    ``write_s`` writing the slot (None: not known yet): ``SAVE_DELAY_S`` at least. ``step_gap``:
    the answer was a follow-up's that came so many seconds after the answer it continued (an
    agent's loop, whose next step skips the save when it comes as soon)."""
    scaled = min(SAVE_PAUSE_MAX_S, SAVE_PAUSE_SHARE * write_s) if write_s else 0.0
    if step_gap is not None and step_gap < FOLLOW_UP_PAUSE_MAX_S:
        scaled = max(scaled, min(FOLLOW_UP_PAUSE_MAX_S, FOLLOW_UP_PAUSE_GAPS * step_gap))
    return max(SAVE_DELAY_S, scaled)


def end_cheaper(plan: RequestPlan, timings: Callable[[], Timings | None], saver: Saver, cost: CostModel,
                llama: LlamaPromptCache | None = None) -> bool:
    """Whether a request waits for the slot that ``plan`` answered on, and recomputing the end that only
    this save would store costs less than the wait for the save. The end is what the slot answered (its
    prompt and the answer) past the longer of two prefixes: the one the tiers were given already (an
    earlier turn's save, a restore: ``Slot.stored``), and the one a waiting request of the same tenant
    keeps (the same document or history with another last question: an answer regenerated, a last message
    edited), which its own save stores. Without the save, a return of this prompt recomputes that end
    (llama-server alone would recompute all it does not hold, or load it from its own prompt cache); with
    it, the waiting request (another conversation, on a server whose slots are all taken, or that
    question) waits for llama-server's write of the whole slot and the hand-over before it (it goes on
    ``HANDOVER_AFTER_S`` after the save, and llama-server's queue runs the save first).

    With llama-server's own prompt cache on (``llama``), a waiting request of the same tenant that keeps
    under half of the slot has llama-server copy it there first, as alone: a return on this node loads it
    from there, and only another node would recompute the end. When the tiers hold the rest (an earlier
    turn), that end is let go; a first turn is priced as above, and saved for the other nodes."""
    table, slot = plan.lease.table, plan.lease.slot
    write = saver.expected_write(table.held_about(slot))
    if write is None or not table.wanted(slot):
        return False
    said = timings()  # the answer's (read once per save, and only past the checks above)
    # A follow-up's prompt (no tokens known) continues what the slot held: its timings tell its size.
    held = said.cache_n + said.prompt_n if said is not None else table.held_about(slot)
    stored = table.stored_answered(slot)
    by_waiter = table.kept_by_waiter(slot)
    if stored and llama is not None and table.waited_by_owner(slot) and llama.keeps(held, by_waiter):
        return True
    kept = max(by_waiter, stored)
    dropped = held - kept + (said.predicted_n if said is not None else 0)
    return cost.recompute_s(max(0, dropped)) < write + HANDOVER_AFTER_S


async def held_beside(table: SlotTable, slot: int, limit: float, draining: Callable[[], bool],
                      lift: Lift, quiet: float = SAVE_DELAY_S, write: float | None = None) -> float | None:
    """Hold the save of ``slot`` back while other slots compute, ``limit`` seconds at most; the
    seconds it waited, None when none computed (or ``limit`` is 0). llama-server alone would run
    them with nothing beside. It goes once none computes, when a request wants its slot (a next
    turn that then skips it, or one that every slot busy leaves waiting), or when a drain begins.
    It waits for another save's write too (``SlotTable.beside``): saves that come due together are
    written one at a time, so a request that comes meanwhile waits for one write, not for all.

    Called after the pause (``Aftercare._paused``: the next request of a busy client comes within
    it) and the skip checks, which are made again after it. Its pending-save marks are lifted first
    (``lift``): another node's next turn meanwhile does not wait for a save that may be seconds
    away, and restores what the tiers hold. A session's save, and a cut answer's (which a re-prompt
    on another node restores), are not held back. ``quiet``: the quiet moment it goes after (``Aftercare``
    gives the save's own pause, ``save_pause``, and ``HELD_QUIET_S`` at least). ``write``: llama-server's
    expected write of the slot; from half of ``limit`` on, the save also goes beside a prompt with
    ``LONG_PROMPT_WRITES`` times that left to compute (``SlotTable.prefilling_beside``)."""
    if limit <= 0 or not table.beside(slot) or table.wanted(slot) or draining():
        return None
    t0 = time.perf_counter()
    half, deadline = t0 + limit / 2, t0 + limit

    def go() -> bool:  # a drain, or past half the wait, a long prompt beside
        return draining() or (write is not None and time.perf_counter() >= half
                              and table.prefilling_beside(slot, LONG_PROMPT_WRITES * write))

    await lift()
    while True:
        now = time.perf_counter()
        await table.until_alone(slot, (half if now < half else deadline) - now, stop=go)
        left = deadline - time.perf_counter()
        if left <= 0 or table.wanted(slot) or go():
            break
        if table.beside(slot):
            continue  # half the wait is over, with slots beside: from now on a long prompt lets it go too
        # None computes now, but a slot that has just answered is often asked again at once (its
        # client's next turn, a retry, an agent's next step): the save goes after a quiet moment, not
        # into that request. 12 repeats of a prompt one after another (SmolLM2, quiet) took 29 ms
        # alone and 72 ms through kvtier when the save held back during the prompt went as it ended.
        # As long as the pause after an answer (``HELD_QUIET_S`` at least): a request that comes
        # within it is spared the write.
        if not await _came(lambda s: table.until_busy(slot, s, stop=go), min(quiet, left)):
            break
    return time.perf_counter() - t0


async def _came(until: Callable[[float], Awaitable[bool]], seconds: float) -> bool:
    """``until(seconds)``: whether what it waits for came. When the loop reached the wait's end that
    late (the host's CPU busy), a request that came meanwhile may not be read yet: it gets
    ``LATE_GRACE_S`` more."""
    t0 = time.perf_counter()
    if await until(seconds):
        return True
    return time.perf_counter() - t0 > seconds + LATE_S and await until(LATE_GRACE_S)


class Aftercare:
    """Saves each answered request's slot in the background and releases it; owns those tasks.

    Args:
        session_slots: the engine's map of session id to the slot that served it last; a
            session saved after its answer is recorded there.
        defer_s: longest a save waits while other slots compute (``held_beside``; 0: never).
    """

    def __init__(self, watcher: ServerWatcher, planner: RestorePlanner, saver: Saver, store: TieredStore,
                 sessions: SessionStore, prompts: PromptTokens, metrics: Metrics, session_slots: dict[str, int],
                 defer_s: float = SAVE_DEFER_S):
        self.watcher = watcher
        self.planner = planner
        self.saver = saver
        self.store = store
        self.sessions = sessions
        self.prompts = prompts
        self.metrics = metrics
        self.session_slots = session_slots
        self.defer_s = defer_s
        self._draining = 0  # drains under way: no save waits beside other slots meanwhile (``held_beside``)
        self._pending: set[asyncio.Task[None]] = set()
        self._saving: set[asyncio.Task[Any] | None] = set()  # of those, the ones still saving (the gauge)

    def finish(self, plan: RequestPlan, *, ok: bool, answer: bytes | None, cut: bool = False) -> None:
        """Save the slot in the background and release it; the answer (its end, for streams) is
        read for its timings there too, after it has been delivered.

        ``cut``: the client left while llama-server answered. The slot still holds the prompt (and
        part of an answer), which a re-prompt with the same start reuses on llama-server alone: it
        is saved and stored too, as what the slot holds (never as a session's turn).
        """
        # A cut session turn is not kept; any other cut answer's slot holds its prompt too: a re-prompt here
        # waits for this slot rather than take a cold one, and other nodes may wait for its save, as for any answer.
        cut = cut and plan.session_id is None
        # A follow-up's prompt was never tokenized (``KVEngine.follow_up``): what its slot holds at
        # least is not known before the save reads it, so no tokenized waiter is taken for its
        # continuation; a follow-up that repeats or extends what it asked is (``await_follow_up``).
        known = (ok or cut) and not plan.follow_up
        plan.lease.table.begin_save(plan.lease.slot, (plan.tokens, plan.salt) if known else None,
                                    plan.asked if ok else ())
        answered = time.perf_counter()
        task = asyncio.get_running_loop().create_task(self._save_then_release(plan, ok, answer, answered, cut))
        self._pending.add(task)
        self._saving.add(task)
        self.metrics.pending_saves.set(len(self._saving))
        task.add_done_callback(self._ended)

    def _saved(self, task: asyncio.Task[Any] | None) -> None:
        self._saving.discard(task)
        self.metrics.pending_saves.set(len(self._saving))

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._pending.discard(task)
        self._saved(task)  # also one cancelled before its save began

    async def drain(self, timeout: float) -> bool:
        """Wait for the saves in flight and the marked stores the saver runs in the background
        (graceful shutdown); False when ``timeout`` passed first. Saves held back beside other slots
        go at once."""
        t0 = time.perf_counter()
        self._draining += 1
        if (table := self.watcher.slots) is not None:
            table.nudge()
        try:
            left = self._pending and (await asyncio.wait(set(self._pending), timeout=timeout))[1]
            return not left and await self.saver.marks.drain(max(0.0, timeout - (time.perf_counter() - t0)))
        finally:
            self._draining -= 1

    async def _save_then_release(self, plan: RequestPlan, ok: bool, answer: bytes | None, answered: float,
                                 cut: bool = False) -> None:
        lease = plan.lease

        def free() -> None:
            """The slot may serve its next request (once: a next request may take it at once)."""
            lease.table.end_save(lease)

        # Other nodes learn first that this save is coming: a next turn of this conversation that
        # reaches one of them may wait for it rather than recompute (saver.marks). The slot is
        # free again once its state is read; the markers stay until Redis holds what was stored (a save
        # held back beside other slots lifts them as it begins to wait: ``held_beside``).
        stored = False
        async with self.saver.marks.held(plan.namespace, plan.tokens if ok or cut else NO_TOKENS) as lift:
            try:
                stored = await self._save(plan, ok, answer, free, lift, cut=cut)
            except Exception as exc:
                # A failed save (a full slot dir, an unreachable tier) leaves the slot as the answer
                # left it: what the table knew of it before may not be a prefix of that any more.
                lease.table.save_failed(lease)
                self.metrics.cache_errors.labels("save").inc()
                log.warning("saving slot %d failed: %s", lease.slot, exc)
                return
            finally:
                free()
                # Not the pending set's size less one: another save may still be in it, past this
                # point, waiting for Redis (the gauge stayed at 1 after both had ended).
                self._saved(asyncio.current_task())
                fetched, plan.fetched = plan.fetched, None
                if fetched is not None:  # after the slot is free: no one waits on this copy
                    await self.store.promote(fetched)
                if stored or fetched is not None:  # what their evictions freed and no chunk fits (sidecar/heap.py):
                    # not in the save pool, where it would wait behind other saves' cuts, and the marks with it
                    await in_thread(release_holes)
            if stored:
                await self.saver.readable(answered, int(plan.tokens.size))

    def _learn(self, plan: RequestPlan, timings: Timings | None) -> None:
        """Learn from the answer's timings; doubt the server when it reused less than planned."""
        target = self.watcher.target
        if not plan.restored_tokens and plan.llama_reused > plan.lease.cached_tokens:  # left to llama-server's cache
            self.watcher.llama_cache.answered(plan.llama_reused, timings, int(plan.tokens.size))
        if not self.planner.learn(
                timings, int(plan.tokens.size), max(plan.restored_tokens, plan.lease.cached_tokens),
                plan.lease.slot, follow_up=plan.follow_up, restored=plan.restored_tokens,
                layout=target.memory_kind if target is not None else MemoryKind.KV, sharing=plan.sharing):
            self.watcher.doubt()  # a restart it has not noticed yet? Check before the next request

    async def _save(self, plan: RequestPlan, ok: bool, answer: bytes | None, free: Callable[[], None], lift: Lift,
                    *, cut: bool = False) -> bool:
        """Learn from the answer, then save the slot's state; False when nothing was stored.
        ``free`` gives the slot back as soon as its state is read (or nothing is to be read);
        ``lift`` deletes the save's pending marks (``held_beside``); ``cut`` as in ``finish``."""
        lease = plan.lease
        table = lease.table
        timings = functools.cache(lambda: Timings.from_answer(answer) if answer is not None else None)
        pause = self._pause(plan, ok)  # after the answer, and again once a save held beside others may go
        await self._paused(plan, pause)
        # A request waiting for the slot takes it, and is sent on, before the answer is read (the
        # yield): reading it is off that request's path.
        if skipped := self._skip(plan, ok, timings, free, known=self.watcher.confirmed):
            await asyncio.sleep(0)
        if answer is not None:
            self._learn(plan, timings())
        if skipped:
            return False
        if not ok and not cut:
            # Nothing from a failed request is cached; what the slot holds now is unknown.
            table.forget(lease.slot)
            free()
            if plan.restored_session is not None:  # no save records the session's use
                await self.sessions.touch(plan.namespace, plan.restored_session)
            await self._server_changed(plan)  # counted when a restart broke the answer off
            return False
        if not cut and plan.session_id is None and (waited := await held_beside(
                table, lease.slot, self.defer_s, lambda: self._draining > 0, lift, max(pause, HELD_QUIET_S),
                self.saver.expected_write(table.held_about(lease.slot)))) is not None:
            self.metrics.save_deferred_seconds.observe(waited)
        if await self._server_changed(plan):
            table.forget(lease.slot)
            return False
        if self._skip(plan, ok, timings, free, known=True):
            return False

        def read() -> None:
            if lease.released:
                return  # handed over while the save waited: the slot serves another request already
            # After the save set the slot's tokens (and so forgot what it answered).
            if ok:
                table.record_asked(lease.slot, plan.asked)
            free()

        if plan.session_id is not None:
            manifest = await self.saver.save_session(table, lease.slot, plan.namespace, plan.session_id,
                                                     owner=plan.salt, read=read)
            self.session_slots[plan.session_id] = lease.slot
            self.prompts.check(plan.prompt, manifest.tokens)
            return True
        save = self.saver.start_save(table, lease.slot, plan.namespace, owner=plan.salt, read=read,
                                     grant=table.slots[lease.slot].leases)
        try:
            await self._hand_over_when_wanted(plan, save)
            state = await save
        finally:
            save.cancel()  # when this task is cancelled (a no-op once the save is done)
        if ok:  # a cut answer's slot may hold part of the prompt only
            self.prompts.check(plan.prompt, state.tokens.tokens)
        return True

    async def _paused(self, plan: RequestPlan, pause: float) -> None:
        """Let the answer's last bytes reach the client first: on a small host the save
        (llama-server writing the slot file, kvtier splitting it) would compete for the CPU with
        its delivery. A request that waits for this slot ends the pause (``pause`` long: ``_pause``)."""
        slot, table = plan.lease.slot, plan.lease.table
        await _came(lambda s: table.until_wanted(slot, s), pause)

    def _pause(self, plan: RequestPlan, ok: bool) -> float:
        """``save_pause`` before this save. Only a save that a next turn may skip waits longer
        before a slow write: the others (a session's, a cut answer's) would only reach the tiers
        later."""
        if not ok or plan.session_id is not None:
            return save_pause(None)
        lease = plan.lease
        return save_pause(self.saver.expected_write(lease.table.held_about(lease.slot)), plan.step_gap)

    def _skip(self, plan: RequestPlan, ok: bool, timings: Callable[[], Timings | None], free: Callable[[], None], *,
              known: bool) -> bool:
        """Skip the save when a request of the same tenant already waits for this slot that
        repeats or continues the prompt it answered (its own save stores all this one would, and
        more), or when any request waits for it and the end only this save would store is cheaper
        to recompute than the wait for the save (``end_cheaper``): llama-server alone serves the
        waiting request at once, and saving now would only make it wait (and stall the others).
        ``known``: llama-server is known to be the process the request was planned for."""
        lease = plan.lease
        if not (known and ok and plan.session_id is None and self.watcher.generation == plan.generation):
            return False
        if lease.table.awaited(lease.slot):
            self.metrics.saves_skipped.inc()
        elif end_cheaper(plan, timings, self.saver, self.planner.cost, self.watcher.llama_cache):
            self.metrics.saves_skipped.inc()
            self.metrics.saves_skipped_ends.inc()
        else:
            return False
        lease.table.skip_save(lease.slot, plan.asked)
        free()
        return True

    async def _hand_over_when_wanted(self, plan: RequestPlan, save: asyncio.Future[Any]) -> None:
        """While the slot's save is sent but not done (llama-server runs it between the batches
        other slots compute: seconds on a busy server), give the slot to a request that waits for
        it (``SlotTable.hand_over``): llama-server alone would serve that request at once, and its
        queue still runs the save first. Only after ``HANDOVER_AFTER_S``, so that the save's
        request is in llama-server's queue before the next request's."""
        lease, table = plan.lease, plan.lease.table
        await asyncio.wait({save}, timeout=HANDOVER_AFTER_S)
        if save.done():
            return
        wanted: asyncio.Future[Any] = asyncio.ensure_future(table.until_wanted(lease.slot))
        try:
            await asyncio.wait({save, wanted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            wanted.cancel()
        if not save.done() and not lease.released and table.wanted(lease.slot):
            table.hand_over(lease)
            self.metrics.saves_handed_over.inc()

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
