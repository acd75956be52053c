"""``python -m bench chatsteps``: an agent over the chat API, each step sent a tool call's time after
the answer before it, on llama-server alone and through kvtier (identical flags), side by side.

    python -m bench chatsteps                        # the 8B KV shape, a ~3,000-token start, 8 steps
    python -m bench chatsteps --shape smollm2 --tool-ms 0

One node, llama-server ``-np 2 -t THREADS`` (its ``--cache-ram`` at the default in both modes),
kvtier on an embedded Valkey. The agent's chat starts with a system prompt and a document of
``--prefix`` tokens; each step adds the last answer and a short tool result (under kvtier's follow-up
limit, 512 characters) and is sent ``--tool-ms`` after that answer ended (several: in turn). Per step: TTFT and the
tokens llama-server computed. kvtier's figures: saves made, skipped (a step that came while the save
of the answer before it had not started: ``kvtier_saves_skipped_total``) and follow-ups.

What it shows: at a large KV size llama-server stops its main loop to write a slot, so a save after
each answer costs the next step its write unless the save is skipped. ``--shape 8b`` is Llama-3-8B's
KV shape (generated weights, 128 KiB per token); ``smollm2`` the small real model.
Writes ``bench/results/chatsteps.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

from launch import smollm2_path
from tests.ggufgen import write_random_llama

from .agents import SHAPE_8B, document
from .common import (
    RESULTS_DIR,
    chat,
    client_session,
    cluster,
    console,
    machine,
    metric,
    percentile,
    print_table,
    redis_or_given,
    scrape,
    versions,
    wait_idle,
    write_json,
)

MODES = ("alone", "kvtier")  # also "kvtier-ram": the sidecar without Redis (its RAM tier alone)
TOOL_RESULT = "Tool result {k}: status ok, 3 rows, ids 41{k}, 52{k}, 63{k}; next page none."


async def run_mode(mode: str, model: str, a: argparse.Namespace, redis_url: str) -> dict[str, Any]:
    """One agent of ``a.steps`` steps on a fresh node; per step its TTFT and tokens computed."""
    sidecar = mode.startswith("kvtier")
    args = ["-c", str(2 * (a.prefix + 2048)), "-np", "2", "-t", str(a.threads)]
    with cluster(1, args, sidecar=sidecar, redis_url=redis_url if mode == "kvtier" else None, model=model) as cl:
        async with client_session() as s:
            messages = [{"role": "system", "content": "You are an agent. Use the tools, then answer."},
                        {"role": "user", "content": document(a.prefix, 300)}]
            steps = []
            for k in range(a.steps):
                reply = await chat(s, cl.url(0), messages, a.max_tokens)
                steps.append({"step": k + 1, "ttft_ms": round(reply.ttft_ms, 1), "computed": reply.recomputed_tokens,
                              "prompt_tokens": reply.prompt_tokens, "prompt_ms": round(reply.prompt_ms, 1)})
                messages += [{"role": "assistant", "content": reply.content},
                             {"role": "user", "content": TOOL_RESULT.format(k=k)}]
                await asyncio.sleep(a.tool_ms[k % len(a.tool_ms)] / 1000)
            out: dict[str, Any] = {"steps": steps}
            if sidecar:
                await wait_idle(s, [cl.url(0)])  # the last step's save
                m = await scrape(s, cl.url(0))
                out["kvtier"] = {"saves_made": metric(m, "kvtier_save_seconds_count"),
                                 "saves_skipped": metric(m, "kvtier_saves_skipped_total"),
                                 "follow_ups": metric(m, "kvtier_follow_ups_total")}
    return out


def table(results: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """Per mode: TTFT p50 and max over the steps after the first, tokens computed (p50)."""
    rows = []
    alone = percentile([x["ttft_ms"] for x in results["alone"]["steps"][1:]], 50) if "alone" in results else None
    for mode, data in results.items():
        later = data["steps"][1:]
        p50 = percentile([x["ttft_ms"] for x in later], 50)
        k = data.get("kvtier", {})
        rows.append([mode, p50, max(x["ttft_ms"] for x in later),
                     round(p50 / alone, 2) if alone else None,
                     percentile([x["computed"] for x in later], 50),
                     " / ".join(f"{x['ttft_ms']:.0f}" for x in later),
                     f"{k['saves_made']:.0f} / {k['saves_skipped']:.0f} / {k['follow_ups']:.0f}" if k else "-"])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench chatsteps", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=("8b", "smollm2"), default="8b")
    p.add_argument("--prefix", type=int, default=3000, help="tokens of the document the chat starts with")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tool-ms", default="50", help="between an answer's end and the next step; several "
                                                   "(comma-separated) are taken in turn: a slow tool call, then quick ones")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", default=str(RESULTS_DIR / "chatsteps.json"))
    a = p.parse_args(argv)
    a.tool_ms = [float(x) for x in str(a.tool_ms).split(",")]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-model-") as tmp, redis_or_given(None) as redis_url:
        model = smollm2_path() if a.shape == "smollm2" else str(write_random_llama(
            Path(tmp) / "kv8b.gguf", smollm2_path(), SHAPE_8B))
        for mode in a.modes.split(","):
            console.print(f"chatsteps: {mode}")
            results[mode] = asyncio.run(run_mode(mode, model, a, redis_url))
        info = {"machine": machine(), "versions": versions(redis_url)}
    rows = table(results)
    delays = " / ".join(f"{x:.0f}" for x in a.tool_ms)
    print_table(f"Chat agent steps {delays} ms after each answer ({a.shape}, ~{a.prefix}-token start)",
                ["mode", "TTFT p50 ms (steps 2+)", "max ms", "/ alone", "computed p50", "per step ms",
                 "saves made / skipped / follow-ups"], rows)
    write_json(a.json, {"benchmark": "chatsteps", **info, "settings": vars(a), "modes": results, "table": rows})
    console.print(f"wrote {a.json}")
    return 0
