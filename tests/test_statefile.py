"""The llama.cpp sequence-state codec on synthetic files (no server).

Files are built by ``ref_file``, an independent encoder that follows llama.cpp's write loops cell by
cell and element by element (``llama_kv_cache::state_write_meta/_data``,
``server_tokens::serialize``), so the vectorised parser, writer, split and assemble are checked
against a literal reading of the format rather than against themselves.
"""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from integrations import chunkassemble
from integrations.chunkassemble import assemble_state, restore_size, state_pieces, write_pieces
from integrations.chunks import read_chunk_header
from integrations.chunksplit import first_cells, split_state
from integrations.fingerprint import inspect, inspect_main, layout_fingerprint, model_identity
from integrations.statefile import GGSQ_MAGIC
from integrations.stateparse import parse_state
from integrations.statewrite import retarget_state, state_size, write_state
from tiers.errors import KVTierError, StateFormatError
from tiers.keys import Namespace

F32, F16, Q8_0, BF16 = 0, 1, 8, 30
TYPE_ROW = {F32: lambda e: 4 * e, F16: lambda e: 2 * e, BF16: lambda e: 2 * e, Q8_0: lambda e: e // 32 * 34}
TYPE_EL = {F32: 4, F16: 2, BF16: 2}


# -- a reference encoder --------------------------------------------------------------------------


@dataclass
class Logical:
    """A state's content, V always kept as rows (cells, v_row bytes)."""

    tokens: list[int]
    pos: list[int]
    seqs: list[list[int]]
    k_type: list[int]
    v_type: list[int]
    k: list[np.ndarray]  # (n, k_row) uint8
    v: list[np.ndarray]  # (n, v_row) uint8
    ext: list[tuple[int, int, int]] | None = None

    @property
    def n(self) -> int:
        return len(self.pos)

    def prefix(self, n: int) -> Logical:
        return Logical(self.tokens[:n], self.pos[:n], [[0]] * n, self.k_type, self.v_type,
                       [k[:n] for k in self.k], [v[:n] for v in self.v])


def logical(n: int, *, n_layer: int = 3, kt: int = F16, vt: int = F16, embd: int | list[int] = 32,
            seq: int = 0, seed: int = 0, n_tokens: int | None = None) -> Logical:
    rng = np.random.default_rng(seed)
    embds = embd if isinstance(embd, list) else [embd] * n_layer
    return Logical(
        tokens=[int(t) for t in rng.integers(0, 49152, n if n_tokens is None else n_tokens)],
        pos=list(range(n)), seqs=[[seq]] * n, k_type=[kt] * n_layer, v_type=[vt] * n_layer,
        k=[rng.integers(0, 256, (n, TYPE_ROW[kt](e)), dtype=np.uint8) for e in embds],
        v=[rng.integers(0, 256, (n, TYPE_ROW[vt](e)), dtype=np.uint8) for e in embds],
    )


def token_words(tokens: list[int], packed: bool, media: list[tuple[int, bytes]] = ()) -> bytes:  # type: ignore[assignment]
    if not packed:
        return struct.pack(f"<{len(tokens)}i", *tokens)
    out = struct.pack("<iII", -1, 1, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens)
    out += struct.pack("<I", len(media)) + b"".join(struct.pack("<I", k) for k, _ in media)
    for _, blob in media:
        out += struct.pack("<I", len(blob)) + blob
    return out + b"\0" * (-len(out) % 4)


def ref_stream(lg: Logical, v_trans: bool) -> bytes:
    out = [struct.pack("<I", lg.n)]
    for i in range(lg.n):
        out.append(struct.pack("<iI", lg.pos[i], len(lg.seqs[i])))
        if lg.ext is not None:
            out.append(struct.pack("<iii", *lg.ext[i]))
        out.extend(struct.pack("<i", s) for s in lg.seqs[i])
    out.append(struct.pack("<II", int(v_trans), len(lg.k)))
    for kt, k in zip(lg.k_type, lg.k):
        out.append(struct.pack("<iQ", kt, k.shape[1]) + k.tobytes())
    for vt, v in zip(lg.v_type, lg.v):
        if not v_trans:
            out.append(struct.pack("<iQ", vt, v.shape[1]) + v.tobytes())
        else:
            el = TYPE_EL[vt]
            n_embd = v.shape[1] // el
            out.append(struct.pack("<iII", vt, el, n_embd))
            for j in range(n_embd):  # each V row: element j of every cell
                out.extend(v[i, j * el : (j + 1) * el].tobytes() for i in range(lg.n))
    return b"".join(out)


def ref_cache(lg: Logical | None, v_trans: bool, n_stream: int = 1, stream: int = 0) -> bytes:
    body = [struct.pack("<I", n_stream)]
    for s in range(n_stream):
        body.append(ref_stream(lg, v_trans) if s == stream and lg is not None and lg.n else struct.pack("<I", 0))
    return b"".join(body)


def ref_file(lg: Logical, *, v_trans: bool = False, n_stream: int = 1, stream: int = 0, packed: bool = False,
             media: list[tuple[int, bytes]] = (), memory: bytes | None = None) -> bytes:  # type: ignore[assignment]
    words = token_words(lg.tokens, packed, media)
    head = struct.pack("<III", GGSQ_MAGIC, 3, len(words) // 4) + words
    return head + (memory if memory is not None else ref_cache(lg, v_trans, n_stream, stream))


# -- parse / write --------------------------------------------------------------------------------

CASES = [
    pytest.param({"packed": p, "n_stream": ns, "stream": st, "v_trans": vt}, {"kt": kt, "vt": vtp},
                 id=f"{'packed' if p else 'plain'}-ns{ns}s{st}-vt{int(vt)}-{name}")
    for p in (False, True)
    for ns, st in ((1, 0), (4, 0), (4, 2))
    for vt in (False, True)
    for name, kt, vtp in (("f16", F16, F16), ("q8_0", Q8_0, Q8_0), ("f32", F32, F32), ("q8k-bf16v", Q8_0, BF16))
    if not (vt and vtp == Q8_0)
]


@pytest.mark.parametrize(("file_kw", "lg_kw"), CASES)
def test_parse_write_round_trip_is_byte_exact(file_kw: dict[str, Any], lg_kw: dict[str, Any]) -> None:
    lg = logical(40, seq=file_kw["stream"], **lg_kw)
    raw = ref_file(lg, **file_kw)
    st = parse_state(raw)
    assert st.memory_kind == "kv" and st.n_stream == file_kw["n_stream"]
    assert st.tokens.format == ("packed" if file_kw["packed"] else "plain")
    assert st.tokens.tokens.tolist() == lg.tokens
    assert st.v_trans == file_kw["v_trans"]
    (s,) = st.cell_streams()
    assert s.pos.tolist() == lg.pos and s.seq_ids.tolist() == [file_kw["stream"]] * lg.n
    for la, k, v in zip(s.layers, lg.k, lg.v):
        assert np.array_equal(la.k, k)
        if not s.v_trans:
            assert np.array_equal(la.v, v)
        else:  # (n_embd, cells * el) -> rows
            el = la.v_el_size
            assert np.array_equal(la.v.reshape(la.n_embd_v_gqa, lg.n, el).transpose(1, 0, 2).reshape(lg.n, -1), v)
    assert state_size(st) == len(raw)
    assert bytes(write_state(st)) == raw
    assert st.splittable, st.split_reason


def test_parse_is_zero_copy() -> None:
    raw = bytearray(ref_file(logical(8)))
    st = parse_state(raw)
    la = st.cell_streams()[0].layers[0]
    raw[-1] ^= 0xFF  # the last byte of the last layer's V rows
    assert st.cell_streams()[0].layers[-1].v[-1, -1] == raw[-1]
    assert la.k.base is not None and not la.k.flags.owndata


def test_multi_sequence_cells_use_the_fallback_and_round_trip() -> None:
    lg = logical(6)
    lg.seqs = [[0], [0, 1], [], [1], [0, 1, 2], [2]]
    raw = ref_file(lg, n_stream=1)
    st = parse_state(raw)
    s = st.cell_streams()[0]
    assert s.n_seq_id.tolist() == [1, 2, 0, 1, 3, 1]
    assert s.seq_ids.tolist() == [0, 0, 1, 1, 0, 1, 2, 2]
    assert bytes(write_state(st)) == raw
    assert st.split_reason == "cells shared by several sequences"


def test_cell_ext_is_parsed_and_not_splittable() -> None:
    lg = logical(5)
    lg.ext = [(i, 2 * i, 100 + i) for i in range(5)]
    raw = ref_file(lg)
    st = parse_state(raw)
    ext = st.cell_streams()[0].ext
    assert st.cell_ext and ext is not None and ext.tolist() == [list(e) for e in lg.ext]
    assert bytes(write_state(st)) == raw
    assert "cell_ext" in (st.split_reason or "")


def test_empty_slot_file_tells_the_stream_count() -> None:
    for n_stream in (1, 4):
        raw = ref_file(logical(0), n_stream=n_stream, packed=True)
        st = parse_state(raw)
        assert st.n_stream == n_stream and st.n_tokens == 0 and st.layout is None
        assert bytes(write_state(st)) == raw
        assert not st.splittable
    assert len(ref_file(logical(0), packed=True)) == 36  # what a real empty slot saves


# -- not splittable -------------------------------------------------------------------------------


def test_two_kv_caches_are_cut_with_the_window_in_the_tail() -> None:
    """Sliding-window memory: the first cache is cut into chunks; the tail keeps one cell or more
    and carries the window, two masked zero cells longer (integrations.swa), so that a restore of
    the whole state is kept by llama-server; a restore file ends with that window."""
    lg = logical(12)
    swa = logical(4, n_layer=2, seed=3)
    swa.pos = list(range(8, 12))
    raw = ref_file(lg, memory=ref_cache(lg, False) + ref_cache(swa, True))
    st = parse_state(raw)
    assert st.memory_kind == "kv_pair" and len(st.caches) == 2
    assert st.layout is not None and st.layout.n_layer == 5
    assert bytes(write_state(st)) == raw
    assert st.split_reason is not None and st.store_reason is None and st.has_rest
    split = split_state(st, 4, tail=True)
    assert split.n_chunks == 2 and split.tail is not None  # 12 cells: 4 stay with the window
    assert read_chunk_header(split.tail).n_cells == 4 and read_chunk_header(split.tail).rest_nbytes > 0
    assert all(read_chunk_header(c).rest_nbytes == 0 for c in split.chunks)
    with pytest.raises(StateFormatError, match="rest"):
        first_cells(split.tail, 2)  # never a prefix reference into it
    back = parse_state(assemble_state([*split.chunks, split.tail], st.tokens.tokens, v_trans=False))
    assert back.memory_kind == "kv_pair" and back.n_tokens == 12
    (base, window), (base0, window0) = back.cell_streams(), st.cell_streams()
    assert base.n_cells == 12 and all(np.array_equal(a.k, b.k) and np.array_equal(a.v, b.v)
                                      for a, b in zip(base.layers, base0.layers, strict=True))
    assert list(window.pos) == [6, 7, 8, 9, 10, 11]  # padded below the window
    for a, b in zip(window.layers, window0.layers, strict=True):
        assert not a.k[:2].any() and np.array_equal(a.k[2:], b.k)
    with pytest.raises(StateFormatError, match="only the last payload"):
        assemble_state([split.tail, *split.chunks], st.tokens.tokens, v_trans=False)
    # A whole state still moves between stream counts.
    moved = parse_state(retarget_state(st, 3))
    assert [c.n_stream for c in moved.caches] == [3, 3]
    # A window that still holds the whole sequence has nothing below it to pad: not stored.
    short, whole_window = logical(4), logical(4, n_layer=2, seed=3)
    st = parse_state(ref_file(short, memory=ref_cache(short, False) + ref_cache(whole_window, True)))
    assert st.store_reason == "the sliding window is not full yet"


def ref_recurrent(pos: int | None, *, n_layer: int = 3, r_row: int = 24, s_row: int = 40, seed: int = 0) -> bytes:
    """A recurrent memory state (``llama_memory_recurrent``) of one cell at ``pos`` (None: empty)."""
    rng = np.random.default_rng(seed)
    n = 0 if pos is None else 1
    out = struct.pack("<I", n) + (struct.pack("<iI", pos, 0) if pos is not None else b"")
    out += struct.pack("<II", 0, n_layer)
    for row in [r_row] * n_layer + [s_row] * n_layer:
        out += struct.pack("<iQ", F32, row) + rng.integers(0, 256, n * row, dtype=np.uint8).tobytes()
    return out


def test_recurrent_memory_alone_is_one_tail() -> None:
    """Recurrent memory alone has no K/V per token: no chunk, one tail of every token whose rest
    is the whole memory state; a restore file built from it is the saved file, byte for byte."""
    lg = logical(150, seed=4)
    raw = ref_file(lg, memory=ref_recurrent(149))
    st = parse_state(raw)
    assert st.memory_kind == "recurrent" and st.tail_only and st.has_rest
    assert st.split_reason is not None and st.store_reason is None and bytes(st.rest) == raw[12 + 4 * 150:]
    split = split_state(st, 64, tail=True, first_chunk=1)
    assert split.n_chunks == 0 and split.chunks == [] and split.tail is not None and split.tail_tokens == 150
    info = read_chunk_header(split.tail)
    assert (info.n_cells, info.first_pos, info.n_layer, info.rest_nbytes) == (150, 0, 0, st.memory.nbytes)
    assert split_state(st, 64).tail is None
    with pytest.raises(StateFormatError, match="rest"):
        first_cells(split.tail, 16)  # never a prefix reference into it
    assert restore_size([split.tail]) == len(raw)
    assert bytes(assemble_state([split.tail], st.tokens.tokens, v_trans=True, n_stream=4)) == raw
    chunk = split_state(ref_file(logical(64, seed=4)), 64).chunks[0]
    with pytest.raises(StateFormatError):
        assemble_state([chunk, split.tail], lg.tokens * 2, v_trans=False)  # a whole state follows no chunk
    # A layer-less payload must be such a tail: from position 0, with a rest, its size exact.
    for bad in (struct.pack("<4sHHIIII", b"KVSC", 1, 2, 150, 64, 0, 8) + bytes(8),
                struct.pack("<4sHHIIII", b"KVSC", 1, 0, 150, 0, 0, 0),
                bytes(split.tail) + b"\0"):
        with pytest.raises(StateFormatError):
            read_chunk_header(bad)
    # What llama.cpp could not restore, or would restore as another sequence's state, is not stored.
    for memory, why in ((ref_recurrent(148), "as of position 148"), (ref_recurrent(None), "0 cells")):
        assert why in (parse_state(ref_file(lg, memory=memory)).store_reason or "")
    with pytest.raises(StateFormatError, match="not splittable"):
        split_state(ref_file(lg, memory=ref_recurrent(None)), 64)


@pytest.mark.parametrize("what", ["gap", "order", "two-seqs", "tokens", "media", "two-streams", "null-token"])
def test_not_splittable_states(what: str) -> None:
    lg = logical(10)
    kw: dict[str, Any] = {}
    if what == "gap":
        lg.pos = list(range(5)) + list(range(6, 11))
    elif what == "order":
        lg.pos = list(range(10))[::-1]
    elif what == "two-seqs":
        lg.seqs = [[0]] * 5 + [[1]] * 5
    elif what == "tokens":
        lg.tokens = lg.tokens + [5]
    elif what == "media":
        kw = {"packed": True, "media": [(3, b"\x01\x02\x03\x04\x05")]}
    elif what == "null-token":
        lg.tokens[3] = -1
        kw = {"packed": True}
    raw = ref_file(lg, **kw)
    if what == "two-streams":
        half = lg.prefix(5)
        raw = ref_file(lg, memory=struct.pack("<I", 2) + ref_stream(half, False) + ref_stream(half, False))
    st = parse_state(raw)
    assert bytes(write_state(st)) == raw
    assert st.split_reason is not None
    with pytest.raises(StateFormatError, match="not splittable"):
        split_state(raw, 4)


def test_packed_media_round_trip() -> None:
    lg = logical(10)
    raw = ref_file(lg, packed=True, media=[(2, b"abc"), (6, b"defgh")])
    st = parse_state(raw)
    assert st.tokens.media_keys.tolist() == [2, 6]
    assert [bytes(m) for m in st.tokens.media] == [b"abc", b"defgh"]
    assert bytes(write_state(st)) == raw


def test_opaque_memory_only_when_allowed() -> None:
    lg = logical(4)
    recurrent_like = struct.pack("<IiI", 1, 3, 0) + struct.pack("<II", 0, 2) + b"\x07" * 50
    raw = ref_file(lg, memory=recurrent_like)
    with pytest.raises(StateFormatError):
        parse_state(raw)
    st = parse_state(raw, allow_opaque=True)
    assert st.memory_kind == "opaque" and st.opaque_reason and not st.splittable
    assert bytes(write_state(st)) == raw
    assert layout_fingerprint("m", st) != layout_fingerprint("m2", st)


# -- split / assemble -----------------------------------------------------------------------------


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_split_assemble_full_chunks_is_the_original(v_trans: bool, packed: bool) -> None:
    lg = logical(48, embd=[32, 64, 32])  # per-layer widths differ on purpose
    raw = ref_file(lg, v_trans=v_trans, packed=packed)
    res = split_state(raw, 16, tail=True)
    assert res.n_chunks == 3 and len(res.chunks) == 3 and res.tail is None and res.tail_tokens == 0
    for i, c in enumerate(res.chunks):
        info = read_chunk_header(c)
        assert (info.n_cells, info.first_pos, info.v_trans) == (16, 16 * i, v_trans)
    out = assemble_state(res.chunks, res.tokens, v_trans=v_trans)
    assert bytes(out) == ref_file(lg, v_trans=v_trans)  # the plain token list
    for k in range(4):  # every prefix
        assert bytes(assemble_state(res.chunks[:k], lg.tokens, v_trans=v_trans)) == ref_file(lg.prefix(16 * k), v_trans=v_trans)


@pytest.mark.parametrize("n_stream", [1, 4])
def test_split_with_tail_and_stream_targets(n_stream: int) -> None:
    lg = logical(45, seq=2)
    raw = ref_file(lg, n_stream=4, stream=2, packed=True)
    res = split_state(raw, 16, tail=True)
    assert (res.n_chunks, len(res.chunks), res.tail_tokens) == (2, 2, 13)
    assert res.tail is not None and read_chunk_header(res.tail).n_cells == 13
    full = lg.prefix(45)
    out = assemble_state([*res.chunks, res.tail], lg.tokens, v_trans=False, n_stream=n_stream)
    assert bytes(out) == ref_file(full, n_stream=n_stream)
    # No tail unless asked; the tail alone is not a prefix.
    assert split_state(raw, 16).tail is None
    with pytest.raises(StateFormatError, match="starts at position 32"):
        assemble_state([res.tail], lg.tokens, v_trans=False)
    # first_chunk skips chunks already stored.
    later = split_state(raw, 16, first_chunk=1)
    assert later.first_chunk == 1 and [bytes(c) for c in later.chunks] == [bytes(res.chunks[1])]


@pytest.mark.parametrize("n_stream", [1, 3])
def test_state_pieces_written_are_the_assembled_file(tmp_path: Path, n_stream: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    lg = logical(45, embd=[32, 64, 32])
    res = split_state(ref_file(lg, packed=True), 16, tail=True)
    payloads = [*res.chunks, res.tail]
    pieces = state_pieces(payloads, lg.tokens, v_trans=False, n_stream=n_stream)
    assert pieces is not None and len(pieces) > 6  # header, then per layer and chunk, no joined copy
    want = ref_file(lg.prefix(45), n_stream=n_stream)
    assert write_pieces(tmp_path / "a.bin", pieces) == len(want) and (tmp_path / "a.bin").read_bytes() == want
    with pytest.raises(FileExistsError):
        write_pieces(tmp_path / "a.bin", pieces)
    # Short writes (a full disk, a signal) resume mid-piece; more pieces than one writev takes.
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, bufs: real(fd, [bytes(b"".join(bufs)[:7])]))
    monkeypatch.setattr(chunkassemble, "_IOV_MAX", 4)
    assert write_pieces(tmp_path / "b.bin", [*pieces, b"", memoryview(b"xyz")]) == len(want) + 3
    assert (tmp_path / "b.bin").read_bytes() == want + b"xyz"
    # Transposed V, on either side: K rows stay slices, each layer's V block is built once.
    trans = split_state(ref_file(lg, v_trans=True, packed=True), 16, tail=True)
    trans_payloads = [*trans.chunks, trans.tail]
    for chunks, target in ((payloads, True), (trans_payloads, True), (trans_payloads, False)):
        pieces = state_pieces(chunks, lg.tokens, v_trans=target, n_stream=n_stream)
        want = ref_file(lg.prefix(45), v_trans=target, n_stream=n_stream)
        assert write_pieces(tmp_path / "t.bin", pieces, overwrite=True) == len(want)
        assert (tmp_path / "t.bin").read_bytes() == want
        # Every layer's K rows are slices of the chunks, not copies.
        shared = sum(any(np.shares_memory(np.frombuffer(p, np.uint8), np.frombuffer(c, np.uint8)) for c in chunks)
                     for p in pieces if p.nbytes)
        assert shared == 3 * len(chunks)


def test_write_pieces_overwrites_in_place_and_refuses_links(tmp_path: Path) -> None:
    path = tmp_path / "kept.bin"
    assert write_pieces(path, [b"0123456789" * 10]) == 100
    inode = path.stat().st_ino
    assert write_pieces(path, [b"abc", memoryview(b"de")], overwrite=True) == 5
    assert path.read_bytes() == b"abcde" and path.stat().st_ino == inode  # same file, cut to size
    assert write_pieces(path, [b"x" * 300], overwrite=True) == 300 and path.read_bytes() == b"x" * 300
    (tmp_path / "elsewhere").write_bytes(b"keep me")
    link = tmp_path / "link.bin"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        write_pieces(link, [b"overwritten?"], overwrite=True)
    assert (tmp_path / "elsewhere").read_bytes() == b"keep me"


def test_write_pieces_removes_a_file_it_could_not_finish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, bufs: list[memoryview]) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    with pytest.raises(OSError, match="No space"):
        write_pieces(tmp_path / "c.bin", [b"abc"])
    assert not (tmp_path / "c.bin").exists()


def test_chunk_smaller_than_one_chunk() -> None:
    lg = logical(5)
    res = split_state(ref_file(lg), 16, tail=True)
    assert res.chunks == [] and res.tail is not None
    assert bytes(assemble_state([res.tail], lg.tokens, v_trans=True)) == ref_file(lg, v_trans=True)
    empty = assemble_state([], lg.tokens, v_trans=False, n_stream=2)
    assert parse_state(empty).n_tokens == 0 and parse_state(empty).n_stream == 2


@pytest.mark.parametrize("vt", [F16, F32, BF16])
def test_v_layout_transposition_round_trip(vt: int) -> None:
    lg = logical(40, vt=vt, embd=[32, 64])
    rows = ref_file(lg, v_trans=False)
    trans = ref_file(lg, v_trans=True)
    r_chunks = split_state(rows, 8, tail=True)
    t_chunks = split_state(trans, 8, tail=True)
    assert r_chunks.layout == t_chunks.layout
    assert bytes(assemble_state(r_chunks.chunks, lg.tokens, v_trans=True)) == trans
    assert bytes(assemble_state(t_chunks.chunks, lg.tokens, v_trans=False)) == rows
    # Back and forth through files of the other layout.
    there = assemble_state(r_chunks.chunks, lg.tokens, v_trans=True)
    back = split_state(there, 8)
    assert bytes(assemble_state(back.chunks, lg.tokens, v_trans=False)) == rows
    # Chunks of both layouts in one prefix.
    mixed = [r_chunks.chunks[0], t_chunks.chunks[1], r_chunks.chunks[2], t_chunks.chunks[3], r_chunks.chunks[4]]
    assert bytes(assemble_state(mixed, lg.tokens, v_trans=True)) == trans
    assert bytes(assemble_state(mixed, lg.tokens, v_trans=False)) == rows


def test_quantized_v_is_never_transposed() -> None:
    lg = logical(16, kt=Q8_0, vt=Q8_0)
    res = split_state(ref_file(lg), 8)
    assert bytes(assemble_state(res.chunks, lg.tokens, v_trans=False)) == ref_file(lg)
    with pytest.raises(StateFormatError, match="q8_0 cannot be transposed.*flash attention"):
        assemble_state(res.chunks, lg.tokens, v_trans=True)


def test_chunks_must_agree() -> None:
    a = split_state(ref_file(logical(16)), 8).chunks
    other_rows = split_state(ref_file(logical(16, embd=64)), 8).chunks
    other_layers = split_state(ref_file(logical(16, n_layer=4)), 8).chunks
    other_type = split_state(ref_file(logical(16, kt=Q8_0)), 8).chunks
    toks = list(range(16))
    for bad in (other_rows, other_layers, other_type):
        with pytest.raises(StateFormatError, match="another KV layout"):
            assemble_state([a[0], bad[1]], toks, v_trans=False)
    with pytest.raises(StateFormatError, match="starts at position"):
        assemble_state([a[1], a[0]], toks, v_trans=False)
    with pytest.raises(StateFormatError, match="starts at position"):
        assemble_state([a[0], a[0]], toks, v_trans=False)
    with pytest.raises(ValueError, match="tokens"):
        assemble_state(a, toks[:10], v_trans=False)


def test_assemble_into_a_given_buffer() -> None:
    lg = logical(16)
    res = split_state(ref_file(lg), 8)
    size = len(ref_file(lg))
    assert restore_size(res.chunks) == size
    buf = bytearray(b"\xAA" * size)  # every byte must be written
    assert bytes(assemble_state(res.chunks, lg.tokens, v_trans=False, out=buf)) == ref_file(lg)
    assert bytes(buf) == ref_file(lg)
    arr = np.full(restore_size(res.chunks, n_stream=3), 0x55, np.uint8)
    assemble_state(res.chunks, lg.tokens, v_trans=True, n_stream=3, out=arr)
    assert arr.tobytes() == ref_file(lg, v_trans=True, n_stream=3)
    with pytest.raises(ValueError):
        assemble_state(res.chunks, lg.tokens, v_trans=False, out=bytearray(size + 1))


# -- malformed input ------------------------------------------------------------------------------


def _small_files() -> list[bytes]:
    lg = logical(3, n_layer=2, embd=32)
    return [ref_file(lg), ref_file(lg, v_trans=True, n_stream=2, stream=1, packed=True),
            ref_file(lg, packed=True, media=[(1, b"xyz")])]


@pytest.mark.parametrize("which", [0, 1, 2])
def test_every_truncation_is_a_state_format_error(which: int) -> None:
    raw = _small_files()[which]
    mem_start = 12 + 4 * struct.unpack_from("<I", raw, 8)[0]
    for cut in range(len(raw)):
        with pytest.raises(StateFormatError):
            parse_state(raw[:cut])
        if cut < mem_start:  # header and token section damage is never opaque
            with pytest.raises(StateFormatError):
                parse_state(raw[:cut], allow_opaque=True)
        else:
            assert not parse_state(raw[:cut], allow_opaque=True).splittable


def test_trailing_bytes_wrong_magic_and_version() -> None:
    raw = _small_files()[0]
    with pytest.raises(StateFormatError, match="bytes after"):
        parse_state(raw + b"\0")
    with pytest.raises(StateFormatError, match="magic"):
        parse_state(b"ggsn" + raw[4:])
    with pytest.raises(StateFormatError, match="version 2"):
        parse_state(raw[:4] + struct.pack("<I", 2) + raw[8:])
    assert issubclass(StateFormatError, KVTierError)


def _patch(raw: bytes, offset: int, fmt: str, value: int) -> bytes:
    b = bytearray(raw)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


def test_huge_counts_never_allocate() -> None:
    lg = logical(3, n_layer=2, embd=32)
    raw = ref_file(lg)
    n = 3
    mem = 12 + 4 * n
    k0 = mem + 4 + 4 + 12 * n + 8  # first K header
    bad = {
        "tokens": _patch(raw, 8, "<I", 0xFFFFFFFF),
        "n_stream": _patch(raw, mem, "<I", 0xFFFFFFFF),
        "cells": _patch(raw, mem + 4, "<I", 0xFFFFFFF0),
        "n_seq_id": _patch(raw, mem + 8 + 4, "<I", 0x7FFFFFFF),
        "v_trans": _patch(raw, k0 - 8, "<I", 7),
        "n_layer": _patch(raw, k0 - 4, "<I", 0xFFFFFFFF),
        "k_row": _patch(raw, k0 + 4, "<Q", 1 << 62),
        "k_row0": _patch(raw, k0 + 4, "<Q", 0),
        "packed_n": ref_file(lg, packed=True)[:20] + struct.pack("<I", 0x7FFFFFFF) + ref_file(lg, packed=True)[24:],
    }
    tv = ref_file(lg, v_trans=True)
    v0 = k0 + 2 * (12 + n * 64)
    bad["el"] = _patch(tv, v0 + 4, "<I", 0xFFFFFFFF)
    bad["n_embd"] = _patch(tv, v0 + 8, "<I", 0xFFFFFFFF)
    tracemalloc.start()
    try:
        for name, b in bad.items():
            with pytest.raises(StateFormatError):
                parse_state(b)
            assert tracemalloc.get_traced_memory()[1] < 1 << 20, name
    finally:
        tracemalloc.stop()


def test_bad_chunk_payloads() -> None:
    c = bytes(split_state(ref_file(logical(16)), 8).chunks[0])
    for cut in range(len(c)):
        with pytest.raises(StateFormatError):
            read_chunk_header(c[:cut])
    with pytest.raises(StateFormatError, match="magic"):
        read_chunk_header(b"XXXX" + c[4:])
    with pytest.raises(StateFormatError, match="version"):
        read_chunk_header(_patch(c, 4, "<H", 9))
    with pytest.raises(StateFormatError, match="flags"):
        read_chunk_header(_patch(c, 6, "<H", 4))
    with pytest.raises(StateFormatError, match="layer count"):
        read_chunk_header(_patch(c, 16, "<I", 1 << 30))
    with pytest.raises(StateFormatError):
        read_chunk_header(_patch(c, 8, "<I", 1 << 30))
    with pytest.raises(StateFormatError):
        read_chunk_header(c + b"\0")
    with pytest.raises(StateFormatError):
        assemble_state([c + b"\0"], list(range(16)), v_trans=False)


# -- inspect and fingerprints ---------------------------------------------------------------------


def test_inspect_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lg = logical(20, n_layer=2)
    p = tmp_path / "s.bin"
    p.write_bytes(ref_file(lg, packed=True, n_stream=4, stream=1, v_trans=True))
    info = inspect(p)
    assert info["n_tokens"] == 20 and info["n_stream"] == 4 and info["n_layer"] == 2
    assert info["v_trans"] is True and info["k_types"] == ["f16", "f16"] and info["v_types"] == ["f16", "f16"]
    assert info["bytes_per_token"] == 2 * (64 + 64) and info["splittable"] is True
    assert info["token_format"] == "packed" and info["stream_cells"] == [[0, 20, 0, 0]]
    assert inspect_main([str(p), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == info
    assert inspect_main([str(p)]) == 0
    table = capsys.readouterr().out
    assert "splittable" in table and "transposed" in table and "f16" in table
    (tmp_path / "bad.bin").write_bytes(b"ggsq\x03")
    assert inspect_main([str(tmp_path / "bad.bin")]) == 1
    assert "bad.bin" in capsys.readouterr().err


def test_inspect_with_model_gives_the_namespace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVTIER_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF-not-really")
    p = tmp_path / "s.bin"
    p.write_bytes(ref_file(logical(20)))
    info = inspect(p, model=model, chunk_tokens=64)
    fp = layout_fingerprint(model_identity(model), parse_state(p.read_bytes()))
    assert info["fingerprint"] == fp and info["namespace_id"] == Namespace(fp, chunk_tokens=64).id
    assert inspect_main([str(p), "--model", str(model)]) == 0
    out = capsys.readouterr().out
    assert fp in out and Namespace(fp).id in out


def test_retarget_moves_cells_to_stream_zero() -> None:
    lg = logical(10, seq=2)
    raw = ref_file(lg, n_stream=4, stream=2, packed=True)
    one = parse_state(retarget_state(raw, 1))
    assert one.n_stream == 1 and one.tokens.format == "packed" and one.n_tokens == 10
    assert np.array_equal(one.cell_streams()[0].layers[1].k, lg.k[1])
    assert bytes(retarget_state(one, 4)) == ref_file(lg, n_stream=4, stream=0, packed=True)


def test_model_identity_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(range(256)) * 100)
    ident = model_identity(model)
    assert ident.startswith("gguf-xxh3-128:")
    assert (tmp_path / "cache" / "model-ids.json").exists()
    assert model_identity(model) == ident
    # A changed file (size or mtime) is hashed again and gets another identity.
    model.write_bytes(b"GGUF" + bytes(range(256)) * 101)
    assert model_identity(model) != ident
    # The JSON cache answers without reading the file (a fresh process would use it).
    other = tmp_path / "cache2.json"
    other.write_text("not json")
    assert model_identity(model, cache_file=other) == model_identity(model)


def test_layout_fingerprint() -> None:
    base = parse_state(ref_file(logical(8)))
    trans = parse_state(ref_file(logical(8), v_trans=True))
    fp = layout_fingerprint("model-a", base)
    assert fp == layout_fingerprint("model-a", trans)  # V layout excluded
    assert fp == layout_fingerprint("model-a", split_state(base, 4).chunks[0])
    assert fp != layout_fingerprint("model-b", base)
    assert fp != layout_fingerprint("model-a", parse_state(ref_file(logical(8, kt=Q8_0))))
    assert fp != layout_fingerprint("model-a", parse_state(ref_file(logical(8, n_layer=4))))
    assert fp != layout_fingerprint("model-a", parse_state(ref_file(logical(8, embd=64))))
    assert Namespace(fp).id != Namespace(layout_fingerprint("model-b", base)).id
    with pytest.raises(ValueError):
        layout_fingerprint("model-a", parse_state(ref_file(logical(0))))
