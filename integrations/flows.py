"""Flows both engines run around ``kvflow``'s steps, written once.

The sidecar (llama-server slots) and the in-process cache (``KVTierCache``) call these the same way:

- ``find_prefix_waiting``: look a prompt up; when another node is saving more of it, wait for that
  save (bounded by the caller) and look up again;
- ``session_image``: a named session's manifest, its chunks and tail fetched, laid out as the
  restore file;
- ``restored_tail`` / ``tail_after_store``: which partial tail a context answers for after a
  restore or a store (the next save of it replaces that tail);
- ``SaveMarks``: one node's pending-save marks, held around each save until Redis holds it; it owns
  the background stores it marks and drains them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tiers.keys import Namespace
from tiers.pending import Lift, PendingSaves
from tiers.redis_backend import RedisBackend
from tiers.sessions import Manifest, SessionStore
from tiers.store import TieredStore
from tiers.threads import in_thread

from .chunkassemble import state_pieces
from .kvflow import (
    PrefixFetched,
    PrefixFound,
    Publisher,
    StoredState,
    TailRecord,
    content_mismatch,
    find_prefix,
    store_state,
)
from .memkind import LookupShape
from .pendingflow import PendingSave, Waited, pending_save, wait_for_pending
from .statefile import SeqState


@dataclass(frozen=True, slots=True)
class FoundAfterWait:
    """What a lookup found, after a wait for another node's save when there was one."""

    found: PrefixFound
    waited: Waited | None = None  # the wait, None when no save in flight was worth one
    before: int = 0  # tokens the lookup before that wait found


async def find_prefix_waiting(store: TieredStore, pending: PendingSaves | None, namespace: Namespace,
                              tokens: np.ndarray, shape: LookupShape, *, have: int = 0,
                              limit: Callable[[PendingSave, int], float],
                              found: PrefixFound | None = None) -> FoundAfterWait:
    """The longest prefix of ``tokens`` the tiers hold (``found`` when the caller looked already);
    when a save in flight on another node names more than that and than ``have`` (what the
    context holds), wait for it at most ``limit(save, known)`` seconds (``known``: the larger of
    the two; 0 or less: no wait), then look up again, whether the save ended or not (part of it
    may be stored). ``pending`` None: no marks are read (none, or no time left to wait).
    """
    if found is None:
        found = await find_prefix(store, namespace, tokens, shape)
    if pending is None:
        return FoundAfterWait(found)
    known = max(found.n_tokens, have)
    waited = await wait_for_pending(pending, namespace, tokens, found, known, lambda save: limit(save, known),
                                    n_ctx=shape.n_ctx)
    if waited is None:
        return FoundAfterWait(found)
    return FoundAfterWait(await find_prefix(store, namespace, tokens, shape), waited, found.n_tokens)


@dataclass(frozen=True, slots=True)
class SessionImage:
    """A session laid out as a restore file: consecutive slices (``state_pieces``), written as
    they are (``writev``) or joined (``joined``)."""

    manifest: Manifest
    pieces: list[memoryview]
    tier: str  # the slowest tier its payloads came from
    fetch_s: float
    assemble_s: float

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def joined(self) -> memoryview:
        """The restore file in one writable buffer (what a llama.cpp context loads)."""
        out = np.empty(self.nbytes, np.uint8)
        at = 0
        for p in self.pieces:
            out[at: at + p.nbytes] = np.frombuffer(p, np.uint8)
            at += p.nbytes
        return out.data


async def session_image(sessions: SessionStore, namespace: Namespace, session: str | Manifest, *,
                        v_trans: bool, n_stream: int = 1) -> SessionImage:
    """Session ``session`` (an id, whose manifest is loaded, or the manifest) fetched, chunks and
    tail, and laid out for a context with V layout ``v_trans`` and ``n_stream`` streams (off the
    event loop: a transposition copies half the state).

    Raises:
        SessionNotFound / SessionDamaged: as ``SessionStore.load``. SessionIncomplete: a chunk or
            the tail is gone or damaged. StateFormatError: the payloads do not make one state.
    """
    manifest = session if isinstance(session, Manifest) else await sessions.load(namespace, session)
    t0 = time.perf_counter()
    payloads, tier = await sessions.fetch(namespace, manifest)
    t1 = time.perf_counter()
    pieces = await in_thread(state_pieces, payloads, manifest.tokens, v_trans=v_trans, n_stream=n_stream)
    return SessionImage(manifest, pieces, tier or "memory", t1 - t0, time.perf_counter() - t1)


def restored_tail(fetched: PrefixFetched) -> TailRecord | None:
    """The partial tail a context answers for after restoring ``fetched`` (None: it restored none,
    and the one it answered for before stands)."""
    return TailRecord(fetched.tail.key, fetched.n_tokens) if fetched.tail is not None else None


def tail_after_store(stored: StoredState, before: TailRecord | None) -> TailRecord | None:
    """The partial tail a context answers for after ``stored``: the one it stored (or none, when
    the state has no tail); when storing the tail failed before it was written, still ``before``
    (not deleted: the next save replaces it)."""
    return stored.tail if stored.tail_error is None or stored.tail_stored else before


class SaveMarks:
    """One node's pending-save marks (``pendingflow.pending_marks``): other nodes' next turns of a
    prompt whose save is marked may wait for it.

    Args:
        pending: the marks in Redis; None: nothing is marked (and stores are not deferred).
        node: this node's id, written into each mark.
        expected: seconds from now until Redis should hold a save of so many tokens (the mark
            tells waiters), None while unknown; no estimate without it.
    """

    def __init__(self, pending: PendingSaves | None, node: str, *,
                 expected: Callable[[int], float | None] | None = None):
        self.pending = pending
        self.node = node
        self.expected = expected
        self._tasks: set[asyncio.Task[None]] = set()

    def held(self, namespace: Namespace, tokens: np.ndarray) -> contextlib.AbstractAsyncContextManager[Lift]:
        """Marks for a save of a state that starts with ``tokens``, held for the block (or until
        it calls the ``Lift`` it is given)."""
        seconds = self.expected(int(tokens.size)) if self.expected is not None else None
        ready_at = time.time() + seconds if seconds is not None else 0.0
        return pending_save(self.pending, namespace, tokens, self.node, ready_at=ready_at)

    async def store_state(self, store: TieredStore, namespace: Namespace, state: SeqState, *,
                          previous: TailRecord | None = None, previous_tokens: np.ndarray | None = None,
                          events: Publisher | None = None) -> StoredState:
        """``kvflow.store_state`` with its save marked until Redis holds it: returns once the local
        tiers hold the state; the marks go when the background writes are done (a task of this
        object's, which ``drain`` waits for)."""
        if self.pending is None:
            return await store_state(store, namespace, state, events=events, previous=previous,
                                     previous_tokens=previous_tokens)
        result: asyncio.Future[StoredState] = asyncio.get_running_loop().create_future()

        async def marked() -> None:
            async with self.held(namespace, state.tokens.tokens):
                try:
                    result.set_result(await store_state(store, namespace, state, events=events, previous=previous,
                                                        previous_tokens=previous_tokens))
                except Exception as exc:
                    result.set_exception(exc)
                    return
                await store.written(timeout=60)

        task = asyncio.get_running_loop().create_task(marked())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(result)

    async def drain(self, timeout: float) -> bool:
        """Wait for the marked stores still running; False when ``timeout`` passed first."""
        if not self._tasks:
            return True
        _, left = await asyncio.wait(set(self._tasks), timeout=timeout)
        return not left


def sessions_of(store: TieredStore, backend: RedisBackend | None) -> SessionStore:
    """``store``'s named sessions, for both engines: manifests in Redis when there is one (any node
    restores them), each session's payloads checked as chunks and tails are (``content_mismatch``)."""
    return SessionStore(store, backend.manifests if backend is not None else None, check=content_mismatch)


def pending_of(backend: RedisBackend | None) -> PendingSaves | None:
    """Marks of saves in flight, shared with every node through Redis; None without Redis."""
    return PendingSaves(backend.connection) if backend is not None else None
