"""``memory_types``: a conversation that hops nodes, for every memory type kvtier restores.

Per model and flags: 2 nodes, a ~2k-token conversation answered on A, continued on B, then on A
again, each node's llama-server restarted just before its turn (a rolling update). llama-server
alone recomputes the history on every hop; kvtier restores it. Models: SmolLM2 (one KV cache),
Gemma 3 270M on default flags and with ``--swa-full`` (a KV cache and a sliding window), a
generated lfm2 (a KV cache and a recurrent state) and a generated mamba2 (a recurrent state alone;
both random weights, so token-id prompts).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from rich.progress import Progress

from launch import gemma3_path, smollm2_path
from tests.ggufgen import ModelShape, write_random_model

from .agents import QUESTIONS, document
from .common import (
    base_llama_args,
    chat,
    client_session,
    cluster,
    percentile,
    post_json,
    redis_flush,
    wait_idle,
)

TURNS = 3


async def scenario_memory_types(redis_url: str, history: int, threads: int, max_tokens: int,
                                prog: Progress | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-models-") as tmp:
        lfm2 = str(write_random_model(Path(tmp) / "lfm2.gguf", smollm2_path(), ModelShape(attn_layers=(1, 3)),
                                      arch="lfm2", seed=11))
        mamba2 = str(write_random_model(Path(tmp) / "mamba2.gguf", smollm2_path(),
                                        ModelShape(conv_kernel=4, ssm_state=16), arch="mamba2", seed=11))
        generated = (lfm2, mamba2)
        models = [("SmolLM2-135M", "one KV cache", smollm2_path(), ()),
                  ("Gemma 3 270M", "KV cache + sliding window", gemma3_path(), ()),
                  ("Gemma 3 270M --swa-full", "KV cache + sliding window", gemma3_path(), ("--swa-full",)),
                  ("lfm2 (generated)", "KV cache + recurrent state", lfm2, ()),
                  ("mamba2 (generated)", "recurrent state alone", mamba2, ())]
        task = prog.add_task("memory types", total=2 * len(models)) if prog else None
        rows = []
        for name, memory, model, flags in models:
            row: dict[str, Any] = {"model": name, "memory": memory, "flags": " ".join(flags) or "default"}
            for mode in ("alone", "kvtier"):
                if prog and task is not None:
                    prog.update(task, description=f"memory types: {name}, {mode}")
                row[mode] = await _hops(redis_url, model, flags, mode == "kvtier", history, threads, max_tokens,
                                        tokens=model in generated)
                if prog and task is not None:
                    prog.advance(task)
            rows.append(row)
    return {"history": history, "turns": TURNS, "max_tokens": max_tokens, "rows": rows}


async def _hops(redis_url: str, model: str, flags: tuple[str, ...], sidecar: bool, history: int, threads: int,
                max_tokens: int, *, tokens: bool) -> list[dict[str, Any]]:
    await redis_flush(redis_url)
    hops = []
    args = base_llama_args(history + 1024, threads, extra=flags)
    with cluster(2, args, sidecar=sidecar, redis_url=redis_url if sidecar else None, model=model,
                 chunk_tokens=256) as cl:
        async with client_session() as s:
            messages = [{"role": "user", "content": document(history, 80) + "\n" + QUESTIONS[0]}]
            prompt = list(range(1000, 1000 + history))
            for t in range(TURNS):
                if t:
                    if sidecar:
                        await wait_idle(s, [cl.url(0), cl.url(1)])
                    cl.nodes[t % 2].llama.restart()  # llama-server only: the sidecar keeps running
                    messages.append({"role": "user", "content": QUESTIONS[t]})
                    prompt += list(range(2000 + 10 * t, 2010 + 10 * t))
                if tokens:  # the answer's own ids continue the sequence (a recurrent state cannot be rewound)
                    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "return_tokens": True,
                            "cache_prompt": True}
                    answer, ms = await post_json(s, cl.url(t) + "/completion", body)
                    prompt += answer["tokens"]
                    timings = answer["timings"]
                    hops.append({"turn": t + 1, "prompt_tokens": timings["prompt_n"] + timings["cache_n"],
                                 "recomputed": timings["prompt_n"], "restored": timings["cache_n"], "ttft_ms": ms})
                    continue
                reply = await chat(s, cl.url(t), messages, max_tokens)
                messages.append({"role": "assistant", "content": reply.content})
                hops.append({"turn": t + 1, "prompt_tokens": reply.prompt_tokens, "recomputed": reply.recomputed_tokens,
                             "restored": reply.restored_tokens, "ttft_ms": reply.ttft_ms})
    return hops


def md_memory_types(mt: dict[str, Any], md_table: Any) -> str:
    parts = [f"""
## Every memory type across nodes

A {mt['history']:,}-token conversation answered on node A, continued on B, then on A again, each node's
llama-server restarted just before its turn (a rolling update; kvtier's sidecars keep running). A
sliding-window or hybrid state is restored whole: its first KV cache from prefix chunks, its window
(two masked cells longer on default flags) or recurrent state from the tail; a recurrent state alone
(mamba2) is one tail. Hops are turns 2 and 3. The generated lfm2 and mamba2 get token ids (random
weights) and are timed per request (answers of {mt.get('max_tokens', 16)} tokens), not to their first
token; their "restored" is llama-server's `cache_n`.

"""]
    rows = []
    for r in mt["rows"]:
        alone, side = r["alone"][1:], r["kvtier"][1:]
        rows.append([r["model"], r["memory"], r["flags"], f"{r['kvtier'][0]['prompt_tokens']:,}",
                     f"{percentile([h['recomputed'] for h in alone], 50):,.0f}",
                     f"{percentile([h['recomputed'] for h in side], 50):,.0f}",
                     f"{percentile([h['restored'] for h in side], 50):,.0f}",
                     f"{percentile([h['ttft_ms'] for h in alone], 50):,.0f}",
                     f"{percentile([h['ttft_ms'] for h in side], 50):,.0f}"])
    parts.append(md_table(["model", "memory", "flags", "turn 1 tokens", "recomputed per hop: alone",
                           "kvtier", "restored (kvtier)", "TTFT p50 ms: alone", "kvtier"], rows))
    parts.append("\n")
    return "".join(parts)
