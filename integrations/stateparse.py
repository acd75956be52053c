"""Parse a llama.cpp sequence-state file (the format: ``statefile``) into a ``SeqState``.

The parser is strict: the memory state must be one of the layouts ``statefile`` lists and consume
every byte, or it is *opaque* (kept as raw bytes, reported with the reason, never split): a context
without memory, three KV caches (``llama_kv_cache_dsa_iswa``), an indexer cache after the recurrent
state (``llama_memory_hybrid_idx``), K-only caches (V skipped for some layers), anything else.
Every count is checked against the bytes left before it is used, so a damaged header can never
cause a large allocation, and all K/V/R/S data are numpy views into the caller's buffer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from tiers.errors import StateFormatError

from .buffers import BytesLike, as_uint8
from .memkind import MemoryKind
from .recurrentstate import RecurrentState, parse_recurrent
from .statefile import (
    CELL_DTYPE,
    CELL_EXT,
    CELL_EXT_DTYPE,
    GGSQ_MAGIC,
    GGSQ_VERSION,
    HEADER_BYTES,
    LLAMA_TOKEN_NULL,
    MAX_KV_CACHES,
    MAX_STREAMS,
    SERVER_TOKENS_VERSION,
    V_TRANS_HEAD,
    KVCache,
    KVLayer,
    KVStream,
    SeqState,
    TokenSection,
)
from .statereader import CELL_HEAD, MAX_LAYERS, ROW_HEAD, TWO_U32, StateReader


def parse_state(data: BytesLike, *, allow_opaque: bool = False) -> SeqState:
    """Parse a sequence-state file; every array in the result is a view into ``data``.

    Args:
        data: the file's bytes (kept alive by the views; a bytearray cannot be resized meanwhile).
        allow_opaque: accept a memory state that fits none of the layouts this parser knows (see
            the module doc) as raw bytes instead of raising.

    Raises:
        StateFormatError: wrong magic or version, truncated or damaged header, token section or
            (unless ``allow_opaque``) memory state.
    """
    arr = as_uint8(data)
    r = StateReader(arr, 0, arr.size)
    if arr.size < HEADER_BYTES:
        raise StateFormatError(f"not a sequence-state file: {arr.size} bytes, the header alone is {HEADER_BYTES}")
    magic, version, n_words = struct.unpack_from("<III", r.mv, 0)
    if magic != GGSQ_MAGIC:
        raise StateFormatError(f"not a sequence-state file (magic {magic:#010x}, expected {GGSQ_MAGIC:#010x} 'ggsq')")
    if version != GGSQ_VERSION:
        raise StateFormatError(f"unsupported sequence-state version {version} (this build reads {GGSQ_VERSION})")
    r.pos = HEADER_BYTES
    if n_words > r.left // 4:
        raise StateFormatError(f"token count {n_words} exceeds the file size ({arr.size} bytes)")
    words = r.view(4 * n_words, "token section").view("<i4")
    tokens = _parse_token_section(words)
    mem_start = r.pos
    memory = arr[mem_start:].data
    try:
        mem = _parse_memory(arr, mem_start, arr.size)
    except StateFormatError as exc:
        if not allow_opaque:
            raise
        return SeqState(version, tokens, MemoryKind.OPAQUE, (), False, memory, int(arr.size), str(exc))
    return SeqState(version, tokens, mem.kind, mem.caches, mem.cell_ext, memory, int(arr.size),
                    recurrent=mem.recurrent)


def _parse_token_section(words: np.ndarray) -> TokenSection:
    if words.size == 0 or words[0] != LLAMA_TOKEN_NULL:
        return TokenSection(words, words, False, np.zeros(0, "<u4"))
    # The server's packed form: -1, version, vector<token>, vector<u32 media key>, media chunks.
    n = int(words.size)
    if n < 3:
        raise StateFormatError("packed token section truncated")
    if int(words[1]) != SERVER_TOKENS_VERSION:
        raise StateFormatError(f"unsupported packed token section version {int(words[1])}")
    n_tok = int(words[2]) & 0xFFFFFFFF
    if n_tok > n - 3 - 1:  # the media-key count must follow
        raise StateFormatError(f"packed token count {n_tok} exceeds the token section ({n} words)")
    tokens = words[3 : 3 + n_tok]
    at = 3 + n_tok
    n_media = int(words[at]) & 0xFFFFFFFF
    if n_media > n - at - 1:
        raise StateFormatError(f"packed media count {n_media} exceeds the token section")
    media_keys = words[at + 1 : at + 1 + n_media].view("<u4")
    r = StateReader(words.view(np.uint8), 4 * (at + 1 + n_media), 4 * n)
    media: list[memoryview] = []
    for i in range(n_media):
        size = r.u32(f"media chunk {i} size")
        media.append(r.view(size, f"media chunk {i}").data)
    if r.left >= 4:
        raise StateFormatError(f"{r.left} trailing bytes in the packed token section")
    return TokenSection(words, tokens, True, media_keys, tuple(media))


@dataclass(frozen=True, slots=True)
class _Memory:
    caches: tuple[KVCache, ...]
    cell_ext: bool
    recurrent: RecurrentState | None

    @property
    def kind(self) -> MemoryKind:
        if self.recurrent is not None:
            return MemoryKind.HYBRID if self.caches else MemoryKind.RECURRENT
        return MemoryKind.KV if len(self.caches) == 1 else MemoryKind.KV_PAIR


def _parse_memory(arr: np.ndarray, start: int, end: int) -> _Memory:
    """Up to two KV caches, then, unless they end the file, a recurrent state that must.

    Each reading is tried without and with ``llama_kv_cell_ext``; when none fits, the error is the
    one of the reading that got furthest into the file (the likeliest to name the damage).
    """
    if start == end:
        # Only a context without memory writes nothing here; for a KV cache it is truncation.
        raise StateFormatError(f"no memory state after the token section (offset {start})")
    failures: list[tuple[int, str]] = []
    for cell_ext in (False, True):
        r = StateReader(arr, start, end)
        caches: list[KVCache] = []
        ends = [r.pos]  # where the recurrent state would start after 0, 1, ... caches
        kv_failure: tuple[int, str] | None = None
        while r.left and len(caches) < MAX_KV_CACHES:
            at = r.pos
            try:
                caches.append(_parse_kv_cache(r, cell_ext))
                ends.append(r.pos)
            except StateFormatError as exc:
                kv_failure, r.pos = (r.pos, str(exc)), at
                break
        if not r.left:
            return _Memory(tuple(caches), cell_ext, None)
        # The recurrent state after as many caches as read; else after fewer: its first words can
        # read as an empty KV cache (a one-token hybrid state starts 1, 0: a stream of no cells).
        rec_failure: tuple[int, str] | None = None
        for n in range(len(caches), -1, -1):
            r.pos = ends[n]
            try:
                return _Memory(tuple(caches[:n]), cell_ext, parse_recurrent(r))
            except StateFormatError as exc:
                rec_failure = rec_failure or (r.pos, str(exc))
        assert rec_failure is not None
        failures.append(_why_not(caches, end - ends[-1], kv_failure, rec_failure))
    raise StateFormatError(max(failures)[1])


def _why_not(caches: list[KVCache], left: int, kv: tuple[int, str] | None, rec: tuple[int, str]) -> tuple[int, str]:
    """(how far the furthest reading got, the message) for memory that fits no known layout."""
    furthest = max(rec[0], kv[0] if kv else 0)
    if not caches:
        assert kv is not None
        readings = sorted([(kv[0], f"as a KV cache: {kv[1]}"), (rec[0], f"as a recurrent state: {rec[1]}")],
                          reverse=True)
        return furthest, "memory state fits no known layout; " + "; ".join(m for _, m in readings)
    what = f"{left} bytes after {'the KV cache state' if len(caches) == 1 else 'two KV cache states'}"
    if kv is None:
        return furthest, f"{what} are not a recurrent state ({rec[1]})"
    return furthest, f"{what} are neither a KV cache ({kv[1]}) nor a recurrent state ({rec[1]})"


def _parse_kv_cache(r: StateReader, cell_ext: bool) -> KVCache:
    n_stream = r.u32("n_stream")
    if n_stream == 0 or n_stream > MAX_STREAMS or n_stream > r.left // 4:
        raise StateFormatError(f"implausible stream count {n_stream} ({r.left} bytes left)")
    streams = [_parse_stream(r, s, cell_ext) for s in range(n_stream)]
    return KVCache(tuple(streams))


def _parse_stream(r: StateReader, s: int, cell_ext: bool) -> KVStream:
    n = r.u32(f"stream {s} cell count")
    if n == 0:
        return KVStream.empty()
    cell_min = 20 if cell_ext else 8
    if n > r.left // cell_min:
        raise StateFormatError(f"stream {s}: cell count {n} exceeds the bytes left ({r.left})")
    pos, n_seq_id, seq_ids, ext = _parse_cells(r, n, cell_ext, s)
    v_trans, n_layer = r.unpack(TWO_U32, f"stream {s} v_trans/n_layer")
    if v_trans > 1:
        raise StateFormatError(f"stream {s}: v_trans must be 0 or 1, got {v_trans}")
    if n_layer == 0 or n_layer > MAX_LAYERS or n_layer > r.left // 24:
        raise StateFormatError(f"stream {s}: implausible layer count {n_layer}")
    ks: list[tuple[int, int, np.ndarray]] = []
    for il in range(n_layer):
        k_type, k_row = r.unpack(ROW_HEAD, f"stream {s} layer {il} K header")
        if k_row == 0 or k_row > r.left // n:
            raise StateFormatError(f"stream {s} layer {il}: K row size {k_row} x {n} cells exceeds the bytes left")
        ks.append((k_type, k_row, r.view(n * k_row, "K rows").reshape(n, k_row)))
    layers: list[KVLayer] = []
    for il, (k_type, k_row, k) in enumerate(ks):
        if not v_trans:
            v_type, v_row = r.unpack(ROW_HEAD, f"stream {s} layer {il} V header")
            if v_row == 0 or v_row > r.left // n:
                raise StateFormatError(f"stream {s} layer {il}: V row size {v_row} x {n} cells exceeds the bytes left")
            v = r.view(n * v_row, "V rows").reshape(n, v_row)
            layers.append(KVLayer(k_type, k_row, k, v_type, v_row, 0, 0, v))
        else:
            v_type, el, n_embd = r.unpack(V_TRANS_HEAD, f"stream {s} layer {il} V header")
            if el == 0 or n_embd == 0 or el * n_embd > r.left // n:
                raise StateFormatError(
                    f"stream {s} layer {il}: transposed V {n_embd} x {n} cells x {el} bytes exceeds the bytes left"
                )
            v = r.view(n * el * n_embd, "transposed V").reshape(n_embd, n * el)
            layers.append(KVLayer(k_type, k_row, k, v_type, el * n_embd, el, n_embd, v))
    return KVStream(n, pos, n_seq_id, seq_ids, ext, bool(v_trans), tuple(layers))


def _parse_cells(
    r: StateReader, n: int, cell_ext: bool, s: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    dtype = CELL_EXT_DTYPE if cell_ext else CELL_DTYPE
    if n * dtype.itemsize <= r.left:
        # Fast path: one seq id per cell (every single-sequence save) is one structured array.
        cells = np.frombuffer(r.arr, dtype, count=n, offset=r.pos)
        if np.all(cells["n_seq_id"] == 1):
            r.pos += n * dtype.itemsize
            ext_arr = np.stack([cells["x"], cells["y"], cells["tok"]], axis=1) if cell_ext else None
            return cells["pos"], cells["n_seq_id"], cells["seq_id"], ext_arr
    # Fallback: cells with 0 or several sequence ids (whole-cache saves); one Python step per cell.
    pos = np.empty(n, "<i4")
    nsq = np.empty(n, "<u4")
    ext_rows: np.ndarray | None = np.empty((n, 3), "<i4") if cell_ext else None
    seq_parts: list[np.ndarray] = []
    for i in range(n):
        p, k = r.unpack(CELL_HEAD, f"stream {s} cell {i}")
        pos[i], nsq[i] = p, k
        if ext_rows is not None:
            ext_rows[i] = r.unpack(CELL_EXT, f"stream {s} cell {i} ext")
        if k > r.left // 4:
            raise StateFormatError(f"stream {s} cell {i}: {k} sequence ids exceed the bytes left")
        seq_parts.append(r.view(4 * k, "sequence ids").view("<i4"))
    seq_ids = np.concatenate(seq_parts) if seq_parts else np.zeros(0, "<i4")
    return pos, nsq, seq_ids, ext_rows
