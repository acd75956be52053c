"""``routing``: round robin in front of a fleet, with and without cache-aware forwarding.

Several conversations at once, each over the same long document, each turn bringing its own notes
(a private text of some hundred tokens, as a user pastes) and a question, a think time of 1-2 s
between turns, every turn sent to the next node in a global round robin (a plain
Service). Modes, side by side in one run:

- ``alone-rr``: llama-server alone, round robin;
- ``sticky``: llama-server alone, each conversation always on one node (ideal affinity);
- ``restore-only``: kvtier, round robin: a turn on another node restores its history from the tiers;
- ``forward``: kvtier with ``--forward`` and ``--advertise-url``: a turn on another node goes to the
  node holding its history hot when the cost model says so.

Per mode: TTFT p50/p95 of turns 2 and later (turn 1 is the document's first prefill), throughput
(turns and generated tokens per second of wall time), bytes read from Redis per turn, and the
routing and restore decisions the sidecars counted.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from rich.progress import Progress

from .agents import QUESTIONS, document
from .common import (
    FLEET_KEY,
    base_llama_args,
    chat,
    client_session,
    cluster,
    delta,
    percentile,
    redis_flush,
    scrape,
)

MODES: dict[str, dict[str, Any]] = {
    "alone-rr": {"sidecar": False, "sticky": False, "args": []},
    "sticky": {"sidecar": False, "sticky": True, "args": []},
    "restore-only": {"sidecar": True, "sticky": False, "args": []},
    "forward": {"sidecar": True, "sticky": False, "args": ["--forward", "--chunk-key", FLEET_KEY]},
}
THINK_S = (1.0, 2.0)


async def scenario_routing(redis_url: str, nodes: int, conversations: int, doc_tokens: int, turns: int,
                           private_tokens: int, slots: int, threads: int, max_tokens: int,
                           prog: Progress | None = None) -> dict[str, Any]:
    """Per mode, ``conversations`` conversations of ``turns`` turns at once over ``nodes`` nodes
    of ``slots`` slots each, each turn with ``private_tokens`` of its own notes."""
    ctx = slots * (doc_tokens + turns * (private_tokens + 60 + max_tokens) + 256)
    task = prog.add_task("routing", total=len(MODES) * conversations * turns) if prog else None
    out: dict[str, Any] = {"nodes": nodes, "conversations": conversations, "doc_tokens": doc_tokens, "turns": turns,
                           "private_tokens": private_tokens, "slots": slots, "modes": {}}
    doc = document(doc_tokens, 70)
    for mode, spec in MODES.items():
        await redis_flush(redis_url)
        sidecar = bool(spec["sidecar"])
        with cluster(nodes, base_llama_args(ctx, threads, extra=["-np", str(slots)]), sidecar=sidecar,
                     redis_url=redis_url if sidecar else None, sidecar_args=spec["args"], advertise=sidecar) as cl:
            async with client_session() as s:
                before = [await scrape(s, cl.url(i)) for i in range(nodes)] if sidecar else []
                if prog and task is not None:
                    prog.update(task, description=f"routing: {mode}")
                results, wall = await _run(s, [cl.url(i) for i in range(nodes)], doc, conversations, turns,
                                           private_tokens, bool(spec["sticky"]), max_tokens, prog, task)
                after = [await scrape(s, cl.url(i)) for i in range(nodes)] if sidecar else []
        rows = [r for conv in results for r in conv]
        out["modes"][mode] = _summarize(rows, wall, before, after)
    out["table"] = [{"mode": m, **{k: v for k, v in r.items() if k != "requests"}} for m, r in out["modes"].items()]
    return out


async def _run(s: Any, urls: list[str], doc: str, conversations: int, turns: int, private_tokens: int,
               sticky: bool, max_tokens: int, prog: Progress | None, task: Any) -> tuple[list[list[dict[str, Any]]], float]:
    """The conversations at once; returns their turns and the wall time (think time included: the
    same in every mode)."""
    counter = iter(range(1 << 30))
    rng = random.Random(7)
    thinks = [[rng.uniform(*THINK_S) for _ in range(turns)] for _ in range(conversations)]

    async def conversation(c: int) -> list[dict[str, Any]]:
        messages = [{"role": "system", "content": "Answer from these records. " + doc}]
        rows = []
        for t in range(turns):
            node = c % len(urls) if sticky else next(counter) % len(urls)
            notes = document(private_tokens, 1000 + 10 * c + t)
            messages.append({"role": "user", "content": f"My notes: {notes}\n{QUESTIONS[(c + t) % len(QUESTIONS)]}"})
            reply = await chat(s, urls[node], messages, max_tokens)
            messages.append({"role": "assistant", "content": reply.content})
            rows.append({"conversation": c, "turn": t + 1, "node": node, "ttft_ms": reply.ttft_ms,
                         "total_ms": reply.total_ms, "generated": reply.predicted_n,
                         "recomputed": reply.recomputed_tokens, "restored": reply.restored_tokens})
            if prog and task is not None:
                prog.advance(task)
            await asyncio.sleep(thinks[c][t])
        return rows

    t0 = time.perf_counter()
    results = await asyncio.gather(*(conversation(c) for c in range(conversations)))
    return list(results), time.perf_counter() - t0


def _summarize(rows: list[dict[str, Any]], wall: float, before: list[Any], after: list[Any]) -> dict[str, Any]:
    later = [r for r in rows if r["turn"] > 1]
    ttft = [r["ttft_ms"] for r in later]
    out: dict[str, Any] = {
        "turns": len(rows), "wall_s": round(wall, 2),
        "ttft_p50_ms": round(percentile(ttft, 50), 1), "ttft_p95_ms": round(percentile(ttft, 95), 1),
        "turns_per_s": round(len(rows) / wall, 3) if wall else 0.0,
        "tokens_per_s": round(sum(r["generated"] for r in rows) / wall, 2) if wall else 0.0,
        "recomputed_per_turn": round(sum(r["recomputed"] for r in later) / max(len(later), 1), 1),
        "requests": rows,
    }
    if after:
        def total(name: str, **labels: str) -> float:
            return sum(delta(a, b, name, **labels) for a, b in zip(after, before))
        out["redis_bytes_per_turn"] = round(total("kvtier_tier_bytes_read_total", tier="redis") / len(rows))
        out["decisions"] = {
            "forwarded": total("kvtier_route_decisions_total", decision="forwarded"),
            "served_here": total("kvtier_route_decisions_total", decision="served_here"),
            "fallback": total("kvtier_route_decisions_total", decision="fallback"),
            "restored": total("kvtier_cost_decisions_total", decision="restore"),
            "recomputed": total("kvtier_cost_decisions_total", decision="recompute"),
        }
        out["bytes_not_moved"] = total("kvtier_route_bytes_not_moved_total")
    return out


def md_routing(sc: dict[str, Any], md_table: Any) -> str:
    """The ``routing`` section of docs/benchmarks.md."""
    rt = sc.get("routing")
    if not rt:
        return ""
    head = f"""
## Routing: round robin in front, with and without forwarding

{rt['conversations']} conversations at once over one {rt['doc_tokens']:,}-token document, each turn with
~{rt.get('private_tokens', 0):,} tokens of the user's own notes and a question, {rt['turns']} turns, 1-2 s of think time between turns, over {rt['nodes']} nodes (`-np {rt.get('slots', 2)}`), every
turn sent to the next node in a round robin (a plain Service). *sticky* keeps each conversation on one node
(ideal affinity); *restore-only* is kvtier as it was, restoring a history on whichever node the turn lands;
*forward* adds `--forward`: a turn that lands away from its history goes to the node that holds it hot when
the cost model (the peer's queue and computing slots included) says it answers sooner. TTFT over turns 2 and later; throughput
over the whole run (think time included, the same in every mode).

"""
    rows = []
    for r in rt["table"]:
        d = r.get("decisions") or {}
        rows.append([r["mode"], f"{r['ttft_p50_ms']:,.0f}", f"{r['ttft_p95_ms']:,.0f}", f"{r['turns_per_s']:.3f}",
                     f"{r['tokens_per_s']:.1f}", f"{r['recomputed_per_turn']:,.0f}",
                     f"{r['redis_bytes_per_turn'] / 1e6:,.1f}" if "redis_bytes_per_turn" in r else "-",
                     ", ".join(f"{k} {v:.0f}" for k, v in d.items() if v) or "-"])
    return head + md_table(["mode", "TTFT p50 (ms)", "TTFT p95 (ms)", "turns/s", "tokens/s", "recomputed per turn",
                            "Redis MB read per turn", "decisions"], rows) + "\n"
