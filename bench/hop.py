"""``python -m bench hop``: conversations that hop between llama-server nodes, with and without kvtier.

    python -m bench hop                                   # defaults: a few minutes on an idle 2-core VM
    python -m bench hop --nodes 4 --users 8 --rounds 6    # bigger
    python -m bench hop --modes kvtier,direct-rr --long-tokens 0

Workload (in the style of LMCache's multi-round QA): U users x R rounds, one shared system prompt,
a per-user document in each user's first turn, short questions after it, greedy answers of
``--max-tokens``. Users take turns (one request at a time, so the timings are not a CPU fight),
and each turn is routed by the mode:

    direct-rr       llama-server alone, each turn of a user on the next node (round robin)
    direct-sticky   llama-server alone, each user pinned to one node
    cache-ram       llama-server alone with its own host-RAM prompt cache (--cache-ram), round robin
    kvtier          a kvtier sidecar beside each llama-server, one shared Redis, round robin
    direct-rolling  rolling update: every round lands on the node restarted just before it
    kvtier-rolling  the same with kvtier

Every llama-server runs ``-np 1 -t THREADS --cache-ram 0`` (except cache-ram). kvtier modes wait
after each answer until the sidecars' background saves reached Redis, so each hop is measured
against a settled cache. Reported per mode: TTFT p50/p90, prompt tokens recomputed (the server's
``prompt_n``), hit rate (share of prompt tokens not recomputed), end-to-end tokens/s.

Long hop (``--long-tokens``, default 4,096): a session of that many tokens is computed on node A
(the full prefill: the recompute cost), then continued on node B, which has never seen it (its RAM
tier is 1 MiB, so every chunk comes from Redis): with ``X-Session-Id`` (the session, tail included,
is restored) and without (automatic mode restores full 256-token chunks and a stored partial tail
the prompt continues). Side by side, the floor
of the same restore: one pipelined Redis GET of the same keys plus llama-server's own
``restore_ms`` of the same state file. Targets: TTFT under 300 ms; restore path within 1.3x of
the floor.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from rich.progress import Progress

from .common import (
    RESULTS_DIR,
    Cluster,
    Reply,
    Timer,
    base_llama_args,
    chat,
    client_session,
    cluster,
    complete,
    console,
    delta,
    exact_tokens,
    filler,
    machine,
    manifest,
    metric,
    percentile,
    pipelined_get_ms,
    post_json,
    print_table,
    progress,
    ratio,
    redis_flush,
    redis_keys,
    redis_or_given,
    scrape,
    slot_restore_floor,
    summary,
    versions,
    wait_idle,
    write_json,
)

MODES: dict[str, dict[str, Any]] = {
    # name: sidecar?, routing, llama-server's own --cache-ram (MiB; -1 = the --cache-ram-mib flag)
    "direct-rr": {"sidecar": False, "routing": "rr", "cache_ram": 0},
    "direct-sticky": {"sidecar": False, "routing": "sticky", "cache_ram": 0},
    "cache-ram": {"sidecar": False, "routing": "rr", "cache_ram": -1},
    "kvtier": {"sidecar": True, "routing": "rr", "cache_ram": 0},
    "direct-rolling": {"sidecar": False, "routing": "rolling", "cache_ram": 0},
    "kvtier-rolling": {"sidecar": True, "routing": "rolling", "cache_ram": 0},
}
DEFAULT_MODES = "direct-rr,direct-sticky,cache-ram,kvtier,direct-rolling,kvtier-rolling"


@dataclass(frozen=True, slots=True)
class Workload:
    """Who says what, and where it is sent."""

    users: int = 3
    rounds: int = 4
    nodes: int = 2
    system_tokens: int = 800  # shared by every user
    context_tokens: int = 200  # each user's own document, in its first turn
    turn_tokens: int = 30  # each later question
    max_tokens: int = 16  # greedy answer length
    threads: int = 2
    cache_ram_mib: int = 2048
    hop_rounds: tuple[int, ...] | None = None  # rolling: rounds (0-based) that land on a restarted node; None = all

    @property
    def ctx(self) -> int:
        """A context that holds the longest conversation (template tokens and answers included)."""
        est = self.system_tokens + self.context_tokens + self.rounds * (self.turn_tokens + self.max_tokens + 16)
        return int(est * 1.25 + 512) // 256 * 256

    def hops_before(self, r: int) -> int:
        rounds = self.hop_rounds if self.hop_rounds is not None else range(1, self.rounds)
        return sum(1 for h in rounds if 0 < h <= r)

    def restart_before(self, r: int) -> bool:
        return r > 0 and (self.hop_rounds is None or r in self.hop_rounds)

    def node_for(self, routing: str, user: int, r: int) -> int:
        if routing == "rr":
            return (user + r) % self.nodes
        if routing == "sticky":
            return user % self.nodes
        if routing == "rolling":
            return self.hops_before(r) % self.nodes
        raise ValueError(f"unknown routing {routing!r}")


def system_prompt(wl: Workload) -> str:
    return ("You are the records assistant of a logistics company. Answer in one short sentence.\n"
            + filler(wl.system_tokens, seed=1, label="Policy"))


def first_turn(wl: Workload, user: int) -> str:
    return (filler(wl.context_tokens, seed=1000 + user, label=f"Note of user {user}")
            + "\nWhich note mentions the warehouse first?")


def question(wl: Workload, user: int, r: int) -> str:
    return filler(wl.turn_tokens, seed=2000 + 97 * user + r, label="Question") + "\nWhat changed?"


# -- one mode --------------------------------------------------------------------------------------


async def _scrape_all(s: aiohttp.ClientSession, cl: Cluster) -> list[dict[str, float]]:
    return [await scrape(s, cl.url(i)) for i in range(len(cl))]


async def run_mode(mode: str, wl: Workload, redis_url: str, prog: Progress | None = None,
                   llama_extra: Sequence[str] = (), turn_probe: Sequence[int] | None = None) -> dict[str, Any]:
    """Run the workload in one mode on fresh nodes; returns the per-request rows and a summary.

    Args:
        turn_probe: rounds (0-based) whose rows are kept in ``by_round`` (all when None).
    """
    spec = MODES[mode]
    cache_ram = wl.cache_ram_mib if spec["cache_ram"] < 0 else spec["cache_ram"]
    args = base_llama_args(wl.ctx, wl.threads, cache_ram, llama_extra)
    if spec["sidecar"]:
        await redis_flush(redis_url)
    total = wl.users * wl.rounds
    task = prog.add_task(f"hop {mode}: starting {wl.nodes} nodes", total=total) if prog else None
    rows: list[dict[str, Any]] = []
    with cluster(wl.nodes, args, sidecar=spec["sidecar"], redis_url=redis_url if spec["sidecar"] else None) as cl:
        histories = [[{"role": "system", "content": system_prompt(wl)}] for _ in range(wl.users)]
        sidecars = [cl.url(i) for i in range(len(cl))] if spec["sidecar"] else []
        async with client_session() as s:
            for r in range(wl.rounds):
                restarted = -1
                if spec["routing"] == "rolling" and wl.restart_before(r):
                    restarted = wl.node_for("rolling", 0, r)
                    if prog and task is not None:
                        prog.update(task, description=f"hop {mode}: restarting node {cl.nodes[restarted].name}")
                    cl.restart(restarted)
                for u in range(wl.users):
                    i = wl.node_for(spec["routing"], u, r)
                    text = first_turn(wl, u) if r == 0 else question(wl, u, r)
                    histories[u].append({"role": "user", "content": text})
                    if prog and task is not None:
                        prog.update(task, description=f"hop {mode}: round {r + 1} user {u + 1} on {cl.nodes[i].name}")
                    before = await scrape(s, cl.url(i)) if spec["sidecar"] else {}
                    reply = await chat(s, cl.url(i), histories[u], wl.max_tokens)
                    extra: dict[str, Any] = {}
                    if spec["sidecar"]:
                        after = await scrape(s, cl.url(i))
                        extra = {"restore_ms": round(1000 * delta(after, before, "kvtier_restore_seconds_sum"), 2),
                                 "decisions_restore": delta(after, before, "kvtier_cost_decisions_total",
                                                            decision="restore"),
                                 "decisions_recompute": delta(after, before, "kvtier_cost_decisions_total",
                                                              decision="recompute")}
                        await wait_idle(s, sidecars)
                    histories[u].append({"role": "assistant", "content": reply.content})
                    reply.node = cl.nodes[i].name
                    rows.append(reply.row(mode=mode, user=u, round=r, restarted=restarted == i, **extra))
                    if prog and task is not None:
                        prog.advance(task)
            final = await _scrape_all(s, cl) if spec["sidecar"] else []
    if prog and task is not None:
        prog.update(task, description=f"hop {mode}: done")
    out = {"mode": mode, **spec, "cache_ram_mib": cache_ram, "requests": rows, "summary": summarize(rows)}
    out["by_round"] = by_round(rows, turn_probe)
    if final:
        out["sidecar_metrics"] = {
            "tokens_restored": sum(metric(m, "kvtier_tokens_restored_total") for m in final),
            "tokens_recomputed": sum(metric(m, "kvtier_tokens_recomputed_total") for m in final),
            "restores_redis": sum(metric(m, "kvtier_restores_total", outcome="ok", tier="redis") for m in final),
            "restores_memory": sum(metric(m, "kvtier_restores_total", outcome="ok", tier="memory") for m in final),
            "decisions_recompute": sum(metric(m, "kvtier_cost_decisions_total", decision="recompute") for m in final),
            "decisions_restore": sum(metric(m, "kvtier_cost_decisions_total", decision="restore") for m in final),
        }
    return out


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """TTFT, recompute and speed over all requests and over the follow-up rounds (round >= 1)."""
    def block(rs: Sequence[dict[str, Any]]) -> dict[str, Any]:
        prompt = sum(r["prompt_tokens"] for r in rs)
        recomputed = sum(r["recomputed_tokens"] for r in rs)
        generated = sum(r["predicted_n"] for r in rs)
        seconds = sum(r["total_ms"] for r in rs) / 1000
        return {
            "requests": len(rs), "ttft_ms": summary([r["ttft_ms"] for r in rs]),
            "prompt_tokens": prompt, "recomputed_tokens": recomputed,
            "restored_tokens": sum(r["restored_tokens"] for r in rs),
            "hit_rate": round(1 - recomputed / prompt, 3) if prompt else 0.0,
            "tokens_per_s_p50": round(percentile([r["tokens_per_s"] for r in rs], 50), 2),
            "tokens_per_s_total": round(generated / seconds, 2) if seconds else 0.0,
        }
    return {"all": block(rows), "followup": block([r for r in rows if r["round"] > 0])}


def by_round(rows: Sequence[dict[str, Any]], keep: Sequence[int] | None) -> list[dict[str, Any]]:
    out = []
    for r in sorted({row["round"] for row in rows}):
        if keep is not None and r not in keep:
            continue
        rs = [row for row in rows if row["round"] == r]
        out.append({"round": r, "turn": r + 1, "ttft_ms_p50": round(statistics.median(x["ttft_ms"] for x in rs), 1),
                    "tokens_per_s_p50": round(statistics.median(x["tokens_per_s"] for x in rs), 2),
                    "total_ms_p50": round(statistics.median(x["total_ms"] for x in rs), 1),
                    "prompt_tokens": round(statistics.median(x["prompt_tokens"] for x in rs)),
                    "recomputed_tokens": round(statistics.median(x["recomputed_tokens"] for x in rs)),
                    "restored_tokens": round(statistics.median(x["restored_tokens"] for x in rs))})
    return out


# -- moving a session: the long hop --------------------------------------------------------------------


async def reset_slot(s: aiohttp.ClientSession, base: str) -> None:
    """Fill the node's only slot with an unrelated short chat, through its sidecar (which then knows)."""
    await chat(s, base, [{"role": "user", "content": "Say hello."}], 1)


async def move_sessions(redis_url: str, sizes: Sequence[int] = (4096,), reps: int = 3, threads: int = 2,
                        prog: Progress | None = None, new_tokens: int = 8,
                        llama_extra: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Move sessions of ``sizes`` tokens from node A to node B, which has never seen them.

    Per size: the prompt is computed once on A through its sidecar (the recompute cost). Then
    ``reps`` times: ``PUT /v1/sessions/{id}`` on A; on B (1 MiB RAM tier, so every chunk comes
    from Redis), each after an unrelated request has taken B's only slot:
    ``POST /v1/sessions/{id}/restore`` (the sessions API); a completion of the session plus
    ``new_tokens`` new tokens with ``X-Session-Id`` (automatic session restore, tail included:
    the hop TTFT); the same completion without the header (automatic mode: full chunks, and the
    partial tail A's automatic save stored when the prompt continues it);
    and the floor of the same restore, one pipelined Redis GET of the session's keys plus
    llama-server's own ``restore_ms`` of A's state file restored into B's llama-server. The same
    hop to node C, whose sidecar runs with ``--prewarm``: it copied A's chunks into its RAM tier
    when A announced them, so only the session's tail comes from Redis (*prewarmed hop*). Last,
    ``reps`` continuations on A's llama-server itself (*warm*: nothing moves, only the new tokens
    are computed), the part of the hop TTFT that no cache can remove. ``llama_extra``: more
    llama-server flags for every node (each result names them).
    """
    ctx = (max(sizes) + 1024) // 256 * 256
    await redis_flush(redis_url)
    task = prog.add_task("move sessions: starting nodes", total=len(sizes) * (1 + reps)) if prog else None

    def say(text: str) -> None:
        if prog and task is not None:
            prog.update(task, description=text)

    results = []
    with cluster(3, base_llama_args(ctx, threads, extra=llama_extra), sidecar=True, redis_url=redis_url,
                 node_sidecar_args=[[], ["--cache-size", "1M"], ["--prewarm", "--cache-size", "2G"]]) as cl:
        a, b, c = cl.nodes
        bases = [a.sidecar_url, b.sidecar_url, c.sidecar_url]
        async with client_session() as s:
            props, _ = await post_json(s, a.llama_url + "/props", method="GET")
            n_ctx = int(props.get("default_generation_settings", {}).get("n_ctx") or ctx)
            for n in sizes:
                if n + new_tokens + 2 > n_ctx:
                    # llama-server caps -c at the model's training context (8,192 for SmolLM2).
                    console.print(f"[yellow]move: {n} tokens do not fit n_ctx {n_ctx}; using {n_ctx - new_tokens - 2}")
                    n = n_ctx - new_tokens - 2
                say(f"move {n}: prefill of {n} tokens on node A (the recompute cost)")
                tokens = await exact_tokens(s, a.llama_url, n, seed=300 + n)
                extra = await exact_tokens(s, a.llama_url, new_tokens, seed=99)
                known = await redis_keys(redis_url, "kvtier:*:c:*")
                prewarmed_before = metric(await scrape(s, c.sidecar_url), "kvtier_prewarmed_chunks_total")
                build = await complete(s, a.sidecar_url, tokens, 1)
                await wait_idle(s, bases)
                chunk_keys = sorted(await redis_keys(redis_url, "kvtier:*:c:*") - known)
                await wait_prewarmed(s, c.sidecar_url, prewarmed_before + len(chunk_keys))
                if prog and task is not None:
                    prog.advance(task)
                runs: list[dict[str, Any]] = []
                for rep in range(reps):
                    sid = f"move-{n}-{rep}"
                    say(f"move {n}: session {rep + 1} of {reps}, A -> B")
                    saved, save_wall = await post_json(s, f"{a.sidecar_url}/v1/sessions/{sid}", {"slot": 0},
                                                       method="PUT")
                    held = (await manifest(redis_url, sid))["tokens"]
                    # C's own copy of the session: B's hop saves the conversation under ``sid`` again,
                    # longer by the new tokens, and a session longer than the prompt is not restored.
                    sid_c = f"{sid}-c"
                    await post_json(s, f"{a.sidecar_url}/v1/sessions/{sid_c}", {"slot": 0}, method="PUT")
                    run: dict[str, Any] = {"save_ms": saved["ms"], "save_wall_ms": round(save_wall, 2),
                                           "session_tokens": saved["tokens"], "session_bytes": saved["bytes"]}
                    await reset_slot(s, b.sidecar_url)
                    await wait_idle(s, bases)
                    restored, wall = await post_json(s, f"{b.sidecar_url}/v1/sessions/{sid}/restore", {"slot": 0})
                    run["api_restore"] = {"ms": restored["ms"], "wall_ms": round(wall, 2), "tier": restored["tier"],
                                          "tokens": restored["n_restored"]}
                    for kind, base, headers in (("session_hop", b.sidecar_url, {"X-Session-Id": sid}),
                                                ("automatic_hop", b.sidecar_url, None),
                                                ("prewarmed_hop", c.sidecar_url, {"X-Session-Id": sid_c})):
                        await reset_slot(s, base)
                        await wait_idle(s, bases)
                        before = await scrape(s, base)
                        reply = await complete(s, base, [*held, *extra], 1, headers)
                        after = await scrape(s, base)
                        run[kind] = reply.row(restore_ms=round(1000 * delta(after, before, "kvtier_restore_seconds_sum"), 2),
                                              phases_ms=restore_phases(after, before))
                        await wait_idle(s, bases)
                    tail_keys = sorted(await redis_keys(redis_url, f"kvtier:*:t:{sid}"))
                    get_ms, get_bytes = await pipelined_get_ms(redis_url, [*chunk_keys, *tail_keys])
                    floor = await slot_restore_floor(s, a, b, repeat=1)
                    run["floor"] = {"redis_get_ms": round(get_ms, 2), "redis_get_bytes": get_bytes,
                                    "restore_ms": floor["restores"][0]["restore_ms"],
                                    "file_bytes": floor["file_bytes"], "n_tokens": floor["n_tokens"]}
                    runs.append(run)
                    if prog and task is not None:
                        prog.advance(task)
                # The same continuation where nothing moves: A's llama-server, its slot holding the
                # session, computes only the new tokens (what any hop costs on top of that is the move).
                warm = []
                for rep in range(reps):
                    # Rotated, so that no two continuations start alike: the slot reuses only ``held``.
                    fresh = [*extra[rep % len(extra):], *extra[: rep % len(extra)]]
                    warm.append((await complete(s, a.llama_url, [*held, *fresh], 1)).row())
                results.append({**summarize_move(n, build, runs, warm), "llama_extra": list(llama_extra)})
    say("move sessions: done")
    return results


RESTORE_PHASES = ("fetch", "assemble", "write", "queue", "llama")


async def wait_prewarmed(s: aiohttp.ClientSession, base: str, goal: float, timeout: float = 60.0) -> None:
    """Wait until the sidecar at ``base`` has copied ``goal`` chunks in all from its peers' events
    (a user's next turn comes seconds later; the copy takes milliseconds)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if metric(await scrape(s, base), "kvtier_prewarmed_chunks_total") >= goal:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{base} did not prewarm {goal:.0f} chunks in {timeout:.0f} s")


def restore_phases(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Milliseconds of each restore phase between two scrapes of a sidecar."""
    return {p: round(1000 * delta(after, before, "kvtier_restore_phase_seconds_sum", phase=p), 2)
            for p in RESTORE_PHASES}


def summarize_move(n: int, build: Reply, runs: list[dict[str, Any]],
                   warm: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    def col(*path: str) -> list[float]:
        out = []
        for run in runs:
            v: Any = run
            for k in path:
                v = v[k]
            out.append(float(v))
        return out

    floor = [r["floor"]["redis_get_ms"] + r["floor"]["restore_ms"] for r in runs]
    floor_p50 = round(percentile(floor, 50), 1)
    api = summary(col("api_restore", "ms"))
    hop_restore = summary(col("session_hop", "restore_ms"))
    hop_ttft = summary(col("session_hop", "ttft_ms"))
    prewarmed = [r for r in runs if "prewarmed_hop" in r]
    pre_ttft = summary([r["prewarmed_hop"]["ttft_ms"] for r in prewarmed])
    first = runs[0] if runs else {}
    warm_ttft = summary([w["ttft_ms"] for w in warm])
    return {
        "tokens": n, "reps": len(runs),
        "recompute": {"prompt_tokens": build.prompt_tokens, "ttft_ms": build.ttft_ms, "prompt_ms": build.prompt_ms,
                      "prefill_tokens_per_s": round(build.recomputed_tokens / (build.prompt_ms / 1000), 1)
                      if build.prompt_ms else None},
        "session_bytes": first.get("session_bytes"), "save_ms": summary(col("save_ms")),
        "api_restore_ms": api, "api_restore_wall_ms": summary(col("api_restore", "wall_ms")),
        "api_restore_tier": first.get("api_restore", {}).get("tier"),
        "session_hop": {"ttft_ms": hop_ttft, "restore_ms": hop_restore,
                        "restored_tokens": first.get("session_hop", {}).get("restored_tokens"),
                        "recomputed_tokens": first.get("session_hop", {}).get("recomputed_tokens"),
                        "tier": first.get("session_hop", {}).get("restore_tier")},
        "automatic_hop": {"ttft_ms": summary(col("automatic_hop", "ttft_ms")),
                          "restore_ms": summary(col("automatic_hop", "restore_ms")),
                          "restored_tokens": first.get("automatic_hop", {}).get("restored_tokens"),
                          "recomputed_tokens": first.get("automatic_hop", {}).get("recomputed_tokens"),
                          "tier": first.get("automatic_hop", {}).get("restore_tier")},
        "prewarmed_hop": {"ttft_ms": pre_ttft,
                          "restore_ms": summary([r["prewarmed_hop"]["restore_ms"] for r in prewarmed]),
                          "tier": prewarmed[0]["prewarmed_hop"].get("restore_tier") if prewarmed else None,
                          "phases_ms_p50": {p: percentile([r["prewarmed_hop"]["phases_ms"][p] for r in prewarmed], 50)
                                            for p in RESTORE_PHASES if p in prewarmed[0]["prewarmed_hop"]["phases_ms"]}}
        if prewarmed else None,
        "floor": {"redis_get_ms": summary(col("floor", "redis_get_ms")),
                  "llama_restore_ms": summary(col("floor", "restore_ms")), "total_ms_p50": floor_p50,
                  "bytes": first.get("floor", {}).get("redis_get_bytes"),
                  "file_bytes": first.get("floor", {}).get("file_bytes")},
        "api_restore_vs_floor": ratio(api["p50"], floor_p50),
        "hop_restore_vs_floor": ratio(hop_restore["p50"], floor_p50),
        "hop_speedup_vs_recompute": ratio(build.ttft_ms, hop_ttft["p50"], 1),
        "hop_phases_ms_p50": {p: percentile([r["session_hop"]["phases_ms"][p] for r in runs], 50)
                              for p in RESTORE_PHASES if p in first["session_hop"]["phases_ms"]},  # runs before "queue"
        "warm": {"ttft_ms": warm_ttft, "recomputed_tokens": [w["recomputed_tokens"] for w in warm]},
        "hop_added_ms_p50": round(hop_ttft["p50"] - warm_ttft["p50"], 1) if warm else None,
        "targets": {"hop_ttft_under_300ms": hop_ttft["p50"] < 300,
                    "prewarmed_hop_ttft_under_300ms": bool(prewarmed) and pre_ttft["p50"] < 300,
                    "restore_within_1_3x_floor": bool(floor_p50 and hop_restore["p50"] <= 1.3 * floor_p50)},
        "runs": runs,
    }


MOVE_HEADERS = ["tokens", "MB", "recompute TTFT ms", "API restore p50/p90 ms", "hop TTFT p50/p90 ms",
                "hop restore p50 ms", "floor p50 ms (GET + restore_ms)", "restore / floor", "automatic hop TTFT p50 ms",
                "prewarmed hop TTFT p50 ms", "warm continuation TTFT p50 ms", "speedup"]


def move_rows(results: Sequence[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for m in results:
        fl = m["floor"]
        rows.append([m["tokens"], round((m["session_bytes"] or 0) / 1e6, 1), m["recompute"]["ttft_ms"],
                     f"{m['api_restore_ms']['p50']:.0f} / {m['api_restore_ms']['p90']:.0f}",
                     f"{m['session_hop']['ttft_ms']['p50']:.0f} / {m['session_hop']['ttft_ms']['p90']:.0f}",
                     m["session_hop"]["restore_ms"]["p50"],
                     f"{fl['total_ms_p50']:.0f} ({fl['redis_get_ms']['p50']:.0f} + {fl['llama_restore_ms']['p50']:.0f})",
                     m["hop_restore_vs_floor"], m["automatic_hop"]["ttft_ms"]["p50"],
                     (m.get("prewarmed_hop") or {}).get("ttft_ms", {}).get("p50"),
                     (m.get("warm") or {}).get("ttft_ms", {}).get("p50"),
                     f"{m['hop_speedup_vs_recompute']}x"])
    return rows


def print_moves(results: Sequence[dict[str, Any]]) -> None:
    print_table("Moving a session to a node that never saw it (Redis path)", MOVE_HEADERS, move_rows(results))
    for m in results:
        t = m["targets"]
        pre = (m.get("prewarmed_hop") or {}).get("ttft_ms", {}).get("p50")
        console.print(f"{m['tokens']} tokens: hop TTFT p50 {m['session_hop']['ttft_ms']['p50']:.0f} ms "
                      f"(target < 300 ms: {'met' if t['hop_ttft_under_300ms'] else 'NOT met'}; prewarmed "
                      f"{pre} ms: {'met' if t.get('prewarmed_hop_ttft_under_300ms') else 'NOT met'}), restore / floor "
                      f"{m['hop_restore_vs_floor']} (target <= 1.3: {'met' if t['restore_within_1_3x_floor'] else 'NOT met'})")


# -- command line --------------------------------------------------------------------------------------


def workload_from(a: argparse.Namespace) -> Workload:
    return Workload(users=a.users, rounds=a.rounds, nodes=a.nodes, system_tokens=a.system_tokens,
                    context_tokens=a.context_tokens, turn_tokens=a.turn_tokens, max_tokens=a.max_tokens,
                    threads=a.threads, cache_ram_mib=a.cache_ram_mib)


def add_workload_flags(p: argparse.ArgumentParser, **defaults: Any) -> None:
    d = {**asdict(Workload()), **defaults}
    p.add_argument("--users", type=int, default=d["users"])
    p.add_argument("--rounds", type=int, default=d["rounds"])
    p.add_argument("--nodes", type=int, default=d["nodes"], help="llama-server nodes (2 to 4)")
    p.add_argument("--system-tokens", type=int, default=d["system_tokens"], help="shared system prompt (about)")
    p.add_argument("--context-tokens", type=int, default=d["context_tokens"], help="each user's document (about)")
    p.add_argument("--turn-tokens", type=int, default=d["turn_tokens"], help="each later question (about)")
    p.add_argument("--max-tokens", type=int, default=d["max_tokens"])
    p.add_argument("--threads", type=int, default=d["threads"])
    p.add_argument("--cache-ram-mib", type=int, default=d["cache_ram_mib"], help="llama-server --cache-ram of cache-ram")


def mode_rows(results: dict[str, dict[str, Any]], part: str = "followup") -> list[list[Any]]:
    rows = []
    for mode, res in results.items():
        sm = res["summary"][part]
        rows.append([mode, sm["requests"], sm["ttft_ms"]["p50"], sm["ttft_ms"]["p90"], sm["prompt_tokens"],
                     sm["recomputed_tokens"], sm["restored_tokens"], f"{100 * sm['hit_rate']:.0f}%",
                     sm["tokens_per_s_p50"]])
    return rows


MODE_HEADERS = ["mode", "requests", "TTFT p50 ms", "TTFT p90 ms", "prompt tok", "recomputed", "restored",
                "hit rate", "tok/s p50"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench hop", description=__doc__.splitlines()[0])
    add_workload_flags(p)
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--long-tokens", type=int, default=4096, help="long-hop conversation length (0 = skip)")
    p.add_argument("--long-reps", type=int, default=3)
    p.add_argument("--redis-url", help="use this Redis instead of an embedded Valkey (it gets FLUSHALLed!)")
    p.add_argument("--json", default=str(RESULTS_DIR / "hop.json"))
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not 2 <= a.nodes <= 4:
        p.error(f"unknown modes {unknown}" if unknown else "--nodes must be 2 to 4")
    wl = workload_from(a)
    timer = Timer()
    results: dict[str, dict[str, Any]] = {}
    moves: list[dict[str, Any]] = []
    with redis_or_given(a.redis_url) as redis_url:
        info = {"machine": machine(), "versions": versions(redis_url)}
        with progress() as prog:
            for mode in modes:
                with timer.phase(mode):
                    results[mode] = asyncio.run(run_mode(mode, wl, redis_url, prog))
            if a.long_tokens > 0:
                with timer.phase("long_hop"):
                    moves = asyncio.run(move_sessions(redis_url, [a.long_tokens], a.long_reps, a.threads, prog))
    info["machine"]["load_avg_end"] = machine()["load_avg"]
    print_table(f"{wl.users} users x {wl.rounds} rounds on {wl.nodes} nodes, follow-up rounds (round >= 2)",
                MODE_HEADERS, mode_rows(results))
    if moves:
        print_moves(moves)
    path = write_json(a.json, {"benchmark": "hop", "workload": asdict(wl), **info, "modes": results,
                               "long_hop": moves[0] if moves else None, "seconds": timer.phases})
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
