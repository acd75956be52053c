"""The record of one llama-server slot (``Slot``), what a save recorded of it (``SavedSlot``), and
what taking it is worth to a request (``slot_worth``).

``SlotTable`` (``slots.py``) writes them, one method per transition; every other part reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from integrations.kvflow import TailRecord

from .asked import Asked


@dataclass(slots=True)
class Slot:
    """What kvtier knows of one slot (written by its ``SlotTable`` only)."""

    id: int
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    busy: bool = False
    last_used: float = 0.0
    owner: str = ""  # tenant salt of what the slot holds: another tenant's tokens never count
    served: bool = False  # has run a completion since llama-server started (it reports a count then)
    asked: Asked = ()  # the request whose answer the slot holds (forgotten with its tokens)
    tail: TailRecord | None = None  # the partial tail it stored or restored last
    resynced: int | None = None  # llama-server's token count when kvtier last read the slot again
    saving: bool = False  # busy with the save after an answer (the request itself is done)
    writing: bool = False  # llama-server writes its state to a file (a save): its other slots wait meanwhile
    # While saving: the prompt that answer ran on and its tenant (the slot holds at least that;
    # ``tokens`` and ``owner`` say so once the save has read the slot).
    answered: tuple[np.ndarray, str] | None = None
    answered_asked: Asked = ()  # while saving: what that answered request asked (its follow-ups')
    # What it holds is not known (a failed or cancelled request, a save that failed): llama-server
    # may still hold the owner's KV, so another tenant's request erases it before use.
    unknown: bool = False
    # The id of the last task llama-server reported for it. Task ids only grow within one
    # llama-server process: one that went down, or vanished, means the server restarted.
    task_id: int | None = None
    # Grants so far: a save begun under an earlier one (its slot handed over since) records nothing.
    leases: int = 0
    # While it saves: what the requests waiting for it untokenized asked (``await_follow_up``).
    followers: list[Asked] = field(default_factory=list)
    answered_at: float = 0.0  # when its last answer ended (the table's clock)
    stored: int = 0  # how many of ``tokens`` the tiers were given (a save stored, a restore read them)
    prefill_until: float = 0.0  # while it computes: when its prompt should be computed (the table's clock)

    @property
    def computing(self) -> bool:
        """Running a request (a slot whose answer is being saved is not computing)."""
        return self.busy and not self.saving

    def hot(self) -> tuple[np.ndarray, str]:
        """What the slot holds at least, and for which tenant: while its save runs, the prompt
        it just answered (known before the save reads the slot), else ``tokens``. While it
        saves, ``tokens`` is what it held before that answer (the save sets them and ends
        ``saving`` in one step), which the answer replaced past their common prefix, however
        long it was."""
        if self.saving and self.answered is not None:
            return self.answered
        return self.tokens, self.owner


@dataclass(frozen=True, slots=True)
class SavedSlot:
    """What a save recorded of a slot: the tokens it read, and what the slot held before."""

    tokens: np.ndarray  # the very array the slot table holds (``is`` tells whether it changed since)
    previous: np.ndarray
    previous_tail: TailRecord | None


# The share of a prompt's expected compute (the cost model's) that ``SlotTable.computes`` counts on: the
# rate comes from prompts of other lengths or loads, or from the prior before any was measured.
PREFILL_SURE = 0.75


# A slot used this recently holds a live conversation (agents' steps, chat turns: back within minutes;
# colder is in the tiers): a request overwriting more than it reuses takes a colder free slot (``slot_worth``).
LIVE_S = 600.0


def slot_worth(slot: Slot, reused: int, coldest: Slot | None, now: float, held: np.ndarray | None = None) -> int:
    """What taking ``slot`` is worth to a request that reuses ``reused`` of its tokens:
    those tokens, less the ones it would overwrite when they belong to a live conversation
    (used within ``LIVE_S``) while a colder slot is free. So a request that shares a system
    prompt with another conversation takes the empty or coldest slot rather than that
    conversation's, whose next turn then finds its slot still holding it; one that
    continues a slot (nothing overwritten) or reuses more than it overwrites takes that slot.
    ``held``: what the slot holds, when not its ``tokens`` (a slot whose save runs: ``Slot.hot``)."""
    lost = 0 if slot.unknown and held is None else int((slot.tokens if held is None else held).size) - reused
    live = slot is not coldest and now - slot.last_used < LIVE_S
    return reused - lost if live else reused
