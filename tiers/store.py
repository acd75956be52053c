"""TieredStore: ordered tiers behind one prefix lookup, with write-behind to slow tiers."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .base import Tier, TierStats
from .codec import BlobCodec, Flags
from .errors import CodecError
from .keys import (
    ChunkHash,
    Namespace,
    chunk_key,
    prefix_chain,
    sequence_key,
    tail_hash_after,
    tail_hashes,
    tail_key,
    whole_key,
)

log = logging.getLogger("kvtier.store")

DEFAULT_QUEUE_LIMIT = 32  # pending background jobs (one per stored state); the oldest is dropped past this
BATCH_BYTES = 32 << 20  # bytes per background pipeline

PayloadSource = Callable[[int], bytes | bytearray | memoryview]
Announce = Callable[[list[bytes]], Awaitable[object]]


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest contiguous prefix the tiers hold."""

    matched_tokens: int
    chunks: list[ChunkHash]
    tiers: list[str]  # the fastest tier holding each chunk

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)


@dataclass(frozen=True, slots=True)
class TailHit:
    """A stored partial tail a prompt continues: its length, hash and key, and the fastest tier."""

    n_tokens: int
    hash: ChunkHash
    key: bytes
    tier: str


@dataclass(frozen=True, slots=True)
class FetchResult:
    """Verified payloads of a prefix, in chain order."""

    payloads: list[bytes | memoryview]
    tiers: list[str]
    n_tokens: int
    bytes_read: int
    seconds: float
    keys: list[bytes] = field(default_factory=list)
    blobs: list[bytes | memoryview] = field(default_factory=list)  # as stored, for a later promotion

    @property
    def n_chunks(self) -> int:
        return len(self.payloads)


@dataclass(frozen=True, slots=True)
class StoreResult:
    chunks_total: int
    chunks_written: int  # new to at least one synchronous tier or queued for a background one
    bytes_encoded: int
    seconds: float


@dataclass(slots=True)
class _StoreCounters:
    corrupt: int = 0
    dropped_writes: int = 0
    background_errors: int = 0
    promotions: int = 0


@dataclass(slots=True)
class _Job:
    """One pending background write: keys, and the encoded value of key ``i`` on demand."""

    keys: list[bytes]
    blob: Callable[[int], bytes]
    enqueued: float = field(default_factory=time.monotonic)
    announce: Announce | None = None  # told the keys a background tier holds now that it did not before


class TieredStore:
    """Ordered tiers (fastest first) behind one prefix lookup.

    Writes go synchronously to the ``sync`` tiers and through a bounded queue to the tiers marked
    ``write_behind`` (Redis), so a request never waits on a remote write; when the queue is full
    the oldest pending write is dropped and counted. Reads verify every blob (``BlobCodec.decode``):
    a damaged or foreign value is deleted from its tier, counted, and ends the prefix there.

    Args:
        tiers: tiers in order, fastest first.
        codec: the one codec every tier's values go through.
        queue_limit: pending background writes before the oldest is dropped.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        codec: BlobCodec,
        *,
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
    ):
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if queue_limit <= 0:
            raise ValueError("queue_limit must be positive")
        self.tiers = list(tiers)
        self.codec = codec
        self._sync = [t for t in self.tiers if not t.write_behind]
        self._background = [t for t in self.tiers if t.write_behind]
        self._queue: collections.deque[_Job] = collections.deque()
        self._queue_limit = queue_limit
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._idle: asyncio.Event | None = None
        self.counters = _StoreCounters()

    # -- lookup and fetch ---------------------------------------------------------------------

    async def lookup(self, namespace: Namespace, tokens: Sequence[int], max_chunks: int | None = None) -> LookupResult:
        """The longest contiguous run of chunks, from the start, that some tier holds."""
        chain = prefix_chain(namespace, tokens, max_chunks)
        return await self.lookup_chain(namespace, chain)

    async def lookup_chain(self, namespace: Namespace, chain: Sequence[ChunkHash]) -> LookupResult:
        keys = [chunk_key(namespace, h) for h in chain]
        holder: list[str | None] = [None] * len(keys)
        for tier in self.tiers:
            todo = [i for i, h in enumerate(holder) if h is None]
            if not todo:
                break
            try:
                present = await tier.contains_many([keys[i] for i in todo])
            except Exception:  # a tier never fails a lookup
                log.warning("lookup on tier %s failed", tier.name, exc_info=True)
                continue
            for i, ok in zip(todo, present):
                if ok:
                    holder[i] = tier.name
        n = next((i for i, h in enumerate(holder) if h is None), len(holder))
        return LookupResult(n * namespace.chunk_tokens, list(chain[:n]), [h for h in holder[:n] if h])

    async def fetch(self, namespace: Namespace, chain: Sequence[ChunkHash], *, promote: bool = True) -> FetchResult:
        """Load and verify the chunks of ``chain``, stopping at the first one no tier has intact.

        Hits from lower tiers are written to the synchronous tiers above them (promotion), unless
        ``promote`` is False: then the caller may do it later with ``promote(result)``, once the
        payloads have served their purpose (a restore should not wait for a copy into RAM).
        """
        t0 = time.perf_counter()
        keys = [chunk_key(namespace, h) for h in chain]
        ns_id = namespace.digest[:8]
        payloads: list[bytes | memoryview | None] = [None] * len(keys)
        sources: list[str | None] = [None] * len(keys)
        raw_blobs: dict[int, bytes | memoryview] = {}
        bytes_read = 0
        for tier in self.tiers:
            todo = [i for i, p in enumerate(payloads) if p is None]
            if not todo:
                break
            try:
                got = await tier.get_many([keys[i] for i in todo])
            except Exception:
                log.warning("fetch on tier %s failed", tier.name, exc_info=True)
                continue
            corrupt: list[bytes] = []
            for i in todo:
                blob = got.get(keys[i])
                if blob is None:
                    continue
                try:
                    decoded = self.codec.decode(blob, chunk_hash=chain[i], namespace_id=ns_id)
                except CodecError as exc:
                    log.warning("damaged chunk %s in tier %s: %s (deleted)", keys[i].decode(), tier.name, exc)
                    corrupt.append(keys[i])
                    continue
                payloads[i] = decoded.payload
                sources[i] = tier.name
                raw_blobs[i] = blob
                bytes_read += len(blob)
            if corrupt:
                self.counters.corrupt += len(corrupt)
                try:
                    await tier.delete(corrupt)
                except Exception:
                    log.warning("could not delete damaged chunks from %s", tier.name, exc_info=True)
        n = next((i for i, p in enumerate(payloads) if p is None), len(payloads))
        result = FetchResult(
            [p for p in payloads[:n] if p is not None], [s for s in sources[:n] if s], n * namespace.chunk_tokens,
            bytes_read, time.perf_counter() - t0, keys[:n], [raw_blobs[i] for i in range(n)],
        )
        if promote:
            await self.promote(result)
            result = replace(result, seconds=time.perf_counter() - t0)
        return result

    async def fetch_with_tail(self, namespace: Namespace, chain: Sequence[ChunkHash], tail: tuple[bytes, bytes] | None,
                              *, promote: bool = True) -> tuple[FetchResult, bytes | memoryview | None]:
        """``fetch`` of ``chain`` and, beside it rather than after it, ``get_verified`` of a partial
        tail given as (key, value hash); None for the tail when there is none, or it is gone or damaged."""
        fetching = self.fetch(namespace, chain, promote=promote)
        if tail is None:
            return await fetching, None
        return await asyncio.gather(fetching, self.get_verified(tail[0], tail[1], namespace))

    async def promote(self, fetched: FetchResult) -> None:
        """Copy the chunks ``fetched`` found in lower tiers into the synchronous tiers above them."""
        order = {t.name: i for i, t in enumerate(self.tiers)}
        for tier in self._sync:
            items = {
                key: bytes(blob)
                for key, src, blob in zip(fetched.keys, fetched.tiers, fetched.blobs)
                if order[src] > order[tier.name]
            }
            if items:
                try:
                    self.counters.promotions += await tier.put_many(items)
                except Exception:
                    log.warning("promotion into %s failed", tier.name, exc_info=True)

    # -- store ----------------------------------------------------------------------------------

    async def store(
        self,
        namespace: Namespace,
        chain: Sequence[ChunkHash],
        payloads: PayloadSource,
        *,
        flags: Flags = Flags.NONE,
        announce: Announce | None = None,
    ) -> StoreResult:
        """Store the chunks of ``chain`` that are not stored yet.

        ``payloads(i)`` gives chunk ``i``'s payload; it is called only for chunks some tier lacks,
        so a prefix shared by many sessions is split, encoded and sent once. The background writer
        may call it after this returns, so what it reads must not change (an immutable copy of the
        saved state): keys name tokens, not bytes, and a changed payload would be stored as valid.
        ``announce(keys)`` is awaited once a background (shared) tier holds keys it lacked: peers
        told of a chunk before then would find nothing.
        """
        t0 = time.perf_counter()
        keys = [chunk_key(namespace, h) for h in chain]
        ns_id = namespace.digest[:8]
        blobs: dict[int, bytes] = {}

        def blob(i: int) -> bytes:
            if i not in blobs:
                blobs[i] = self.codec.encode(payloads(i), chunk_hash=chain[i], namespace_id=ns_id,
                                             n_tokens=namespace.chunk_tokens, flags=flags)
            return blobs[i]

        written = set()
        for tier in self._sync:
            try:
                present = await tier.contains_many(keys)
            except Exception:
                log.warning("contains on tier %s failed", tier.name, exc_info=True)
                continue  # a broken tier is not written to
            missing = [i for i, ok in enumerate(present) if not ok]
            if not missing:
                continue
            try:
                await tier.put_many({keys[i]: blob(i) for i in missing})
                written.update(missing)
            except Exception:
                log.warning("put on tier %s failed", tier.name, exc_info=True)
        if self._background:
            # The writer probes each background tier itself (EXISTS before SET) and encodes only
            # what is missing there: a key seen once may be gone by now (TTL, eviction, a restarted
            # Redis), so nothing is assumed.
            self._enqueue(_Job(keys, blob, announce=announce))
        return StoreResult(len(keys), len(written), sum(len(b) for b in blobs.values()), time.perf_counter() - t0)

    async def lookup_tail(self, namespace: Namespace, parent: bytes,
                          tokens: Sequence[int] | np.ndarray) -> TailHit | None:
        """The longest partial tail stored after chunk ``parent`` whose tokens start ``tokens``.

        One existence check per tier for every candidate length (``tail_hashes``); a nearer tier
        holding a shorter tail does not hide a longer one further down.
        """
        hashes = tail_hashes(parent, tokens)
        if not hashes:
            return None
        keys = [tail_key(namespace, h) for h in hashes]
        best: TailHit | None = None
        for tier in self.tiers:
            try:
                present = await tier.contains_many(keys)
            except Exception:  # a tier never fails a lookup
                log.warning("tail lookup on tier %s failed", tier.name, exc_info=True)
                continue
            t = next((i + 1 for i in range(len(keys) - 1, -1, -1) if present[i]), 0)
            if t and (best is None or t > best.n_tokens):
                best = TailHit(t, hashes[t - 1], keys[t - 1], tier.name)
        return best

    async def store_tail(self, namespace: Namespace, parent: bytes, tokens: Sequence[int] | np.ndarray,
                         payload: bytes | bytearray | memoryview, *, announce: Announce | None = None) -> bytes:
        """Store the partial tail of ``tokens`` cells after chunk ``parent``; returns its key.
        ``announce`` as for ``store``."""
        h = tail_hash_after(parent, tokens)
        blob = self.codec.encode(payload, chunk_hash=h, namespace_id=namespace.digest[:8], n_tokens=len(tokens),
                                 flags=Flags.TAIL)
        key = tail_key(namespace, h)
        await self.put_raw(key, blob, announce=announce)
        return key

    async def store_tails(self, namespace: Namespace, items: Sequence[tuple[ChunkHash, bytes, int]]) -> list[bytes]:
        """Store several values under partial-tail keys at once, each given as (tail hash, payload,
        token count); one write per tier, one background job. Returns their keys."""
        ns_id = namespace.digest[:8]
        blobs = {tail_key(namespace, h): self.codec.encode(payload, chunk_hash=h, namespace_id=ns_id, n_tokens=n,
                                                           flags=Flags.TAIL)
                 for h, payload, n in items}
        if blobs:
            await self.put_raw_many(blobs)
        return list(blobs)

    async def put_raw(self, key: bytes, blob: bytes, *, announce: Announce | None = None) -> None:
        """Write one already encoded value to every tier (sync tiers now, background queued)."""
        await self.put_raw_many({key: blob}, announce=announce)

    async def put_raw_many(self, blobs: Mapping[bytes, bytes], *, announce: Announce | None = None) -> None:
        """Write already encoded values to every tier (sync tiers now, background queued)."""
        for tier in self._sync:
            try:
                await tier.put_many(blobs)
            except Exception:
                log.warning("put on tier %s failed", tier.name, exc_info=True)
        if self._background:
            keys = list(blobs)
            self._enqueue(_Job(keys, lambda i: blobs[keys[i]], announce=announce))

    async def store_whole(self, namespace: Namespace, tokens: Sequence[int], payload: bytes | memoryview) -> bytes:
        """Store an unsplittable state under the key of its exact token sequence."""
        h = sequence_key(namespace, tokens)
        blob = self.codec.encode(payload, chunk_hash=h, namespace_id=namespace.digest[:8],
                                 n_tokens=len(tokens), flags=Flags.WHOLE)
        await self.put_raw(whole_key(namespace, h), blob)
        return h

    async def fetch_whole(self, namespace: Namespace, tokens: Sequence[int]) -> bytes | memoryview | None:
        """The whole state stored for exactly ``tokens``, or None."""
        h = sequence_key(namespace, tokens)
        return await self.get_verified(whole_key(namespace, h), h, namespace)

    async def get_verified(self, key: bytes, value_hash: bytes, namespace: Namespace) -> bytes | memoryview | None:
        """One value from the fastest tier that holds it intact (damaged copies are deleted)."""
        for tier in self.tiers:
            try:
                got = (await tier.get_many([key])).get(key)
            except Exception:
                log.warning("get on tier %s failed", tier.name, exc_info=True)
                continue
            if got is None:
                continue
            try:
                return self.codec.decode(got, chunk_hash=value_hash, namespace_id=namespace.digest[:8]).payload
            except CodecError as exc:
                self.counters.corrupt += 1
                log.warning("damaged value %s in tier %s: %s (deleted)", key.decode(errors="replace"), tier.name, exc)
                try:
                    await tier.delete([key])
                except Exception:
                    log.warning("could not delete a damaged value from %s", tier.name, exc_info=True)
        return None

    async def prefetch(self, keys: Sequence[bytes]) -> int:
        """Copy values that only the background tiers hold into the synchronous ones (pre-warming).

        Values are copied as stored; every read verifies them anyway. Returns how many were copied.
        """
        if not self._sync or not self._background or not keys:
            return 0
        copied = 0
        for tier in self._sync:
            try:
                present = await tier.contains_many(keys)
            except Exception:
                log.warning("contains on tier %s failed", tier.name, exc_info=True)
                continue
            wanted = [k for k, ok in zip(keys, present) if not ok]
            for source in self._background:
                if not wanted:
                    break
                try:
                    got = await source.get_many(wanted)
                    if got:
                        copied += await tier.put_many({k: bytes(v) for k, v in got.items()})
                except Exception:
                    log.warning("prefetch from %s into %s failed", source.name, tier.name, exc_info=True)
                wanted = [k for k in wanted if k not in got]
        return copied

    async def delete_everywhere(self, keys: Sequence[bytes]) -> None:
        for tier in self.tiers:
            try:
                await tier.delete(keys)
            except Exception:
                log.warning("delete on tier %s failed", tier.name, exc_info=True)

    # -- background writes ----------------------------------------------------------------------

    def _enqueue(self, job: _Job) -> None:
        if len(self._queue) >= self._queue_limit:
            self._queue.popleft()
            self.counters.dropped_writes += 1
        self._queue.append(job)
        self._ensure_worker()
        assert self._wakeup is not None and self._idle is not None
        self._idle.clear()
        self._wakeup.set()

    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._idle = asyncio.Event()
            self._worker = asyncio.get_running_loop().create_task(self._drain_forever(), name="kvtier-write-behind")

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    async def _drain_forever(self) -> None:
        assert self._wakeup is not None and self._idle is not None
        while True:
            if not self._queue:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            job = self._queue.popleft()
            for tier in self._background:
                await self._write_background(tier, job)

    async def _write_background(self, tier: Tier, job: _Job) -> None:
        try:
            present = await tier.contains_many(job.keys)
            missing = [i for i, ok in enumerate(present) if not ok]
            # Pipelines of ~32 MB keep each round trip large but bounded.
            batch: dict[bytes, bytes] = {}
            size = 0
            written: list[bytes] = []
            for n, i in enumerate(missing):
                value = job.blob(i)
                batch[job.keys[i]] = value
                size += len(value)
                if size >= BATCH_BYTES or n == len(missing) - 1:
                    stored = await tier.put_many(batch)
                    if stored < len(batch):
                        # Tiers report failures as counts, not exceptions (a miss is not an error).
                        self.counters.background_errors += 1
                        log.warning("background write to %s stored %d of %d values", tier.name, stored, len(batch))
                    else:
                        written += batch
                    batch, size = {}, 0
        except Exception:
            self.counters.background_errors += 1
            log.warning("background write to %s failed", tier.name, exc_info=True)
            return
        if written and job.announce is not None:
            try:
                await job.announce(written)
            except Exception:
                log.debug("announcing %d stored keys failed", len(written), exc_info=True)

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until the background queue is empty; False if ``timeout`` ran out first."""
        if self._worker is None or self._idle is None:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    # -- stats and lifecycle --------------------------------------------------------------------

    def stats(self) -> dict[str, TierStats]:
        return {t.name: t.stats() for t in self.tiers}

    async def aclose(self, drain_timeout: float = 5.0) -> None:
        """Drain pending background writes (bounded by ``drain_timeout``), then close the tiers."""
        if self._worker is not None:
            # Flush even with an empty queue: the worker may still be writing the job it took last.
            await self.flush(drain_timeout)
            # Cancel until it ends, but never wait on it unbounded: Python 3.11's asyncio.wait_for
            # (inside redis-py) can swallow a cancellation that races its inner task's completion,
            # and a worker that survived one cancel would otherwise be awaited forever.
            deadline = asyncio.get_running_loop().time() + 1.0
            while not self._worker.done() and asyncio.get_running_loop().time() < deadline:
                self._worker.cancel()
                await asyncio.wait({self._worker}, timeout=0.1)
            if not self._worker.done():
                log.warning("the background writer did not stop; abandoning it")
            self._worker = None
        for tier in self.tiers:
            try:
                await tier.aclose()
            except Exception:
                log.warning("closing tier %s failed", tier.name, exc_info=True)
