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

Each request is served as kvtier's tiered store serves it (``bench.trace_replay``): a block counts as
a hit only when every block before it in that request hit too (``hit``: kvtier restores the longest
contiguous prefix); ``held`` also counts the blocks a level held after a miss, which kvtier cannot use.
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
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tiers.policies import POLICIES

from .trace_replay import (
    TRACE_BLOCK_TOKENS,
    Level,
    RamLevel,
    RedisLevel,
    ReplayResult,
    Request,
    TraceFacts,
    UnboundedLevel,
    load_trace,
    replay,
    trace_facts,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
TRACE_NAME = "mooncake-fast25-conversation.jsonl"
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / TRACE_NAME
RESULTS_DIR = REPO_ROOT / "bench" / "results"
GIB = 1 << 30
BYTES_PER_TOKEN = 131_072  # 128 KiB: Llama-3-8B f16 KV (32 layers x 8 KV heads x 128 x 2 x 2 bytes)
BUDGETS_GIB = (64, 128, 256, 512, 1024, 2048, 4096)  # one level alone, and Redis behind RAM
RAM_IN_FRONT_GIB = (128,)  # RAM tiers put in front of Redis


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
        """Its levels, fastest first, each budget in tokens; none for a zero budget."""
        if self.unbounded:
            return [UnboundedLevel()]
        levels: list[Level] = []
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
    redis = setup.redis_gib > 0 and len(result.served_tokens) > 0
    read, written = (result.served_tokens[-1], result.written_tokens[-1]) if redis else (0, 0)
    return {
        "setup": setup.name, "ram_gib": setup.ram_gib, "ram_policy": setup.ram_policy if setup.ram_gib else None,
        "redis_gib": setup.redis_gib, "hit_rate": round(result.hit_rate, 4),
        "token_hit_rate": round(result.token_hit_rate, 4), "held_rate": round(result.held_rate, 4),
        "of_ceiling": round(result.hit_blocks / ceiling.hit_blocks, 4) if ceiling.hit_blocks else 0.0,
        "prefill_tokens_saved": result.hit_tokens, "redis_gib_read": round(read * bytes_per_token / GIB, 1),
        "redis_gib_written": round(written * bytes_per_token / GIB, 1), **asdict(result),
    }


# -- output ---------------------------------------------------------------------------------------


def print_table(rows: Sequence[Mapping[str, Any]], facts: TraceFacts, bytes_per_token: int,
                console: Console) -> None:
    table = Table(title=f"Hit rates on {facts.requests:,} requests, {facts.blocks:,} block references, "
                        f"{bytes_per_token / 1024:g} KiB/token", title_justify="left")
    for name in ("setup", "RAM GiB", "Redis GiB", "hit %", "held %", "token hit %", "of ceiling %",
                 "saved M tokens", "Redis read GiB", "Redis written GiB"):
        table.add_column(name, justify="left" if name == "setup" else "right")
    for r in rows:
        table.add_row(
            r["setup"], f"{r['ram_gib']:g}" if r["ram_gib"] else "", f"{r['redis_gib']:g}" if r["redis_gib"] else "",
            f"{100 * r['hit_rate']:.1f}", f"{100 * r['held_rate']:.1f}", f"{100 * r['token_hit_rate']:.1f}",
            f"{100 * r['of_ceiling']:.1f}", f"{r['prefill_tokens_saved'] / 1e6:.1f}",
            *((f"{r['redis_gib_read']:,.0f}", f"{r['redis_gib_written']:,.0f}") if r["redis_gib"] else ("", "")),
        )
    console.print(table)
    new_kv = facts.distinct_tokens * bytes_per_token / GIB
    console.print(f"Unbounded footprint: {new_kv:,.0f} GiB ({facts.distinct_blocks:,} blocks; "
                  f"{new_kv / max(facts.duration_s, 1):.2f} GiB/s of new KV over {facts.duration_s:,.0f} s); "
                  f"repeat ceiling {100 * facts.repeat_fraction:.1f}% of blocks; a repeated block's previous use "
                  "was {:.0f} / {:.0f} / {:.0f} s before (25th / 50th / 90th percentile).".format(*facts.reuse_gap_s))
    console.print("hit: the longest contiguous prefix (what kvtier restores); held: any block a level held.")


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
