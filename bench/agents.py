"""Turns that do not wait: agent loops, llama-server restarts, and how soon a save is readable.

Three ``python -m bench report`` scenarios (issue "never miss the last turn"):

- ``agent_loop``: conversations over a long document whose next turn is sent the moment the last
  answer ended, round robin over 3 nodes (``-np 2``), so each turn lands on a node while the node
  before it is still saving. Modes, side by side: llama-server alone; kvtier that never waits for
  a save in flight (``--save-wait 0``, kvtier before pending-save marks); kvtier.
- ``server_restarts``: a rolling update where only llama-server restarts (the sidecar keeps
  running, as when the llama-server container alone is restarted in a Pod), 2 nodes, each node's
  llama-server restarted just before it takes a turn. llama-server alone against kvtier.
- ``save_readable``: from the end of an answer to Redis holding its new chunks and tail (what a
  next turn on another node can restore), measured by the sidecar itself
  (``kvtier_save_readable_seconds``), for fresh prompts of 2k and 8k tokens.

Per hop: tokens llama-server recomputed (``timings.prompt_n``), tokens restored, TTFT.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.progress import Progress

from launch import smollm2_path
from tests.ggufgen import ModelShape, write_random_llama

from .common import (
    FLEET_KEY,
    Reply,
    base_llama_args,
    chat,
    client_session,
    cluster,
    complete,
    delta,
    exact_tokens,
    filler,
    percentile,
    redis_flush,
    scrape,
    summary,
    wait_idle,
)

LOOP_MODES = {"alone": None, "kvtier-no-wait": ["--save-wait", "0"], "kvtier": [],
              "kvtier-forward": ["--forward", "--chunk-key", FLEET_KEY]}
QUESTIONS = ["Summarise the first record.", "Which depot is named most?", "List two months that appear.",
             "What did the audit team do?", "Name one object and its count.", "Which record is the last one?",
             "What happened on day 3?", "Give one verb used twice."]


def document(n_tokens: int, seed: int) -> str:
    """About ``n_tokens`` SmolLM2 tokens of records (``filler`` runs ~27% long)."""
    return filler(n_tokens * 100 // 127, seed)


def _hop(reply: Reply, turn: int, node: int, **extra: Any) -> dict[str, Any]:
    return {"turn": turn, "node": node, "prompt_tokens": reply.prompt_tokens, "recomputed": reply.recomputed_tokens,
            "restored": reply.restored_tokens, "ttft_ms": reply.ttft_ms, "forwarded_to": reply.node, **extra}


async def scenario_agent_loop(redis_url: str, histories: Sequence[int], turns: int, threads: int, max_tokens: int,
                              prog: Progress | None = None) -> dict[str, Any]:
    """Per mode and history length, one conversation of ``turns`` turns sent without pauses,
    turn ``t`` on node ``t % 3``."""
    ctx = 2 * (max(histories) + 1024)  # two slots, each the longest history plus its turns
    task = prog.add_task("agent loop", total=len(LOOP_MODES) * len(histories) * turns) if prog else None
    out: dict[str, Any] = {"histories": list(histories), "turns": turns, "nodes": 3, "modes": {}}
    for mode, flags in LOOP_MODES.items():
        sidecar = flags is not None
        await redis_flush(redis_url)
        hops: list[dict[str, Any]] = []
        with cluster(3, base_llama_args(ctx, threads, extra=["-np", "2"]), sidecar=sidecar,
                     redis_url=redis_url if sidecar else None, sidecar_args=flags or [],
                     advertise="--forward" in (flags or [])) as cl:
            async with client_session() as s:
                for h, history in enumerate(histories):
                    messages = [{"role": "system", "content": "Answer from these records. " + document(history, 40 + h)}]
                    for t in range(turns):
                        if prog and task is not None:
                            prog.update(task, description=f"agent loop: {mode}, {history} tokens, turn {t + 1}")
                        messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
                        reply = await chat(s, cl.url(t), messages, max_tokens)  # no pause: the loop goes on
                        messages.append({"role": "assistant", "content": reply.content})
                        hops.append(_hop(reply, t + 1, t % 3, history=history))
                        if prog and task is not None:
                            prog.advance(task)
                if sidecar:
                    samples = [await scrape(s, cl.url(i)) for i in range(3)]
                    out.setdefault("waits", {})[mode] = {
                        outcome: sum(delta(x, {}, "kvtier_save_waits_total", outcome=outcome) for x in samples)
                        for outcome in ("landed", "failed", "timeout", "skipped")}
                    out.setdefault("forwarded", {})[mode] = sum(
                        delta(x, {}, "kvtier_route_decisions_total", decision="forwarded") for x in samples)
        out["modes"][mode] = hops
    out["table"] = _loop_table(out)
    return out


def _loop_table(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Per mode and history: recomputed tokens and TTFT over the hops (turn 1 is the first prefill)."""
    rows = []
    for mode, hops in out["modes"].items():
        for history in out["histories"]:
            later = [x for x in hops if x["history"] == history and x["turn"] > 1]
            if not later:
                continue
            rows.append({"mode": mode, "history": history, "hops": len(later),
                         "recomputed_p50": percentile([x["recomputed"] for x in later], 50),
                         "recomputed_max": max(x["recomputed"] for x in later),
                         "restored_p50": percentile([x["restored"] for x in later], 50),
                         "ttft_ms": summary([x["ttft_ms"] for x in later])})
    return rows


# Llama-3-8B's KV shape (32 layers, 8 KV heads of 128: 128 KiB per token), generated with random
# weights: at one llama-server thread its prefill is slow enough that the health loop looks at a
# restarted server again while a turn runs, which is what lost saves before.
SHAPE_8B = ModelShape(n_layer=32, n_embd=256, n_head=8, n_head_kv=8, head_dim=128, n_ff=512)
DOWN_S = 2.5  # a restarted llama-server is down past one health check of its sidecar (every 2 s)


async def scenario_server_restarts(redis_url: str, history: int, turns: int, threads: int, max_tokens: int,
                                   prog: Progress | None = None, slow_history: int = 0) -> dict[str, Any]:
    """2 nodes; before each turn, the llama-server of the node that takes it is stopped, left down
    for ``DOWN_S`` (its sidecar keeps running and sees it down) and started; the turn is sent as soon
    as llama-server answers its health check. SmolLM2 on ``threads`` threads, and with
    ``slow_history`` a model with an 8B KV shape on one thread (slow turns)."""
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-model-") as tmp:
        models = [("SmolLM2-135M", smollm2_path(), threads, history)]
        if slow_history:
            slow = write_random_llama(Path(tmp) / "kv8b.gguf", smollm2_path(), SHAPE_8B)
            models.append(("8B KV shape (generated), -t 1", str(slow), 1, slow_history))
        task = prog.add_task("server restarts", total=2 * turns * len(models)) if prog else None
        out: dict[str, Any] = {"turns": turns, "nodes": 2, "down_s": DOWN_S, "models": []}
        for name, model, model_threads, model_history in models:
            row: dict[str, Any] = {"model": name, "history": model_history, "threads": model_threads, "modes": {}}
            for mode, sidecar in (("alone", False), ("kvtier", True)):
                if prog and task is not None:
                    prog.update(task, description=f"server restarts: {name}, {mode}")
                row["modes"][mode] = await _restart_turns(redis_url, model, model_history, turns, model_threads,
                                                          max_tokens, sidecar, prog, task)
            out["models"].append(row)
    return out


async def _restart_turns(redis_url: str, model: str, history: int, turns: int, threads: int, max_tokens: int,
                         sidecar: bool, prog: Progress | None, task: Any) -> list[dict[str, Any]]:
    await redis_flush(redis_url)
    hops: list[dict[str, Any]] = []
    with cluster(2, base_llama_args(2 * (history + 1024), threads, extra=["-np", "2"]), sidecar=sidecar,
                 redis_url=redis_url if sidecar else None, model=model) as cl:
        async with client_session() as s:
            messages = [{"role": "system", "content": "Answer from these records. " + document(history, 60)}]
            for t in range(turns):
                if t > 0 and sidecar:
                    await wait_idle(s, [cl.url(0), cl.url(1)])  # the last turn's save is done
                llama = cl.nodes[t % 2].llama  # llama-server only: the sidecar keeps running
                await asyncio.to_thread(llama.stop)
                await asyncio.sleep(DOWN_S)
                await asyncio.to_thread(llama.start)
                messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
                reply = await chat(s, cl.url(t), messages, max_tokens)
                messages.append({"role": "assistant", "content": reply.content})
                hop = _hop(reply, t + 1, t % 2)
                if not sidecar:  # what llama-server itself kept (its cache_n): nothing, after a restart
                    hop["restored"] = reply.prompt_tokens - reply.recomputed_tokens
                hops.append(hop)
                if prog and task is not None:
                    prog.advance(task)
    return hops


async def scenario_save_readable(redis_url: str, sizes: Sequence[int], reps: int, threads: int,
                                 prog: Progress | None = None) -> dict[str, Any]:
    """Per size, ``reps`` fresh prompts answered on one node; for each, the sidecar's own measure
    of the time from the answer's end until Redis held its chunks and tail."""
    task = prog.add_task("save readable", total=len(sizes) * reps) if prog else None
    rows: list[dict[str, Any]] = []
    await redis_flush(redis_url)
    with cluster(1, base_llama_args(max(sizes) + 256, threads), sidecar=True, redis_url=redis_url) as cl:
        async with client_session() as s:
            for size in sizes:
                for rep in range(reps):
                    if prog and task is not None:
                        prog.update(task, description=f"save readable: {size} tokens, rep {rep + 1}")
                    before = await scrape(s, cl.url(0))
                    prompt = await exact_tokens(s, cl.llama_url(0), size, seed=1000 + 17 * size + rep)
                    reply = await complete(s, cl.url(0), prompt, 1)
                    await wait_idle(s, [cl.url(0)])
                    after = await scrape(s, cl.url(0))
                    n = delta(after, before, "kvtier_save_readable_seconds_count")
                    seconds = delta(after, before, "kvtier_save_readable_seconds_sum")
                    rows.append({"size": size, "rep": rep, "prompt_tokens": reply.prompt_tokens,
                                 "readable_ms": round(1000 * seconds / n, 1) if n == 1 else None,
                                 "save_ms": round(1000 * delta(after, before, "kvtier_save_seconds_sum"), 1)})
                    if prog and task is not None:
                        prog.advance(task)
    table = []
    for size in sizes:
        rs = [r for r in rows if r["size"] == size and r["readable_ms"] is not None]
        table.append({"size": size, "prompt_tokens": rs[0]["prompt_tokens"] if rs else 0,
                      "readable_ms": summary([r["readable_ms"] for r in rs]),
                      "save_ms": summary([r["save_ms"] for r in rs])})
    return {"sizes": list(sizes), "reps": reps, "table": table, "requests": rows}


# -- docs/benchmarks.md ---------------------------------------------------------------------------


def md_agents(sc: dict[str, Any], md_table: Any) -> str:
    """The sections of these scenarios that the report ran."""
    parts = []
    if sc.get("agent_loop"):
        loop = sc["agent_loop"]
        parts.append(f"""
## Agent loops: the next turn at once, on another node

One conversation per history length over a long document, {loop['turns']} turns, each sent the moment the
last answer ended, round robin over {loop['nodes']} nodes (`-np 2`): each turn reaches a node while the node
before it is still saving the last one. *kvtier-no-wait* is kvtier without pending-save marks
(`--save-wait 0`): it restores what the tiers hold when the turn arrives. kvtier waits for the save in
flight when waiting beats recomputing (bounded by `--save-wait`, 2 s), and not at all when the saving
node expects its save to land later than that. *kvtier-forward* adds `--forward`: a turn may be sent on
to the node whose slot holds the conversation hot (shown as `→ node`). Hops are turns 2 and later;
turn 1 is the first prefill everywhere.

""")
        parts.append(md_table(
            ["mode", "history (tokens)", "hops", "recomputed p50", "recomputed max", "restored p50", "TTFT p50 (ms)",
             "TTFT p90 (ms)"],
            [[r["mode"], f"{r['history']:,}", r["hops"], f"{r['recomputed_p50']:,.0f}", f"{r['recomputed_max']:,}",
              f"{r['restored_p50']:,.0f}", f"{r['ttft_ms']['p50']:,.0f}", f"{r['ttft_ms']['p90']:,.0f}"]
             for r in loop["table"]]))
        waits = loop.get("waits", {})
        if waits:
            parts.append("\n\nWaits for a save in flight (all nodes): " + "; ".join(
                f"{mode}: " + ", ".join(f"{k} {v:.0f}" for k, v in w.items()) for mode, w in waits.items()) + ".")
            parts.append(" Forwarded: " + "; ".join(f"{mode} {n:.0f}" for mode, n in loop.get("forwarded", {}).items())
                         + ".\n")
        parts.append("\nPer hop (recomputed / restored tokens, TTFT ms):\n\n")
        modes = list(loop["modes"])
        hops = loop["modes"][modes[0]]
        parts.append(md_table(
            ["history", "turn", "node", *modes],
            [[f"{h['history']:,}", h["turn"], "ABC"[h["node"]],
              *(_cell(loop["modes"][m][i]) for m in modes)] for i, h in enumerate(hops)]))
        parts.append("\n")
    if sc.get("server_restarts"):
        rs = sc["server_restarts"]
        models = rs.get("models") or [{"model": "SmolLM2-135M", "history": rs.get("history", 0), "modes": rs["modes"]}]
        parts.append(f"""
## llama-server restarted under a running sidecar

A rolling update of llama-server alone (an OOM kill, a failed liveness probe: the sidecar container keeps
running): {rs['nodes']} nodes, {rs['turns']} turns, and before each turn the llama-server of the node that
takes it is stopped, left down for {rs.get('down_s', 0)} s (its sidecar's health loop sees it down) and
started again. kvtier must learn the restart once, restore the conversation from the tiers as on a fresh
node, and store each turn's state though the health loop notices the restart again while the turn runs.
The slow model (Llama-3-8B's KV shape, 128 KiB per token, one thread) makes turns long. Per turn: tokens
recomputed / restored (llama-server's `cache_n` alone), TTFT in ms.
""")
        for row in models:
            modes = list(row["modes"])
            parts.append(f"\n{row['model']}, a {row['history']:,}-token document:\n\n")
            parts.append(md_table(
                ["turn", "node", *(f"{m}: recomputed / restored, TTFT ms" for m in modes)],
                [[h["turn"], "AB"[h["node"]], *(_cell(row["modes"][m][i]) for m in modes)]
                 for i, h in enumerate(row["modes"][modes[0]])]))
            parts.append("\n")
    if sc.get("save_readable"):
        sr = sc["save_readable"]
        parts.append(f"""
## From the end of an answer to a readable save

How soon another node can restore a turn: the sidecar's `kvtier_save_readable_seconds`, from the end of
the answer until Redis holds its new chunks and partial tail (slot save, split, encode, Redis write), for
fresh prompts ({sr['reps']} each). *save* is the part before the Redis write (`kvtier_save_seconds`).

""")
        parts.append(md_table(
            ["prompt tokens", "readable p50 (ms)", "readable p90 (ms)", "save p50 (ms)"],
            [[f"{r['prompt_tokens']:,}", f"{r['readable_ms']['p50']:,.0f}", f"{r['readable_ms']['p90']:,.0f}",
              f"{r['save_ms']['p50']:,.0f}"] for r in sr["table"]]))
        parts.append("\n")
    return "".join(parts)


def _cell(hop: dict[str, Any]) -> str:
    where = f" → {hop['forwarded_to']}" if hop.get("forwarded_to") else ""
    return f"{hop['recomputed']:,} / {hop['restored']:,}, {hop['ttft_ms']:,.0f}{where}"
