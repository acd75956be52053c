"""`kvtier demo` (what `make demo` runs), on a short document: both modes, every process started,
restarted and stopped by the demo itself, and the JSON the issue specifies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.demo import main

pytestmark = pytest.mark.llama


def test_the_rolling_update_demo_runs_and_reports_each_turn(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    assert main(["--turns", "3", "--paragraphs", "6", "--max-tokens", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    turns = report["turns"]
    assert [(t["mode"], t["node"]) for t in turns] == [
        (mode, node) for mode in ("sidecar", "direct") for node in ("A", "B", "A")]
    for t in turns:
        assert {"node", "prompt_tokens", "restored_tokens", "recomputed_tokens", "ttft_ms", "mode"} <= t.keys()
        assert t["ttft_ms"] > 0 and t["prompt_tokens"] > 300
    side = [t for t in turns if t["mode"] == "sidecar"]
    # Every turn after the first lands on a node that has just restarted: kvtier restores all but
    # the new turn (full chunks and the partial tail the other node saved); llama-server alone
    # recomputes everything.
    for t in side[1:]:
        assert t["restore_tier"] == "redis" and t["recomputed_tokens"] < 40, t
        assert t["restored_tokens"] + t["recomputed_tokens"] == t["prompt_tokens"], t
    assert all(t["restored_tokens"] == 0 and t["recomputed_tokens"] == t["prompt_tokens"]
               for t in turns if t["mode"] == "direct")
    summary = report["summary"]
    assert {"ttft_ms_sidecar_p50", "ttft_ms_direct_p50", "speedup", "identical_outputs"} <= summary.keys()
    assert summary["speedup"] > 0 and isinstance(summary["identical_outputs"], bool)
