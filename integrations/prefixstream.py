"""A found prefix of plain KV fetched window by window, each written into its restore file as it arrives.

``fetch_prefix`` holds a whole prefix before its restore file is laid out: at 8B 8k, 1 GiB in
hand, then a 1 GiB file written after the last chunk came. Here the next window is fetched while
the one before is written at its offsets (``PlacedFile``), promoted into the faster tiers and
dropped: the fetch and the write overlap, and no more than two windows are held.

A chunk or tail that turns out gone, damaged or unlike the first changes the file's layout after
part of it is written: the stream stops (``StreamStopped``), and the caller restores the prefix the
way ``fetch_prefix`` does, which ends it before that chunk (the chunks already promoted come from
the RAM tier then).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tiers.errors import KVTierError, StateFormatError
from tiers.keys import ChunkHash, Namespace, prefix_chain
from tiers.sessions import Manifest, SessionStore
from tiers.store import ContentCheck, FetchResult, TailHit, TieredStore

from .chunkplace import Placed, PlacedFile
from .chunks import read_chunk_header
from .kvflow import PrefixFound, checked_tail, content_mismatch


class StreamStopped(KVTierError):
    """A streamed restore could not finish its file as laid out: the caller restores another way."""


class FileSink(Protocol):
    """Where a streamed restore file goes: sized once, then written piece by piece at offsets."""

    async def size(self, nbytes: int) -> None: ...

    async def write(self, placed: Placed) -> None: ...


@dataclass(frozen=True, slots=True)
class Streamed:
    """What a streamed restore wrote."""

    n_tokens: int
    nbytes: int  # the restore file's size
    tiers: frozenset[str]
    tail: TailHit | None  # the tail a context answers for after it (None: none, or a reference)
    fetch_s: float  # seconds of fetching, one window after another (the writes ran beside them)
    bytes_by_tier: dict[str, int]  # bytes read from each tier (the cost model's fetch rates)


def window_chunks(window_bytes: int, chunk_tokens: int, bytes_per_token: int) -> int:
    """Chunks per window: about ``window_bytes``, at least two."""
    return max(2, window_bytes // max(1, chunk_tokens * bytes_per_token))


async def stream_prefix(store: TieredStore, namespace: Namespace, found: PrefixFound, tokens: np.ndarray,
                        sink: FileSink, *, window: int, n_stream: int = 1, have: int = 0) -> Streamed:
    """Fetch ``found`` (plain KV: no rest, chunks in rows) ``window`` chunks at a time and write its
    restore file into ``sink`` as the windows arrive; each window is promoted once written.

    Raises:
        StreamStopped: a chunk was gone, damaged or unlike the first (the file is unfinished), or
            without its tail the prefix is no longer than ``have`` (what the slot holds: nothing written).
    """
    async def tail() -> _Tail:
        hit = found.tail
        if hit is None or (value := await store.read_verified(hit.key, hit.hash, namespace)) is None:
            return None, None, ""
        payload, answered = await checked_tail(store, namespace, found, hit, value, found.chunks.matched_tokens)
        return payload, answered, value.tier

    return await _stream(store, namespace, found.chunks.chunks, tail, tokens, sink, window=window,
                         n_stream=n_stream, check=content_mismatch, have=have)


async def stream_session(sessions: SessionStore, namespace: Namespace, manifest: Manifest, sink: FileSink, *,
                         window: int, n_stream: int = 1) -> Streamed:
    """``stream_prefix`` for session ``manifest``: its chunks, then its tail.

    Raises:
        StreamStopped: a chunk or the tail was gone, damaged or unlike the first chunk.
    """
    async def tail() -> _Tail:
        if not manifest.tail_tokens:
            return None, None, ""
        value = await sessions.read_tail(namespace, manifest)
        if value is None:
            raise StreamStopped(f"session {manifest.id!r}: its tail is gone or damaged")
        return value.payload, None, value.tier

    chain = prefix_chain(namespace, manifest.tokens, manifest.chunks)
    return await _stream(sessions.store, namespace, chain, tail, manifest.tokens, sink, window=window,
                         n_stream=n_stream, check=sessions.check)


# A tail's payload when it is restored (None: none, or it is gone), the tail a context then answers
# for (None: none, or a reference), and the tier it came from.
_Tail = tuple[bytes | memoryview | None, TailHit | None, str]


async def _stream(store: TieredStore, namespace: Namespace, chain: Sequence[ChunkHash],
                  tail: Callable[[], Coroutine[Any, Any, _Tail]],
                  tokens: np.ndarray, sink: FileSink, *, window: int, n_stream: int,
                  check: ContentCheck | None, have: int = 0) -> Streamed:
    """The chunks of ``chain`` and the ``tail`` after them into ``sink``, window by window, when
    they are more than ``have`` tokens."""
    C = namespace.chunk_tokens
    fetch_s = [0.0]

    async def fetch(start: int) -> FetchResult:
        t0 = time.perf_counter()
        hashes = chain[start : start + window]
        got = await store.fetch(namespace, hashes, promote=False)
        if check is not None:
            got = await store.matching(got, check, C, start * C)
        fetch_s[0] += time.perf_counter() - t0
        if got.n_chunks < len(hashes):
            raise StreamStopped(f"chunk {start + got.n_chunks} of {len(chain)} is gone or damaged")
        return got

    current, (tail_payload, hit, tail_tier) = await _both(fetch(0), tail())
    cells = [C] * len(chain) + ([_cells(tail_payload)] if tail_payload is not None else [])
    if sum(cells) <= have:
        raise StreamStopped(f"{sum(cells)} tokens without the tail: no more than the slot holds")
    try:
        layout = PlacedFile(read_chunk_header(current.payloads[0]), cells, tokens, n_stream=n_stream)
        await sink.size(layout.nbytes)
        placed = layout.head() + (layout.chunk(len(chain), tail_payload) if tail_payload is not None else [])
    except StateFormatError as exc:
        raise StreamStopped(str(exc)) from exc
    by_tier: dict[str, int] = {}
    for at in range(0, len(chain), window):
        following = asyncio.create_task(fetch(at + window)) if at + window < len(chain) else None
        try:
            placed += _placed(layout, at, current.payloads)
            await sink.write(placed)
            await store.promote(current)
        except BaseException:
            if following is not None:
                following.cancel()
            raise
        for tier, blob in zip(current.tiers, current.blobs):
            by_tier[tier] = by_tier.get(tier, 0) + len(blob)
        placed = []
        if following is not None:
            current = await following
    tiers = set(by_tier) | ({tail_tier} if tail_payload is not None else set())
    return Streamed(sum(cells), layout.nbytes, frozenset(tiers), hit, fetch_s[0], by_tier)


async def _both(first: Coroutine[Any, Any, FetchResult],
                tail: Coroutine[Any, Any, _Tail]) -> tuple[FetchResult, _Tail]:
    """The first window and, beside it, the tail; neither is left running when the other fails."""
    tasks = (asyncio.create_task(first), asyncio.create_task(tail))
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    return tasks[0].result(), tasks[1].result()


def _cells(payload: bytes | memoryview) -> int:
    return read_chunk_header(payload).n_cells


def _placed(layout: PlacedFile, first: int, payloads: Sequence[bytes | memoryview]) -> Placed:
    try:
        return [p for i, payload in enumerate(payloads) for p in layout.chunk(first + i, payload)]
    except StateFormatError as exc:
        raise StreamStopped(str(exc)) from exc
