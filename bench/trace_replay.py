"""A cache trace's replay through kvtier's tiers: what ``bench capacity`` runs for each setup.

A trace is a list of requests, each the ids of its prompt's blocks (an id names the block and its
whole prefix, as the Mooncake trace's hash ids do) and their token counts. Each level weighs a block
by its tokens, so a budget is in tokens (bytes / bytes per token). Per request, as kvtier's tiered
store does:

1. lookup: the fastest level holding each block (presence only, as ``contains_many`` and Redis's
   EXISTS, which refresh no recency); the hit is the longest contiguous prefix held;
2. fetch of that prefix from the fastest level holding each block, the RAM tier first, so a RAM
   hit never reaches Redis's LRU; blocks found lower down are copied up into the RAM tier;
3. the save after the answer: each level stores the blocks it lacks.

The save is modelled as done before the next request arrives (in reality a request that arrives
while an earlier one is computing cannot use its blocks yet, so these are upper bounds), and a
partial tail's reuse finer than the trace's blocks is not modelled.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tiers.memory import MemoryTier
from tiers.policies import LRUPolicy

TRACE_BLOCK_TOKENS = 512  # the Mooncake trace hashes prompts in 512-token blocks


# -- the trace ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """One request of the trace: its block ids, each block's token count and cache key."""

    timestamp_ms: int
    blocks: tuple[int, ...]
    sizes: tuple[int, ...]  # tokens per block: all full but the last
    keys: tuple[bytes, ...]

    @classmethod
    def of(cls, timestamp_ms: int, input_tokens: int, blocks: Sequence[int],
           block_tokens: int = TRACE_BLOCK_TOKENS) -> Request:
        sizes = tuple(min(block_tokens, input_tokens - i * block_tokens) for i in range(len(blocks)))
        if sizes and sizes[-1] <= 0:
            raise ValueError(f"{len(blocks)} blocks of {block_tokens} tokens for {input_tokens} input tokens")
        return cls(timestamp_ms, tuple(blocks), sizes, tuple(b.to_bytes(8, "little", signed=True) for b in blocks))


def load_trace(path: Path, block_tokens: int = TRACE_BLOCK_TOKENS) -> list[Request]:
    """The requests of a Mooncake-format JSONL trace, in timestamp order (ties keep file order).

    Raises:
        ValueError: a line that is not such a request (its number in the message).
    """
    requests = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids = row["hash_ids"]
                if not all(isinstance(i, int) for i in ids):
                    raise ValueError("hash_ids must be integers")
                requests.append(Request.of(int(row["timestamp"]), int(row["input_length"]), ids, block_tokens))
            except (ValueError, KeyError, TypeError, OverflowError) as exc:
                raise ValueError(f"{path.name} line {n}: not a trace request ({exc})") from None
    return sorted(requests, key=lambda r: r.timestamp_ms)


@dataclass(frozen=True, slots=True)
class TraceFacts:
    requests: int
    blocks: int
    tokens: int
    distinct_blocks: int
    distinct_tokens: int  # what an unbounded cache holds at the end
    repeat_blocks: int  # references to a block seen earlier: an unbounded cache's hits
    repeat_tokens: int
    duration_s: float  # first to last request
    reuse_gap_s: tuple[float, float, float]  # time since a repeated block's last use: 25th, 50th, 90th percentile

    @property
    def repeat_fraction(self) -> float:
        return self.repeat_blocks / self.blocks if self.blocks else 0.0


def trace_facts(requests: Sequence[Request]) -> TraceFacts:
    last_use: dict[int, int] = {}  # block -> ms
    gaps: list[int] = []
    blocks = tokens = repeat_tokens = distinct_tokens = 0
    for req in requests:
        for block, size in zip(req.blocks, req.sizes):
            blocks += 1
            tokens += size
            if block in last_use:
                gaps.append(req.timestamp_ms - last_use[block])
                repeat_tokens += size
            else:
                distinct_tokens += size
            last_use[block] = req.timestamp_ms
    gaps.sort()
    gap = tuple(gaps[int(q * (len(gaps) - 1))] / 1000 if gaps else 0.0 for q in (0.25, 0.5, 0.9))
    duration = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000 if requests else 0.0
    return TraceFacts(len(requests), blocks, tokens, len(last_use), distinct_tokens, len(gaps), repeat_tokens,
                      duration, (gap[0], gap[1], gap[2]))


# -- cache levels ---------------------------------------------------------------------------------


class Level(Protocol):
    name: str
    write_behind: bool  # a background tier (Redis): never promoted into

    @property
    def written_tokens(self) -> int:
        """Tokens of the values it stored."""
        ...

    async def holds(self, keys: Sequence[bytes]) -> list[bool]:
        """Presence, without touching recency (EXISTS, ``contains_many``)."""
        ...

    async def read(self, keys: Sequence[bytes]) -> set[bytes]:
        """Fetch the keys in chain order; returns those held (their recency is refreshed)."""
        ...

    async def write(self, items: Mapping[bytes, int]) -> None:
        """Store keys of one chain, in chain order, each weighing the given tokens."""
        ...


class RamLevel:
    """kvtier's RAM tier as it runs: ``MemoryTier`` and its policy, one byte standing for one token."""

    write_behind = False

    def __init__(self, capacity_tokens: int, policy: str):
        self.name = f"ram-{policy}"
        self.tier = MemoryTier(capacity_tokens, policy=policy, name=self.name)
        self._values: dict[int, bytes] = {}  # one shared value per size: the tier only measures them

    @property
    def written_tokens(self) -> int:
        return self.tier.stats().bytes_in

    async def holds(self, keys: Sequence[bytes]) -> list[bool]:
        return await self.tier.contains_many(keys)

    async def read(self, keys: Sequence[bytes]) -> set[bytes]:
        return set(await self.tier.get_many(keys))

    async def write(self, items: Mapping[bytes, int]) -> None:
        await self.tier.put_many({k: self._value(n) for k, n in items.items()})

    def _value(self, n: int) -> bytes:
        if n not in self._values:
            self._values[n] = bytes(n)
        return self._values[n]


class RedisLevel:
    """Redis under ``maxmemory`` with ``allkeys-lru``, modelled as exact LRU (``LRUPolicy``).

    Redis refreshes a key on GET and SET, in the order the pipeline sends them (chain order: unlike
    the RAM tier, a chain's root is its least recent key), and not on EXISTS. A value larger than
    the whole budget is not kept.
    """

    write_behind = True

    def __init__(self, capacity_tokens: int, name: str = "redis-lru"):
        self.name = name
        self.capacity = capacity_tokens
        self._policy = LRUPolicy()
        self._sizes: dict[bytes, int] = {}
        self._used = 0
        self.written_tokens = 0

    async def holds(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self._sizes for k in keys]

    async def read(self, keys: Sequence[bytes]) -> set[bytes]:
        found = {k for k in keys if k in self._sizes}
        for key in keys:
            if key in found:
                self._policy.on_access(key)
        return found

    async def write(self, items: Mapping[bytes, int]) -> None:
        for key, size in items.items():
            if size > self.capacity:
                continue
            old = self._sizes.pop(key, None)
            if old is not None:
                self._used -= old
                self._policy.on_remove(key)
            while self._used + size > self.capacity and self._sizes:
                self._used -= self._sizes.pop(self._policy.victim())
            self._sizes[key] = size
            self._used += size
            self.written_tokens += size
            self._policy.on_insert(key, size)


class UnboundedLevel:
    """A cache that keeps everything: the ceiling any budget can reach."""

    name = "unbounded"
    write_behind = False

    def __init__(self) -> None:
        self._keys: set[bytes] = set()
        self.written_tokens = 0

    async def holds(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self._keys for k in keys]

    async def read(self, keys: Sequence[bytes]) -> set[bytes]:
        return {k for k in keys if k in self._keys}

    async def write(self, items: Mapping[bytes, int]) -> None:
        self.written_tokens += sum(n for k, n in items.items() if k not in self._keys)
        self._keys.update(items)


# -- the replay -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What the levels served over a trace (blocks and tokens)."""

    blocks: int
    tokens: int
    hit_blocks: int  # served: the longest contiguous prefix the levels held
    hit_tokens: int  # = prefill tokens saved
    held_blocks: int  # held by some level at lookup, wherever they stand in the request
    held_tokens: int
    served_tokens: tuple[int, ...]  # hit tokens per level, fastest first
    written_tokens: tuple[int, ...]  # tokens stored per level (saves, and copies up into RAM)

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    @property
    def held_rate(self) -> float:
        return self.held_blocks / self.blocks if self.blocks else 0.0


async def replay(requests: Iterable[Request], levels: Sequence[Level]) -> ReplayResult:
    """Serve every request through ``levels`` (fastest first) as kvtier's tiered store does."""
    blocks = tokens = hit_blocks = hit_tokens = held_blocks = held_tokens = 0
    served = [0] * len(levels)
    for req in requests:
        holder = await _lookup(req.keys, levels)
        n = next((i for i, h in enumerate(holder) if h is None), len(holder))
        blocks += len(req.keys)
        tokens += sum(req.sizes)
        hit_blocks += n
        hit_tokens += sum(req.sizes[:n])
        held_blocks += sum(h is not None for h in holder)
        held_tokens += sum(s for s, h in zip(req.sizes, holder) if h is not None)
        for li, i in await _fetch(req, n, levels):
            served[li] += req.sizes[i]
        for level in levels:  # the save after the answer: each level gets what it lacks
            present = await level.holds(req.keys)
            missing = {k: s for k, s, ok in zip(req.keys, req.sizes, present) if not ok}
            if missing:
                await level.write(missing)
    return ReplayResult(blocks, tokens, hit_blocks, hit_tokens, held_blocks, held_tokens, tuple(served),
                        tuple(level.written_tokens for level in levels))


async def _lookup(keys: Sequence[bytes], levels: Sequence[Level]) -> list[int | None]:
    """The fastest level holding each key (``TieredStore.lookup_chain``)."""
    holder: list[int | None] = [None] * len(keys)
    for li, level in enumerate(levels):
        todo = [i for i, h in enumerate(holder) if h is None]
        if not todo:
            break
        for i, ok in zip(todo, await level.holds([keys[i] for i in todo])):
            if ok:
                holder[i] = li
    return holder


async def _fetch(req: Request, n: int, levels: Sequence[Level]) -> list[tuple[int, int]]:
    """Read the first ``n`` blocks from the fastest level holding each, then copy the ones found
    lower down into the synchronous levels above (``VerifiedReader``, ``Promoter``). Returns
    (level, block index) per block served."""
    todo = list(range(n))
    source: dict[int, int] = {}
    for li, level in enumerate(levels):
        if not todo:
            break
        found = await level.read([req.keys[i] for i in todo])
        source.update({i: li for i in todo if req.keys[i] in found})
        todo = [i for i in todo if i not in source]
    for li, level in enumerate(levels):
        up = {req.keys[i]: req.sizes[i] for i in sorted(source) if source[i] > li}
        if up and not level.write_behind:
            await level.write(up)
    return [(li, i) for i, li in source.items()]
