"""The save side of one ``KVTierCache``: what its context stored last, and storing the next state.

A context's saves replace one another: each stores only the chunks no tier holds yet, and a new
partial tail that replaces the one the context answered for before (after its last save or
restore; ``flows.restored_tail`` / ``flows.tail_after_store``, as on the sidecar). Saves are marked
pending for other nodes until Redis holds them (``flows.SaveMarks``), so a next turn elsewhere may
wait for one rather than recompute.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tiers.keys import Namespace
from tiers.store import StoreResult

from . import flows
from .kvflow import PrefixFetched, TailRecord
from .statefile import SeqState
from .syncstore import SyncStore

log = logging.getLogger("kvtier.llama_cpp")


@dataclass(slots=True)
class CacheCounters:
    """What the cache did since it was created."""

    lookups: int = 0  # __getitem__ calls
    hits: int = 0  # lookups answered with a prefix longer than the context already held
    tokens_restored: int = 0
    saves: int = 0  # states split and offered to the store
    chunks_written: int = 0  # chunks new to at least one tier
    bytes_written: int = 0  # encoded bytes of those chunks
    errors: int = 0  # failed cache steps (each one answered as a miss / skipped)


class ContextSaves:
    """One context's stores: its last partial tail and the tokens it held then, and the marks of
    its saves in flight.

    Args:
        failed: called with a step's name and its error when part of a save fails (counted and
            logged by the cache; the save goes on without that part).
    """

    def __init__(self, store: SyncStore, namespace: Namespace, node: str, counters: CacheCounters,
                 failed: Callable[[str, BaseException], None], timeout: float):
        self.store = store
        self.namespace = namespace
        self.counters = counters
        self.marks = flows.SaveMarks(store.pending, node)
        self.tail: TailRecord | None = None  # the partial tail this context stored or restored last
        self._held = np.zeros(0, np.int32)  # what the context held at the last save (for that tail)
        self._warned: set[str] = set()
        self._failed = failed
        self._timeout = timeout

    def restored(self, fetched: PrefixFetched) -> None:
        """After a restore of ``fetched``: its tail is the one the next save replaces."""
        tail = flows.restored_tail(fetched)
        if tail is not None:
            self.tail = tail

    def store_state(self, tokens: np.ndarray, state: SeqState) -> StoreResult | None:
        """Store ``state`` (what the context holds of ``tokens``): new chunks and its tail; the
        chunks' result, None when no chunk was cut (a tail alone) or the state cannot be stored
        (``SeqState.store_reason``, logged once per reason)."""
        t0 = time.perf_counter()
        reason = state.store_reason
        if reason is not None:
            if reason not in self._warned:  # once per reason: every completion would repeat it
                self._warned.add(reason)
                log.warning("state not stored: %s", reason)
            return None
        previous, self._held = self._held, tokens.copy()
        stored = self.store.call(self.marks.store_state(
            self.store.store, self.namespace, state, events=self.store.events, previous=self.tail,
            previous_tokens=previous), self._timeout)
        if stored.tail_error is not None:
            self._failed("tail store", stored.tail_error)
        self.tail = flows.tail_after_store(stored, self.tail)
        self.counters.saves += 1
        result = stored.chunks
        if result is None:  # a state with a rest under one chunk, or recurrent memory alone: a tail only
            log.debug("stored a tail of %d tokens in %.1f ms", tokens.size, (time.perf_counter() - t0) * 1e3)
            return None
        self.counters.chunks_written += result.chunks_written
        self.counters.bytes_written += result.bytes_encoded
        log.debug("stored %d new of %d chunks in %.1f ms", result.chunks_written, result.chunks_total,
                  (time.perf_counter() - t0) * 1e3)
        return result

    def drain(self, timeout: float) -> None:
        """Wait (bounded) for this context's marked stores to finish, so their marks are cleared."""
        if self.store.closed:
            return
        try:
            self.store.call(self.marks.drain(timeout), timeout + 5)
        except Exception as exc:
            log.debug("waiting for marked stores failed: %s", exc)
