"""Pending saves: a node that has just answered marks the prefixes its save will store, and a
lookup on another node that finds less than such a mark names may wait for that save.

- ``pending_marks``: the marks of a save (every full chunk of the prompt, and its partial end to
  within ``REF_STEP`` tokens), held by ``pending_save`` while it runs;
- ``find_pending``: the save in flight that would give a prompt the most beyond what the tiers
  hold (one Redis round trip); ``wait_for_pending`` waits for it, bounded.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np

from tiers.errors import KVTierError
from tiers.keys import Namespace, pending_key, prefix_chain, tail_hash_after, tail_hashes
from tiers.pending import Lift, PendingMark, PendingSaves

from .kvflow import PrefixFound, restorable_tokens
from .prefixrefs import REF_STEP

log = logging.getLogger("kvtier.flow")


@dataclass(frozen=True, slots=True)
class PendingSave:
    """A save in flight that will store ``n_tokens`` of a prompt (at least), under marker ``key``."""

    key: bytes
    n_tokens: int
    mark: PendingMark


def pending_marks(namespace: Namespace, tokens: np.ndarray) -> list[tuple[bytes, int]]:
    """The markers (key, tokens it names) a save of a state that starts with ``tokens``, a prompt
    just answered, sets before it runs: each full chunk, then the partial end rounded down to a
    multiple of ``REF_STEP`` (what ``find_pending`` looks for)."""
    C = namespace.chunk_tokens
    chain = prefix_chain(namespace, tokens)
    marks = [(pending_key(namespace, h), (i + 1) * C) for i, h in enumerate(chain)]
    start = len(chain) * C
    n = (int(tokens.size) - start) // REF_STEP * REF_STEP
    if n:
        parent = chain[-1] if chain else namespace.digest
        marks.append((pending_key(namespace, tail_hash_after(parent, tokens[start: start + n])), start + n))
    return marks


async def find_pending(pending: PendingSaves, namespace: Namespace, tokens: np.ndarray, found: PrefixFound, *,
                       n_ctx: int = 0) -> PendingSave | None:
    """The save in flight that would give the most of ``tokens`` beyond ``found``, or None.

    One Redis round trip: the markers of ``tokens``' full chunks after the found ones, and of its
    partial ends after them every ``REF_STEP`` tokens.
    """
    C = namespace.chunk_tokens
    limit = restorable_tokens(int(tokens.size), n_ctx)
    chain = prefix_chain(namespace, tokens, limit // C)
    k = found.chunks.n_chunks
    probes = [(pending_key(namespace, chain[i]), (i + 1) * C) for i in range(k, len(chain))]
    start = k * C
    parent = chain[k - 1] if k else namespace.digest
    ends = tail_hashes(parent, tokens[start: start + min(C - 1, limit - start)])
    probes += [(pending_key(namespace, ends[n - 1]), start + n) for n in range(REF_STEP, len(ends) + 1, REF_STEP)]
    probes = [(key, n) for key, n in probes if n > found.n_tokens]
    marks = await pending.read([key for key, _ in probes])
    best = None
    for (key, n), mark in zip(probes, marks, strict=True):
        if mark is not None and (best is None or n > best.n_tokens):
            best = PendingSave(key, n, mark)
    return best


@dataclass(frozen=True, slots=True)
class Waited:
    """A wait for a save in flight: the save, whether it ended (False: the wait timed out), how long."""

    save: PendingSave
    ended: bool
    seconds: float


async def wait_for_pending(pending: PendingSaves, namespace: Namespace, tokens: np.ndarray, found: PrefixFound,
                           have: int, limit: Callable[[PendingSave], float], *, n_ctx: int = 0) -> Waited | None:
    """Wait for the save in flight that gives the most of ``tokens`` when it names more than
    ``have``, for at most ``limit(save)`` seconds; None when there is none (or Redis cannot say).
    Look ``tokens`` up again after a wait, ended or not: part of the save may be stored."""
    try:
        save = await find_pending(pending, namespace, tokens, found, n_ctx=n_ctx)
    except KVTierError as exc:
        log.debug("pending saves not read: %s", exc)
        return None
    if save is None or save.n_tokens <= have:
        return None
    bound = limit(save)
    if bound <= 0:
        return None
    t0 = time.perf_counter()
    try:
        ended = await pending.wait_gone(save.key, bound)
    except KVTierError as exc:
        log.debug("pending save not followed: %s", exc)
        ended = False
    return Waited(save, ended, time.perf_counter() - t0)


@contextlib.asynccontextmanager
async def pending_save(pending: PendingSaves | None, namespace: Namespace, tokens: np.ndarray,
                       node: str, *, ready_at: float = 0.0) -> AsyncIterator[Lift]:
    """Marks for a save of a state that starts with ``tokens`` (``pending_marks``), held for the
    block (which may lift them before it ends): other nodes' next turns of it may wait for it.
    ``ready_at``: when Redis should hold it (``time.time()``; 0 for no estimate). Nothing without
    ``pending``."""
    if pending is None or not tokens.size:
        yield _nothing_to_lift
        return
    keys = [key for key, _ in pending_marks(namespace, tokens)]
    async with pending.held(keys, PendingMark(int(tokens.size), node, ready_at)) as lift:
        yield lift


async def _nothing_to_lift() -> None:
    pass
