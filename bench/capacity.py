"""``capacity``: how much RAM tier and Redis a real workload needs, by replaying a production trace.

    python -m bench capacity                                   # the Mooncake FAST'25 conversation trace
    python -m bench capacity --bytes-per-token 327680          # a 70B model's KV (320 KiB/token)
    python -m bench capacity --budgets 64 256 1024 --ram 128   # GiB

The trace (``../shared/traces/mooncake-fast25-conversation.jsonl`` beside the checkout, or
``--trace``) lists, per request, the hash ids of its 512-token prompt blocks, where equal ids mark
equal prefixes. Requests are replayed in timestamp order through caches of a byte budget, each block
weighing its tokens x ``--bytes-per-token`` (128 KiB, an 8B model's f16 KV: a block is 64 MiB):

- ``ram``: kvtier's RAM tier itself (``tiers.memory.MemoryTier``, with its S3-FIFO or LRU policy from
  ``tiers.policies``), holding one byte per token so a budget of B bytes is B / bytes-per-token;
- ``redis``: a Redis with ``maxmemory-policy allkeys-lru``. Redis approximates LRU by sampling; it is
  modelled as exact LRU (``tiers.policies.LRUPolicy``), touched in the order Redis sees reads and writes;
- ``ram+redis``: a RAM tier in front of Redis, as kvtier runs them;
- ``unbounded``: a cache that never evicts, the ceiling.

Per request, as kvtier does: a lookup of the longest contiguous prefix held by any level; a fetch of
that prefix (a RAM hit is read from RAM only, so Redis's LRU never sees it; a Redis hit is copied up
into the RAM tier); then a store of every block a level lacks. A block counts as a hit only when every
block before it in that request hit too (``hit``); ``held`` also counts the blocks a level held after
a miss, which kvtier cannot use. The save is modelled as done before the next request arrives
(requests overlap in reality, so this is an upper bound), and partial-tail reuse finer than the
trace's blocks is not modelled.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.table import Table

from tiers.memory import MemoryTier
from tiers.policies import POLICIES, LRUPolicy

REPO_ROOT = Path(__file__).resolve().parent.parent
TRACE_NAME = "mooncake-fast25-conversation.jsonl"
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / TRACE_NAME
RESULTS_DIR = REPO_ROOT / "bench" / "results"
GIB = 1 << 30
TRACE_BLOCK_TOKENS = 512  # the Mooncake trace hashes prompts in 512-token blocks
BYTES_PER_TOKEN = 131_072  # 128 KiB: Llama-3-8B f16 KV (32 layers x 8 KV heads x 128 x 2 x 2 bytes)
BUDGETS_GIB = (64, 128, 256, 512, 1024, 2048, 4096)  # one level alone, and Redis behind RAM
RAM_IN_FRONT_GIB = (128,)  # RAM tiers put in front of Redis


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
            except (ValueError, KeyError, TypeError) as exc:
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

    @property
    def repeat_fraction(self) -> float:
        return self.repeat_blocks / self.blocks if self.blocks else 0.0


def trace_facts(requests: Iterable[Request]) -> TraceFacts:
    seen: set[int] = set()
    n = blocks = tokens = repeats = repeat_tokens = distinct_tokens = 0
    for req in requests:
        n += 1
        for block, size in zip(req.blocks, req.sizes):
            blocks += 1
            tokens += size
            if block in seen:
                repeats += 1
                repeat_tokens += size
            else:
                seen.add(block)
                distinct_tokens += size
    return TraceFacts(n, blocks, tokens, len(seen), distinct_tokens, repeats, repeat_tokens)


# -- cache levels ---------------------------------------------------------------------------------


class Level(Protocol):
    name: str
    write_behind: bool  # a background tier (Redis): never promoted into

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
            self._policy.on_insert(key, size)


class UnboundedLevel:
    """A cache that keeps everything: the ceiling any budget can reach."""

    name = "unbounded"
    write_behind = False

    def __init__(self) -> None:
        self._keys: set[bytes] = set()

    async def holds(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self._keys for k in keys]

    async def read(self, keys: Sequence[bytes]) -> set[bytes]:
        return {k for k in keys if k in self._keys}

    async def write(self, items: Mapping[bytes, int]) -> None:
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
    return ReplayResult(blocks, tokens, hit_blocks, hit_tokens, held_blocks, held_tokens, tuple(served))


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


# -- setups ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setup:
    """One configuration replayed: RAM tier and Redis budgets (GiB, 0: none)."""

    name: str
    ram_gib: float = 0.0
    ram_policy: str = "s3fifo"
    redis_gib: float = 0.0
    unbounded: bool = False

    def levels(self, bytes_per_token: int) -> list[Level]:
        levels: list[Level] = []
        if self.unbounded:
            return [UnboundedLevel()]
        ram, redis = (int(gib * GIB) // bytes_per_token for gib in (self.ram_gib, self.redis_gib))
        if ram > 0:
            levels.append(RamLevel(ram, self.ram_policy))
        if redis > 0:
            levels.append(RedisLevel(redis))
        return levels


def setups(budgets_gib: Sequence[float], policies: Sequence[str], ram_in_front_gib: Sequence[float],
           ram_policy: str) -> list[Setup]:
    """The unbounded ceiling; each budget as a RAM tier per policy and as Redis; then each RAM tier
    in front of Redis of each larger budget."""
    out = [Setup("unbounded", unbounded=True)]
    for gib in budgets_gib:
        out += [Setup(f"ram {p}", ram_gib=gib, ram_policy=p) for p in policies]
        out.append(Setup("redis lru", redis_gib=gib))
    for ram in ram_in_front_gib:
        out += [Setup(f"ram {ram:g} GiB {ram_policy} + redis lru", ram_gib=ram, ram_policy=ram_policy, redis_gib=gib)
                for gib in budgets_gib if gib > ram]
    return out


def run_setup(requests: Sequence[Request], setup: Setup, bytes_per_token: int) -> ReplayResult:
    return asyncio.run(replay(requests, setup.levels(bytes_per_token)))


_worker_requests: list[Request] = []  # a worker process's copy of the trace


def _load_in_worker(path: Path) -> None:
    _worker_requests[:] = load_trace(path)


def _run_in_worker(setup: Setup, bytes_per_token: int) -> ReplayResult:
    return run_setup(_worker_requests, setup, bytes_per_token)


def run_all(requests: Sequence[Request], trace: Path, plan: Sequence[Setup], bytes_per_token: int,
            jobs: int) -> list[ReplayResult]:
    """Every setup's replay, in ``jobs`` processes (each reads the trace itself) when above 1:
    the replays are independent and CPU-bound."""
    if jobs <= 1 or len(plan) <= 1:
        return [run_setup(requests, s, bytes_per_token) for s in plan]
    with ProcessPoolExecutor(min(jobs, len(plan)), initializer=_load_in_worker, initargs=(trace,)) as pool:
        return list(pool.map(_run_in_worker, plan, [bytes_per_token] * len(plan)))


def row(setup: Setup, result: ReplayResult, ceiling: ReplayResult, bytes_per_token: int) -> dict[str, Any]:
    """One result as the JSON and the table show it."""
    redis_tokens = result.served_tokens[-1] if setup.redis_gib and result.served_tokens else 0
    return {
        "setup": setup.name, "ram_gib": setup.ram_gib, "ram_policy": setup.ram_policy if setup.ram_gib else None,
        "redis_gib": setup.redis_gib, "hit_rate": round(result.hit_rate, 4),
        "token_hit_rate": round(result.token_hit_rate, 4), "held_rate": round(result.held_rate, 4),
        "of_ceiling": round(result.hit_blocks / ceiling.hit_blocks, 4) if ceiling.hit_blocks else 0.0,
        "prefill_tokens_saved": result.hit_tokens, "redis_gib_read": round(redis_tokens * bytes_per_token / GIB, 1),
        **{k: v for k, v in asdict(result).items() if k != "served_tokens"},
    }


# -- output ---------------------------------------------------------------------------------------


def print_table(rows: Sequence[Mapping[str, Any]], facts: TraceFacts, bytes_per_token: int,
                console: Console) -> None:
    table = Table(title=f"Hit rates on {facts.requests:,} requests, {facts.blocks:,} block references, "
                        f"{bytes_per_token / 1024:g} KiB/token", title_justify="left")
    for name in ("setup", "RAM GiB", "Redis GiB", "hit %", "held %", "token hit %", "of ceiling %",
                 "prefill saved (M tokens)", "Redis read GiB"):
        table.add_column(name, justify="left" if name == "setup" else "right")
    for r in rows:
        table.add_row(
            r["setup"], f"{r['ram_gib']:g}" if r["ram_gib"] else "", f"{r['redis_gib']:g}" if r["redis_gib"] else "",
            f"{100 * r['hit_rate']:.1f}", f"{100 * r['held_rate']:.1f}", f"{100 * r['token_hit_rate']:.1f}",
            f"{100 * r['of_ceiling']:.1f}", f"{r['prefill_tokens_saved'] / 1e6:.1f}",
            f"{r['redis_gib_read']:g}" if r["redis_gib"] else "",
        )
    console.print(table)
    console.print(f"Unbounded footprint: {facts.distinct_tokens * bytes_per_token / GIB:,.0f} GiB "
                  f"({facts.distinct_blocks:,} blocks); repeat ceiling {100 * facts.repeat_fraction:.1f}% of blocks. "
                  "hit: the longest contiguous prefix (what kvtier restores); held: any block a level held.")


def trace_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench capacity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                    help=f"Mooncake-format JSONL trace (default: ../shared/traces/{TRACE_NAME} beside the checkout)")
    ap.add_argument("--bytes-per-token", type=int, default=BYTES_PER_TOKEN,
                    help="KV bytes per token (131072: Llama-3-8B f16; 327680: Llama-3-70B f16)")
    ap.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS_GIB), metavar="GIB",
                    help="cache budgets in GiB, for each level alone and for Redis behind the RAM tier")
    ap.add_argument("--policies", nargs="+", default=["s3fifo", "lru"], choices=sorted(POLICIES),
                    help="RAM-tier eviction policies to replay")
    ap.add_argument("--ram", type=float, nargs="*", default=list(RAM_IN_FRONT_GIB), metavar="GIB",
                    help="RAM tiers (GiB) to put in front of Redis; none for no two-level runs")
    ap.add_argument("--ram-policy", default="s3fifo", choices=sorted(POLICIES),
                    help="the policy of the RAM tier in front of Redis")
    ap.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 8),
                    help="processes replaying setups side by side (default: the CPUs, at most 8)")
    ap.add_argument("--json", type=Path, help="result file (default: bench/results/capacity-DATE.json)")
    args = ap.parse_args(argv)
    if args.bytes_per_token <= 0:
        ap.error("--bytes-per-token must be positive")
    if args.jobs <= 0:
        ap.error("--jobs must be positive")
    if any(b < 0 or not math.isfinite(b) for b in [*args.budgets, *args.ram]):
        ap.error("budgets must be finite GiB values, 0 or more")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 150)  # a log file: no 80-column wrap
    if not args.trace.is_file():
        print(f"python -m bench capacity: no trace at {args.trace}: pass --trace PATH to a Mooncake-format JSONL "
              f"trace ({TRACE_NAME} of the Mooncake FAST'25 release)", file=sys.stderr)
        return 2
    try:
        requests = load_trace(args.trace)
    except ValueError as exc:
        print(f"python -m bench capacity: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    facts = trace_facts(requests)
    plan = setups(args.budgets, args.policies, args.ram, args.ram_policy)
    results = run_all(requests, args.trace, plan, args.bytes_per_token, args.jobs)
    ceiling = results[0]
    rows = [row(s, r, ceiling, args.bytes_per_token) for s, r in zip(plan, results)]
    print_table(rows, facts, args.bytes_per_token, console)
    out = {
        "benchmark": "capacity", "command": " ".join(["python -m bench capacity", *argv]),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "trace": {"name": args.trace.name, "sha256": trace_digest(args.trace), "block_tokens": TRACE_BLOCK_TOKENS,
                  **asdict(facts), "repeat_fraction": round(facts.repeat_fraction, 4)},
        "bytes_per_token": args.bytes_per_token, "rows": rows,
        "env": {"python": platform.python_version(), "cpus": os.cpu_count(), "jobs": args.jobs,
                "seconds": round(time.perf_counter() - t0, 1)},
    }
    path = args.json or RESULTS_DIR / f"capacity-{datetime.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
