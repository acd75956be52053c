"""Benchmark of the sequence-state codec: split/assemble throughput and real save/restore/recompute.

    python -m bench state --json out.json                      # synthetic 1k/4k/8k + real 1k
    python -m bench state --real-tokens 1024,4096 --json out.json
    python -m bench state --no-real                            # no llama-server needed

Synthetic states have SmolLM2-135M's real shape (30 layers, n_embd_k_gqa = n_embd_v_gqa = 192, f16
K/V: 23,040 bytes per token) filled with random bytes; they measure parse, split into 256-token
chunks, assemble in the same V layout, and assemble across V layouts (transposing V). The real part
runs llama-server with SmolLM2 and measures, per prompt length, the server's save, the codec on
the saved file, a restore of the assembled file and a full recompute of the same prompt, side by
side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from integrations.chunkassemble import assemble_state, restore_size, state_pieces, write_pieces
from integrations.chunksplit import split_state
from integrations.memkind import MemoryKind
from integrations.statefile import KVCache, KVLayer, KVStream, SeqState, TokenSection
from integrations.stateparse import parse_state
from integrations.statewrite import write_state

N_LAYER, N_EMBD_GQA, F16 = 30, 192, 1  # SmolLM2-135M: 3 KV heads x 64
CHUNK_TOKENS = 256


def synthetic_state(n_tokens: int, v_trans: bool, seed: int = 0) -> bytes:
    """A SmolLM2-shaped f16 state of random bytes, one sequence at positions 0..n-1."""
    rng = np.random.default_rng(seed)
    row = 2 * N_EMBD_GQA
    blob = np.frombuffer(rng.bytes(2 * N_LAYER * n_tokens * row), np.uint8)
    layers = []
    for il in range(N_LAYER):
        k = blob[(2 * il) * n_tokens * row : (2 * il + 1) * n_tokens * row].reshape(n_tokens, row)
        v = blob[(2 * il + 1) * n_tokens * row : (2 * il + 2) * n_tokens * row]
        if v_trans:
            layers.append(KVLayer(F16, row, k, F16, row, 2, N_EMBD_GQA, v.reshape(N_EMBD_GQA, 2 * n_tokens)))
        else:
            layers.append(KVLayer(F16, row, k, F16, row, 0, 0, v.reshape(n_tokens, row)))
    zeros = np.zeros(n_tokens, "<i4")
    stream = KVStream(n_tokens, np.arange(n_tokens, dtype="<i4"), np.ones(n_tokens, "<u4"), zeros, None, v_trans,
                      tuple(layers))
    tokens = TokenSection.plain(rng.integers(0, 49152, n_tokens))
    state = SeqState(3, tokens, MemoryKind.KV, (KVCache((stream,)),), False, memoryview(b""), 0)
    return bytes(write_state(state))


def timed(fn: Callable[[], Any], repeat: int) -> tuple[list[float], Any]:
    times, out = [], None
    for _ in range(repeat):
        out = None  # let the previous result go before timing the next call
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return times, out


def codec_figures(data: bytes, repeat: int) -> dict[str, Any]:
    """Parse, split and assemble (same and other V layout) of one state file's bytes."""
    gb = len(data) / 1e9
    t_parse, state = timed(lambda: parse_state(data), repeat)
    t_split, split = timed(lambda: split_state(state, CHUNK_TOKENS, tail=True), repeat)
    parts = [*split.chunks, *([split.tail] if split.tail is not None else [])]
    same = bool(state.v_trans)
    t_same, out = timed(lambda: assemble_state(parts, split.tokens, v_trans=same), repeat)
    reuse = np.empty(restore_size(parts), np.uint8)
    t_reuse, _ = timed(lambda: assemble_state(parts, split.tokens, v_trans=same, out=reuse), repeat)
    t_other, _ = timed(lambda: assemble_state(parts, split.tokens, v_trans=not same), max(2, repeat // 2))
    if state.tokens.format == "plain":
        assert bytes(out) == data, "split + assemble must reproduce the file"

    def rate(ts: list[float]) -> dict[str, float]:
        return {"median_gbps": round(gb / statistics.median(ts), 2), "best_gbps": round(gb / min(ts), 2),
                "median_ms": round(1e3 * statistics.median(ts), 2)}

    return {"bytes": len(data), "n_tokens": state.n_tokens, "v_trans": same, "chunks": len(parts),
            "parse_ms": round(1e3 * statistics.median(t_parse), 3), "split": rate(t_split),
            "assemble": rate(t_same), "assemble_into_reused_buffer": rate(t_reuse),
            "assemble_transposing": rate(t_other)}


# -- real llama-server ----------------------------------------------------------------------------


def _post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as r:
        out = json.loads(r.read())
    return out, 1e3 * (time.perf_counter() - t)


def _prompt_tokens(url: str, n: int) -> list[int]:
    text = " ".join(f"Note {i}: shipment {i * 37 % 101} of {['bolts', 'nuts', 'gears', 'belts'][i % 4]} arrived "
                    f"at dock {i % 9} on day {i % 28 + 1}." for i in range(n // 8 + 16))
    toks, _ = _post(url + "/tokenize", {"content": text})
    out: list[int] = toks["tokens"][:n]
    if len(out) < n:
        raise RuntimeError(f"prompt text gave {len(out)} tokens, need {n}")
    return out


def real_figures(lengths: list[int], repeat: int) -> list[dict[str, Any]]:
    import tempfile

    from launch import LlamaServer, smollm2_path

    from .common import DEFAULT_WORKDIR

    ctx = max(lengths) + 64
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir=DEFAULT_WORKDIR) as d:
        srv = LlamaServer(smollm2_path(), ["-c", str(ctx), "-np", "1", "-fa", "on", "-b", "2048", "-ub", "512",
                                           "--cache-ram", "0"], Path(d) / "state-slots")
        srv.start()
        try:
            rows = _real_rows(srv.url, srv.slot_dir, lengths, repeat)
        finally:
            srv.stop()
    return rows


def _real_rows(url: str, slot_dir: Path, lengths: list[int], repeat: int) -> list[dict[str, Any]]:
    rows = []
    # Warm-up: the first completion of a fresh server also pages the weights in.
    _post(url + "/completion", {"prompt": _prompt_tokens(url, 64), "n_predict": 1, "id_slot": 0})
    for n in lengths:
        prompt = _prompt_tokens(url, n)
        body = {"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": True, "id_slot": 0}
        _post(url + "/slots/0?action=erase", {})
        run, recompute_wall = _post(url + "/completion", body)
        saved, save_wall = _post(url + "/slots/0?action=save", {"filename": "bench.bin"})
        data = (slot_dir / "bench.bin").read_bytes()
        codec = codec_figures(data, repeat)
        state = parse_state(data)
        split = split_state(state, CHUNK_TOKENS, tail=True)
        t = time.perf_counter()
        payloads = [*split.chunks, *([split.tail] if split.tail else [])]
        v_trans = bool(state.v_trans)  # as kvtier writes it: slices of the chunks unless V is transposed
        (slot_dir / "restore.bin").unlink(missing_ok=True)
        write_pieces(slot_dir / "restore.bin", state_pieces(payloads, split.tokens, v_trans=v_trans)
                     or [assemble_state(payloads, split.tokens, v_trans=v_trans)])
        write_ms = 1e3 * (time.perf_counter() - t)
        restores = []
        for _ in range(repeat):
            _post(url + "/slots/0?action=erase", {})
            res, wall = _post(url + "/slots/0?action=restore", {"filename": "restore.bin"})
            restores.append((res["timings"]["restore_ms"], wall))
        after, _ = _post(url + "/completion", body)
        assert after["timings"]["prompt_n"] == 1, after["timings"]  # only the last token is recomputed
        rows.append({
            "n_tokens": n, "file_bytes": len(data),
            "save_ms": saved["timings"]["save_ms"], "save_wall_ms": round(save_wall, 1),
            "split_gbps": codec["split"]["median_gbps"], "assemble_gbps": codec["assemble"]["median_gbps"],
            "assemble_and_write_ms": round(write_ms, 1),
            "restore_ms": round(statistics.median(r[0] for r in restores), 1),
            "restore_wall_ms": round(statistics.median(r[1] for r in restores), 1),
            "recompute_ms": round(run["timings"]["prompt_ms"], 1), "recompute_wall_ms": round(recompute_wall, 1),
            "prefill_tokens_per_s": round(run["timings"]["prompt_per_second"], 1),
        })
    return rows


# -- report ---------------------------------------------------------------------------------------


def _gbps(r: dict[str, float]) -> str:
    return f"{r['median_gbps']} ({r['best_gbps']})"


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers, *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench state", description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--sizes", default="1024,4096,8192", help="synthetic state sizes in tokens")
    ap.add_argument("--real-tokens", default="1024", help="prompt lengths for the llama-server part")
    ap.add_argument("--no-real", action="store_true", help="skip the llama-server part")
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args(argv)

    synthetic = []
    for n in (int(x) for x in a.sizes.split(",") if x):
        for v_trans in (False, True):
            synthetic.append(codec_figures(synthetic_state(n, v_trans), a.repeat))
    print(f"synthetic SmolLM2-shaped states (f16, {N_LAYER} layers, {CHUNK_TOKENS}-token chunks); "
          f"GB/s median (best) of {a.repeat}")
    print(_table(
        ["tokens", "MB", "V", "parse ms", "split GB/s", "assemble GB/s", "assemble reused-buffer GB/s",
         "assemble+transpose GB/s"],
        [[r["n_tokens"], f"{r['bytes'] / 1e6:.1f}", "transposed" if r["v_trans"] else "rows", r["parse_ms"],
          _gbps(r["split"]), _gbps(r["assemble"]), _gbps(r["assemble_into_reused_buffer"]),
          _gbps(r["assemble_transposing"])] for r in synthetic]))

    real: list[dict[str, Any]] = []
    if not a.no_real:
        real = real_figures([int(x) for x in a.real_tokens.split(",") if x], max(3, a.repeat // 2))
        print("\nreal llama-server, SmolLM2-135M Q4_1, -fa on, f16 KV (server ms; wall ms incl. HTTP)")
        print(_table(
            ["tokens", "MB", "save ms", "split GB/s", "assemble GB/s", "assemble+write ms", "restore ms",
             "restore wall ms", "recompute ms", "prefill tok/s"],
            [[r["n_tokens"], f"{r['file_bytes'] / 1e6:.1f}", r["save_ms"], r["split_gbps"], r["assemble_gbps"],
              r["assemble_and_write_ms"], r["restore_ms"], r["restore_wall_ms"], r["recompute_ms"], r["prefill_tokens_per_s"]]
             for r in real]))

    if a.json:
        report = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__},
                  "chunk_tokens": CHUNK_TOKENS, "synthetic": synthetic, "real": real}
        Path(a.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
