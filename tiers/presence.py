"""Which tier holds which keys: the existence checks behind the store's lookups, one call per tier.

A tier that fails a check holds nothing for it (``attempt``): a lookup never fails, it finds less.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import Tier, attempt


async def first_holders(tiers: Sequence[Tier], keys: Sequence[bytes]) -> list[str]:
    """The name of the fastest of ``tiers`` holding each key, for the keys from the first up to the
    first that no tier holds: a prefix ends at its first gap. Each tier is asked only about the
    keys the faster ones lack."""
    holder: list[str | None] = [None] * len(keys)
    for tier in tiers:
        todo = [i for i, h in enumerate(holder) if h is None]
        if not todo:
            break
        present = await attempt(tier.contains_many([keys[i] for i in todo]), "lookup", tier)
        for i, ok in zip(todo, present or ()):
            if ok:
                holder[i] = tier.name
    n = next((i for i, h in enumerate(holder) if h is None), len(holder))
    return [h for h in holder[:n] if h]


async def longest_held(tiers: Sequence[Tier], keys: Sequence[bytes]) -> tuple[int, str] | None:
    """(n, tier): the largest ``n`` such that some tier holds ``keys[n - 1]``, and the fastest tier
    that does; None when no tier holds any. Every tier is asked about every key: a nearer tier
    holding a shorter one does not hide a longer one further down."""
    best: tuple[int, str] | None = None
    for tier in tiers:
        present = await attempt(tier.contains_many(keys), "tail lookup", tier) or [False] * len(keys)
        n = next((i + 1 for i in range(len(keys) - 1, -1, -1) if present[i]), 0)
        if n and (best is None or n > best[0]):
            best = (n, tier.name)
    return best
