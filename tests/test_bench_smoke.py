"""The benchmarks' pure parts: statistics, routing, metrics parsing, the report's rendering, and
``python -m bench`` choosing a benchmark.

No servers and no timings: the report is rendered from a fixed, synthetic result document built
with the same summarising functions the real run uses.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from bench import chatsteps, datapath, hop, neverworse, overhead, report, stages
from bench.__main__ import BENCHMARKS
from bench.__main__ import main as bench_main
from bench.common import Reply, parse_metrics, percentile, summary
from bench.overhead import histogram_quantile

METRICS_TEXT = """\
# HELP kvtier_tokens_restored_total Prompt tokens restored from the tiers
# TYPE kvtier_tokens_restored_total counter
kvtier_tokens_restored_total 768.0
# HELP kvtier_cost_decisions_total Cost-model decisions
# TYPE kvtier_cost_decisions_total counter
kvtier_cost_decisions_total{decision="restore"} 3.0
kvtier_cost_decisions_total{decision="recompute"} 1.0
# HELP kvtier_overhead_seconds Sidecar time before forwarding
# TYPE kvtier_overhead_seconds histogram
kvtier_overhead_seconds_bucket{le="0.005"} 8.0
kvtier_overhead_seconds_bucket{le="0.01"} 10.0
kvtier_overhead_seconds_bucket{le="+Inf"} 10.0
kvtier_overhead_seconds_count 10.0
kvtier_overhead_seconds_sum 0.02
"""


def test_percentile_interpolates_and_summary_counts() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    s = summary([1.0, 2.0, 3.0, 4.0])
    assert s["p50"] == 2.5 and s["n"] == 4


def test_metrics_parse_and_histogram_quantile() -> None:
    after = parse_metrics(METRICS_TEXT)
    assert after['kvtier_cost_decisions_total{decision="recompute"}'] == 1.0
    assert after["kvtier_tokens_restored_total"] == 768.0
    q = histogram_quantile({}, after, "kvtier_overhead_seconds", 0.9)
    assert q is not None and 0.005 < q <= 0.01  # the 9th of 10 observations is in the second bucket


def test_routing_round_robin_sticky_and_rolling() -> None:
    wl = hop.Workload(users=2, rounds=4, nodes=2)
    assert [wl.node_for("rr", 0, r) for r in range(4)] == [0, 1, 0, 1]  # every turn hops
    assert [wl.node_for("sticky", 1, r) for r in range(4)] == [1, 1, 1, 1]
    assert [wl.node_for("rolling", 0, r) for r in range(4)] == [0, 1, 0, 1]
    assert [wl.restart_before(r) for r in range(4)] == [False, True, True, True]
    sparse = hop.Workload(rounds=30, nodes=4, hop_rounds=(9, 19, 29))
    assert [sparse.node_for("rolling", 0, r) for r in (0, 8, 9, 18, 19, 29)] == [0, 0, 1, 1, 2, 3]
    assert [r for r in range(30) if sparse.restart_before(r)] == [9, 19, 29]
    assert report.probe_rounds(30) == [0, 9, 19, 29]


def _reply(ttft: float, prompt: int, recomputed: int, restored: int = 0) -> Reply:
    return Reply(content="ok", ttft_ms=ttft, total_ms=ttft + 200, prompt_tokens=prompt, recomputed_tokens=recomputed,
                 restored_tokens=restored, predicted_n=16, prompt_ms=ttft * 0.9)


def fixed_report() -> dict[str, Any]:
    """A result document shaped like a real run's, with made-up (but consistent) figures."""
    def mode(name: str, recompute: int, restored: int) -> dict[str, Any]:
        rows = [_reply(100.0 + 10 * r, 1000 + 60 * r, recompute, restored).row(mode=name, user=0, round=r, restarted=False)
                for r in range(30)]
        return {"mode": name, "summary": hop.summarize(rows), "by_round": hop.by_round(rows, None),
                "cache_ram_mib": 2048}

    wl = hop.Workload(users=1, rounds=30, nodes=4, system_tokens=600, turn_tokens=40)
    move_runs = [{"save_ms": 50.0, "save_wall_ms": 60.0, "session_tokens": 4097, "session_bytes": 94_000_000,
                  "api_restore": {"ms": 200.0 + i, "wall_ms": 210.0, "tier": "redis", "tokens": 4097},
                  "session_hop": _reply(260.0 + i, 4105, 8, 4097).row(
                      restore_ms=200.0, phases_ms={"fetch": 110.0, "assemble": 2.0, "write": 50.0, "queue": 7.0, "llama": 30.0}),
                  "automatic_hop": _reply(900.0, 4105, 9, 4096).row(restore_ms=190.0),
                  "prewarmed_hop": _reply(240.0 + i, 4105, 8, 4097).row(
                      restore_ms=80.0, phases_ms={"fetch": 5.0, "assemble": 2.0, "write": 45.0, "queue": 1.0, "llama": 28.0}),
                  "floor": {"redis_get_ms": 70.0, "restore_ms": 100.0, "redis_get_bytes": 94_000_000,
                            "file_bytes": 94_000_100, "n_tokens": 4097}} for i in range(3)]
    memory = {"kv": "f16", "sessions": 10, "system_tokens": 2000, "own_tokens": 500, "session_tokens": 25010,
              "whole_bytes": 576_000_000, "whole_bytes_per_token": 23_040.0, "redis_key_bytes": 205_000_000,
              "redis_used_memory_delta": 206_000_000, "redis_keys": 40, "redis_chunk_bytes": 160_000_000,
              "redis_tail_bytes": 45_000_000, "redis_manifest_bytes": 40_000, "ram_tier_bytes": [1e8, 1e8],
              "ram_tier_bytes_total": 2e8, "reduction_vs_whole": 0.644}
    short_rows = [{"prefix_tokens": 64, "chunk_tokens": c, "prompt_tokens": 80, "alone_ttft_ms": summary([400.0, 410.0]),
                   "kvtier_ttft_ms": summary([k, k + 10]), "vs_alone": round(k / 405, 2), "paired_vs_alone": 1.0,
                   "restored_tokens_p50": 0.0, "recomputed_tokens_p50": 80.0, "decisions_restore": 0,
                   "decisions_recompute": 0} for c, k in ((256, 404.0), (64, 120.0))]
    return {
        "benchmark": "report", "preset": "full", "command": "python -m bench report", "started": "2026-01-01T00:00:00",
        "minutes": 20.0, "threads": 2,
        "machine": {"cores": 2, "cpu_model": "Test CPU", "ram_gib": 8.0, "gpu": "none", "load_avg": [1.0, 1.0, 1.0],
                    "load_avg_end": [1.0, 1.0, 1.0]},
        "versions": {"kvtier": "0.1.0", "llama_cpp_python_pin": "0.3.36", "python": "3.11"},
        "seconds": {"memory": 60.0},
        "scenarios": {
            "memory": [memory, {**memory, "kv": "q8_0", "whole_bytes": 306_000_000, "redis_key_bytes": 110_000_000}],
            "turns": {"workload": asdict(wl), "probe_turns": [1, 10, 20, 30],
                      "modes": {"direct-rr": mode("direct-rr", 300, 0), "kvtier": mode("kvtier", 150, 256),
                                "direct-rolling": mode("direct-rolling", 2000, 0),
                                "kvtier-rolling": mode("kvtier-rolling", 150, 2048)}},
            "move": [hop.summarize_move(4096, _reply(23_000.0, 4096, 4096), move_runs,
                                        [_reply(150.0, 4105, 8).row() for _ in range(3)])],
            "move_fa_off": [{**hop.summarize_move(4096, _reply(31_000.0, 4096, 4096), move_runs,
                                                  [_reply(90.0, 4105, 8).row() for _ in range(3)]),
                             "llama_extra": ["-fa", "off"]}],
            "multiuser": {"workload": asdict(hop.Workload()),
                          "modes": {m: mode(m, 300, 0) for m in ("direct-rr", "direct-sticky", "cache-ram", "kvtier")}},
            "short": {"lengths": [64], "reps": 2, "chunks": [256, 64], "table": short_rows, "worst_ratio": 1.02,
                      "target_within_5pct": True},
        },
    }


def test_claims_put_measured_rows_next_to_the_write_up() -> None:
    rows = report.claims(fixed_report())
    names = [r["scenario"] for r in rows]
    assert names[0] == "memory for 10 concurrent sessions" and rows[0]["gain"] == "-64.4%"
    assert any("turn 30 (rolling update)" in n for n in names)
    move, fa_off = rows[-2:]
    assert move["without"] == "23,000 ms" and move["with"] == "261 ms"
    assert fa_off["scenario"].endswith("(llama-server -fa off)") and fa_off["without"] == "31,000 ms"


def test_render_markdown_from_a_fixed_report(tmp_path: Path) -> None:
    data = fixed_report()
    data["reruns"] = [{"scenarios": ["move"], "started": "2026-01-02T00:00:00", "minutes": 3.0,
                       "machine": {"load_avg": [0.5, 0.4, 0.3]}}]
    images = report.render_plots(data, tmp_path / "img")  # {} when matplotlib is not installed
    md = report.render_markdown(data, {}, images, tmp_path)
    assert "minutes; move re-run on 2026-01-02T00:00:00 (3.0 minutes, load average 0.5 / 0.4 / 0.3))" in md
    for heading in ("## The write-up's claims, measured", "## 1. Memory for 10 concurrent sessions",
                    "## 2. Generation speed at turn 30", "## 3. Moving a session", "## 4. Multi-user",
                    "## 5. When not to restore", "## Other benchmarks", "## GPU"):
        assert heading in md
    assert "Not measured" in md and "None" not in md and "nan" not in md
    assert "| 4,096 | 94.0 MB | 23,000 |" in md  # the move table, from the summarised runs
    assert "restore within 1.3x of the floor **met**" in md  # 201 ms vs a 170 ms floor: 1.18
    assert "| 900 | 150 | 111 | 88.1x |" in md  # automatic, warm TTFT, hop - warm (261 - 150), speedup
    assert "| 4,096 | Redis | 110 | 2 | 50.0 | 7 | 30.0 |" in md  # restore phases
    assert "| 4,096 | prewarmed RAM | 5 | 2 | 45.0 | 1 | 28.0 |" in md
    assert "| 4,096 | 241 / 242 | 80.0 |" in md  # prewarmed hop TTFT p50 / p90, restore
    assert "(prewarmed: **met**)" in md
    # The -fa off run beside the default one: recompute, warm, hop TTFTs, and the default's.
    assert "started with `-fa off`" in md
    assert "| 4,096 | 31,000 | 23,000 | 90.0 | 150 | 261 / 262 | 900 | 241 | 261 | 1.18 | 2 | **met** |" in md
    for path in images.values():
        assert Path(path).stat().st_size > 1000
        assert f"]({Path(path).relative_to(tmp_path).as_posix()})" in md


ROOT = Path(__file__).resolve().parent.parent


def test_python_m_bench_runs_the_named_benchmark_and_times_it(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[list[str]] = []
    monkeypatch.setitem(BENCHMARKS, "report", lambda argv: seen.append(argv) or 3)
    assert bench_main(["report", "--quick"]) == 3
    assert seen == [["--quick"]]
    assert "(bench report: " in capsys.readouterr().err
    assert bench_main(["nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_python_m_bench_from_the_checkout() -> None:
    usage = subprocess.run([sys.executable, "-m", "bench"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           check=False)
    assert usage.returncode == 2
    assert "tiers, state, hop, overhead, llama-cpp-python, report" in usage.stdout
    state = subprocess.run([sys.executable, "-m", "bench", "state", "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, check=False)
    assert state.returncode == 0 and state.stdout.startswith("usage: python -m bench state"), state.stderr


def test_neverworse_rows_and_their_section() -> None:
    runs = {"repeat_at_once": [{"repeat_ttft_ms": 40.0, "repeat_computed": 1}, {"repeat_ttft_ms": 60.0,
                                                                              "repeat_computed": 3}],
            "abort_reprompt": [{"where": w, "reused_share": 0.99, "prefix_tokens": 1500, "reused_tokens": 1490}
                               for w in ("same node", "other node")],
            "sibling_at_once": [{"sibling_ttft_ms": t, "sibling_computed": 12} for t in (300.0, 500.0, 400.0)],
            "other_at_once": [{"other_ttft_ms": 200.0, "other_computed": 90, "return_ttft_ms": 700.0,
                               "return_computed": 40}],
            "beside_save": [{"other_ttft_ms": t, "other_total_ms": t + 700, "other_computed": 476}
                            for t in (1500.0, 1600.0, 1400.0)],
            "due_together": [{"other_ttft_ms": t, "other_total_ms": t + 500, "other_computed": 470}
                             for t in (800.0, 900.0)],
            "agent_subagents": [{"finalize_ratio": 0.1, "finalize_ttft_ms": 900.0, "finalize_computed": 20}]}
    sidecars = [{"kvtier_server_checks_seconds_count": n, "kvtier_server_checks_seconds_sum": n * 0.5}
                for n in (1.0, 2.0)]
    rows = neverworse.summarize({"quiet/alone": runs, "loaded/kvtier-cache-ram-0": {**runs, "sidecars": sidecars}})
    assert ["quiet", "repeat_at_once", "alone", "repeat TTFT ms (p50)", 50.0, 2.0] in rows
    assert ["loaded", "all", "kvtier-cache-ram-0", "identity checks requests waited for: count; ms in all",
            "3; 1,500", None] in rows
    assert ["loaded", "abort_reprompt (other node)", "kvtier-cache-ram-0", "prefix reused (p50)", 0.99, 10] in rows
    assert ["quiet", "sibling_at_once", "alone", "sibling TTFT ms (p50)", 400.0, 12] in rows
    assert ["quiet", "other_at_once", "alone", "second turn's return TTFT ms (p50)", 700.0, 40] in rows
    assert ["quiet", "beside_save", "alone", "new conversation beside a save: TTFT ms (p50)", 1500.0, 476] in rows
    assert ["quiet", "beside_save", "alone", "the same: whole 32-token answer ms (p50)", 2200.0, 476] in rows
    assert ["quiet", "due_together", "alone", "new conversation beside two saves due: TTFT ms (p50)", 850.0,
            470] in rows
    settings = {"slots": 4, "ctx": 16384, "threads": 2, "reps": 2, "prefix": 1500, "abort_after": 64,
                "main_tokens": 2000, "sub_tokens": 1500}
    table = [dict(zip(["load", "scenario", "mode", "figure", "value", "computed"], r, strict=True)) for r in rows]
    md = neverworse.md_neverworse({"settings": settings, "table": table, "minutes": 3.0}, report.md_table)
    assert "| quiet | agent_subagents | alone | finalize / last main step TTFT (p50) | 0.1 | 20.0 |" in md
    assert "| quiet | agent_subagents | alone | finalize TTFT ms (p50) | 900 | 20.0 |" in md
    assert "1 round(s) of three agents" in md  # a result file from before --agent-rounds
    assert "`-np 4 -c 16384 -t 2`" in md
    assert "SmolLM2, 2 nodes" in md  # no --model given
    assert ", one mode after another;" in md  # a result file from before the modes took turns
    assert "x alone" not in md  # no mode ran alone in the load of kvtier-cache-ram-0
    md = neverworse.md_neverworse({"settings": {**settings, "model": "/models/kvtier-random-l32.gguf", "block": 2},
                                   "table": table}, report.md_table)
    assert "kvtier-random-l32.gguf, 2 nodes" in md
    assert "taking turns in blocks of 2 reps" in md


def test_neverworse_compares_each_mode_with_alone_in_the_same_load() -> None:
    rows = [["quiet", "repeat_at_once", "alone", "repeat TTFT ms (p50)", 20.0, 1],
            ["quiet", "repeat_at_once", "kvtier", "repeat TTFT ms (p50)", 23.0, 1],
            ["loaded", "repeat_at_once", "alone", "repeat TTFT ms (p50)", 100.0, 1],
            ["loaded", "repeat_at_once", "kvtier", "repeat TTFT ms (p50)", 90.0, 1],
            ["quiet", "abort_reprompt (other node)", "alone", "prefix reused (p50)", 0, 1366],
            ["quiet", "abort_reprompt (other node)", "kvtier", "prefix reused (p50)", 0.99, 8],
            ["quiet", "all", "kvtier", "identity checks requests waited for: count; ms in all", "0; 0", None]]
    assert neverworse.versus_alone(rows) == [["quiet", "repeat_at_once", "kvtier", "repeat TTFT ms (p50)", 1.15],
                                             ["loaded", "repeat_at_once", "kvtier", "repeat TTFT ms (p50)", 0.9]]


def test_neverworse_bounds_say_when_the_reps_cannot_tell_the_goal() -> None:
    def reps(*ms: float) -> list[dict[str, float]]:
        return [{"repeat_ttft_ms": x} for x in ms]

    steady = reps(*(20.0 + i % 3 for i in range(24)))  # 20-22 ms
    results = {"quiet/alone": {"repeat_at_once": steady},
               "quiet/kvtier": {"repeat_at_once": reps(*(20.5 + i % 3 for i in range(24)))},
               "loaded/alone": {"repeat_at_once": reps(*(100.0 + 37 * i % 800 for i in range(24)))},
               "loaded/kvtier": {"repeat_at_once": reps(*(110.0 + 41 * i % 800 for i in range(24)))},
               "quiet/kvtier-cache-ram-0": {"repeat_at_once": reps(*(30.0 + i % 3 for i in range(24)))}}
    rows = {(r[0], r[2]): r for r in neverworse.bounds(results)}
    assert set(rows) == {("quiet", "kvtier"), ("loaded", "kvtier"), ("quiet", "kvtier-cache-ram-0")}
    quiet = rows["quiet", "kvtier"]
    assert quiet[:6] == ["quiet", "repeat_at_once", "kvtier", "repeat TTFT ms", "24 / 24", 1.02]
    lo, hi = map(float, quiet[6].split("-"))
    assert lo <= 1.02 <= hi <= 1.1 and quiet[7] == "within 1.1x"
    assert rows["quiet", "kvtier-cache-ram-0"][7] == "over 1.1x"  # ~31 over ~21 ms, narrow on both sides
    lo, hi = map(float, rows["loaded", "kvtier"][6].split("-"))
    assert lo < 1.1 < hi and rows["loaded", "kvtier"][7] == "cannot tell 1.1x"  # 0.1-0.9 s on both sides
    assert neverworse.bounds(results) == neverworse.bounds(results)  # a fixed seed: one file, one interval


def test_neverworse_repeats_of_one_rep_are_resampled_together() -> None:
    """Repeats sent one after another share their rep's moment of the machine: four repeats of the
    same figure a rep give the interval of one a rep, not a narrower one."""
    alone = [100.0 + 37 * i % 800 for i in range(12)]
    mode = [110.0 + 41 * i % 800 for i in range(12)]

    def results(repeats: int) -> dict[str, dict[str, Any]]:
        def rows(ms: list[float]) -> list[dict[str, Any]]:
            return [{"rep": r, "nth": n + 1, "repeat_ttft_ms": x} for r, x in enumerate(ms) for n in range(repeats)]
        return {"loaded/alone": {"repeat_at_once": rows(alone)}, "loaded/kvtier": {"repeat_at_once": rows(mode)}}

    once, four = neverworse.bounds(results(1)), neverworse.bounds(results(4))
    assert four[0][4] == "48 / 48" and once[0][4] == "12 / 12"
    assert four[0][5:] == once[0][5:]  # the same p50 ratio, interval and verdict
    assert neverworse.by_rep([{"rep": 0, "f": 1.0}, {"rep": 1, "f": 2.0}, {"rep": 0, "f": 3.0}], "f") == [[1.0, 3.0], [2.0]]
    assert neverworse.by_rep([{"f": 1.0}, {"f": 2.0}], "f") == [[1.0], [2.0]]  # an agent's rows stand alone


def test_chatsteps_rows_leave_the_first_step_out_and_compare_with_alone() -> None:
    def steps(*ms: float) -> list[dict[str, Any]]:
        return [{"step": i + 1, "ttft_ms": x, "computed": 40 + i, "prompt_tokens": 3000} for i, x in enumerate(ms)]

    results = {"alone": {"steps": steps(9000, 800, 1000, 900)},
               "kvtier": {"steps": steps(9500, 700, 4000, 900), "kvtier": {"saves_made": 2.0, "saves_skipped": 2.0,
                                                                         "follow_ups": 3.0}}}
    alone, kvtier = chatsteps.table(results)
    assert alone == ["alone", 900, 1000, 1.0, 42, "800 / 1000 / 900", "-"]
    assert kvtier == ["kvtier", 900, 4000, 1.0, 42, "700 / 4000 / 900", "2 / 2 / 3"]


def test_stage_medians_and_the_overhead_verdict() -> None:
    records = [  # a full path and a follow-up (no prompt, no prepare), ms since the bytes arrived
        {"in": 0, "handler": 0.3, "parse": 0.5, "follow_up": 0.55, "prompt": 0.7, "prepare": 0.9, "sent": 1.0,
         "head": 60.0, "answer": 60.3, "save": 60.35, "written": 60.6},
        {"in": 0, "handler": 0.2, "parse": 0.4, "follow_up": 0.5, "sent": 0.6,
         "head": 50.0, "answer": 50.2, "save": 50.25, "written": 50.4},
    ]
    m = stages.medians(records)
    assert m["prompt tokens"] == 0.15  # the follow-up has none: the full path's alone
    assert m["request written to llama-server"] == 0.1  # from prepare, or from the follow-up check
    assert m["before forwarding (total)"] == 0.8
    assert m["after the answer (total)"] == 0.5
    assert stages.medians([])["parse (body, shape, JSON, ready)"] is None
    kind = {"added_outside_compute_ms_p50": 1.2}
    assert overhead._verdict({**kind, "target_ms": 1.0}) == "NOT met (< 1 ms)"
    assert overhead._verdict(kind) == "met (< 2 ms)"  # a run from before the target was 1 ms
    wake = overhead.wake_cost(samples=2, idle_ms=(1, 5))  # the host's figures, reported with each run
    assert list(wake) == ["hot", "after_1ms_idle", "after_5ms_idle"] and all(v > 0 for v in wake.values())


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="schedstat is Linux's")
def test_overhead_reads_the_cpu_a_process_spends_on_a_request() -> None:
    """The main thread's CPU time: work on it moves it by about that much, sleeping does not, a
    process that is gone gives None; the table compares kvtier with both relays per kind."""
    pid = os.getpid()  # pytest's main thread is this process's
    start, ran = overhead.main_thread_cpu_us(pid), time.thread_time()
    assert start is not None
    while time.thread_time() - ran < 0.05:  # 50 ms of this thread's CPU, however busy the machine
        pass
    busy, ran = overhead.main_thread_cpu_us(pid), time.thread_time() - ran
    time.sleep(0.05)
    idle = overhead.main_thread_cpu_us(pid)
    assert busy is not None and idle is not None
    assert busy - start == pytest.approx(ran * 1e6, rel=0.2) and idle - busy < 5_000
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    assert overhead.main_thread_cpu_us(int(done.stdout)) is None and overhead.main_thread_cpu_us(None) is None
    res = {"kinds": {"tokens": {"cpu_us": {"sidecar": {"p50": 1500.0}, "web": {"p50": 800.0}, "relay": {"p50": 300.0}}},
                     "chat": {"cpu_us": {"sidecar": {"p50": 900.0}}},
                     "old": {}}}  # a result file from before the figure
    assert overhead.cpu_rows(res) == [["tokens", 1500.0, 800.0, 300.0, 700.0, 1200.0], ["chat", 900.0, None, None, None, None]]


def test_datapath_rates_each_path_against_the_floor_the_issue_names() -> None:
    """The save to Redis against llama-server's save plus the fastest raw SET, the other node's
    restore against the fastest raw GET plus llama-server's load, the same node's against the load."""
    run = json.loads((Path(__file__).parent.parent / "bench/results/datapath-save-over-2026-12-03.json").read_text())
    res = run["results"][0]
    rows = {r[1]: r for r in datapath.size_rows(res, run["settings"]["conns"])}
    floors = [x["floor"] for x in res["alone"]]
    save_floor = statistics.median(f["save_ms"] + min(r["set_ms"] for r in f["redis"]) for f in floors)
    redis_floor = statistics.median(f["restore_ms"] + min(r["get_ms"] for r in f["redis"]) for f in floors)
    load = statistics.median(f["restore_ms"] for f in floors)
    assert rows["floor: to Redis (llama-server save + fastest SET)"][2] == pytest.approx(save_floor, abs=1e-3)
    saved = rows["kvtier save: answer end -> Redis holds"]
    assert saved[4] == round(100 * save_floor / saved[2], 1)
    other, same = rows["kvtier restore, other node (redis)"], rows["kvtier restore, same node (memory)"]
    assert other[4] == round(100 * redis_floor / other[2], 1) and same[4] == round(100 * load / same[2], 1)


def test_datapath_runs_name_a_kv_shape_and_a_size() -> None:
    """``--sizes`` entries are ``[SHAPE:]TOKENS``; each shape's KV bytes per token are the issue's
    (8B 128 KiB, 70B 320 KiB, SmolLM2 22.5 KiB); an unknown shape is refused by name."""
    assert datapath.parse_runs("4000, 70b:2000,smollm2:4000") == [("8b", 4000), ("70b", 2000), ("smollm2", 4000)]
    assert [datapath.kv_per_token(s) for s in ("8b", "70b", "smollm2")] == [128 << 10, 320 << 10, 23040]
    assert datapath.model_name("70b") == "kvtier-random-l80-e256-h8-kv8x128-ff512.gguf"
    with pytest.raises(SystemExit, match="unknown shape '13b'"):
        datapath.parse_runs("13b:1000")


def test_datapath_next_turn_rows_compare_alone_and_kvtier() -> None:
    """The next turn's TTFT through kvtier (its save in flight) is rated against llama-server alone's."""
    al = [{"next_turn": {"ttft_ms": t, "prompt_n": 16}} for t in (100.0, 120.0, 110.0)]
    kv = [{"next_turn": {"ttft_ms": t, "prompt_n": 16, "saves_skipped": 0}} for t in (200.0, 220.0, 240.0)]
    alone, kvtier = datapath.next_turn_rows("8b 4,000", al, kv)
    assert alone[2] == 110.0 and kvtier[2] == 220.0
    assert kvtier[5].startswith("2.0x alone; computed 16; saves skipped 0/3")
    assert datapath.next_turn_rows("8b 4,000", al, []) == []  # runs from before the phase


def test_datapath_rates_kvtiers_gap_against_llama_servers_save_alone_and_beside_the_sidecars() -> None:
    """Per rep, kvtier's longest gap over llama-server's own save's: measured alone, and in kvtier's
    round past the sidecars (a row of its own); runs from before that round, and rounds whose other
    user started only after the save, show ``-``."""
    def gap(ms: float, b_first_ms: float = -900.0) -> dict[str, Any]:
        return {"max_gap_ms": ms, "p50_gap_ms": 20.0, "b_tps": 40.0, "covered": True, "save_s": 0.5,
                "b_times_ms": [b_first_ms, b_first_ms + 25.0]}
    al = [{"stall_llama": gap(500.0)}, {"stall_llama": gap(400.0)}, {"stall_llama": gap(400.0)}]
    kv = [{"stall_kvtier": gap(600.0), "stall_llama_beside": gap(750.0)}, {"stall_kvtier": gap(600.0)},
          {"stall_kvtier": gap(600.0), "stall_llama_beside": gap(900.0, b_first_ms=400.0)}]
    assert datapath.gap_ratios(al, kv) == "1.20x / 0.80x, 1.50x / -, 1.50x / -"
    # B's first token after A's end: that round's save came before B streamed; its gap is left out.
    assert not datapath.measured_save(gap(900.0, b_first_ms=400.0)) and datapath.measured_save(gap(1.0))
    assert datapath.measured_save({"max_gap_ms": 1.0})  # a run from before B's times were kept


def test_datapath_starts_the_other_user_at_a_progress_event_not_at_a_token() -> None:
    """A's prompt counts as computed at llama-server's last progress event (processed = total), which
    comes even when its tokens are held back; token events and earlier progress are not it."""
    def progress(processed: int, total: int = 4000) -> dict[str, Any]:
        return {"content": "", "stop": False, "prompt_progress": {"total": total, "cache": 0,
                                                                   "processed": processed, "time_ms": 1}}
    assert datapath.prompt_computed(progress(4000)) is True
    assert datapath.prompt_computed(progress(0)) is False and datapath.prompt_computed(progress(2048)) is False
    assert datapath.prompt_computed(progress(0, total=0)) is False
    assert datapath.prompt_computed({"content": "a", "stop": False}) is None


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_datapath_rss_peaks_tell_private_memory_from_mapped_files(tmp_path: Path) -> None:
    """A private buffer raises the private peak; a mapped file's pages raise the mapped one."""
    import mmap
    import os
    import time

    import numpy as np

    mib = 1 << 20
    path = tmp_path / "mapped.bin"
    path.write_bytes(b"\1" * (64 * mib))
    with datapath.RssPeaks({"me": os.getpid()}, every=0.005) as peaks:
        time.sleep(0.05)
        before = dict(peaks.anon), dict(peaks.mapped)
        # Anonymous pages of their own: a numpy buffer may reuse heap pages freed and still resident
        # (kvtier's malloc settings keep them, once an earlier test imported the sidecar), and not raise RSS.
        with mmap.mmap(-1, 96 * mib, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as private:
            np.frombuffer(private, np.uint8)[:] = 1
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                assert sum(m[i] for i in range(0, len(m), 4096)) == 64 * mib // 4096  # every page touched
                time.sleep(0.05)
    assert peaks.anon["me"] >= before[0]["me"] + 90
    assert peaks.mapped["me"] >= before[1]["me"] + 60
