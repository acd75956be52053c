"""Restores: fetch a planned prefix (or a session), lay it out as a state file, load it into a slot."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from integrations.chunkassemble import state_pieces
from integrations.flows import restored_tail, session_image
from integrations.kvflow import PrefixFound, TailRecord, fetch_prefix
from integrations.memkind import MemoryKind
from integrations.prefixstream import (
    FileSink,
    Streamed,
    StreamStopped,
    stream_prefix,
    stream_session,
    window_chunks,
)
from tiers.keys import Namespace, chunk_key
from tiers.sessions import Manifest, SessionStore
from tiers.store import FetchResult, TieredStore
from tiers.threads import in_thread

from .costmodel import CostModel
from .metrics import Metrics
from .slotfiles import RestoreIO, SlotFiles
from .slots import Lease
from .watcher import Target

log = logging.getLogger("kvtier.engine")

SAVED_FILE = "file"  # the restore tier named for a state loaded from a file a save left in the slot dir


@dataclass(frozen=True, slots=True)
class Restored:
    """What a restore put into a slot."""

    n_tokens: int
    tier: str  # the slowest tier it read from
    ms: float
    fetched: FetchResult | None = None  # chunks found below the fastest tier: promoted after the answer
    tail: TailRecord | None = None  # the automatic tail it restored


class RestoreWriter:
    """Fetches payloads and has llama-server load them into a slot; teaches the cost model the rates."""

    def __init__(self, store: TieredStore, sessions: SessionStore, files: SlotFiles, cost: CostModel,
                 metrics: Metrics, window_bytes: int):
        self.store = store
        self.window_bytes = window_bytes  # a large restore's fetch window (``stream_prefix``)
        self.sessions = sessions
        self.files = files
        self.cost = cost
        self.metrics = metrics

    async def restore_prefix(self, lease: Lease, namespace: Namespace, found: PrefixFound, tokens: np.ndarray,
                             target: Target, *, owner: str) -> Restored | None:
        """Fetch ``found`` and load it into the leased slot, and record in the slot table what it now
        holds (for tenant ``owner``); None when no more than the slot held already arrived."""
        slot, cached = lease.slot, lease.cached_tokens
        if found.n_tokens > cached and (loaded := await self._saved_file(
                lease, namespace, tokens, found.n_tokens, owner=owner, exact=found.whole, cached=cached)) is not None:
            return loaded
        t0 = time.perf_counter()
        # What comes from below the RAM tier is promoted into it: room is made first, so the
        # fetched chunks are not held beside a full tier.
        self.store.make_room(found.bytes_by_tier(namespace.chunk_tokens, target.bytes_per_token),
                             keep=[chunk_key(namespace, h) for h in found.chunks.chunks])
        if (window := self._stream_window(namespace, target, found.chunks.n_chunks, found.whole)) is not None:
            try:
                return await self._streamed(lease, namespace, found, tokens, target, window, owner=owner, t0=t0)
            except StreamStopped as exc:  # the file as laid out cannot be finished: fetch the prefix whole
                self._stopped(slot, exc)
        got = await fetch_prefix(self.store, namespace, found)
        if got.n_tokens <= cached:
            self.metrics.restores.labels("none", "miss").inc()
            return None
        self.metrics.restore_phase_seconds.labels("fetch").observe(time.perf_counter() - t0)
        chunks = got.chunks
        for tier in set(chunks.tiers):
            share = chunks.tiers.count(tier) / max(chunks.n_chunks, 1)
            self.cost.observe_fetch(tier, int(chunks.bytes_read * share), chunks.seconds * share)
        nbytes, restore_s = await self.load(slot, got.payloads, tokens, target, sharing=lease.sharing)
        self.cost.observe_restore(nbytes, restore_s)
        if got.tail is not None:
            self.metrics.tails.labels("restored").inc()
        done = Restored(got.n_tokens, self._slowest(got.tiers), (time.perf_counter() - t0) * 1000, chunks,
                        restored_tail(got))
        self._count(done, nbytes, cached)
        lease.table.record_restore(slot, tokens[:done.n_tokens].copy(), owner=owner, tail=done.tail)
        log.info("slot %d: restored %d tokens from %s in %.1f ms", slot, done.n_tokens, done.tier, done.ms)
        return done

    def _stream_window(self, namespace: Namespace, target: Target, n_chunks: int, whole: bool = False) -> int | None:
        """Chunks per window when a restore of ``n_chunks`` chunks is streamed (``prefixstream``:
        plain KV in rows, more than one window), else None."""
        window = window_chunks(self.window_bytes, namespace.chunk_tokens, target.bytes_per_token)
        streams = target.memory_kind is MemoryKind.KV and not target.v_trans and not whole and n_chunks > window
        return window if streams else None

    def _stopped(self, slot: int, exc: StreamStopped) -> None:
        self.metrics.restore_streams.labels("stopped").inc()
        log.info("slot %d: streamed restore stopped (%s); restoring what the tiers hold", slot, exc)

    async def _streamed(self, lease: Lease, namespace: Namespace, found: PrefixFound, tokens: np.ndarray,
                        target: Target, window: int, *, owner: str, t0: float) -> Restored:
        """Restore ``found`` with its restore file written window by window as the chunks arrive
        (``stream_prefix``), each promoted once written; record it in the slot table."""
        got, io = await self._stream_into(lease, found.n_tokens * target.bytes_per_token, lambda sink: stream_prefix(
            self.store, namespace, found, tokens, sink, window=window, n_stream=target.n_stream,
            have=lease.cached_tokens))
        if got.tail is not None:
            self.metrics.tails.labels("restored").inc()
        tail = TailRecord(got.tail.key, got.n_tokens) if got.tail is not None else None
        done = Restored(got.n_tokens, self._slowest(got.tiers), (time.perf_counter() - t0) * 1000, None, tail)
        self._count(done, io.nbytes, lease.cached_tokens)
        lease.table.record_restore(lease.slot, tokens[:done.n_tokens].copy(), owner=owner, tail=done.tail)
        log.info("slot %d: restored %d tokens from %s in %.1f ms (written as fetched)", lease.slot, done.n_tokens,
                 done.tier, done.ms)
        return done

    async def _stream_into(self, lease: Lease, expect: int,
                           stream: Callable[[FileSink], Awaitable[Streamed]]) -> tuple[Streamed, RestoreIO]:
        """Have ``stream`` write the leased slot's restore file (of about ``expect`` bytes) as it
        fetches, restore it, and learn the rates: the fetch, and what the write did not hide."""
        box: list[Streamed] = []

        async def fill(sink: FileSink) -> None:
            box.append(await stream(sink))

        io = await self.files.restore_placed(lease.slot, expect, fill)
        got = box[0]
        self.metrics.restore_streams.labels("written").inc()
        self.metrics.restore_phase_seconds.labels("fetch").observe(got.fetch_s)
        read = sum(got.bytes_by_tier.values())
        for tier, nbytes in got.bytes_by_tier.items():
            self.cost.observe_fetch(tier, nbytes, got.fetch_s * nbytes / max(read, 1))
        io = replace(io, write_s=max(0.0, io.write_s - got.fetch_s))
        self._observe(io, 0.0, lease.sharing)
        self.cost.observe_restore(io.nbytes, io.write_s + io.llama_s)
        return got, io

    def _slowest(self, tiers: Iterable[str]) -> str:
        order = [t.name for t in self.store.tiers]
        return max(tiers, key=order.index)

    async def _saved_file(self, lease: Lease, namespace: Namespace, tokens: np.ndarray, n: int, *, owner: str,
                          exact: bool, cached: int) -> Restored | None:
        """Load the file a save on this node left in the slot dir, when it still holds the state of
        ``tokens[:n]`` (``SlotFiles.restore_saved``), and record it; None when none does.

        A state of plain KV may hold up to twice the prefix's tokens (not ``exact``): llama-server
        keeps the cells the prompt shares with it and drops the rest, as after its own cached
        prompts. One with a rest (sliding window, recurrent) must hold exactly the prefix, whose
        end its rest is; a session's, exactly the session's tokens.
        """
        t0 = time.perf_counter()
        loaded = await self.files.restore_saved(lease.slot, namespace, tokens, n, exact=exact)
        if loaded is None:
            return None
        io, held = loaded
        # The queue wait is learned as ever; no restore rate: this is not the rate of a restore
        # from the tiers, which is what the cost model prices.
        self._observe(io, 0.0, lease.sharing)
        # No tail recorded: without reading it, the tail found may be a reference, which is no
        # tail of this context (``restored_tail``) and must not be deleted as one.
        done = Restored(n, SAVED_FILE, (time.perf_counter() - t0) * 1000)
        self._count(done, io.nbytes, cached)
        lease.table.record_restore(lease.slot, held, owner=owner, tail=done.tail)
        log.info("slot %d: restored %d tokens from a saved file of %d in %.1f ms", lease.slot, n, held.size, done.ms)
        return done

    async def restore_session(self, lease: Lease, namespace: Namespace, manifest: Manifest, target: Target, *,
                              owner: str, cached: int = 0) -> Restored:
        """Restore a whole session (chunks and tail) into the leased slot, and record it in the slot
        table (for tenant ``owner``).

        Raises:
            SessionIncomplete: a chunk or the tail is gone. LlamaServerError: the restore was refused.
        """
        if (loaded := await self._saved_file(lease, namespace, manifest.tokens, manifest.tokens.size, owner=owner,
                                             exact=True, cached=cached)) is not None:
            return loaded
        t0 = time.perf_counter()
        if (window := self._stream_window(namespace, target, manifest.chunks)) is not None:
            try:
                got, io = await self._stream_into(
                    lease, manifest.n_tokens * target.bytes_per_token, lambda sink: stream_session(
                        self.sessions, namespace, manifest, sink, window=window, n_stream=target.n_stream))
            except StreamStopped as exc:  # fetched whole instead: a part gone raises SessionIncomplete there
                self._stopped(lease.slot, exc)
            else:
                streamed = Restored(got.n_tokens, self._slowest(got.tiers), (time.perf_counter() - t0) * 1000)
                self._count(streamed, io.nbytes, cached)
                lease.table.set_tokens(lease.slot, manifest.tokens.copy(), owner=owner, stored=True)
                return streamed
        image = await session_image(self.sessions, namespace, manifest, v_trans=target.v_trans,
                                    n_stream=target.n_stream)
        self.metrics.restore_phase_seconds.labels("fetch").observe(image.fetch_s)
        nbytes, _ = await self._write(lease.slot, image.pieces, image.assemble_s, lease.sharing)
        done = Restored(int(manifest.tokens.size), image.tier, (time.perf_counter() - t0) * 1000)
        self._count(done, nbytes, cached)
        lease.table.set_tokens(lease.slot, manifest.tokens.copy(), owner=owner, stored=True)
        return done

    async def load(self, slot: int, payloads: Sequence[bytes | memoryview], tokens: np.ndarray,
                   target: Target, *, sharing: int = 0) -> tuple[int, float]:
        """Assemble ``payloads`` into a state file and have llama-server restore it into ``slot``.

        Returns the file's size and the seconds from payloads to restored slot (the cost model's
        restore rate: everything but the fetch and any wait in llama-server's task queue, which it
        learns apart, by the ``sharing`` other slots computing beside the restore).
        """
        t0 = time.perf_counter()
        # The file as a list of slices of the payloads (and of transposed V blocks, for a server
        # without flash attention), written without joining them; off the event loop, as a
        # transposition copies half the state.
        pieces = await in_thread(state_pieces, payloads, tokens, v_trans=target.v_trans,
                                 n_stream=target.n_stream)
        return await self._write(slot, pieces, time.perf_counter() - t0, sharing)

    async def _write(self, slot: int, pieces: list[memoryview], assemble_s: float,
                     sharing: int) -> tuple[int, float]:
        """Write the restore file ``pieces`` (laid out in ``assemble_s``) and restore it into
        ``slot``, beside ``sharing`` other computing slots."""
        io = await self.files.restore(slot, pieces)
        self._observe(io, assemble_s, sharing)
        return io.nbytes, assemble_s + io.write_s + io.llama_s

    def _observe(self, io: RestoreIO, assemble_s: float, sharing: int) -> None:
        """Record a restore's phases and teach the cost model its wait in llama-server's queue."""
        phases = self.metrics.restore_phase_seconds
        phases.labels("assemble").observe(assemble_s)
        phases.labels("write").observe(io.write_s)
        phases.labels("queue").observe(io.waited_s - io.llama_s)
        phases.labels("llama").observe(io.llama_s)
        # The restore's own time (llama-server's restore_ms) and the wait in its queue behind other
        # slots' batches are learned apart: the wait depends on how many slots compute (seconds
        # under load), the restore on its size.
        self.cost.observe_queue_wait(sharing, io.waited_s - io.llama_s)

    def _count(self, done: Restored, nbytes: int, cached: int) -> None:
        self.metrics.restores.labels(done.tier, "ok").inc()
        self.metrics.restore_seconds.observe(done.ms / 1000)
        self.metrics.bytes_restored.inc(nbytes)
        self.metrics.tokens_restored.inc(done.n_tokens - cached)
