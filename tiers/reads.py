"""The store's reads from one tier: verified on the way out, and copied up into the faster tiers."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .base import Tier
from .codec import BlobCodec
from .errors import CodecError
from .threads import in_thread

log = logging.getLogger("kvtier.store")

# Values of at least this many bytes in all are checked on a worker thread, not the event loop.
OFF_LOOP_BYTES = 4 << 20


@runtime_checkable
class RefreshingReads(Protocol):
    """A tier whose reads extend a value's life (Redis's TTL) and can tell what it was before,
    so that a value its reader rejects is not kept alive by the reads that reject it."""

    async def get_many_with_ttl(self, keys: Sequence[bytes]) -> tuple[dict[bytes, bytes | memoryview],
                                                                        dict[bytes, int]]: ...

    async def reset_ttl(self, ttls: Mapping[bytes, int]) -> None: ...


@dataclass(frozen=True, slots=True)
class Verified:
    """A value read intact: its payload, the blob as stored (for a later promotion), and its tier."""

    payload: bytes | memoryview
    blob: bytes | memoryview
    tier: str


class VerifiedReader:
    """Reads values from the tiers, fastest first, and checks each one (``BlobCodec.decode``).

    A damaged or foreign value is deleted from its tier and counted (``corrupt``): left in place
    it would be found, and rejected, by every later read.
    """

    def __init__(self, codec: BlobCodec):
        self.codec = codec
        self.corrupt = 0

    async def read(self, tiers: Sequence[Tier], hashes: Mapping[bytes, bytes],
                   namespace_id: bytes) -> dict[bytes, Verified]:
        """Each key of ``hashes`` (key -> the value hash its value must carry) from the fastest of
        ``tiers`` that holds it intact; absent where none does."""
        found: dict[bytes, Verified] = {}
        for tier in tiers:
            todo = {k: h for k, h in hashes.items() if k not in found}
            if not todo:
                break
            found.update(await self._read_tier(tier, todo, namespace_id))
        return found

    async def _read_tier(self, tier: Tier, hashes: Mapping[bytes, bytes],
                         namespace_id: bytes) -> dict[bytes, Verified]:
        ttls: dict[bytes, int] = {}
        try:
            if isinstance(tier, RefreshingReads):
                got, ttls = await tier.get_many_with_ttl(list(hashes))
            else:
                got = await tier.get_many(list(hashes))
        except Exception:  # a tier never fails a read
            log.warning("read from tier %s failed", tier.name, exc_info=True)
            return {}
        # Checking sums (and MACs) over a restore's hundreds of MiB off the event loop, which relays
        # other users' tokens meanwhile; a few small values where they are.
        if sum(len(b) for b in got.values()) >= OFF_LOOP_BYTES:
            found, damaged = await in_thread(self._check, tier.name, hashes, got, namespace_id)
        else:
            found, damaged = self._check(tier.name, hashes, got, namespace_id)
        if damaged and isinstance(tier, RefreshingReads):
            # Before the delete, which may fail: a rejected value keeps the life it had.
            await tier.reset_ttl({k: ttls[k] for k in damaged if k in ttls})
        await self.discard(tier, damaged)
        return found

    def _check(self, tier: str, hashes: Mapping[bytes, bytes], got: Mapping[bytes, bytes | memoryview],
               namespace_id: bytes) -> tuple[dict[bytes, Verified], list[bytes]]:
        """The values of ``got`` that decode intact under their expected hashes, and the damaged keys."""
        found: dict[bytes, Verified] = {}
        damaged: list[bytes] = []
        for key, value_hash in hashes.items():
            blob = got.get(key)
            if blob is None:
                continue
            try:
                payload = self.codec.decode(blob, chunk_hash=value_hash, namespace_id=namespace_id).payload
                found[key] = Verified(payload, blob, tier)
            except CodecError as exc:
                log.warning("damaged value %s in tier %s: %s (deleted)", key.decode(errors="replace"), tier, exc)
                damaged.append(key)
        return found, damaged

    async def reject(self, tier: Tier, key: bytes, reason: str) -> None:
        """A value that passed the codec but holds something else than its key names: deleted from
        ``tier``, where it was read, and counted as the codec's own rejections are."""
        log.warning("value %s in tier %s does not match its key: %s (deleted)", key.decode(errors="replace"),
                    tier.name, reason)
        await self.discard(tier, [key])

    async def discard(self, tier: Tier, keys: Sequence[bytes]) -> None:
        """Delete values found damaged in ``tier`` and count them (``corrupt``); left in place they
        would be found, and rejected, by every later read."""
        if not keys:
            return
        self.corrupt += len(keys)
        try:
            await tier.delete(keys)
        except Exception:
            log.warning("could not delete damaged values from %s", tier.name, exc_info=True)


class Promoter:
    """Copies values that slower tiers hold into the synchronous tiers above them: after a fetch
    (``promote``, counted in ``promotions``) or before one (``prefetch``, pre-warming).

    Values are copied as stored; every read verifies them anyway.

    Args:
        tiers: the store's tiers, fastest first.
    """

    def __init__(self, tiers: Sequence[Tier]):
        self._order = {t.name: i for i, t in enumerate(tiers)}
        self._sync = [t for t in tiers if not t.write_behind]
        self._background = [t for t in tiers if t.write_behind]
        self.promotions = 0

    async def promote(self, keys: Sequence[bytes], sources: Sequence[str],
                      blobs: Sequence[bytes | memoryview]) -> None:
        """Copy the value of each key, found in tier ``sources[i]``, into the synchronous tiers above it.

        The blobs go as they are: a tier copies what it may not keep (the RAM tier keeps a buffer of
        its own, such as a value the bulk lane read, and copies a view of a mapped file). A copy
        here would hold a restore's state twice while it is promoted."""
        for tier in self._sync:
            items = {
                key: blob
                for key, src, blob in zip(keys, sources, blobs)
                if self._order[src] > self._order[tier.name]
            }
            if items:
                try:
                    self.promotions += await tier.put_many(items)
                except Exception:
                    log.warning("promotion into %s failed", tier.name, exc_info=True)

    async def prefetch(self, keys: Sequence[bytes]) -> int:
        """Copy the values of ``keys`` that only the background tiers hold into the synchronous
        ones; returns how many were copied."""
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
                got: dict[bytes, bytes | memoryview] = {}  # a failing source copies nothing
                try:
                    got = await source.get_many(wanted)
                    if got:
                        copied += await tier.put_many(got)
                except Exception:
                    log.warning("prefetch from %s into %s failed", source.name, tier.name, exc_info=True)
                wanted = [k for k in wanted if k not in got]
        return copied
