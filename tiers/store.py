"""TieredStore: ordered tiers behind one prefix lookup, with write-behind to slow tiers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .base import Tier, TierStats, Value, attempt
from .codec import BlobCodec, Flags, Framed
from .keys import (
    ChunkHash,
    Namespace,
    chunk_key,
    prefix_chain,
    tail_hash_after,
    tail_hashes,
    tail_key,
)
from .presence import first_holders, longest_held
from .reads import Promoter, Verified, VerifiedReader
from .threads import in_background
from .writebehind import DEFAULT_QUEUE_LIMIT, DEFAULT_WINDOW_BYTES, Announce, WriteBehind
from .writethrough import WriteThrough

__all__ = ["DEFAULT_QUEUE_LIMIT", "DEFAULT_WINDOW_BYTES", "REPLACED_GRACE_S", "Announce", "ContentCheck", "FetchResult", "LookupResult", "PayloadSource", "StoreCounters",
           "StoreResult", "TailHit", "TieredStore", "Verified"]

PayloadSource = Callable[[int], bytes | bytearray | memoryview | Framed]
# How long a value that a newer one replaces (a conversation's or a session's partial tail) stays
# in the background tiers after the new one is there (``delete_everywhere(grace=)``): another node
# may have looked it up and still be fetching the chunks before it (0.4 s for a 3,700-token SmolLM2
# state here, seconds at an 8B model's size). Deleted at once, agent_loop's 4k hop lost the tail it
# had found and recomputed 134 tokens instead of 45.
REPLACED_GRACE_S = 30.0
# (payload, expected first position, expected cell count) -> None when the payload holds those
# cells, else what is wrong: the engine's check that a value holds what its key names (tiers knows
# bytes, not KV; ``integrations.kvflow.content_mismatch`` is the llama.cpp one).
ContentCheck = Callable[[bytes | memoryview, int, int], str | None]


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

    def first(self, n: int, chunk_tokens: int) -> FetchResult:
        """The result of its first ``n`` chunks only (those after them were rejected)."""
        if n >= self.n_chunks:
            return self
        return replace(self, payloads=self.payloads[:n], tiers=self.tiers[:n], n_tokens=n * chunk_tokens,
                       bytes_read=sum(len(b) for b in self.blobs[:n]), keys=self.keys[:n], blobs=self.blobs[:n])


@dataclass(frozen=True, slots=True)
class StoreResult:
    chunks_total: int
    chunks_written: int  # new to at least one synchronous tier or queued for a background one
    bytes_encoded: int
    seconds: float


@dataclass(frozen=True, slots=True)
class StoreCounters:
    """What the store has counted, read from the parts that count it."""

    corrupt: int = 0  # damaged or foreign values found and deleted
    dropped_writes: int = 0  # background writes dropped from a full queue
    background_errors: int = 0  # background writes that failed
    promotions: int = 0  # values copied up into faster tiers after a fetch


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
        window_bytes: how much of a large store is cut and encoded at a time.
    """

    def __init__(self, tiers: Sequence[Tier], codec: BlobCodec, *, queue_limit: int = DEFAULT_QUEUE_LIMIT,
                 window_bytes: int = DEFAULT_WINDOW_BYTES):
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.tiers = list(tiers)
        self.codec = codec
        self.window_bytes = window_bytes  # a large store's window: the next is cut while one is sent
        self._through = WriteThrough([t for t in self.tiers if not t.write_behind])
        self._writer = WriteBehind([t for t in self.tiers if t.write_behind], queue_limit=queue_limit)
        self._reader = VerifiedReader(codec)
        self._promoter = Promoter(self.tiers)

    @property
    def counters(self) -> StoreCounters:
        return StoreCounters(self._reader.corrupt, self._writer.dropped, self._writer.errors,
                             self._promoter.promotions)

    @property
    def queue_depth(self) -> int:
        """Background writes waiting."""
        return self._writer.depth

    # -- lookup and fetch ---------------------------------------------------------------------

    async def lookup(self, namespace: Namespace, tokens: Sequence[int], max_chunks: int | None = None) -> LookupResult:
        """The longest contiguous run of chunks, from the start, that some tier holds."""
        chain = prefix_chain(namespace, tokens, max_chunks)
        return await self.lookup_chain(namespace, chain)

    async def lookup_chain(self, namespace: Namespace, chain: Sequence[ChunkHash]) -> LookupResult:
        holders = await first_holders(self.tiers, [chunk_key(namespace, h) for h in chain])
        return LookupResult(len(holders) * namespace.chunk_tokens, list(chain[: len(holders)]), holders)

    async def fetch(self, namespace: Namespace, chain: Sequence[ChunkHash], *, promote: bool = True) -> FetchResult:
        """Load and verify the chunks of ``chain``, stopping at the first one no tier has intact.

        Hits from lower tiers are written to the synchronous tiers above them (promotion), unless
        ``promote`` is False: then the caller may do it later with ``promote(result)``, once the
        payloads have served their purpose (a restore should not wait for a copy into RAM).
        """
        t0 = time.perf_counter()
        keys = [chunk_key(namespace, h) for h in chain]
        found = await self._reader.read(self.tiers, dict(zip(keys, chain)), namespace.digest[:8])
        n = next((i for i, k in enumerate(keys) if k not in found), len(keys))
        hits = [found[k] for k in keys[:n]]
        result = FetchResult(
            [v.payload for v in hits], [v.tier for v in hits], n * namespace.chunk_tokens,
            sum(len(v.blob) for v in hits), time.perf_counter() - t0, keys[:n], [v.blob for v in hits],
        )
        if promote:
            await self.promote(result)
            result = replace(result, seconds=time.perf_counter() - t0)
        return result

    def make_room(self, bytes_by_tier: Mapping[str, int], keep: Sequence[bytes] = ()) -> None:
        """Before a fetch whose chunks are promoted later: a synchronous tier with a byte budget (RAM)
        evicts now what the bytes from other tiers will displace there, sparing ``keep`` (the fetch's)."""
        for tier in self._through.tiers:
            make_room = getattr(tier, "make_room", None)
            if make_room is not None:
                make_room(sum(n for name, n in bytes_by_tier.items() if name != tier.name), set(keep))

    async def fetch_with_tail(self, namespace: Namespace, chain: Sequence[ChunkHash], tail: tuple[bytes, bytes] | None,
                              *, promote: bool = True) -> tuple[FetchResult, Verified | None]:
        """``fetch`` of ``chain`` and, beside it rather than after it, ``read_verified`` of a partial
        tail given as (key, value hash); None for the tail when there is none, or it is gone or damaged."""
        fetching = self.fetch(namespace, chain, promote=promote)
        if tail is None:
            return await fetching, None
        return await asyncio.gather(fetching, self.read_verified(tail[0], tail[1], namespace))

    async def promote(self, fetched: FetchResult) -> None:
        """Copy the chunks ``fetched`` found in lower tiers into the synchronous tiers above them."""
        await self._promoter.promote(fetched.keys, fetched.tiers, fetched.blobs)

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
        after ``payloads.prepare(first, end)`` is awaited for the window of chunks it is in, when it
        has that method, so a prefix shared by many sessions is split, encoded and sent once. The
        background writer may call it after this returns, so what it reads must not change (an
        immutable copy of the saved state): keys name tokens, not bytes, and a changed payload
        would be stored as valid. ``announce(keys)`` is awaited once a background (shared) tier
        holds keys it lacked: peers told of a chunk before then would find nothing.

        The write to the background tiers is queued first: it sends each window of about
        ``window_bytes`` as soon as it is cut and encoded, while the next one is (for the RAM tier).
        """
        t0 = time.perf_counter()
        keys = [chunk_key(namespace, h) for h in chain]
        ns_id = namespace.digest[:8]
        blobs: dict[int, Value] = {}

        def blob(i: int) -> Value:
            if i not in blobs:
                blobs[i] = self.codec.encode(payloads(i), chunk_hash=chain[i], namespace_id=ns_id,
                                             n_tokens=namespace.chunk_tokens, flags=flags)
            return blobs[i]

        size = getattr(payloads, "size_of", None)  # a source that can tell a chunk's size before cutting it
        per = max(2, self.window_bytes // max(1, size(0))) if size and keys else 0  # 0: one window of all
        prepare = _Windows(payloads, blob, len(keys), per)
        self._writer.submit(keys, blob, announce=announce, prepare=prepare)  # encodes only what a background tier lacks
        written = await self._through.put_missing(keys, blob, prepare, size)
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
        found = await longest_held(self.tiers, keys)
        if found is None:
            return None
        n, tier = found
        return TailHit(n, hashes[n - 1], keys[n - 1], tier)

    async def store_tail(self, namespace: Namespace, parent: bytes, tokens: Sequence[int] | np.ndarray,
                         payload: bytes | bytearray | memoryview | Framed, *,
                         announce: Announce | None = None) -> bytes:
        """Store the partial tail of ``tokens`` cells after chunk ``parent``; returns its key.
        ``announce`` as for ``store``."""
        h = tail_hash_after(parent, tokens)
        # Up to a chunk's size: encoded off the event loop, as the chunks are (``store``).
        blob = await in_background(self.codec.encode, payload, chunk_hash=h, namespace_id=namespace.digest[:8],
                                   n_tokens=len(tokens), flags=Flags.TAIL)
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

    async def put_raw(self, key: bytes, blob: Value, *, announce: Announce | None = None) -> None:
        """Write one already encoded value to every tier (sync tiers now, background queued)."""
        await self.put_raw_many({key: blob}, announce=announce)

    async def put_raw_many(self, blobs: Mapping[bytes, Value], *, announce: Announce | None = None) -> None:
        """Write already encoded values to every tier (sync tiers now, background queued)."""
        await self._through.put_many(blobs)
        keys = list(blobs)
        self._writer.submit(keys, lambda i: blobs[keys[i]], announce=announce)

    async def read_verified(self, key: bytes, value_hash: bytes, namespace: Namespace) -> Verified | None:
        """One value from the fastest tier that holds it intact (damaged copies are deleted), with
        the tier it came from; None when no tier does."""
        return (await self._reader.read(self.tiers, {key: value_hash}, namespace.digest[:8])).get(key)

    async def matching(self, fetched: FetchResult, check: ContentCheck, chunk_tokens: int, first_pos: int = 0) -> FetchResult:
        """``fetched`` up to its first chunk failing ``check`` (which is ``reject``ed): chunk ``i``
        must hold the ``chunk_tokens`` cells from ``first_pos + i * chunk_tokens``."""
        for i, payload in enumerate(fetched.payloads):
            reason = check(payload, first_pos + i * chunk_tokens, chunk_tokens)
            if reason is not None:
                await self.reject(fetched.keys[i], fetched.tiers[i], reason)
                return fetched.first(i, chunk_tokens)
        return fetched

    async def reject(self, key: bytes, tier: str, reason: str) -> None:
        """A value that passed the codec but does not hold what its key names (another chunk's
        cells under this chunk's key): deleted from ``tier``, where it was read, and counted as
        damaged (``counters.corrupt``), as the codec's own rejections are."""
        await self._reader.reject(next(t for t in self.tiers if t.name == tier), key, reason)

    async def prefetch(self, keys: Sequence[bytes]) -> int:
        """Copy values that only the background tiers hold into the synchronous ones (pre-warming).

        Values are copied as stored; every read verifies them anyway. Returns how many were copied.
        """
        return await self._promoter.prefetch(keys)

    async def delete_everywhere(self, keys: Sequence[bytes], *, grace: float | None = None) -> None:
        """Delete ``keys`` from every tier. ``grace``, for values that ones stored just now replace:
        the background tiers let them go that many seconds after the writes queued before are done
        (``WriteBehind.expire_after``), so that another node that looked one up still fetches it."""
        for tier in self.tiers if grace is None else self._through.tiers:
            await attempt(tier.delete(keys), "delete", tier)
        if grace is not None:
            self._writer.expire_after(list(keys), grace)

    async def purge_local(self, *, prefix: bytes | None = None, keys: Sequence[bytes] = ()) -> int:
        """Delete from this node's tiers (RAM, the shared directory; not the background ones)
        every value under ``prefix`` and the values of ``keys``; returns how many were deleted.
        Writes still queued for the background tiers are not dropped: ``flush`` first."""
        return await self._through.purge(prefix, keys)

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until the background queue is empty; False if ``timeout`` ran out first."""
        return await self._writer.flush(timeout)

    async def written(self, timeout: float | None = None) -> bool:
        """Wait until every background write queued so far is done (not those queued after);
        True when all of them reached every background tier in time."""
        return await self._writer.written(timeout)

    # -- stats and lifecycle --------------------------------------------------------------------

    def stats(self) -> dict[str, TierStats]:
        return {t.name: t.stats() for t in self.tiers}

    async def aclose(self, drain_timeout: float = 5.0) -> None:
        """Drain pending background writes (bounded by ``drain_timeout``), then close the tiers."""
        await self._writer.aclose(drain_timeout)
        for tier in self.tiers:
            await attempt(tier.aclose(), "close", tier)


class _Windows:
    """``prepare(i)`` for a store's tiers: chunk ``i`` and the rest of its window cut and encoded off
    the event loop (sums and MACs over hundreds of MiB at real KV sizes) before a tier asks for
    them. The RAM tier's write and the background writer await the same window once.

    A window starts at the first chunk asked for and holds ``per`` chunks (0: all the rest),
    stopping at one already under way."""

    def __init__(self, payloads: PayloadSource, blob: Callable[[int], Value], n: int, per: int):
        self._cut = getattr(payloads, "prepare", None)  # a source that cuts its payloads off the loop
        self._blob = blob
        self._n = n
        self._per = per or n
        self._ready: dict[int, asyncio.Future[None]] = {}

    def ready(self, i: int) -> bool:
        """Whether chunk ``i`` is cut and encoded (the background writer sends what is before it)."""
        window = self._ready.get(i)
        return window is not None and window.done()

    async def __call__(self, i: int) -> None:
        if i not in self._ready:
            end = min(i + self._per, self._n)
            end = next((j for j in range(i, end) if j in self._ready), end)
            window = asyncio.ensure_future(self._prepare(i, end))
            for j in range(i, end):
                self._ready[j] = window
        # Shielded: a caller that leaves (a cancelled save) does not cancel the other's window.
        await asyncio.shield(self._ready[i])

    async def _prepare(self, first: int, end: int) -> None:
        if self._cut is not None:
            await self._cut(first, end)
        await in_background(lambda: [self._blob(j) for j in range(first, end)])
