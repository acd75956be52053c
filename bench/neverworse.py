"""``python -m bench neverworse``: three ordinary patterns where kvtier must never be slower than
llama-server alone (same flags, its host-memory prompt cache ``--cache-ram`` at its default).

    python -m bench neverworse                      # quiet, then with a CPU load beside (a few minutes)
    python -m bench neverworse --scenarios repeat_at_once --no-load

- ``repeat_at_once``: a chat sent again the moment its answer ends (a benchmark calibrating itself, a
  client retrying). TTFT of the repeat.
- ``abort_reprompt``: a streamed answer the client closes after ``--abort-after`` tokens, then the
  same ~``--prefix`` token prefix with a new ending (a user pressing stop, an agent cancelling), on
  the same node and on another node. The share of the prefix reused (not computed again).
- ``sibling_at_once``: a question on a ~``--prefix`` token text, then at once another question on the
  same text (an answer regenerated, a last message edited, questions on one document one after
  another). TTFT of the second, which llama-server alone serves from the slot; kvtier waits for the
  first answer's save only when the end that save alone keeps costs more to recompute than the wait.
- ``other_at_once``: on a node of its own with one slot (every slot taken), a conversation's second turn
  (its first turn saved a few seconds before), then at once a new ~``OTHER_TOKENS``-token conversation
  (another user), then the second turn again (its return). TTFT of the new conversation, which
  llama-server alone starts at once (after copying the slot to its prompt cache, when that is on);
  kvtier waits for the second turn's save only when the end no tier holds costs more to recompute
  than the wait. And TTFT of the return, which pays for what was not saved.
- ``beside_save``: a conversation's first turn on a ~``--prefix`` token text, then at once, on another
  of the node's free slots, a new ~``BESIDE_TOKENS``-token conversation of another user answered in
  ``BESIDE_ANSWER`` tokens. TTFT and whole answer time of the new one, which llama-server alone serves
  with nothing beside it; through kvtier the first turn's save (llama-server's write of its slot, which
  stops every slot, then kvtier's work on it) may run beside it.
- ``due_together``: a first turn on a ~``--prefix``/2 token text, then at once another conversation's
  on another slot (through kvtier the first one's save waits beside it), then ``DUE_AFTER_S`` after
  that answer, on a third slot, a new ~``BESIDE_TOKENS``-token conversation answered in
  ``BESIDE_ANSWER`` tokens. Its TTFT and whole answer time: both first turns' saves are due as it
  comes, and llama-server's queue runs every write sent before it first.
- ``agent_subagents``: three agents at once, each growing a main thread in four steps, then running
  two sub-agent windows of their own, then a short finalize on the main thread, with at most four
  requests in flight (``--agent-rounds`` such rounds, one after the other). Finalize TTFT over the
  main thread's last step, and tokens computed.

Modes: ``alone`` (llama-server), ``kvtier`` (the same flags), ``kvtier-cache-ram-0`` (llama-server's
prompt cache off, as where tenants share a server); ``alone-cache-ram-0`` on request. Every mode has
nodes of its own (``-np 4``, one llama-server per node; a kvtier mode with an embedded Valkey of its
own), all up together on fresh processes for each load, and the modes take turns: ``--block`` reps
of a scenario on one mode, then on the next, the order rotating, each block after every sidecar's
saves have ended. So the machine's drift over a run (these VMs slow down and speed up by 10-20% over
minutes) falls on every mode alike; run one mode after another, it read as a mode's cost. All
modes' llama-servers take memory at once (two per mode, three with ``other_at_once``): with a
``--model`` of large KV, give fewer ``--modes``. With a load, one process spins on a core beside the
nodes for the whole load. Writes ``bench/results/neverworse.json`` after each load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import multiprocessing
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from .agents import QUESTIONS, document
from .common import (
    RESULTS_DIR,
    Cluster,
    Reply,
    chat,
    client_session,
    cluster,
    complete,
    console,
    metric,
    percentile,
    print_table,
    ratio_interval,
    redis_flush,
    redis_or_given,
    scrape,
    tokenize,
    wait_idle,
    write_json,
)

SCENARIOS = ("repeat_at_once", "abort_reprompt", "sibling_at_once", "other_at_once", "beside_save",
             "due_together", "agent_subagents")
OTHER_TOKENS = 64  # other_at_once: the new conversation's prompt (a short one shows the wait)
BESIDE_TOKENS = 512  # beside_save: the new conversation's prompt, and its answer
BESIDE_ANSWER = 32
DUE_AFTER_S = 0.1  # due_together: after the second answer (past a save's shortest pause, 30 ms)
# llama-server alone and kvtier on identical flags (llama-server's prompt cache at its default); and
# kvtier with that cache off (the README's flags where tenants share a server).
MODES = ("alone", "kvtier", "kvtier-cache-ram-0")
# Also llama-server alone with its cache off (``--modes``): what an operator of tenants runs without kvtier.
OTHER_MODES = ("alone-cache-ram-0",)
GOAL = 1.1  # #29: each timed figure at most this many times llama-server alone's
# The per-rep timings a mode is judged on against alone (figure, the rows' field), for their intervals.
TIMED = {"repeat_at_once": (("repeat TTFT ms", "repeat_ttft_ms"),),
         "sibling_at_once": (("sibling TTFT ms", "sibling_ttft_ms"),),
         "other_at_once": (("other conversation TTFT ms", "other_ttft_ms"), ("return TTFT ms", "return_ttft_ms")),
         "beside_save": (("new conversation TTFT ms", "other_ttft_ms"),),
         "due_together": (("new conversation TTFT ms", "other_ttft_ms"),),
         "agent_subagents": (("finalize TTFT ms", "finalize_ttft_ms"),
                             ("finalize / last main step", "finalize_ratio"))}


def llama_args(ctx: int, threads: int, slots: int, mode: str = "alone") -> list[str]:
    """The issue's flags: ``-np 4``, and llama-server's own prompt cache at its default size (off
    in mode ``kvtier-cache-ram-0``)."""
    return ["-c", str(ctx), "-np", str(slots), "-t", str(threads),
            *(["--cache-ram", "0"] if mode.endswith("cache-ram-0") else [])]


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def cpu_load(on: bool) -> Iterator[None]:
    """One process spinning on a core while the block runs (the machine busy with other work)."""
    if not on:
        yield
        return
    proc = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
    proc.start()
    try:
        yield
    finally:
        proc.terminate()
        proc.join(5)


@dataclass
class Rig:
    """One mode's nodes, up for a whole load: two of ``-np --slots`` (``single``: one of one slot,
    for ``other_at_once``) and, in a kvtier mode, their sidecars."""

    cluster: Cluster
    single: Cluster | None

    def url(self, i: int) -> str:
        return self.cluster.url(i)

    @property
    def sidecars(self) -> list[str]:
        """Every sidecar of the mode (none alone)."""
        return [n.sidecar_url for c in (self.cluster, self.single) if c is not None and c.sidecar for n in c.nodes]


async def repeat_at_once(s: aiohttp.ClientSession, rig: Rig, a: argparse.Namespace, r: int) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": "Answer from these records. " + document(a.prefix, 70 + r)},
                {"role": "user", "content": QUESTIONS[r % len(QUESTIONS)]}]
    first = await chat(s, rig.url(0), messages, 16)
    rows: list[dict[str, Any]] = []
    for nth in range(1, a.repeats + 1):
        again = await chat(s, rig.url(0), messages, 16)  # the moment the answer before ended
        rows.append({"rep": r, "nth": nth, "repeat_ttft_ms": again.ttft_ms, "repeat_computed": again.recomputed_tokens,
                     "prompt_tokens": again.prompt_tokens, **({"first_ttft_ms": first.ttft_ms} if nth == 1 else {})})
    return rows


async def sibling_at_once(s: aiohttp.ClientSession, rig: Rig, a: argparse.Namespace, r: int) -> list[dict[str, Any]]:
    doc = "Answer from these records. " + document(a.prefix, 110 + r)
    first = await complete(s, rig.url(0), f"{doc}\nQuestion: {QUESTIONS[r % len(QUESTIONS)]}\nAnswer:", 8)
    other = QUESTIONS[(r + 1) % len(QUESTIONS)]
    sibling = await complete(s, rig.url(0), f"{doc}\nQuestion: {other}\nAnswer:", 8)  # the moment the first ended
    await asyncio.sleep(1.0)  # the next rep's text starts apart, after this one's saves
    return [{"rep": r, "first_ttft_ms": first.ttft_ms, "sibling_ttft_ms": sibling.ttft_ms,
             "sibling_computed": sibling.recomputed_tokens, "prompt_tokens": sibling.prompt_tokens}]


async def other_at_once(s: aiohttp.ClientSession, rig: Rig, a: argparse.Namespace, r: int) -> list[dict[str, Any]]:
    assert rig.single is not None
    url = rig.single.url(0)
    question = QUESTIONS[r % len(QUESTIONS)]
    first = f"Answer from these records. {document(a.prefix, 150 + r)}\nQuestion: {question}\nAnswer:"
    turn1 = await complete(s, url, first, 8)
    await asyncio.sleep(3.0)  # its save ends (kvtier): the tiers hold the first turn
    second = f"{first}{turn1.content}\nQuestion: {QUESTIONS[(r + 1) % len(QUESTIONS)]}\nAnswer:"
    turn2 = await complete(s, url, second, 8)
    other = await complete(s, url, f"Note {r}. {document(OTHER_TOKENS, 950 + r)}\nSummary:", 8)  # at once
    back = await complete(s, url, second, 8)  # the second turn returns
    await asyncio.sleep(3.0)
    return [{"rep": r, "turn2_ttft_ms": turn2.ttft_ms, "other_ttft_ms": other.ttft_ms,
             "other_computed": other.recomputed_tokens, "return_ttft_ms": back.ttft_ms,
             "return_computed": back.recomputed_tokens, "prompt_tokens": back.prompt_tokens}]


async def beside_save(s: aiohttp.ClientSession, rig: Rig, a: argparse.Namespace, r: int) -> list[dict[str, Any]]:
    doc = f"Answer from these records. {document(a.prefix, 170 + r)}\nQuestion: {QUESTIONS[r % len(QUESTIONS)]}\nAnswer:"
    first = await complete(s, rig.url(0), doc, 8)
    other = await complete(s, rig.url(0), f"Note {r}. {document(BESIDE_TOKENS, 990 + r)}\nSummary:", BESIDE_ANSWER)
    await asyncio.sleep(6.0)  # the first turn's save ends (kvtier: after the other answer) before the next rep
    return [{"rep": r, "first_ttft_ms": first.ttft_ms, "other_ttft_ms": other.ttft_ms,
             "other_total_ms": other.total_ms, "other_computed": other.recomputed_tokens,
             "first_prompt_tokens": first.prompt_tokens}]


async def due_together(s: aiohttp.ClientSession, rig: Rig, a: argparse.Namespace, r: int) -> list[dict[str, Any]]:
    docs = [f"Answer from these records. {document(a.prefix // 2, 210 + 2 * r + i)}\nQuestion: "
            f"{QUESTIONS[(r + i) % len(QUESTIONS)]}\nAnswer:" for i in (0, 1)]
    firsts = [await complete(s, rig.url(0), doc, 8) for doc in docs]  # the second the moment the first ended
    await asyncio.sleep(DUE_AFTER_S)
    other = await complete(s, rig.url(0), f"Note {r}. {document(BESIDE_TOKENS, 1010 + r)}\nSummary:", BESIDE_ANSWER)
    await asyncio.sleep(6.0)  # the first turns' saves end before the next rep
    return [{"rep": r, "first_ttft_ms": [f.ttft_ms for f in firsts], "other_ttft_ms": other.ttft_ms,
             "other_total_ms": other.total_ms, "other_computed": other.recomputed_tokens}]


async def _aborted(s: aiohttp.ClientSession, url: str, prompt: str, after: int) -> int:
    """Stream an answer and leave after ``after`` token events; the events read."""
    body = {"prompt": prompt, "n_predict": 4 * after, "temperature": 0, "cache_prompt": True, "stream": True,
            "ignore_eos": True}
    seen = 0
    async with s.post(url + "/completion", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: "):
                seen += 1
                if seen >= after:
                    break  # the connection closes with the response: the client left
    return seen


async def abort_reprompt(s: aiohttp.ClientSession, rig: Rig, a: argparse.Namespace, r: int) -> list[dict[str, Any]]:
    rows = []
    llama_url = rig.cluster.llama_url(0)
    doc = "Answer from these records. " + document(a.prefix, 90 + r)
    prefix_tokens = len(await tokenize(s, llama_url, doc))
    for where, url in (("same node", rig.url(0)), ("other node", rig.url(1))):
        await _aborted(s, rig.url(0), f"{doc}\nQuestion: {QUESTIONS[0]}\nAnswer:", a.abort_after)
        await asyncio.sleep(0.2)  # the client's next request, a moment later
        again: Reply = await complete(s, url, f"{doc}\nQuestion: {QUESTIONS[r % 7 + 1]}\nAnswer:", 8)
        reused = again.prompt_tokens - again.recomputed_tokens
        rows.append({"rep": r, "where": where, "prefix_tokens": prefix_tokens, "reused_tokens": reused,
                     "reused_share": round(min(1.0, reused / prefix_tokens), 3), "ttft_ms": again.ttft_ms})
        doc += " " + str(r)  # the other node's round starts a fresh prefix
        prefix_tokens = len(await tokenize(s, llama_url, doc))
    return rows


async def _agent(s: aiohttp.ClientSession, url: str, a: int, main_tokens: int, sub_tokens: int,
                 gate: asyncio.Semaphore) -> dict[str, Any]:
    async def ask(messages: list[dict[str, str]]) -> Reply:
        async with gate:
            return await chat(s, url, messages, 16)

    step = main_tokens // 4
    main = [{"role": "system", "content": f"You are agent {a}. Keep notes."}]
    last: Reply | None = None
    for k in range(4):
        main.append({"role": "user", "content": document(step, 200 + 10 * a + k)})
        last = await ask(main)
        main.append({"role": "assistant", "content": last.content})
    assert last is not None
    subs = [[{"role": "system", "content": f"Sub-agent {a}.{j}: read and report."},
             {"role": "user", "content": document(sub_tokens, 5000 + 10 * a + j)}] for j in range(2)]
    await asyncio.gather(*(ask(m) for m in subs))
    main.append({"role": "user", "content": "Both sub-agents reported. Finalize in one line."})
    final = await ask(main)
    return {"agent": a, "main_last_ttft_ms": last.ttft_ms, "finalize_ttft_ms": final.ttft_ms,
            "finalize_ratio": round(final.ttft_ms / max(last.ttft_ms, 1e-3), 3),
            "finalize_computed": final.recomputed_tokens, "finalize_prompt_tokens": final.prompt_tokens}


async def agent_subagents(s: aiohttp.ClientSession, rig: Rig, a: argparse.Namespace, r: int) -> list[dict[str, Any]]:
    """Round ``r``: three agents at once with new documents (the slots and llama-server's prompt cache
    still hold the rounds before), on the second node."""
    gate = asyncio.Semaphore(4)
    agents = await asyncio.gather(*(_agent(s, rig.url(1), 3 * r + i, a.main_tokens, a.sub_tokens, gate)
                                    for i in range(3)))
    return [{**x, "round": r} for x in agents]


Rep = Callable[[aiohttp.ClientSession, Rig, argparse.Namespace, int], Awaitable[list[dict[str, Any]]]]
REPS: dict[str, Rep] = {"repeat_at_once": repeat_at_once, "abort_reprompt": abort_reprompt,
                        "sibling_at_once": sibling_at_once, "other_at_once": other_at_once, "beside_save": beside_save,
                        "due_together": due_together, "agent_subagents": agent_subagents}


@contextlib.contextmanager
def rigs(a: argparse.Namespace, redis_urls: dict[str, str]) -> Iterator[dict[str, Rig]]:
    """Every mode's nodes on fresh processes, up together (each kvtier mode on its own Redis)."""
    with contextlib.ExitStack() as stack:
        out = {}
        for mode in a.modes:
            nodes = functools.partial(cluster, sidecar=mode.startswith("kvtier"), redis_url=redis_urls.get(mode),
                                      model=a.model)
            main = stack.enter_context(nodes(2, llama_args(a.ctx, a.threads, a.slots, mode)))
            single = (stack.enter_context(nodes(1, llama_args(a.ctx, a.threads, 1, mode)))
                      if "other_at_once" in a.scenarios else None)
            out[mode] = Rig(main, single)
        yield out


async def run_load(a: argparse.Namespace, by_mode: dict[str, Rig]) -> dict[str, dict[str, Any]]:
    """Each scenario's reps in blocks of ``--block`` (agent rounds one at a time), each block run on
    every mode in turn, the order rotating from block to block, so that a drift of the machine's
    speed over the run falls on every mode alike. Before each block every sidecar has finished its
    saves: no mode's work after its block runs beside another mode's block."""
    out: dict[str, dict[str, Any]] = {mode: {} for mode in by_mode}
    every_sidecar = [u for rig in by_mode.values() for u in rig.sidecars]
    async with client_session() as s:
        for name in a.scenarios:
            reps = a.agent_rounds if name == "agent_subagents" else a.reps
            size = 1 if name == "agent_subagents" else a.block
            for b, first in enumerate(range(0, reps, size)):
                for mode in a.modes[b % len(a.modes):] + a.modes[:b % len(a.modes)]:
                    if every_sidecar:
                        await wait_idle(s, every_sidecar)
                    for r in range(first, min(reps, first + size)):
                        rows = await REPS[name](s, by_mode[mode], a, r)
                        out[mode].setdefault(name, []).extend({**row, "after_idle": r == first} for row in rows)
        for mode, rig in by_mode.items():  # what each sidecar did before forwarding, over every scenario
            if rig.sidecars:
                out[mode]["sidecars"] = [await sidecar_figures(s, url) for url in rig.sidecars]
    return out


async def sidecar_figures(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    m = await scrape(s, url)
    return {name: metric(m, name) for name in (
        "kvtier_overhead_seconds_count", "kvtier_overhead_seconds_sum", "kvtier_server_checks_seconds_count",
        "kvtier_server_checks_seconds_sum", "kvtier_saves_skipped_total", "kvtier_saves_skipped_ends_total",
        "kvtier_follow_ups_total", "kvtier_save_deferred_seconds_count", "kvtier_save_deferred_seconds_sum")}


def summarize(results: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """One row per load, scenario and mode: the scenario's own figure (medians)."""
    rows: list[list[Any]] = []
    for key, by_scenario in results.items():
        load, mode = key.split("/")
        for name, data in by_scenario.items():
            if name == "sidecars":  # both nodes, over every scenario of the run
                checks = sum(x["kvtier_server_checks_seconds_count"] for x in data)
                waited = sum(x["kvtier_server_checks_seconds_sum"] for x in data)
                rows.append([load, "all", mode, "identity checks requests waited for: count; ms in all",
                             f"{checks:.0f}; {1e3 * waited:,.0f}", None])
            elif name == "repeat_at_once":
                rows.append([load, name, mode, "repeat TTFT ms (p50)",
                             percentile([x["repeat_ttft_ms"] for x in data], 50),
                             percentile([x["repeat_computed"] for x in data], 50)])
            elif name == "sibling_at_once":
                rows.append([load, name, mode, "sibling TTFT ms (p50)",
                             percentile([x["sibling_ttft_ms"] for x in data], 50),
                             percentile([x["sibling_computed"] for x in data], 50)])
            elif name == "other_at_once":
                rows.append([load, name, mode, "other conversation TTFT ms (p50)",
                             percentile([x["other_ttft_ms"] for x in data], 50),
                             percentile([x["other_computed"] for x in data], 50)])
                rows.append([load, name, mode, "second turn's return TTFT ms (p50)",
                             percentile([x["return_ttft_ms"] for x in data], 50),
                             percentile([x["return_computed"] for x in data], 50)])
            elif name in ("beside_save", "due_together"):
                computed = percentile([x["other_computed"] for x in data], 50)
                beside = "a save" if name == "beside_save" else "two saves due"
                rows.append([load, name, mode, f"new conversation beside {beside}: TTFT ms (p50)",
                             percentile([x["other_ttft_ms"] for x in data], 50), computed])
                rows.append([load, name, mode, f"the same: whole {BESIDE_ANSWER}-token answer ms (p50)",
                             percentile([x["other_total_ms"] for x in data], 50), computed])
            elif name == "abort_reprompt":
                for where in ("same node", "other node"):
                    part = [x for x in data if x["where"] == where]
                    rows.append([load, f"{name} ({where})", mode, "prefix reused (p50)",
                                 percentile([x["reused_share"] for x in part], 50),
                                 percentile([max(0, x["prefix_tokens"] - x["reused_tokens"]) for x in part], 50)])
            else:
                computed = percentile([x["finalize_computed"] for x in data], 50)
                rows.append([load, name, mode, "finalize / last main step TTFT (p50)",
                             percentile([x["finalize_ratio"] for x in data], 50), computed])
                rows.append([load, name, mode, "finalize TTFT ms (p50)",
                             percentile([x["finalize_ttft_ms"] for x in data], 50), computed])
    return rows


def versus_alone(rows: list[list[Any]]) -> list[list[Any]]:
    """Each mode's figure over llama-server alone's in the same load (its p50 over alone's p50)."""
    alone = {(r[0], r[1], r[3]): r[4] for r in rows if r[2] == "alone" and isinstance(r[4], int | float)}
    out = []
    for load, scenario, mode, figure, value, _ in rows:
        base = alone.get((load, scenario, figure))
        if mode != "alone" and base and isinstance(value, int | float) and "reused" not in figure:
            out.append([load, scenario, mode, figure, round(value / base, 2)])
    return out


def bounds(results: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """Each mode's timed figures over alone's in the same load: the p50 ratio, its 90% bootstrap
    interval, and what that interval says of the goal: within it, over it, or (an interval that
    spans it, as a spread of 0.1 to 0.9 s over 24 reps gives) that these reps cannot tell."""
    out = []
    for key, by_scenario in results.items():
        load, mode = key.split("/")
        alone = results.get(f"{load}/alone", {})
        if mode == "alone":
            continue
        for name, figures in TIMED.items():
            for figure, field in figures:
                mine, theirs = by_rep(by_scenario.get(name, []), field), by_rep(alone.get(name, []), field)
                xs, base = [x for rep in mine for x in rep], [x for rep in theirs for x in rep]
                if not xs or not (base_p50 := percentile(base, 50)):
                    continue
                lo, hi = ratio_interval(mine, theirs)
                verdict = (f"within {GOAL:g}x" if hi <= GOAL else f"over {GOAL:g}x" if lo > GOAL
                           else f"cannot tell {GOAL:g}x")
                out.append([load, name, mode, figure, f"{len(xs)} / {len(base)}",
                            round(percentile(xs, 50) / base_p50, 2), f"{lo:.2f}-{hi:.2f}", verdict])
    return out


def by_rep(rows: list[dict[str, Any]], field: str) -> list[list[float]]:
    """``field`` of ``rows`` grouped by rep (``--repeats``: several repeats a rep), in order; rows
    without a rep (an agent's) stand alone."""
    groups: dict[Any, list[float]] = {}
    for i, x in enumerate(rows):
        groups.setdefault(x.get("rep", ("row", i)), []).append(x[field])
    return list(groups.values())


BOUNDS_HEAD = ["load", "scenario", "mode", "figure", "reps (mode / alone)", "x alone (p50)", "90% interval",
               "verdict"]


def md_neverworse(data: dict[str, Any], md_table: Any) -> str:
    """The section of docs/benchmarks.md for a result file of this benchmark."""
    st = data["settings"]
    head = (f"\n### `python -m bench neverworse`\n\nllama-server `-np {st['slots']} -c {st['ctx']} -t {st['threads']}` "
            f"(its `--cache-ram` at the default, 8 GiB, but in mode *kvtier-cache-ram-0*), "
            f"{Path(st['model']).name if st.get('model') else 'SmolLM2'}, 2 nodes, kvtier on an "
            f"embedded Valkey; {st['reps']} reps{_repeats(st)}{_interleaved(st)}; *loaded*: one process spinning on a core beside the nodes. "
            f"`repeat_at_once`: a chat of ~{st['prefix']} tokens sent again the moment its answer ends; "
            f"`abort_reprompt`: a stream left after {st['abort_after']} tokens, then the same prefix with a new "
            f"question, on the same node and on the other; `sibling_at_once`: a question on a ~{st['prefix']}-"
            f"token text, then at once another on the same text; `other_at_once` (one node of one slot): a "
            f"conversation's second turn, then at once a ~{OTHER_TOKENS}-token new conversation, then the second "
            f"turn again; `beside_save`: a ~{st['prefix']}-token first turn, then at once a ~{BESIDE_TOKENS}-token new "
            f"conversation on another slot, answered in {BESIDE_ANSWER} tokens; `due_together`: a ~{st['prefix'] // 2}-"
            f"token first turn, at once another on another slot, then {DUE_AFTER_S:g} s after its answer the same new "
            f"conversation on a third slot; `agent_subagents`: "
            f"{st.get('agent_rounds', 1)} round(s) of three agents, each a "
            f"~{st['main_tokens']}-token main thread in four steps, two ~{st['sub_tokens']}-token sub-agent windows, "
            f"then a short finalize on the main thread, at most four requests at once. Medians; "
            f"{data.get('minutes', '?')} minutes.\n\n")
    rows = [[r["load"], r["scenario"], r["mode"], r["figure"], r["value"], r["computed"]] for r in data["table"]]
    md = head + md_table(["load", "scenario", "mode", "figure", "value", "tokens computed (p50)"], rows) + "\n"
    if ratios := versus_alone(rows):
        md += "\n" + md_table(["load", "scenario", "mode", "figure", "x alone (p50 over p50)"], ratios) + "\n"
    if intervals := bounds(data.get("results", {})):
        md += "\n" + md_table(BOUNDS_HEAD, intervals) + "\n"
    return md


def _repeats(settings: dict[str, Any]) -> str:
    n = settings.get("repeats", 1)
    return f" (`repeat_at_once`: {n} repeats a rep, each at once; the intervals resample whole reps)" if n > 1 else ""


def _interleaved(settings: dict[str, Any]) -> str:
    if "block" not in settings:  # a result file from before the modes took turns
        return ", one mode after another"
    return f", the modes taking turns in blocks of {settings['block']} reps (agents: a round) with all nodes up"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench neverworse", description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES + OTHER_MODES)}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--ctx", type=int, default=16384, help="llama-server -c (shared by its slots)")
    p.add_argument("--prefix", type=int, default=1500, help="tokens of the repeated and the aborted prefix")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1, help="repeat_at_once: the prompt sent again this many times "
                   "a rep, each the moment the answer before ended (a client calibrating); the interval "
                   "resamples whole reps")
    p.add_argument("--block", type=int, default=2, help="reps run back to back on one mode before the next mode's "
                                                        "turn (modes take turns, all nodes up together)")
    p.add_argument("--model", help="GGUF for every node (default SmolLM2; a generated 8B-shaped model shows "
                                   "what a save's write costs at real KV sizes)")
    p.add_argument("--abort-after", type=int, default=64)
    p.add_argument("--main-tokens", type=int, default=2000)
    p.add_argument("--sub-tokens", type=int, default=1500)
    p.add_argument("--agent-rounds", type=int, default=1, help="agent_subagents: rounds of three agents, one after "
                                                              "the other (more finalizes to take the median of)")
    p.add_argument("--no-load", action="store_true", help="quiet only (no run with a CPU load beside)")
    p.add_argument("--redis-url", help="use this Redis instead of an embedded Valkey (it gets FLUSHALLed!)")
    p.add_argument("--json", default=str(RESULTS_DIR / "neverworse.json"))
    a = p.parse_args(argv)
    a.scenarios = [x for x in a.scenarios.split(",") if x]
    a.modes = [x for x in a.modes.split(",") if x]
    if bad := [x for x in a.scenarios if x not in SCENARIOS] + [x for x in a.modes if x not in MODES + OTHER_MODES]:
        p.error(f"unknown scenarios or modes {bad}")
    if a.repeats < 1 or a.reps < 1:
        p.error("--reps and --repeats take 1 or more")
    if a.redis_url and sum(m.startswith("kvtier") for m in a.modes) > 1:
        p.error("--redis-url serves one kvtier mode (each needs a Redis of its own): pick one with --modes")
    results: dict[str, dict[str, Any]] = {}
    started = time.time()
    for load in ("quiet",) if a.no_load else ("quiet", "loaded"):
        console.print(f"neverworse: {load}, modes {', '.join(a.modes)} interleaved")
        with contextlib.ExitStack() as stack:
            redis_urls = {m: stack.enter_context(redis_or_given(a.redis_url)) for m in a.modes if m.startswith("kvtier")}
            for url in redis_urls.values():
                asyncio.run(redis_flush(url))
            by_mode = stack.enter_context(rigs(a, redis_urls))
            stack.enter_context(cpu_load(load == "loaded"))
            for mode, out in asyncio.run(run_load(a, by_mode)).items():
                results[f"{load}/{mode}"] = out
        rows = summarize(results)
        _write(a, results, rows, started)  # after each load: a run cut short keeps what it measured
    print_table("Never worse than llama-server alone (same flags, default --cache-ram)",
                ["load", "scenario", "mode", "figure", "value", "tokens computed (p50)"], rows)
    print_table("Over llama-server alone (p50 over p50, same load, modes interleaved)",
                ["load", "scenario", "mode", "figure", "x alone"], [[*r[:4], f"{r[4]:.2f}"] for r in versus_alone(rows)])
    print_table(f"Over llama-server alone, with a 90% bootstrap interval (goal: at most {GOAL:g}x)", BOUNDS_HEAD,
                [[*r[:5], f"{r[5]:.2f}", *r[6:]] for r in bounds(results)])
    console.print("tokens computed: of the repeat; of the prefix (abort_reprompt); of the sibling; of the other "
                  "conversation and of the return (other_at_once); of the new conversation (beside_save, due_together); "
                  "of the finalize")
    return 0


def _write(a: argparse.Namespace, results: dict[str, dict[str, Any]], rows: list[list[Any]], started: float) -> None:
    write_json(a.json, {"benchmark": "neverworse", "settings": {k: v for k, v in vars(a).items() if k != "json"},
                        "minutes": round((time.time() - started) / 60, 1), "results": results,
                        "table": [dict(zip(["load", "scenario", "mode", "figure", "value", "computed"], r, strict=True))
                                  for r in rows]})


if __name__ == "__main__":
    raise SystemExit(main())
