"""Every memory layout the pinned llama-server writes into a slot file, read from real servers.

One generated model per layout (``tests/ggufgen.py``): llama (one KV cache), gemma3 with a sliding
window (two KV caches, ``llama_kv_cache_iswa``), lfm2 (hybrid: a KV cache for its attention
layers, then the recurrent state of its short convolutions) and mamba2 (recurrent only). Each
server starts once, runs a short completion on slot 0 and saves the slot, empty and full. The
files must parse as their layout, write back byte for byte, be described part by part by
``kvtier state inspect``, and fail with a clear ``StateFormatError`` when truncated or damaged.
Layouts the parser does not know, built from these real parts, must stay opaque.
"""

from __future__ import annotations

import json
import re
import struct
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from integrations.fingerprint import inspect_main
from integrations.statefile import SeqState
from integrations.stateparse import parse_state
from integrations.statewrite import write_state
from tests.ggufgen import ModelShape, write_random_model
from tests.servers import llama_server, smollm2_path
from tiers.errors import StateFormatError

pytestmark = pytest.mark.llama

N_PREDICT = 8
PROMPT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 5
WINDOW = 32  # gemma3's sliding window, in tokens
SHAPES = {
    "llama": ModelShape(),
    "gemma3": ModelShape(sliding_window=WINDOW, swa_pattern=2),  # layers 0, 2 sliding, 1, 3 full
    "lfm2": ModelShape(attn_layers=(1, 3), conv_kernel=4),  # layers 0, 2 short convolutions
    "mamba2": ModelShape(conv_kernel=4, ssm_state=16),
}
KIND = {"llama": "kv", "gemma3": "kv_pair", "lfm2": "hybrid", "mamba2": "recurrent"}
F32 = 0


@dataclass(frozen=True, slots=True)
class Saved:
    arch: str
    shape: ModelShape
    empty: bytes  # slot 0 before any request
    full: bytes  # slot 0 after the completion
    n_tokens: int  # what the completion evaluated: prompt and all generated tokens but the last
    one: bytes  # slot 0 holding one token (a one-token prompt answered with one token)


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


@pytest.fixture(scope="module", params=list(SHAPES))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Saved]:
    """One model's slot files. Module-scoped and parametrized: pytest runs the tests model by model,
    so each server starts once and stops before the next one starts (2-core machines)."""
    arch: str = request.param
    tmp = tmp_path_factory.mktemp(arch)
    model = write_random_model(tmp / f"{arch}.gguf", smollm2_path(), SHAPES[arch], arch=arch, seed=11)
    with llama_server(tmp, "-c", "1024", "-fa", "on", model=str(model)) as srv:
        def save(name: str) -> bytes:
            res = post(srv.url + "/slots/0?action=save", {"filename": name})
            data = (srv.slot_dir / name).read_bytes()
            assert res["n_written"] == len(data)
            return data

        empty = save("empty.bin")
        run = post(srv.url + "/completion", {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0,
                                             "cache_prompt": True, "id_slot": 0})
        assert run["timings"]["predicted_n"] == N_PREDICT
        full = save("full.bin")
        post(srv.url + "/slots/0?action=erase", {})
        post(srv.url + "/completion", {"prompt": [1000], "n_predict": 1, "cache_prompt": True, "id_slot": 0})
        yield Saved(arch, SHAPES[arch], empty, full, run["timings"]["prompt_n"] + N_PREDICT - 1, save("one.bin"))


def recurrent_start(raw: bytes, st: SeqState) -> int:
    assert st.recurrent is not None
    return len(raw) - st.recurrent.nbytes  # the recurrent state ends the file


def patched(raw: bytes, offset: int, fmt: str, value: int) -> bytes:
    b = bytearray(raw)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


# -- the layouts ----------------------------------------------------------------------------------


def test_parses_as_its_layout_and_writes_back_byte_for_byte(saved: Saved) -> None:
    for raw in (saved.empty, saved.full, saved.one):
        st = parse_state(raw)
        assert st.memory_kind == KIND[saved.arch]
        assert bytes(write_state(st)) == raw
    assert parse_state(saved.one).n_tokens == 1
    st = parse_state(saved.full)
    assert st.n_tokens == saved.n_tokens
    assert st.splittable == (saved.arch == "llama"), st.split_reason


def test_kv_caches_hold_what_the_model_attends_to(saved: Saved) -> None:
    st = parse_state(saved.full)
    n, shape = saved.n_tokens, saved.shape
    cells = [[s.n_cells for s in c.streams] for c in st.caches]
    kv_row = 2 * shape.n_embd_k_gqa  # f16 K (and V) bytes per layer and cell
    if saved.arch == "llama":
        assert cells == [[n]] and st.layout is not None and st.layout.bytes_per_token == shape.n_layer * 2 * kv_row
    elif saved.arch == "gemma3":
        # The full-attention layers keep every cell; the sliding-window layers' cache keeps the window.
        base, swa = (c.streams[0] for c in st.caches)
        assert base.pos.tolist() == list(range(n)) and len(base.layers) == 2
        assert swa.pos.tolist() == list(range(n - WINDOW, n)) and len(swa.layers) == 2
        assert {la.k_row_size for la in base.layers + swa.layers} == {kv_row}
        assert "two KV caches" in (st.split_reason or "")
    elif saved.arch == "lfm2":
        (kv,) = st.caches[0].streams
        assert kv.pos.tolist() == list(range(n)) and len(kv.layers) == len(shape.attn_layers)
        assert st.layout is None  # the recurrent half has no per-token layout
    else:
        assert st.caches == () and st.n_stream is None and st.layout is None


def test_recurrent_rows(saved: Saved) -> None:
    if saved.arch not in ("lfm2", "mamba2"):
        assert parse_state(saved.full).recurrent is None
        return
    shape = saved.shape
    if saved.arch == "lfm2":  # r: the last l_cache - 1 inputs of each channel; no S state
        n_rec, r_row, s_row = shape.n_layer - len(shape.attn_layers), shape.n_embd * (shape.conv_kernel - 1) * 4, 0
    else:  # r: conv inputs of x, B, C (d_inner = 2 n_embd, one group); s: d_state x d_inner
        d_inner = 2 * shape.n_embd
        n_rec = shape.n_layer
        r_row = (shape.conv_kernel - 1) * (d_inner + 2 * shape.ssm_state) * 4
        s_row = shape.ssm_state * d_inner * 4
    for raw, n_cells in ((saved.empty, 0), (saved.full, 1)):
        rec = parse_state(raw).recurrent
        assert rec is not None and rec.n_cells == n_cells and rec.n_layer == shape.n_layer
        assert len(rec.layers) == n_rec
        for la in rec.layers:
            assert (la.r_type, la.r_row_size, la.r.shape) == (F32, r_row, (n_cells, r_row))
            assert (la.s_type, la.s_row_size, la.s.shape) == (F32, s_row, (n_cells, s_row))
    rec = parse_state(saved.full).recurrent
    assert rec is not None
    # One cell for slot 0's sequence, at its last position; a one-sequence save writes no seq ids.
    assert rec.pos.tolist() == [saved.n_tokens - 1] and rec.n_seq_id.tolist() == [0] and rec.seq_ids.size == 0
    assert any(la.r.any() for la in rec.layers)  # the convolutions saw the prompt
    reason = parse_state(saved.full).split_reason or ""
    assert f"{n_rec} of {shape.n_layer} layers, as of position {saved.n_tokens - 1}" in reason
    assert reason.startswith("hybrid memory" if saved.arch == "lfm2" else "recurrent memory")


def test_inspect_names_each_part(saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "slot.bin"
    path.write_bytes(saved.full)
    assert inspect_main([str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["memory_kind"] == KIND[saved.arch] and info["n_tokens"] == saved.n_tokens
    assert len(info["caches"]) == {"llama": 1, "gemma3": 2, "lfm2": 1, "mamba2": 0}[saved.arch]
    assert (info["recurrent"] is not None) == (saved.arch in ("lfm2", "mamba2"))
    stored_as = {"llama": "prefix chunks", "gemma3": "the first KV cache", "lfm2": "the first KV cache",
                 "mamba2": "one tail: every token"}[saved.arch]
    assert info["store_reason"] is None and info["stored_as"].startswith(stored_as)
    assert inspect_main([str(path)]) == 0
    table = capsys.readouterr().out
    n = saved.n_tokens
    if saved.arch == "gemma3":
        assert "KV cache 0  " in table and f"positions 0..{n - 1}" in table
        assert "KV cache 1  " in table and f"positions {n - WINDOW}..{n - 1}" in table
    elif saved.arch in ("llama", "lfm2"):
        assert "KV cache  " in table and f"positions 0..{n - 1}" in table
    if info["recurrent"] is not None:
        assert f"positions [{n - 1}]" in table and "R (conv) rows" in table and "S (SSM) rows" in table
        assert "recurrent layers" in table and "f32" in table
    assert "splittable" in table and ("no: " in table) == (saved.arch != "llama")
    assert re.search(rf"^kvtier stores +{stored_as}", table, re.MULTILINE), table


# -- damage ---------------------------------------------------------------------------------------


def test_truncated_files_raise(saved: Saved) -> None:
    raw = saved.full
    mem_start = 12 + 4 * struct.unpack_from("<I", raw, 8)[0]
    # Every cut in the first 256 bytes of the memory and the last 64, and one every 997 bytes between.
    cuts = sorted({*range(mem_start, min(len(raw), mem_start + 256)), *range(max(mem_start, len(raw) - 64), len(raw)),
                   *range(mem_start, len(raw), 997)})
    for cut in cuts:
        with pytest.raises(StateFormatError):
            parse_state(raw[:cut])
        st = parse_state(raw[:cut], allow_opaque=True)
        assert st.memory_kind == "opaque" and st.opaque_reason and not st.splittable
        assert bytes(write_state(st)) == raw[:cut]
    with pytest.raises(StateFormatError, match=r"needs \d+ bytes at offset \d+|exceeds the bytes left") as err:
        parse_state(raw[:-1])
    if saved.arch in ("lfm2", "mamba2"):  # the reading that got furthest names the recurrent block
        assert "recurrent row block" in str(err.value)


def test_damaged_headers_raise(saved: Saved) -> None:
    raw = saved.full
    with pytest.raises(StateFormatError, match="magic"):
        parse_state(patched(raw, 0, "<I", 0x67677370))
    with pytest.raises(StateFormatError, match="version 4"):
        parse_state(patched(raw, 4, "<I", 4))
    with pytest.raises(StateFormatError, match="bytes after"):
        parse_state(raw + b"\0" * 12)
    st = parse_state(raw)
    if st.recurrent is None:
        return
    at = recurrent_start(raw, st)
    meta = at + 4 + 8 * st.recurrent.n_cells  # s_trans, n_layer
    with pytest.raises(StateFormatError, match="s_trans 1"):
        parse_state(patched(raw, meta, "<I", 1))
    with pytest.raises(StateFormatError, match="implausible layer count 0"):
        parse_state(patched(raw, meta + 4, "<I", 0))
    # One layer fewer than the file holds: the blocks run past n_layer R and S pairs.
    n_rec = len(st.recurrent.layers)
    with pytest.raises(StateFormatError, match=f"bytes after {2 * (n_rec - 1)} row blocks"):
        parse_state(patched(raw, meta + 4, "<I", n_rec - 1))
    first = meta + 8  # the first R block: i32 type, u64 row size
    with pytest.raises(StateFormatError, match="R blocks of .* layers differ"):
        parse_state(patched(raw, first, "<i", 1))  # the first layer's R rows become f16, the others stay f32
    with pytest.raises(StateFormatError, match="recurrent row block 0: row size"):
        parse_state(patched(raw, first + 4, "<Q", 1 << 40))
    with pytest.raises(StateFormatError, match="cell count"):
        parse_state(patched(raw, at, "<I", 1 << 30))


def test_unknown_layouts_stay_opaque(saved: Saved) -> None:
    """Layouts the pinned llama.cpp writes for other memory types, made of these real parts."""
    raw, st = saved.full, parse_state(saved.full)
    mem_start = len(raw) - st.memory.nbytes
    memory = raw[mem_start:]
    unknown: list[bytes] = []
    if st.caches and st.recurrent is None:
        unknown.append(raw + memory * (3 - len(st.caches)))  # three or four KV caches (DSA with SWA writes three)
    if st.recurrent is not None:
        at = recurrent_start(raw, st)
        unknown.append(raw + raw[mem_start:at] if st.caches else raw + raw[at:])  # a cache after the recurrent state
        # A PLE conv history: an untyped u64 row size and rows after the first layer's R rows.
        r_end = at + 4 + 8 * st.recurrent.n_cells + 8 + 12 + st.recurrent.layers[0].r.nbytes
        unknown.append(raw[:r_end] + struct.pack("<Q", 8) + b"\x01" * 8 + raw[r_end:])
    for data in unknown:
        with pytest.raises(StateFormatError):
            parse_state(data)
        opaque = parse_state(data, allow_opaque=True)
        assert opaque.memory_kind == "opaque" and opaque.opaque_reason and opaque.recurrent is None
        assert opaque.split_reason and "not a standard KV cache" in opaque.split_reason
        assert bytes(write_state(opaque)) == data
