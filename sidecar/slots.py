"""What each llama-server slot holds, and who may use it.

Each slot is used by one request at a time (a per-slot lock, held through the request and the save
that follows it). More requests than slots wait in one FIFO queue, so they are served in arrival
order; a waiter is handed the best idle slot for its own prompt when its turn comes.

``SlotTable`` is the only writer of a slot's record: the other parts read ``Slot`` and tell the table
what happened (a restore, the begin and end of a save, what a save read and stored, a slot found
emptied), one method per transition.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import numpy as np

from integrations.flows import tail_after_store
from integrations.kvflow import StoredState, TailRecord
from tiers.keys import common_prefix

from .asked import Asked, continues, follows
from .slotrecord import PREFILL_SURE, SavedSlot, Slot, slot_worth


@dataclass(slots=True, eq=False)
class Lease:
    """A slot granted to one request, bound to the table it came from.

    ``release()`` gives it back to that table (not to a table that replaced it since, after
    llama-server restarted) and is idempotent; ``with lease:`` releases on exit.
    """

    table: SlotTable
    slot: int
    cached_tokens: int  # tokens of the request's prompt the slot already holds (same tenant)
    waited_s: float = 0.0
    foreign: bool = False  # the slot holds another tenant's tokens: erase before use
    released: bool = False

    @property
    def sharing(self) -> int:  # other slots computing beside this one: its slot actions wait behind them
        return self.table.computing - 1

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.table._release(self.slot)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# A request waiting for a slot: its future, prompt, the slot it asked for (or None) and its tenant.
Waiter = tuple[asyncio.Future[Lease], np.ndarray, int | None, str]


class SlotRecords:
    """The records of what each slot holds, and the transitions of the save after an answer
    (``SlotTable`` is one: its choice of slots and its queue are in the class itself)."""

    slots: list[Slot]
    _clock: Callable[[], float]
    _waiters: collections.deque[Waiter]
    _watched: dict[int, asyncio.Event]  # slots whose save waits for a waiter (set at each new one)

    def set_tokens(self, slot: int, tokens: np.ndarray, owner: str | None = None, *, stored: bool = False) -> None:
        """Record what ``slot`` holds (exactly), whose it is (``None``: as before), and if the tiers hold it all."""
        record = self.slots[slot]
        record.tokens = np.asarray(tokens, dtype=np.int32)
        record.stored, record.asked, record.unknown = record.tokens.size if stored else 0, (), False
        if owner is not None:
            record.owner = owner

    def forget(self, slot: int) -> None:
        """What ``slot`` holds is unknown now (a failed request or save): none of it counts as
        cached, and another tenant's request erases it before use (its owner is kept)."""
        self.set_tokens(slot, np.zeros(0, np.int32))
        self.slots[slot].unknown = True

    def begin_save(self, slot: int, answered: tuple[np.ndarray, str] | None, asked: Asked = ()) -> None:
        """An answer ended in ``slot`` and its save begins: the slot is saving, and holds at least
        ``answered`` (the prompt it answered and its tenant; None when that prompt is not known: a
        failed request, or a follow-up sent without its tokens, which continues what the slot held).
        ``asked``: what that request asked, given only when it ended well (``pending_follow_up``)."""
        record = self.slots[slot]
        record.served = record.saving = True
        record.answered = answered
        record.answered_asked = asked
        record.answered_at = self._clock()
        self.nudge()  # one slot fewer computing: a save waiting beside it checks

    def begin_write(self, slot: int) -> None:
        """A save has llama-server write ``slot``'s state (until ``end_write``: read, or failed)."""
        self.slots[slot].writing = True

    def end_write(self, slot: int) -> None:
        self.slots[slot].writing = False
        self.nudge()  # a save held back beside this write checks

    def since_answer(self, slot: int) -> float | None:
        """Seconds since ``slot``'s last answer ended; None before its first."""
        at = self.slots[slot].answered_at
        return self._clock() - at if at else None

    def pending_follow_up(self, asked: Asked, *, want: int | None = None, owner: str = "") -> int | None:
        """A slot whose save after an answer has not read it yet, and whose answered request
        ``asked`` repeats exactly or, a chat, extends by that answer and one new message (the next
        turn: ``extends``), for the same tenant; None when there is none. Such a request may wait
        for that slot as a follow-up (``KVEngine.follow_up``), untokenized: it holds all the
        answered prompt, so its own save stores all the skipped one would have (``awaited``). A
        text prompt with another end is tokenized first: only its tokens tell whether it does.
        The answer may itself have been a follow-up's (its prompt's tokens never known)."""
        for s in self.slots:
            if (s.saving and s.hot()[1] == owner and (want is None or s.id == want)
                    and follows(s.answered_asked, asked)):
                return s.id
        return None

    def awaited(self, slot: int) -> bool:
        """Whether a request of the same tenant waits for ``slot`` while its save runs, repeating or
        continuing the prompt it answered (its tokens, or what it asked: ``await_follow_up``): the
        slot serves it as llama-server alone would."""
        record = self.slots[slot]
        if not record.saving:
            return False
        if any(follows(record.answered_asked, a) for a in record.followers):
            return True
        return record.answered is not None and 0 < record.answered[0].size == self.kept_by_waiter(slot)

    def kept_by_waiter(self, slot: int) -> int:
        """The most of the prompt ``slot`` answered that a request of the same tenant waiting for
        it keeps (their common prefix), while its save runs; 0 when none waits."""
        record = self.slots[slot]
        if not record.saving or record.answered is None:
            return 0
        answered, owner = record.answered
        return max((common_prefix(answered, tokens) for fut, tokens, want, waiter in self._waiters
                    if not fut.done() and waiter == owner and want in (None, slot)), default=0)

    def waited_by_owner(self, slot: int) -> bool:
        """Whether every request waiting that ``slot`` could serve is of the tenant it holds (one of
        another tenant has the slot erased before use, which llama-server's own cache keeps no copy of)."""
        owner = self.slots[slot].hot()[1]
        return all(waiter == owner for fut, _, want, waiter in self._waiters if not fut.done() and want in (None, slot))

    def wanted(self, slot: int) -> bool:
        """Whether a request waits that ``slot`` could serve (it asked for that slot, or any)."""
        return any(not fut.done() and want in (None, slot) for fut, _, want, _ in self._waiters)

    async def until_wanted(self, slot: int, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) for ``slot`` to be ``wanted``; whether it is."""
        return await self._until(slot, lambda: self.wanted(slot), timeout)

    def nudge(self) -> None:
        """Saves waiting on the table look again (``_until``): a slot was released, or a drain began."""
        for event in self._watched.values():
            event.set()

    async def _until(self, slot: int, holds: Callable[[], bool], timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) for ``holds()``, checked again each time
        a request starts waiting or a slot is released (``nudge``; the save of ``slot`` waits, one
        at a time); whether it holds."""
        event = self._watched[slot] = asyncio.Event()
        try:
            async with asyncio.timeout(timeout):
                while not holds():
                    event.clear()
                    await event.wait()
        except TimeoutError:
            pass
        finally:
            self._watched.pop(slot, None)
        return holds()

    def hand_over(self, lease: Lease) -> None:
        """The save after ``lease``'s answer is sent but not done (it waits in llama-server's queue
        behind other slots' batches) and a request waits for the slot: the slot goes to it now.
        llama-server runs its queued tasks in order, so that save still reads what the answer left
        before the next request's task starts. The slot holds at least the prompt it answered, and
        the request it answered asked what it asked (its follow-ups may go there, as after
        ``skip_save``); the save records nothing when it ends (``record_saved``)."""
        asked = self.slots[lease.slot].answered_asked
        self._holds_answered(lease.slot)
        self.slots[lease.slot].asked = asked
        self.end_save(lease)

    def skip_save(self, slot: int, asked: Asked) -> None:
        """The save after an answer is not made (``awaited``): the slot holds at least the prompt
        it answered, for that prompt's tenant, and the request it answered asked ``asked``."""
        self._holds_answered(slot)
        self.slots[slot].asked = asked

    def _holds_answered(self, slot: int) -> None:
        """Record that ``slot`` holds the prompt its answer ran on (at least), for that prompt's tenant,
        the tiers what they held of both; when that prompt is not known (a follow-up), what the table
        knew stays: the conversation it continued, the same tenant's."""
        record = self.slots[slot]
        if record.answered is not None:
            stored = self.stored_answered(slot)
            self.set_tokens(slot, record.answered[0], owner=record.answered[1])
            record.stored = stored

    def stored_answered(self, slot: int) -> int:
        """How many tokens of the prompt ``slot`` answered last the tiers hold (by what it held before;
        a follow-up's, whose tokens are not known, continues all of that)."""
        record = self.slots[slot]
        return record.stored if record.answered is None else self.stored_of(slot, *record.answered)

    def stored_of(self, slot: int, tokens: np.ndarray, owner: str) -> int:
        """How many of ``tokens`` (tenant ``owner``'s) the tiers hold by what ``slot`` holds."""
        record = self.slots[slot]
        return min(record.stored, common_prefix(record.tokens, tokens)) if record.owner == owner else 0

    def save_failed(self, lease: Lease) -> None:
        """The save after ``lease``'s answer failed before it read the slot (a full slot dir, a
        llama-server error): the slot holds at least the prompt that answer ran on. What it held
        before differs from that past their common prefix, and may be another tenant's."""
        if not lease.released:  # else the save read the slot (and recorded it), or it was handed over
            self._holds_answered(lease.slot)  # a failed request forgot its slot before the save

    def end_save(self, lease: Lease) -> None:
        """The save after an answer has read the slot (or will not read it): give the slot back for
        its next request. Once: a next request may hold the slot by a later call."""
        if lease.released:
            return
        record = self.slots[lease.slot]
        record.saving = False
        record.answered, record.answered_asked = None, ()
        lease.release()

    def record_saved(self, slot: int, tokens: np.ndarray, owner: str, grant: int | None = None) -> SavedSlot:
        """A save read ``tokens`` from ``slot`` (tenant ``owner``); returns what the slot held
        before and the array it holds now (a later change of the slot replaces that array).
        ``grant``: the slot's lease count when the save began; when it was handed over since
        (``hand_over``), the slot serves another request and nothing is recorded."""
        record = self.slots[slot]
        if grant is not None and grant != record.leases:
            return SavedSlot(np.asarray(tokens, dtype=np.int32), np.zeros(0, np.int32), None)
        previous, previous_tail = record.tokens, record.tail
        self.set_tokens(slot, tokens, owner=owner, stored=True)
        return SavedSlot(record.tokens, previous, previous_tail)

    def record_tail(self, slot: int, saved: SavedSlot, stored: StoredState) -> None:
        """The tail the slot answers for after storing the save ``saved`` (``tail_after_store``),
        unless the slot changed since (a next request restored into it, or was saved): then that
        tail is no longer the one it holds."""
        record = self.slots[slot]
        if record.tokens is saved.tokens:
            record.tail = tail_after_store(stored, record.tail)

    def drop_tail(self, slot: int) -> None:
        """Keep the tail ``slot`` stored last from its next save's replacing it (``store_state``
        deletes the tail a save supersedes)."""
        self.slots[slot].tail = None

    def record_asked(self, slot: int, asked: Asked) -> None:
        """What the request whose answer ``slot`` holds asked (for its follow-ups): set after the
        save recorded the slot's tokens, which forgets what it asked before."""
        self.slots[slot].asked = asked


class SlotTable(SlotRecords):
    """Slot choice: the idle slot whose reuse is worth most (``slot_worth``), the least recently used one among equals."""

    def __init__(self, n_slots: int, clock: Callable[[], float] = time.monotonic):
        if n_slots <= 0:
            raise ValueError("n_slots must be positive")
        self.slots = [Slot(i) for i in range(n_slots)]
        self._clock = clock
        self._waiters: collections.deque[Waiter] = collections.deque()
        self._watched: dict[int, asyncio.Event] = {}

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    @property
    def computing(self) -> int:
        """Slots running a request (``Slot.computing``)."""
        return sum(1 for s in self.slots if s.computing)

    def beside(self, slot: int) -> int:
        """Other slots that ``slot``'s save would stall: computing, or written by another save (one write
        at a time: a request that comes meanwhile waits for one write in llama-server's queue)."""
        return sum(1 for s in self.slots if s.id != slot and (s.writing or s.computing))

    def computes(self, slot: int, seconds: float) -> None:
        """The request on ``slot`` has about ``seconds`` of its prompt to compute (``KVEngine.prepare``):
        counted as ``PREFILL_SURE`` of that, so that a save sent beside it lands before its end."""
        self.slots[slot].prefill_until = self._clock() + PREFILL_SURE * seconds
        self.nudge()  # a save held past half its wait may go beside a long prompt (``held_beside``)

    def prefilling_beside(self, slot: int, seconds: float) -> bool:
        """Whether another slot computes a prompt with at least ``seconds`` of it left."""
        now = self._clock()
        return any(s.id != slot and s.computing and s.prefill_until - now >= seconds for s in self.slots)

    async def until_alone(self, slot: int, timeout: float, *, stop: Callable[[], bool] = lambda: False) -> None:
        """Wait up to ``timeout`` s until none is ``beside`` ``slot``, it is ``wanted``, or ``stop()``."""
        await self._until(slot, lambda: not self.beside(slot) or self.wanted(slot) or stop(), timeout)

    async def until_busy(self, slot: int, timeout: float, *, stop: Callable[[], bool] = lambda: False) -> bool:
        """Wait up to ``timeout`` seconds for ``beside`` slots, ``slot`` to be ``wanted``, or ``stop()``;
        whether one of them came (``held_beside``: the quiet moment before a held save)."""
        return await self._until(slot, lambda: bool(self.beside(slot)) or self.wanted(slot) or stop(), timeout)

    def _choose(self, tokens: np.ndarray, want: int | None, owner: str) -> Lease | int | None:
        """The lease for the best idle slot (``slot_worth``); or the id of a slot whose save is running, worth
        more than any idle one by the same measure (a next turn keeps its slot; a new conversation sharing a
        header with it takes a free one, not a wait behind that save's write); None when nothing is idle."""
        idle = [s for s in self.slots if not s.busy and (want is None or s.id == want)]
        held = {s.id: common_prefix(s.tokens, tokens) if s.owner == owner else 0 for s in idle}
        now, coldest = self._clock(), min(idle, key=lambda s: s.last_used) if idle else None
        worth = {s.id: slot_worth(s, held[s.id], coldest, now) for s in idle}
        saving = [(slot_worth(s, common_prefix(hot, tokens), None, now, hot), s.id) for s in self.slots
                  if s.saving and (want is None or s.id == want) for hot, hot_owner in [s.hot()] if hot_owner == owner]
        if saving and (wait_for := max(saving))[0] > max(worth.values(), default=0):
            return wait_for[1]
        if not idle:
            return None
        best = max(idle, key=lambda s: (worth[s.id], -s.last_used))
        self._grant(best)
        return Lease(self, best.id, held[best.id],
                     foreign=best.owner != owner and (best.tokens.size > 0 or best.unknown))

    async def acquire(self, tokens: np.ndarray, *, want: int | None = None, timeout: float | None = None,
                      owner: str = "") -> Lease:
        """A slot for ``tokens``; waits (FIFO) while every eligible slot is busy.

        Args:
            want: a specific slot id (the sessions API), else any slot.
            timeout: seconds to wait before ``TimeoutError``.
            owner: the tenant (salt); only its own slots' tokens count as a common prefix.
        """
        if want is not None and not 0 <= want < self.n_slots:
            raise ValueError(f"slot {want} does not exist (this server has {self.n_slots})")
        t0 = self._clock()
        if not self._waiters:
            lease = self._choose(tokens, want, owner)
            if isinstance(lease, Lease):
                return lease
        fut: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        entry = (fut, tokens, want, owner)
        self._waiters.append(entry)
        self._wake()  # those ahead may wait for one slot in particular: this one may still go now
        self.nudge()  # a save waiting for a waiter checks this one
        try:  # without a timeout, no shield: the waiter wakes in the loop's next turn, not its second
            lease = await (fut if timeout is None else asyncio.wait_for(asyncio.shield(fut), timeout))
        except (TimeoutError, asyncio.CancelledError):
            if entry in self._waiters:
                self._waiters.remove(entry)
            if fut.done() and not fut.cancelled():
                fut.result().release()  # granted as we gave up: hand it on
            else:
                fut.cancel()
            raise
        lease.waited_s = self._clock() - t0
        return lease

    def follow_up(self, asked: Asked, *, want: int | None = None, owner: str = "") -> Lease | None:
        """The idle slot holding the request that ``asked`` continues (see ``continues``), taken
        now; None when there is none or other requests are waiting (they keep their turn).

        The lease's ``cached_tokens`` is 0: what the slot shares with the new prompt is not computed.
        """
        if self._waiters:
            return None
        for s in self.slots:
            if (not s.busy and s.asked and s.owner == owner and (want is None or s.id == want)
                    and continues(s.asked, asked)):
                self._grant(s)
                return Lease(self, s.id, 0)
        return None

    async def await_follow_up(self, asked: Asked, *, want: int | None = None, owner: str = "") -> Lease | None:
        """For a request that repeats or extends an answer whose save has not read its slot yet
        (``pending_follow_up``): that slot, once the save has read it, or skipped it since this
        request waits (``awaited``), as a follow-up's lease (``cached_tokens`` 0, as ``follow_up``).
        None when there is no such slot, or it no longer holds what was asked (its save failed):
        the request then takes the full path."""
        slot = self.pending_follow_up(asked, want=want, owner=owner)
        if slot is None:
            return None
        record = self.slots[slot]
        record.followers.append(asked)
        try:
            lease = await self.acquire(record.hot()[0], want=slot, owner=owner)
        finally:
            record.followers.remove(asked)
        if lease.foreign or not follows(record.asked, asked):
            lease.release()
            return None
        lease.cached_tokens = 0
        return lease

    def try_acquire(self, slot: int) -> Lease | None:
        """Take a specific idle slot without waiting (None when busy)."""
        s = self.slots[slot]
        if s.busy:
            return None
        self._grant(s)
        return Lease(self, slot, 0)

    def _grant(self, slot: Slot) -> None:
        slot.busy = True
        slot.last_used = self._clock()
        slot.prefill_until = 0.0  # not known until its plan (``computes``; a follow-up's stays so)
        slot.leases += 1
        self.nudge()  # one slot more computing: a save waiting for a quiet moment checks

    def _release(self, slot: int) -> None:
        self.slots[slot].busy = False
        self.slots[slot].last_used = self._clock()
        self._wake()
        self.nudge()  # one slot fewer computing: a save waiting beside it checks

    def _wake(self) -> None:
        # FIFO among waiters; one waiting for a specific busy slot does not block the others.
        for entry in list(self._waiters):
            fut, tokens, want, owner = entry
            if fut.done():
                self._waiters.remove(entry)
                continue
            lease = self._choose(tokens, want, owner)
            if not isinstance(lease, Lease):
                if lease is None and want is None:
                    return  # nothing idle at all
                continue  # waiting for one slot in particular: the others keep their turn
            self._waiters.remove(entry)
            fut.set_result(lease)

    # -- what a slot holds: every change goes through one of these ---------------------------------

    def record_restore(self, slot: int, tokens: np.ndarray, *, owner: str, tail: TailRecord | None) -> None:
        """A restore put ``tokens`` into ``slot`` for tenant ``owner``, and ``tail`` when it restored
        one (the next save of the slot replaces that tail; with none restored, the one recorded
        stays only while ``tokens`` hold all it covers: another context's is not this one's)."""
        record = self.slots[slot]
        old = record.tail
        if tail is None and old is not None and common_prefix(record.tokens, tokens) < old.end:
            old = None
        self.set_tokens(slot, tokens, owner=owner, stored=True)
        record.tail = tail if tail is not None else old

    def emptied(self, slot: int) -> None:
        """llama-server reports ``slot`` empty (erased behind kvtier's back): it holds nothing and
        counts as never served (it reports no token count then)."""
        self.set_tokens(slot, np.zeros(0, np.int32))
        self.slots[slot].served = False

    def resyncing(self, slot: int, held: int) -> None:
        """kvtier reads ``slot`` again since llama-server reports ``held`` tokens (once per count)."""
        self.slots[slot].resynced = held

    def note_tasks(self, infos: list[dict[str, Any]]) -> bool | None:
        """Record each slot's last task id from llama-server's ``/slots``. True when one is lower
        than recorded, or gone: task ids only grow within one llama-server process, so another
        process answers now. False when some recorded id was found again or higher; None when no
        slot had one recorded (no slot ran a task yet): nothing tells one process from another."""
        verdict: bool | None = None
        for info in infos:
            slot_id, task = info.get("id"), info.get("id_task")
            if not isinstance(slot_id, int) or not 0 <= slot_id < self.n_slots:
                continue
            slot = self.slots[slot_id]
            task = task if isinstance(task, int) and not isinstance(task, bool) else None
            if slot.task_id is not None:
                went_back = task is None or task < slot.task_id
                verdict = went_back or bool(verdict)
            slot.task_id = task
        return verdict

    def tokens(self, slot: int) -> np.ndarray:
        return self.slots[slot].tokens

    def held_about(self, slot: int) -> int:
        """About how many tokens ``slot`` holds, its answer not counted: the prompt it answered last
        while its save is to come (what it held before may be another conversation's), else what
        it is known to hold (a follow-up continues that)."""
        record = self.slots[slot]
        return record.answered[0].size if record.answered is not None else record.tokens.size
