"""``python -m bench report``: one command that measures kvtier against a widely shared write-up's claims.

    python -m bench report                    # full run (about 15-25 minutes on an idle 2-core VM)
    python -m bench report --quick            # small sizes (a few minutes), same scenarios
    python -m bench report --render-only      # re-render docs/benchmarks.md from bench/results/report.json

SmolLM2-135M on llama-servers (``-np 1 -t 2 --cache-ram 0``), one kvtier sidecar beside each,
and a real Redis protocol server (an embedded Valkey). The write-up claimed, for "distributed KV
caching for llama.cpp":

    memory for 10 concurrent sessions           18.2 GB -> 6.8 GB    -62.6%
    generation speed at turn 30 of a chat        2.3 -> 7.1 tok/s    +208.7%
    moving a session to another node            1200 ms -> 180 ms    -85.0%

Scenarios (each side by side with its baseline, in the same run):

1. memory: 10 sessions sharing a 2,000-token system prompt, 500 own tokens each, saved as
   sessions by kvtier (Redis ``MEMORY USAGE`` of kvtier's keys; the sidecars' RAM tiers) versus
   the same sessions as whole slot states (the files llama-server's slot save writes, which is
   also what llama-cpp-python's caches hold per entry); f16 KV and ``-ctk/-ctv q8_0``.
2. turns: one conversation of 30 short turns across 4 replicas, round robin and rolling update
   (restarts before turns 10, 20, 30), with and without kvtier: TTFT and end-to-end tokens/s at
   turns 1, 10, 20, 30, with the recomputed prompt tokens that explain them.
3. move: sessions of 1k/4k/8k tokens (8,000: SmolLM2 has an 8,192-token context) saved on A,
   restored on B through the sessions API, and
   continued on B, against the floor (pipelined Redis GET + llama-server's ``restore_ms``) and
   against recompute (``bench/hop.py``'s ``move_sessions``); ``move_fa_off``: the same with every
   llama-server started with ``-fa off`` (its default turns flash attention on for a CPU).
4. multiuser: U users x R rounds across 2 nodes: kvtier vs llama-server alone (round robin,
   sticky) vs llama-server's own ``--cache-ram`` (``bench/hop.py``'s ``run_mode``).
5. short: prefixes of 64-256 tokens, where a restore can be worth less than it costs: kvtier's
   TTFT against llama-server alone, and the cost model's decisions from /metrics.
6. agent_loop, server_restarts, save_readable: turns sent the moment the last answer ended, round
   robin over 3 nodes; llama-server alone restarted under running sidecars; the time from an
   answer's end to its save being readable in Redis (``bench/agents.py``).
7. memory_types: a 2k-token conversation hopping nodes for SmolLM2, Gemma 3 (default flags and
   ``--swa-full``) and a generated hybrid (lfm2), recompute against kvtier (``bench/memtypes.py``).
8. routing: concurrent conversations with think time, round robin in front: llama-server alone,
   sticky, kvtier restore-only, kvtier with forwarding (``bench/routing.py``).

Writes ``bench/results/report.json`` (git-ignored), ``docs/benchmarks.md`` and ``docs/img/*.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rich.progress import Progress

from . import agents, hop, memtypes, neverworse, routing
from .common import (
    RESULTS_DIR,
    Timer,
    base_llama_args,
    client_session,
    cluster,
    complete,
    console,
    delta,
    exact_tokens,
    machine,
    metric,
    percentile,
    post_json,
    print_table,
    progress,
    ratio,
    redis_flush,
    redis_memory,
    redis_or_given,
    scrape,
    summary,
    versions,
    wait_idle,
)
from .hop import RESTORE_PHASES

SCENARIOS = ("memory", "turns", "move", "move_fa_off", "multiuser", "short", "agent_loop", "server_restarts",
             "save_readable", "memory_types", "routing")
# llama-server's flash attention: its default (auto) turns it on for a CPU; off, V is stored transposed.
FA_OFF = ("-fa", "off")
CLAIMS = {
    "memory": {"without": "18.2 GB", "with": "6.8 GB", "gain": "-62.6%"},
    "turn30": {"without": "2.3 tok/s", "with": "7.1 tok/s", "gain": "+208.7%"},
    "move": {"without": "1200 ms", "with": "180 ms", "gain": "-85.0%"},
}
PRESETS: dict[str, dict[str, Any]] = {
    "full": {"sessions": 10, "system_tokens": 2000, "own_tokens": 500, "turns": 30, "turn_system": 600,
             "turn_tokens": 40, "move_sizes": [1024, 4096, 8000], "reps": 5, "users": 4, "rounds": 4,
             "mu_system": 1000, "mu_context": 300, "short_lengths": [64, 128, 256], "agent_histories": [2000, 6000],
             "agent_turns": 5, "restart_history": 2200, "restart_turns": 6, "restart_slow_history": 1500,
             "readable_sizes": [2048, 8000],
             "routing_nodes": 3, "routing_conversations": 6, "routing_doc": 2000, "routing_turns": 4,
             "routing_private": 400, "routing_slots": 2,
             "types_history": 2000},
    "quick": {"sessions": 10, "system_tokens": 600, "own_tokens": 150, "turns": 12, "turn_system": 300,
              "turn_tokens": 30, "move_sizes": [512, 2048], "reps": 3, "users": 3, "rounds": 3,
              "mu_system": 400, "mu_context": 120, "short_lengths": [64, 128], "agent_histories": [2000],
              "agent_turns": 4, "restart_history": 1000, "restart_turns": 4, "restart_slow_history": 800,
              "readable_sizes": [2048],
              "routing_nodes": 2, "routing_conversations": 3, "routing_doc": 600, "routing_turns": 3,
              "routing_private": 200, "routing_slots": 2,
              "types_history": 1000},
}


# -- 1. memory ------------------------------------------------------------------------------------------


async def scenario_memory(redis_url: str, sessions: int, system_tokens: int, own_tokens: int, kv: str,
                          threads: int, prog: Progress | None) -> dict[str, Any]:
    """``sessions`` sessions sharing a system prompt: kvtier's bytes against whole slot states."""
    extra = ["-fa", "on", *(["-ctk", "q8_0", "-ctv", "q8_0"] if kv == "q8_0" else [])]
    ctx = (system_tokens + own_tokens + 512) // 256 * 256
    await redis_flush(redis_url)
    empty = await redis_memory(redis_url)
    task = prog.add_task(f"memory ({kv}): starting 2 nodes", total=sessions) if prog else None
    rows = []
    with cluster(2, base_llama_args(ctx, threads, extra=extra), sidecar=True, redis_url=redis_url) as cl:
        bases = [n.sidecar_url for n in cl.nodes]
        async with client_session() as s:
            system = await exact_tokens(s, cl.llama_url(0), system_tokens, seed=5)
            for i in range(sessions):
                node = cl.nodes[i % 2]
                if prog and task is not None:
                    prog.update(task, description=f"memory ({kv}): session {i + 1} on node {node.name}")
                own = await exact_tokens(s, node.llama_url, own_tokens, seed=1000 + i)
                reply = await complete(s, node.sidecar_url, [*system, *own], 1, {"X-Session-Id": f"mem-{i}"})
                await wait_idle(s, bases)
                # The same session as a whole slot state, saved by llama-server itself.
                saved, _ = await post_json(s, f"{node.llama_url}/slots/0?action=save", {"filename": "whole.bin"})
                path = node.slot_dir / "whole.bin"
                size = path.stat().st_size
                path.unlink()
                rows.append(reply.row(node=node.name, session=i, whole_bytes=size, slot_tokens=saved.get("n_saved")))
                if prog and task is not None:
                    prog.advance(task)
            used = await redis_memory(redis_url)
            side = [await scrape(s, b) for b in bases]
    whole = sum(r["whole_bytes"] for r in rows)
    tokens = sum(int(r["slot_tokens"] or 0) for r in rows)
    ram = [metric(m, "kvtier_tier_bytes_used", tier="memory") for m in side]
    return {
        "kv": kv, "sessions": sessions, "system_tokens": system_tokens, "own_tokens": own_tokens,
        "session_tokens": tokens, "whole_bytes": whole, "whole_bytes_per_token": round(whole / tokens, 1) if tokens else 0,
        "redis_key_bytes": used["memory_usage"], "redis_used_memory_delta": used["used_memory"] - empty["used_memory"],
        "redis_keys": used["keys"], "redis_chunk_bytes": used.get("memory_usage_c", 0),
        "redis_tail_bytes": used.get("memory_usage_t", 0), "redis_manifest_bytes": used.get("memory_usage_s", 0),
        "ram_tier_bytes": ram, "ram_tier_bytes_total": sum(ram),
        "reduction_vs_whole": round(1 - used["memory_usage"] / whole, 3) if whole else None,
        "sessions_detail": rows,
    }


# -- 2. turns / 4. multiuser (bench/hop.py) ---------------------------------------------------------------


def probe_rounds(turns: int) -> list[int]:
    """0-based rounds of turns 1, 1/3, 2/3 and the last (1, 10, 20, 30 for 30 turns)."""
    return sorted({0, max(turns // 3 - 1, 1), max(2 * turns // 3 - 1, 2), turns - 1})


async def scenario_turns(redis_url: str, wl: hop.Workload, prog: Progress | None) -> dict[str, Any]:
    probe = probe_rounds(wl.rounds)
    rolling = replace(wl, hop_rounds=tuple(r for r in probe if r > 0))
    out: dict[str, Any] = {"workload": asdict(wl), "probe_turns": [r + 1 for r in probe], "modes": {}}
    for mode in ("direct-rr", "kvtier", "direct-rolling", "kvtier-rolling"):
        res = await hop.run_mode(mode, rolling if mode.endswith("rolling") else wl, redis_url, prog)
        res.pop("requests", None)  # by_round keeps what the report shows
        out["modes"][mode] = res
    return out


async def scenario_multiuser(redis_url: str, wl: hop.Workload, prog: Progress | None) -> dict[str, Any]:
    out: dict[str, Any] = {"workload": asdict(wl), "modes": {}}
    for mode in ("direct-rr", "direct-sticky", "cache-ram", "kvtier"):
        res = await hop.run_mode(mode, wl, redis_url, prog)
        res.pop("requests", None)
        out["modes"][mode] = res
    return out


# -- 5. short prefixes ----------------------------------------------------------------------------------


async def scenario_short(redis_url: str, lengths: Sequence[int], reps: int, threads: int,
                         prog: Progress | None, question_tokens: int = 16,
                         chunks: Sequence[int] = (256, 64)) -> dict[str, Any]:
    """A short prefix seen on node A is asked again on node B (whose slot holds something else).

    Per chunk size, one pair of nodes with sidecars; each repetition measures the same request
    through B's sidecar and straight to B's llama-server, in alternating order, so the two paths
    share the machine's moods. (A direct request changes B's slot behind the sidecar's back; the
    next request goes through the sidecar and llama-server checks the slot's tokens itself, so
    this costs the sidecar nothing but a stale guess.)
    """
    task = prog.add_task("short prefixes", total=len(chunks) * len(lengths) * reps) if prog else None
    rows: list[dict[str, Any]] = []
    for chunk in chunks:
        await redis_flush(redis_url)
        with cluster(2, base_llama_args(1024, threads), sidecar=True, redis_url=redis_url, chunk_tokens=chunk) as cl:
            a, b = cl.url(0), cl.url(1)
            async with client_session() as s:
                for n in lengths:
                    prefix = await exact_tokens(s, cl.llama_url(0), n, seed=500 + n)
                    for rep in range(reps):
                        if prog and task is not None:
                            prog.update(task, description=f"short prefixes: {chunk}-token chunks, {n} tokens, rep {rep + 1}")
                        qa = await exact_tokens(s, cl.llama_url(0), question_tokens, seed=600 + 2 * rep)
                        qb = await exact_tokens(s, cl.llama_url(0), question_tokens, seed=601 + 2 * rep)
                        await complete(s, a, [*prefix, *qa], 1)  # A computes the prefix: the tiers hold it
                        await wait_idle(s, [a, b])
                        pair: dict[str, Any] = {}
                        for path in (("kvtier", "alone") if rep % 2 == 0 else ("alone", "kvtier")):
                            await hop.reset_slot(s, b)
                            await wait_idle(s, [a, b])
                            before = await scrape(s, b)
                            reply = await complete(s, b if path == "kvtier" else cl.llama_url(1), [*prefix, *qb], 1)
                            after = await scrape(s, b)
                            pair[path] = reply.row(
                                decisions_restore=delta(after, before, "kvtier_cost_decisions_total", decision="restore"),
                                decisions_recompute=delta(after, before, "kvtier_cost_decisions_total",
                                                          decision="recompute"))
                            await wait_idle(s, [a, b])
                        rows.append({"chunk_tokens": chunk, "prefix_tokens": n, "rep": rep, **pair})
                        if prog and task is not None:
                            prog.advance(task)
    table = []
    for chunk in chunks:
        for n in lengths:
            rs = [r for r in rows if r["prefix_tokens"] == n and r["chunk_tokens"] == chunk]
            alone = [r["alone"]["ttft_ms"] for r in rs]
            side = [r["kvtier"]["ttft_ms"] for r in rs]
            table.append({
                "prefix_tokens": n, "chunk_tokens": chunk, "prompt_tokens": rs[0]["kvtier"]["prompt_tokens"] if rs else 0,
                "alone_ttft_ms": summary(alone), "kvtier_ttft_ms": summary(side),
                "vs_alone": ratio(percentile(side, 50), percentile(alone, 50)),
                "paired_vs_alone": round(percentile([k / a for k, a in zip(side, alone) if a], 50), 2),
                "restored_tokens_p50": percentile([r["kvtier"]["restored_tokens"] for r in rs], 50),
                "recomputed_tokens_p50": percentile([r["kvtier"]["recomputed_tokens"] for r in rs], 50),
                "decisions_restore": sum(r["kvtier"]["decisions_restore"] for r in rs),
                "decisions_recompute": sum(r["kvtier"]["decisions_recompute"] for r in rs)})
    worst = max((t["vs_alone"] or 0 for t in table), default=0)
    return {"lengths": list(lengths), "reps": reps, "chunks": list(chunks), "table": table, "worst_ratio": worst,
            "target_within_5pct": worst <= 1.05, "requests": rows}


# -- orchestration ----------------------------------------------------------------------------------------


async def run_all(a: argparse.Namespace, preset: dict[str, Any], redis_url: str, timer: Timer,
                  checkpoint: Any = None) -> dict[str, Any]:
    """Run the chosen scenarios in order. A scenario that fails is recorded as ``{"error": ...}`` and
    the others still run; ``checkpoint(out)`` is called after each one (the JSON is written as it goes).
    """
    turns = hop.Workload(users=1, rounds=preset["turns"], nodes=4, system_tokens=preset["turn_system"],
                         context_tokens=preset["turn_tokens"], turn_tokens=preset["turn_tokens"],
                         max_tokens=a.max_tokens, threads=a.threads)
    multi = hop.Workload(users=preset["users"], rounds=preset["rounds"], nodes=2, system_tokens=preset["mu_system"],
                         context_tokens=preset["mu_context"], turn_tokens=30, max_tokens=a.max_tokens,
                         threads=a.threads, cache_ram_mib=a.cache_ram_mib)
    out: dict[str, Any] = {}
    with progress() as prog:
        jobs = {
            "memory": lambda: _memory_both(redis_url, preset, a.threads, prog),
            "turns": lambda: scenario_turns(redis_url, turns, prog),
            "move": lambda: hop.move_sessions(redis_url, preset["move_sizes"], preset["reps"], a.threads, prog),
            "move_fa_off": lambda: hop.move_sessions(redis_url, preset["move_sizes"], preset["reps"], a.threads, prog,
                                                     llama_extra=FA_OFF),
            "multiuser": lambda: scenario_multiuser(redis_url, multi, prog),
            "short": lambda: scenario_short(redis_url, preset["short_lengths"], preset["reps"], a.threads, prog),
            "agent_loop": lambda: agents.scenario_agent_loop(redis_url, preset["agent_histories"], preset["agent_turns"],
                                                             a.threads, a.max_tokens, prog),
            "server_restarts": lambda: agents.scenario_server_restarts(
                redis_url, preset["restart_history"], preset["restart_turns"], a.threads, a.max_tokens, prog,
                slow_history=preset["restart_slow_history"]),
            "save_readable": lambda: agents.scenario_save_readable(redis_url, preset["readable_sizes"], preset["reps"],
                                                                   a.threads, prog),
            "memory_types": lambda: memtypes.scenario_memory_types(redis_url, preset["types_history"], a.threads,
                                                                   a.max_tokens, prog),
            "routing": lambda: routing.scenario_routing(
                redis_url, preset["routing_nodes"], preset["routing_conversations"], preset["routing_doc"],
                preset["routing_turns"], preset["routing_private"], preset["routing_slots"], a.threads, a.max_tokens,
                prog),
        }
        for name in SCENARIOS:
            if name not in a.scenarios:
                continue
            with timer.phase(name):
                try:
                    out[name] = await jobs[name]()
                except Exception as exc:  # one broken scenario must not cost the others' hour
                    console.print_exception(max_frames=5)
                    out[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            if checkpoint is not None:
                checkpoint(out)
    return out


async def _memory_both(redis_url: str, preset: dict[str, Any], threads: int, prog: Progress) -> list[dict[str, Any]]:
    return [await scenario_memory(redis_url, preset["sessions"], preset["system_tokens"], preset["own_tokens"], kv,
                                  threads, prog) for kv in ("f16", "q8_0")]


def failed(value: Any) -> bool:
    return isinstance(value, dict) and "error" in value


def claims(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The write-up's three rows next to what this run measured (None where not measured)."""
    sc = {k: v for k, v in report.get("scenarios", {}).items() if not failed(v)}
    rows: list[dict[str, Any]] = []
    mem = next((m for m in sc.get("memory", []) if m["kv"] == "f16"), None)
    if mem:
        rows.append({"scenario": f"memory for {mem['sessions']} concurrent sessions", "claim": CLAIMS["memory"],
                     "without": f"{mem['whole_bytes'] / 1e9:.2f} GB", "with": f"{mem['redis_key_bytes'] / 1e9:.2f} GB",
                     "gain": f"{-100 * mem['reduction_vs_whole']:+.1f}%",
                     "note": f"whole slot states vs kvtier's Redis keys; {mem['system_tokens']:,}-token shared "
                             f"prompt + {mem['own_tokens']:,} own tokens, f16 KV"})
    turns = sc.get("turns")
    if turns:
        last = turns["probe_turns"][-1]
        b, k = _turn(turns, "direct-rolling", last), _turn(turns, "kvtier-rolling", last)
        if b and k:
            rows.append({"scenario": f"generation speed at turn {last} (rolling update)", "claim": CLAIMS["turn30"],
                         "without": f"{b['tokens_per_s_p50']:.1f} tok/s", "with": f"{k['tokens_per_s_p50']:.1f} tok/s",
                         "gain": _pct(k["tokens_per_s_p50"], b["tokens_per_s_p50"]),
                         "note": f"end-to-end, {b['prompt_tokens']:,}-token prompt on a just-restarted replica; "
                                 f"recomputed {b['recomputed_tokens']:,} vs {k['recomputed_tokens']:,} tokens"})
        (_, b_tps, b_rec), (_, k_tps, k_rec) = late_turns(turns, "direct-rr"), late_turns(turns, "kvtier")
        if b_tps and k_tps:
            rows.append({"scenario": f"generation speed at turns {'-'.join(map(str, late_window(turns)))} (round robin, "
                                     f"{turns['workload']['nodes']} replicas)", "claim": CLAIMS["turn30"],
                         "without": f"{b_tps:.1f} tok/s", "with": f"{k_tps:.1f} tok/s", "gain": _pct(k_tps, b_tps),
                         "note": f"end-to-end, median of the ten turns; llama-server alone reuses what its own "
                                 f"slot holds: recomputed {b_rec:,.0f} vs {k_rec:,.0f} tokens per turn"})
    for key, flags in (("move", ""), ("move_fa_off", " (llama-server -fa off)")):
        moves = sc.get(key) or []
        if not moves:
            continue
        m = min(moves, key=lambda x: abs(x["tokens"] - 4096))
        rows.append({"scenario": f"moving a {m['tokens']:,}-token session to another node{flags}", "claim": CLAIMS["move"],
                     "without": f"{m['recompute']['ttft_ms']:,.0f} ms", "with": f"{m['session_hop']['ttft_ms']['p50']:,.0f} ms",
                     "gain": _pct(m["session_hop"]["ttft_ms"]["p50"], m["recompute"]["ttft_ms"]),
                     "note": "TTFT on the other node: recompute vs restore from Redis + the 8 new tokens"
                             + (f" ({m['warm']['ttft_ms']['p50']:,.0f} ms of it computing those, as on the node that "
                                "holds the session)" if m.get("warm", {}).get("ttft_ms", {}).get("n") else "")})
    return rows


def _turn(turns: dict[str, Any], mode: str, turn: int) -> dict[str, Any] | None:
    res = turns["modes"].get(mode)
    if not res:
        return None
    return next((r for r in res["by_round"] if r["turn"] == turn), None)


def _pct(new: float, old: float) -> str:
    return f"{100 * (new / old - 1):+.1f}%" if old else "-"


def others(results_dir: Path) -> dict[str, Any]:
    """Result files of the other benchmarks (``--json bench/results/<name>.json``), when present."""
    found: dict[str, Any] = {}
    for name in ("hop", "overhead", "tiers", "state", "llama-cpp-python", "llama_cpp_python", "neverworse"):
        path = results_dir / f"{name}.json"
        if path.exists():
            try:
                found[name.replace("_", "-")] = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                console.print(f"[yellow]skipping {path}: {exc}")
    return found


# -- rendering: docs/benchmarks.md and docs/img/*.png (pure functions of the JSON) -------------------------


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}".rstrip("0").rstrip(".") if abs(v) < 10 else f"{v:.1f}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v).replace("|", "\\|")
    align = ["---"] + ["--:"] * (len(headers) - 1)
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _met(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def render_plots(report: dict[str, Any], img_dir: Path) -> dict[str, str]:
    """PNG plots (matplotlib, Agg) of the report; returns {name: path}. Skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullFormatter, ScalarFormatter
    except ImportError:
        console.print("[yellow]matplotlib is not installed: no plots (pip install matplotlib)")
        return {}
    img_dir.mkdir(parents=True, exist_ok=True)
    sc = {k: v for k, v in report.get("scenarios", {}).items() if not failed(v)}
    out: dict[str, str] = {}

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        out[name] = str(img_dir / f"{name}.png")
        fig.savefig(out[name], dpi=110)
        plt.close(fig)

    moves, short = sc.get("move") or [], sc.get("short")
    if moves or short:
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        if short:
            alone = sorted({(t["prompt_tokens"], t["alone_ttft_ms"]["p50"]) for t in short["table"]
                            if t["chunk_tokens"] == short["chunks"][0]})
            ax.plot(*zip(*alone), "o-", color="tab:red", alpha=0.6, label="short prefix: llama-server alone")
            for chunk, style in zip(short["chunks"], ("s--", "^--")):
                pts = sorted((t["prompt_tokens"], t["kvtier_ttft_ms"]["p50"]) for t in short["table"]
                             if t["chunk_tokens"] == chunk)
                ax.plot(*zip(*pts), style, alpha=0.8, label=f"short prefix: kvtier, {chunk}-token chunks")
        if moves:
            xs = [m["recompute"]["prompt_tokens"] for m in moves]
            ax.plot(xs, [m["recompute"]["ttft_ms"] for m in moves], "o-", color="tab:red", lw=2,
                    label="recompute (llama-server alone)")
            ax.plot(xs, [m["session_hop"]["ttft_ms"]["p50"] for m in moves], "s-", color="tab:green", lw=2,
                    label="kvtier: restore from Redis + new tokens")
            ax.plot(xs, [m["automatic_hop"]["ttft_ms"]["p50"] for m in moves], "d:", color="tab:olive",
                    label="kvtier automatic (chunks; the stored tail on the first hop)")
            ax.plot(xs, [m["floor"]["total_ms_p50"] for m in moves], "x:", color="grey",
                    label="floor: Redis GET + llama-server restore")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("prompt tokens on the node that has not seen them")
        ax.set_ylabel("TTFT ms (p50)")
        ax.set_title("Restore vs recompute: time to first token")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, "ttft_vs_context")

    turns = sc.get("turns")
    if turns:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
        for ax, pair, title in ((axes[0], ("direct-rr", "kvtier"), "round robin across 4 replicas"),
                                (axes[1], ("direct-rolling", "kvtier-rolling"), "rolling update")):
            for mode, colour in zip(pair, ("tab:red", "tab:green")):
                res = turns["modes"].get(mode)
                if res:
                    rs = res["by_round"]
                    ax.plot([r["turn"] for r in rs], [r["ttft_ms_p50"] for r in rs], ".-", color=colour,
                            label="llama-server alone" if mode.startswith("direct") else "kvtier")
            if "rolling" in pair[0]:
                for t in turns["probe_turns"][1:]:
                    ax.axvline(t, color="grey", ls=":", lw=1)
            ax.set_title(title)
            ax.set_xlabel("turn")
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        axes[0].set_ylabel("TTFT ms")
        if turns["modes"].get("direct-rolling"):
            axes[1].text(0.02, 0.02, "dotted: the turn lands on a node restarted just before", fontsize=7,
                         transform=axes[1].transAxes)
        save(fig, "ttft_per_turn")

    mem = sc.get("memory") or []
    if mem:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        labels = [m["kv"] for m in mem]
        x = range(len(mem))
        ax.bar([i - 0.2 for i in x], [m["whole_bytes"] / 1e6 for m in mem], 0.4, label="whole slot states")
        ax.bar([i + 0.2 for i in x], [m["redis_key_bytes"] / 1e6 for m in mem], 0.4, label="kvtier (Redis keys)")
        ax.set_xticks(list(x), labels)
        ax.set_ylabel("MB")
        ax.set_title(f"{mem[0]['sessions']} sessions sharing a {mem[0]['system_tokens']:,}-token prompt")
        ax.legend()
        save(fig, "memory")

    mu = sc.get("multiuser")
    if mu:
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        modes = list(mu["modes"])
        p50 = [mu["modes"][m]["summary"]["followup"]["ttft_ms"]["p50"] for m in modes]
        p90 = [mu["modes"][m]["summary"]["followup"]["ttft_ms"]["p90"] for m in modes]
        ax.bar([i - 0.2 for i in range(len(modes))], p50, 0.4, label="p50")
        ax.bar([i + 0.2 for i in range(len(modes))], p90, 0.4, label="p90")
        ax.set_xticks(range(len(modes)), modes)
        ax.set_ylabel("TTFT ms (follow-up rounds)")
        w = mu["workload"]
        ax.set_title(f"{w['users']} users x {w['rounds']} rounds on {w['nodes']} nodes")
        ax.legend()
        save(fig, "multiuser")
    return out


def _img(images: dict[str, str], name: str, alt: str, md_dir: Path) -> str:
    if name not in images:
        return ""
    try:
        rel = Path(images[name]).resolve().relative_to(md_dir.resolve())
    except ValueError:
        rel = Path(images[name])
    return f"\n![{alt}]({rel.as_posix()})\n"


def render_markdown(report: dict[str, Any], other: dict[str, Any], images: dict[str, str], md_dir: Path) -> str:
    """docs/benchmarks.md from the report JSON (and the other benchmarks' JSON files)."""
    m, v = report.get("machine", {}), report.get("versions", {})
    sc = {k: val for k, val in report.get("scenarios", {}).items() if not failed(val)}
    errors = {k: val["error"] for k, val in report.get("scenarios", {}).items() if failed(val)}
    parts = [textwrap.dedent(f"""\
        # Benchmarks

        <!-- Generated by `python -m bench report` from bench/results/report.json. Do not edit by hand:
             rerun the command (or `python -m bench report --render-only` after changing the renderer). -->

        The numbers on this page come from one run of `{report.get('command', 'python -m bench report').strip()}`
        ({report.get('preset', 'full')} settings, started {report.get('started', '?')}, {report.get('minutes', '?')}
        minutes{_reruns(report)}). Reproduce with `make venv llama-server && .venv/bin/python -m bench report` (add
        `--quick` for a smaller run); the raw figures are in `bench/results/report.json`.

        Model: SmolLM2-135M-Instruct Q4_1 (30 layers, 3 KV heads x 64: 23,040 bytes of f16 KV per token). Each
        node is one `llama-server -np 1 -t {report.get('threads', 2)} --cache-ram 0`
        (plus a `kvtier serve` sidecar where kvtier is measured); the Redis is an embedded Valkey on loopback.
        Slot directories are on tmpfs, as the Helm chart's memory-backed `emptyDir`.

        ## Machine and versions

        """)]
    load0, load1 = m.get("load_avg", []), m.get("load_avg_end", [])
    parts.append(md_table(["cores", "CPU", "RAM", "GPU", "load average at start", "at end"],
                          [[m.get("cores"), m.get("cpu_model"), f"{m.get('ram_gib')} GiB", m.get("gpu", "none"),
                            " / ".join(map(str, load0)), " / ".join(map(str, load1))]]))
    parts.append("\n\n" + md_table(["component", "version"], [[k.replace("_", " "), val] for k, val in v.items()]))
    parts.append(textwrap.dedent("""

        The machine is a shared 2-core VM (see the load averages): absolute timings are noisy (the same prompt
        processing varies by about 15% from one request to the next). Every comparison runs its variants side
        by side in the same run, and the tables quote medians (p50) and ratios.

        ## The write-up's claims, measured

        A widely shared write-up on "distributed KV caching for llama.cpp" claimed the left half of this table.
        The right half is what kvtier measured here, on a 135M model on CPU: the absolute figures are not
        comparable with a large model on a GPU, the directions and the ratios are what to read.

        """))
    cl = report.get("claims") or claims(report)
    parts.append(md_table(["scenario", "claimed without", "claimed with", "claimed gain", "measured without",
                           "measured with kvtier", "measured gain", "what was measured"],
                          [[c["scenario"], c["claim"]["without"], c["claim"]["with"], c["claim"]["gain"], c["without"],
                            c["with"], f"**{c['gain']}**", c["note"]] for c in cl]))
    parts.append("\n")
    if sc.get("memory"):
        parts.append(_md_memory(sc["memory"], images, md_dir))
    if sc.get("turns"):
        parts.append(_md_turns(sc["turns"], images, md_dir))
    if sc.get("move"):
        parts.append(_md_move(sc["move"], images, md_dir))
    if sc.get("move_fa_off"):
        parts.append(_md_move_fa_off(sc["move_fa_off"], sc.get("move") or []))
    if sc.get("multiuser"):
        parts.append(_md_multiuser(sc["multiuser"], images, md_dir))
    if sc.get("short"):
        parts.append(_md_short(sc["short"]))
    parts.append(agents.md_agents(sc, md_table))
    if sc.get("memory_types"):
        parts.append(memtypes.md_memory_types(sc["memory_types"], md_table))
    parts.append(routing.md_routing(sc, md_table))
    if errors:
        parts.append("\n## Scenarios that failed in this run\n\n" + "".join(f"- {k}: `{e}`\n" for k, e in errors.items()))
    parts.append(_md_others(other))
    parts.append(textwrap.dedent("""
        ## GPU

        Not measured: no GPU machine was available to this run, so every GPU row is empty rather than
        estimated. On a GPU, prefill is one to two orders of magnitude faster than on these two cores while a
        restore still moves the same bytes over the network, so the cost model restores less often: see
        [scaling.md](scaling.md) for where it stops restoring, computed from the rates measured here.
        """))
    if report.get("seconds"):
        parts.append("\nTime per scenario (s): " + ", ".join(f"{k} {val:,.0f}" for k, val in report["seconds"].items())
                     + ".\n")
    return "".join(parts)


def _reruns(report: dict[str, Any]) -> str:
    """", then X re-run at T (N minutes)" for scenarios re-run with ``--merge``; a run whose
    scenarios were all re-run again later is marked superseded (the page shows the last one)."""
    runs = report.get("reruns", [])
    out = []
    for i, r in enumerate(runs):
        later = {sc for after in runs[i + 1:] for sc in after["scenarios"]}
        gone = " (superseded)" if set(r["scenarios"]) <= later else ""
        out.append(f"; {', '.join(r['scenarios'])} re-run on {r['started']} ({r['minutes']} minutes, "
                   f"load average {' / '.join(map(str, r.get('machine', {}).get('load_avg', [])))}){gone}")
    return "".join(out)


def _md_memory(mem: list[dict[str, Any]], images: dict[str, str], md_dir: Path) -> str:
    m0 = mem[0]
    rows = [[m["kv"], m["sessions"], m["session_tokens"], _mb(m["whole_bytes"]), f"{m['whole_bytes_per_token']:,.0f}",
             _mb(m["redis_key_bytes"]), (f"{_mb(m['redis_chunk_bytes'])} / {_mb(m['redis_tail_bytes'])} / "
                                         f"{m['redis_manifest_bytes'] / 1e3:,.0f} kB"), _mb(m["redis_used_memory_delta"]),
             " + ".join(_mb(x) for x in m["ram_tier_bytes"]), f"**{-100 * m['reduction_vs_whole']:+.1f}%**"]
            for m in mem]
    return textwrap.dedent(f"""
        ## 1. Memory for {m0['sessions']} concurrent sessions

        {m0['sessions']} sessions share a {m0['system_tokens']:,}-token system prompt and add {m0['own_tokens']:,}
        tokens each; they alternate between two nodes and each is saved as a session (`X-Session-Id`).
        *Whole slot states* is the sum of the files llama-server's own slot save writes for the same sessions,
        which is also what llama-cpp-python's `LlamaRAMCache`/`LlamaDiskCache` keep per entry: every session
        carries its own copy of the shared prompt. kvtier stores 256-token chunks under content-addressed keys,
        so the shared prompt's full chunks are stored once; each session adds its own chunks and its tail
        (the tokens after its last full chunk). *Redis keys* is `MEMORY USAGE` summed over kvtier's keys.
        The RAM tier of each sidecar is a node-local cache in front of Redis (bounded by `--cache-size`), not a
        second copy that must exist: it holds what that node computed or fetched.

        """) + md_table(["KV", "sessions", "tokens", "whole slot states", "bytes/token", "kvtier in Redis",
                         "chunks / tails / manifests", "Redis used_memory delta", "RAM tier per node",
                         "vs whole states"], rows) + "\n" + _img(images, "memory", "memory", md_dir)


def _md_turns(turns: dict[str, Any], images: dict[str, str], md_dir: Path) -> str:
    w = turns["workload"]
    rows = []
    for t in turns["probe_turns"]:
        for mode in ("direct-rr", "kvtier", "direct-rolling", "kvtier-rolling"):
            r = _turn(turns, mode, t)
            if r:
                rows.append([t, mode, r["prompt_tokens"], r["recomputed_tokens"], r["restored_tokens"],
                             r["ttft_ms_p50"], r["total_ms_p50"], r["tokens_per_s_p50"]])
    return textwrap.dedent(f"""
        ## 2. Generation speed at turn {turns['probe_turns'][-1]} of a conversation that hops nodes

        One conversation: a {w['system_tokens']:,}-token system prompt, then {w['rounds']} turns of about
        {w['turn_tokens']} tokens with greedy answers of {w['max_tokens']} tokens, on {w['nodes']} replicas.
        *Round robin*: turn *t* goes to replica *t* mod {w['nodes']}; llama-server alone still holds, in its
        only slot, what that replica saw {w['nodes']} turns earlier, so it recomputes only the turns since then,
        while kvtier also restores those from Redis (full 256-token chunks and the partial tail the other
        replica's slot held after them; the new turn is recomputed). *Rolling update*: before turns {', '.join(map(str, turns['probe_turns'][1:]))} the
        conversation moves to a replica that has just restarted (turns in between stay on the same replica):
        llama-server alone recomputes the whole history there. Tokens/s is end to end: answer tokens over the
        whole request time, prompt processing included, as a user experiences it.

        """) + md_table(["turn", "mode", "prompt tokens", "recomputed", "restored", "TTFT ms", "request ms",
                         "tokens/s"], rows) + textwrap.dedent(f"""

        One request per turn is one sample: prompt processing of the same few hundred tokens at a 3k context
        varies by about 15% from request to request here. In round robin every turn is a hop, so the medians
        over the last ten turns ({'-'.join(map(str, late_window(turns)))}) say more than turn {turns['probe_turns'][-1]} alone
        (in the rolling update only the restart turns are hops):

        """) + md_table(["mode", f"TTFT p50 ms, turns {'-'.join(map(str, late_window(turns)))}", "tokens/s p50",
                         "recomputed tokens (mean)"],
                        [[m, *late_turns(turns, m)] for m in ("direct-rr", "kvtier")]) \
        + "\n\n" + _img(images, "ttft_per_turn", "TTFT per turn", md_dir)


def late_window(turns: dict[str, Any]) -> tuple[int, int]:
    """The last ten turns (first, last), 1-based."""
    last = turns["probe_turns"][-1]
    return max(1, last - 9), last


def late_turns(turns: dict[str, Any], mode: str) -> list[float]:
    """TTFT p50, tokens/s p50 and mean recomputed tokens over the last ten turns of ``mode``."""
    lo, hi = late_window(turns)
    rows = [r for r in turns["modes"].get(mode, {}).get("by_round", []) if lo <= r["turn"] <= hi]
    if not rows:
        return [0.0, 0.0, 0.0]
    return [percentile([r["ttft_ms_p50"] for r in rows], 50), percentile([r["tokens_per_s_p50"] for r in rows], 50),
            round(sum(r["recomputed_tokens"] for r in rows) / len(rows))]


def _md_move(moves: list[dict[str, Any]], images: dict[str, str], md_dir: Path) -> str:
    rows = []
    for mv in moves:
        fl = mv["floor"]
        rows.append([mv["tokens"], _mb(mv["session_bytes"] or 0), mv["recompute"]["ttft_ms"],
                     f"{mv['api_restore_ms']['p50']:,.0f} / {mv['api_restore_ms']['p90']:,.0f}",
                     f"{mv['session_hop']['ttft_ms']['p50']:,.0f} / {mv['session_hop']['ttft_ms']['p90']:,.0f}",
                     mv["session_hop"]["restore_ms"]["p50"],
                     f"{fl['total_ms_p50']:,.0f} = {fl['redis_get_ms']['p50']:,.0f} + {fl['llama_restore_ms']['p50']:,.0f}",
                     mv["hop_restore_vs_floor"], mv["automatic_hop"]["ttft_ms"]["p50"],
                     mv.get("warm", {}).get("ttft_ms", {}).get("p50", "-"), mv.get("hop_added_ms_p50", "-"),
                     f"{mv['hop_speedup_vs_recompute']}x"])
    phases = [[mv["tokens"], "Redis", *(mv.get("hop_phases_ms_p50", {}).get(p, "-") for p in RESTORE_PHASES)]
              for mv in moves]
    prewarmed = [mv for mv in moves if mv.get("prewarmed_hop")]
    phases += [[mv["tokens"], "prewarmed RAM", *(mv["prewarmed_hop"]["phases_ms_p50"].get(p, "-")
                                                for p in RESTORE_PHASES)] for mv in prewarmed]
    pre_rows = [[mv["tokens"], f"{mv['prewarmed_hop']['ttft_ms']['p50']:,.0f} / {mv['prewarmed_hop']['ttft_ms']['p90']:,.0f}",
                 mv["prewarmed_hop"]["restore_ms"]["p50"], mv["prewarmed_hop"]["tier"],
                 mv.get("warm", {}).get("ttft_ms", {}).get("p50", "-"),
                 _met(mv["targets"].get("prewarmed_hop_ttft_under_300ms", False))] for mv in prewarmed]
    targets = "; ".join(f"{mv['tokens']:,} tokens: TTFT < 300 ms {_met(mv['targets']['hop_ttft_under_300ms'])} "
                        f"(prewarmed: {_met(mv['targets'].get('prewarmed_hop_ttft_under_300ms', False))}), "
                        f"restore within 1.3x of the floor {_met(mv['targets']['restore_within_1_3x_floor'])}"
                        for mv in moves)
    pre_text = ("\n\n*Prewarmed hop*: the same hop to node C, whose sidecar runs with `--prewarm`: it copied A's "
                "chunks into its RAM tier when A announced them (seconds before the hop, as between two turns of a "
                "user), so only the session's short tail comes from Redis.\n\n"
                + md_table(["tokens", "prewarmed hop TTFT p50 / p90 ms", "restore p50 ms", "tier", "warm TTFT ms",
                            "< 300 ms"], pre_rows)) if pre_rows else ""
    reps = moves[0]["reps"]
    return textwrap.dedent(f"""
        ## 3. Moving a session to another node

        A session is computed on node A (its prefill is the *recompute* column) and saved there with
        `PUT /v1/sessions/{{id}}`. Node B has never seen it and its RAM tier is 1 MiB, so everything comes from
        Redis. On B, {reps} times each: `POST /v1/sessions/{{id}}/restore` (*API restore*, the sidecar's own
        timing: fetch, verify, assemble, restore); a completion of the session plus 8 new tokens sent with
        `X-Session-Id` (*hop TTFT*: the sidecar restores the session, tail included, and llama-server computes
        the new tokens); the same completion without the header (*automatic*: the full 256-token chunks, and
        the partial tail A's slot held after them when the prompt continues it; B's own save after the first
        automatic hop holds that tail and more and deletes it, so the repeats restore the chunks alone and
        recompute the rest: the p50 is theirs). The *floor* is the same restore done by hand in the same run: one
        pipelined Redis GET of the session's keys plus llama-server's own `restore_ms` for the same state file.
        *Warm* is the same continuation on node A's llama-server, whose slot still holds the session: nothing
        moves and only the new tokens are computed, so *hop - warm* is what moving the session cost.

        """) + md_table(["tokens", "state", "recompute TTFT ms", "API restore p50 / p90 ms", "hop TTFT p50 / p90 ms",
                         "hop restore p50 ms", "floor p50 ms = GET + restore_ms", "restore / floor",
                         "automatic hop TTFT ms", "warm TTFT ms", "hop - warm ms", "hop vs recompute"], rows) \
        + pre_text + f"\n\nTargets: {targets}.\n\nWhere the hop's restore time goes (p50 ms, from the sidecar's " \
        + "`kvtier_restore_phase_seconds`): *fetch* from the tiers and verify, *assemble* the file's layout (a list " \
        + "of slices of the chunks; where V is transposed, each layer's V block is built once), *write* the state " \
        + "file (one `writev`), " \
        + "*queue* the wait in llama-server's task queue, *llama* is llama-server's restore.\n\n" \
        + md_table(["tokens", "from", *RESTORE_PHASES], phases) + "\n\n" \
        + _img(images, "ttft_vs_context", "TTFT vs context length", md_dir)


def _md_move_fa_off(moves: list[dict[str, Any]], default: list[dict[str, Any]]) -> str:
    """The same hops with every llama-server started with ``-fa off``, beside the default run."""
    by_size = {mv["tokens"]: mv for mv in default}
    rows = []
    for mv in moves:
        d = by_size.get(mv["tokens"])
        warm = mv.get("warm", {}).get("ttft_ms", {}).get("p50")
        d_warm = d.get("warm", {}).get("ttft_ms", {}).get("p50") if d else None
        rows.append([mv["tokens"], mv["recompute"]["ttft_ms"], d["recompute"]["ttft_ms"] if d else "-",
                     warm if warm is not None else "-", d_warm if d_warm is not None else "-",
                     f"{mv['session_hop']['ttft_ms']['p50']:,.0f} / {mv['session_hop']['ttft_ms']['p90']:,.0f}",
                     mv["automatic_hop"]["ttft_ms"]["p50"],
                     mv["prewarmed_hop"]["ttft_ms"]["p50"] if mv.get("prewarmed_hop") else "-",
                     d["session_hop"]["ttft_ms"]["p50"] if d else "-", mv["hop_restore_vs_floor"],
                     mv.get("hop_phases_ms_p50", {}).get("assemble", "-"),
                     _met(mv["targets"]["hop_ttft_under_300ms"])])
    return textwrap.dedent(f"""
        ### The same hops with llama-server's flash attention off

        llama-server's default (`-fa auto`) turns flash attention on for this CPU. The same scenario with
        every llama-server started with `{' '.join(moves[0].get('llama_extra') or [])}`, after the run
        above: prefill is slower (*recompute*), a short continuation at long context is faster (*warm*:
        the 8 new tokens on the node that holds the session), and V is stored transposed, so kvtier builds
        each layer's V block when it restores (*assemble*; K stays a list of slices). *default* columns are
        the run above.

        """) + md_table(["tokens", "recompute TTFT ms", "default: recompute ms", "warm TTFT ms", "default: warm ms",
                         "hop TTFT p50 / p90 ms", "automatic hop TTFT ms", "prewarmed hop TTFT ms",
                         "default: hop TTFT ms", "restore / floor", "assemble p50 ms", "hop < 300 ms"], rows) + "\n"


def _md_multiuser(mu: dict[str, Any], images: dict[str, str], md_dir: Path) -> str:
    w = mu["workload"]
    rows = []
    for mode, res in mu["modes"].items():
        f = res["summary"]["followup"]
        rows.append([mode, f["requests"], f["ttft_ms"]["p50"], f["ttft_ms"]["p90"], f["prompt_tokens"],
                     f["recomputed_tokens"], f["restored_tokens"], f"{100 * f['hit_rate']:.0f}%", f["tokens_per_s_p50"]])
    a = mu["modes"].get("kvtier", {}).get("summary", {}).get("all")
    first = (f" Over all rounds (first turns included) kvtier's hit rate was {100 * a['hit_rate']:.0f}% and its "
             f"TTFT p50 {a['ttft_ms']['p50']:,.0f} ms.") if a else ""
    return textwrap.dedent(f"""
        ## 4. Multi-user, multi-round workload

        In the style of LMCache's multi-round QA benchmark: {w['users']} users x {w['rounds']} rounds, a shared
        {w['system_tokens']:,}-token system prompt, a {w['context_tokens']:,}-token document of each user's own in
        its first turn, questions of about {w['turn_tokens']} tokens after it, answers of {w['max_tokens']} tokens;
        users take turns, and each user's next turn goes to the other node (round robin) except in
        *direct-sticky* (each user pinned to one node). Every llama-server has one slot (`-np 1`): pinned or
        not, a node's slot holds the last conversation it served, so llama-server alone reuses the shared
        system prompt and little else; `cache-ram` gives it its own host-RAM prompt cache
        (`--cache-ram {mu['modes'].get('cache-ram', {}).get('cache_ram_mib', 2048)}`), which only helps when the
        user comes back to the same node. The table covers the follow-up rounds (a user's first turn is a cold
        start everywhere). Hit rate = prompt tokens not recomputed / prompt tokens.{first}

        """) + md_table(["mode", "requests", "TTFT p50 ms", "TTFT p90 ms", "prompt tokens", "recomputed", "restored",
                         "hit rate", "tokens/s p50"], rows) + "\n" + _img(images, "multiuser", "multi-user TTFT", md_dir)


def _md_short(short: dict[str, Any]) -> str:
    rows = [[t["prefix_tokens"], t["prompt_tokens"], t["chunk_tokens"], t["alone_ttft_ms"]["p50"],
             t["kvtier_ttft_ms"]["p50"], t["kvtier_ttft_ms"]["p90"], t["vs_alone"], t["paired_vs_alone"],
             t["restored_tokens_p50"], t["recomputed_tokens_p50"],
             f"{t['decisions_restore']:.0f} / {t['decisions_recompute']:.0f}"] for t in short["table"]]
    return textwrap.dedent(f"""
        ## 5. When not to restore: short prefixes

        A prefix of {', '.join(map(str, short['lengths']))} tokens (plus a 16-token question) is computed on node
        A; the same prefix with another question then goes to node B, whose only slot holds an unrelated chat,
        {short['reps']} times, once through B's sidecar and once straight to B's llama-server (alternating which
        goes first). With the default 256-token chunks a shorter prefix has no full chunk to restore, so
        kvtier's cost there is its own overhead; with smaller chunks the cost model
        (`kvtier_cost_decisions_total`) decides per request. Target: kvtier's TTFT never more than 5% above
        llama-server alone: worst p50 ratio {short['worst_ratio']} ({_met(short['target_within_5pct'])}).

        """) + md_table(["prefix tokens", "prompt tokens", "chunk tokens", "alone TTFT p50 ms", "kvtier TTFT p50 ms",
                         "kvtier p90 ms", "p50 ratio", "paired ratio p50", "restored p50", "recomputed p50",
                         "decisions restore / recompute"], rows) + textwrap.dedent("""

        On two CPU cores prefill runs at a few hundred tokens/s, so even a 64-token chunk restores (a few MB,
        milliseconds) faster than it recomputes, and the cost model says *restore* wherever a chunk exists.
        It says *recompute* when a fast prefill makes recomputing cheaper than moving the bytes, that is on
        GPUs: [scaling.md](scaling.md) computes where that happens.
        """)


def _md_others(other: dict[str, Any]) -> str:
    out = [("\n## Other benchmarks\n\nEach writes its JSON with `--json bench/results/<name>.json`; this page "
            "includes the files present when it was rendered.\n")]
    hop_r = other.get("hop")
    if hop_r:
        out.append("\n### `python -m bench hop`\n\n")
        w = hop_r["workload"]
        out.append(f"{w['users']} users x {w['rounds']} rounds on {w['nodes']} nodes (follow-up rounds; "
                   f"load average {hop_r['machine'].get('load_avg')}):\n\n")
        out.append(md_table(hop.MODE_HEADERS, hop.mode_rows(hop_r["modes"])))
        if hop_r.get("long_hop"):
            out.append("\n\nLong hop:\n\n" + md_table(hop.MOVE_HEADERS, hop.move_rows([hop_r["long_hop"]])))
        out.append("\n")
    else:
        out.append("\n- `python -m bench hop --json bench/results/hop.json`: not run for this page.\n")
    ov = other.get("overhead")
    if ov:
        from .overhead import HEADERS
        from .overhead import rows as ov_rows

        tails = ("each pair adds a new short tail (the next question: text the sidecar has not seen)"
                 if ov.get("fresh_tails") else "the same request every time")
        if ov.get("direct_server") == "own":
            tails += "; direct requests go to a second llama-server with the same flags (no shared slot)"
        out.append(f"\n### `python -m bench overhead`\n\n{ov['prompt_tokens']}-token prompt already in the slot, "
                   f"{tails}, n_predict 1, {ov['reps']} rounds per kind, the paths' order rotating (load average "
                   f"{ov['machine'].get('load_avg')}). *Outside llama-server's compute*: each request's wall time "
                   f"minus llama-server's `prompt_ms + predicted_ms` (which jitter by several ms here, alike on both "
                   f"paths), sidecar p50 minus direct p50; the target is judged on it. *sidecar's own*: the mean of "
                   f"its `kvtier_overhead_seconds` histogram (its time before forwarding, prompt tokens included); "
                   f"*of which prompt tokens*: the mean of `kvtier_prompt_seconds` (rendering and tokenizing). "
                   f"*GET /health*: llama-server's health check passed through the sidecar untouched, against the "
                   f"same request straight to llama-server: the extra HTTP hop alone, no compute on either side. "
                   f"*a bare relay adds*: the same figure for `bench/barerelay.py` (bytes in, bytes out on "
                   f"uvloop, in front of a third llama-server with the same flags, timed in the same rounds): "
                   f"the floor any Python proxy sits on here; *an aiohttp relay adds*: the same for the "
                   f"sidecar's HTTP layer alone (`--aiohttp`: aiohttp, `Upstream`, the relay; no middleware, no logic). "
                   f"*prompt tokens*: given by the client, computed in kvtier, asked of llama-server, or not "
                   f"needed (a follow-up: the request continues what its slot answered last and goes there "
                   f"untokenized; `chat_new_history` changes an earlier message, so it is tokenized).\n\n")
        out.append(md_table(HEADERS, ov_rows(ov)) + "\n")
    else:
        out.append("- `python -m bench overhead --json bench/results/overhead.json`: not run for this page.\n")
    out.append(neverworse.md_neverworse(other["neverworse"], md_table) if other.get("neverworse") else
               "- `python -m bench neverworse`: not run for this page.\n")
    st = other.get("state")
    if st and st.get("real"):
        out.append("\n### `python -m bench state` (real llama-server part)\n\n")
        out.append(md_table(["tokens", "state MB", "save ms", "restore ms", "recompute ms", "prefill tok/s"],
                            [[r["n_tokens"], round(r["file_bytes"] / 1e6, 1), r["save_ms"], r["restore_ms"],
                              r["recompute_ms"], r["prefill_tokens_per_s"]] for r in st["real"]]) + "\n")
    elif not st:
        out.append("- `python -m bench state --json bench/results/state.json`: not run for this page.\n")
    for name in ("tiers", "llama-cpp-python"):
        data = other.get(name)
        if data is None:
            out.append(f"- `python -m bench {name} --json bench/results/{name.replace('-', '_')}.json`: not run for "
                       "this page.\n")
            continue
        out.append(f"\n### `python -m bench {name}`\n\n<details><summary>figures from "
                   f"bench/results/{name.replace('-', '_')}.json</summary>\n\n```\n{_flat(data)}\n```\n</details>\n")
    return "".join(out)


def _flat(data: Any, prefix: str = "", depth: int = 0, limit: int = 60) -> str:
    """The scalar figures of a JSON document, one per line (for results whose layout this renderer does not know)."""
    lines: list[str] = []

    def walk(d: Any, p: str, level: int) -> None:
        if len(lines) >= limit:
            return
        if isinstance(d, dict) and level < 4:
            for k, val in d.items():
                walk(val, f"{p}.{k}" if p else str(k), level + 1)
        elif isinstance(d, list) and level < 4 and len(d) <= 8:
            for i, val in enumerate(d):
                walk(val, f"{p}[{i}]", level + 1)
        elif isinstance(d, (int, float, str, bool)) and not isinstance(d, str) or isinstance(d, str) and len(d) < 80:
            lines.append(f"{p}: {d}")
    walk(data, prefix, depth)
    return "\n".join(lines)


def print_summary(report: dict[str, Any]) -> None:
    rows = [[c["scenario"], f"{c['claim']['without']} -> {c['claim']['with']} ({c['claim']['gain']})",
             c["without"], c["with"], c["gain"]] for c in claims(report)]
    print_table("The write-up's claims next to this run", ["scenario", "claimed", "without (measured)",
                                                         "with kvtier (measured)", "gain"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench report", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (a few minutes)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    p.add_argument("--render-only", action="store_true", help="only re-render the docs from the JSON")
    p.add_argument("--merge", action="store_true",
                   help="re-run --scenarios into the existing JSON, keeping its other scenarios (the page lists re-runs)")
    p.add_argument("--json", default=str(RESULTS_DIR / "report.json"))
    p.add_argument("--md", default="docs/benchmarks.md")
    p.add_argument("--img", default="docs/img")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16, help="answer length in the conversation scenarios")
    p.add_argument("--cache-ram-mib", type=int, default=2048)
    p.add_argument("--redis-url", help="use this Redis instead of an embedded Valkey (it gets FLUSHALLed!)")
    for key, value in PRESETS["full"].items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, list):
            p.add_argument(flag, type=lambda x: [int(v) for v in x.split(",") if v], default=None)
        else:
            p.add_argument(flag, type=int, default=None)
    a = p.parse_args(argv)
    a.scenarios = [x for x in a.scenarios.split(",") if x]
    if bad := [x for x in a.scenarios if x not in SCENARIOS]:
        p.error(f"unknown scenarios {bad}")
    json_path = Path(a.json)
    if not a.render_only:
        preset = dict(PRESETS["quick" if a.quick else "full"])
        preset.update({k: v for k, v in vars(a).items() if k in preset and v is not None})
        timer = Timer()
        started = dt.datetime.now(dt.UTC)
        json_path.parent.mkdir(parents=True, exist_ok=True)

        base = json.loads(json_path.read_text()) if a.merge and json_path.exists() else None

        def write(scenarios: dict[str, Any]) -> None:
            info["machine"]["load_avg_end"] = machine()["load_avg"]
            run = {"command": "python -m bench report " + " ".join(argv or []), **info,
                   "started": started.isoformat(timespec="seconds"),
                   "minutes": round((dt.datetime.now(dt.UTC) - started).total_seconds() / 60, 1),
                   "seconds": timer.phases}
            if base is not None:  # the earlier run stays the page's run; this one is listed as a re-run
                report = {**base, "scenarios": {**base.get("scenarios", {}), **scenarios},
                          "reruns": [*base.get("reruns", []), {**run, "scenarios": sorted(scenarios)}]}
            else:
                report = {"benchmark": "report", "preset": "quick" if a.quick else "full", "settings": preset,
                          "threads": a.threads, "max_tokens": a.max_tokens, **run, "scenarios": scenarios}
            json_path.write_text(json.dumps(report, indent=2, default=str))

        with redis_or_given(a.redis_url) as redis_url:
            info = {"machine": machine(), "versions": versions(redis_url)}
            write(asyncio.run(run_all(a, preset, redis_url, timer, checkpoint=write)))
        console.print(f"wrote {json_path}")
    report = json.loads(json_path.read_text())
    report["claims"] = claims(report)
    images = render_plots(report, Path(a.img))
    md = render_markdown(report, others(json_path.parent), images, Path(a.md).parent)
    Path(a.md).parent.mkdir(parents=True, exist_ok=True)
    Path(a.md).write_text(md)
    print_summary(report)
    console.print(f"wrote {a.md} and {len(images)} plots in {a.img}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
