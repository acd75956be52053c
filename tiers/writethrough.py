"""WriteThrough: the store's writes to its synchronous tiers (RAM, the node's shared directory),
made while the caller waits; ``WriteBehind`` is the queue for the others."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from .base import Prepare, Tier, Value, attempt

log = logging.getLogger("kvtier.store")


class WriteThrough:
    """Writes to the tiers not marked ``write_behind``, one call per tier, now.

    A tier that fails is logged and left out (``attempt``): a failing tier never fails the store,
    and a tier that cannot say what it holds is not written to.

    Args:
        tiers: the synchronous tiers, in the store's order.
    """

    def __init__(self, tiers: Sequence[Tier]):
        self.tiers = list(tiers)

    async def put_missing(self, keys: Sequence[bytes], blob: Callable[[int], Value],
                          prepare: Prepare | None = None, size: Callable[[int], int] | None = None) -> set[int]:
        """Write to each tier the keys it lacks, the value of key ``i`` being ``blob(i)`` (asked for
        only when some tier lacks it, after ``prepare(i)`` is awaited);
        returns the indexes written to at least one tier. ``size(i)``: about how large ``blob(i)``
        is, for a tier with a byte budget to make room before the values are made."""
        written: set[int] = set()
        for tier in self.tiers:
            present = await attempt(tier.contains_many(keys), "contains", tier)
            missing = [i for i, ok in enumerate(present or ()) if not ok]
            if not missing:
                continue
            make_room = getattr(tier, "make_room", None)  # the RAM tier's
            if make_room is not None and size is not None:
                make_room(sum(size(i) for i in missing))
            items = {}
            for i in missing:  # each window cut and encoded off the loop (``prepare``), then taken
                if prepare is not None:
                    await prepare(i)
                items[keys[i]] = i
            try:  # blob(i) encodes here when it was not prepared: a payload that fails is a failed put
                await tier.put_many({key: blob(i) for key, i in items.items()})
                written.update(missing)
            except Exception:
                log.warning("put on tier %s failed", tier.name, exc_info=True)
        return written

    async def put_many(self, blobs: Mapping[bytes, Value]) -> None:
        """Write already encoded values to every tier, whatever it holds."""
        for tier in self.tiers:
            await attempt(tier.put_many(blobs), "put", tier)

    async def purge(self, prefix: bytes | None, keys: Sequence[bytes]) -> int:
        """Delete every value under ``prefix`` (from the tiers that can list one) and the values of
        ``keys``; returns how many were deleted."""
        removed = 0
        for tier in self.tiers:
            if prefix is not None:
                delete_prefix = getattr(tier, "delete_prefix", None)  # memory and shared tiers have it
                if delete_prefix is not None:
                    removed += await attempt(delete_prefix(prefix), "purge", tier) or 0
            if keys:
                removed += await attempt(tier.delete(keys), "purge", tier) or 0
        return removed
