"""llama.cpp sequence-state files ('ggsq' version 3): strict zero-copy parse, byte-exact write, inspect.

What ``POST /slots/{id}?action=save`` writes (``llama_context::state_seq_save_file``)::

    u32 magic 'ggsq' (0x67677371), u32 version (3), u32 n, n x i32 token section, memory state

The token section is a plain token list, or the server's packed form (``server_tokens::serialize``):
``-1, u32 version (1), u32 n + n x i32 tokens, u32 n_media + keys, n_media x (u32 size + bytes)``,
zero-padded to whole i32 words. The memory state of a standard KV cache
(``llama_kv_cache::state_write``)::

    u32 n_stream
    per stream: u32 cell_count                                   (0: empty stream, nothing follows)
        per cell: i32 pos, u32 n_seq_id, [llama_kv_cell_ext: i32 x, i32 y, i32 tok], n_seq_id x i32
        u32 v_trans, u32 n_layer
        per layer K: i32 type, u64 row_size, cell_count rows
        per layer V, v_trans = 0: i32 type, u64 row_size, cell_count rows
                     v_trans = 1: i32 type, u32 el_size, u32 n_embd_v_gqa,
                                  n_embd_v_gqa x (cell_count x el_size)

Sliding-window models write two such caches back to back (``llama_kv_cache_iswa``); recurrent and
hybrid memory write other layouts. The parser is strict: the memory state must be one or two
standard KV caches that consume every byte, or it is *opaque* (kept as raw bytes, never split).
Every count is checked against the bytes left before it is used, so a damaged header can never
cause a large allocation, and all K/V data are numpy views into the caller's buffer.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiers.errors import StateFormatError

GGSQ_MAGIC = 0x67677371  # 'ggsq'
GGSQ_VERSION = 3  # LLAMA_STATE_SEQ_VERSION of the pinned llama.cpp
LLAMA_TOKEN_NULL = -1
SERVER_TOKENS_VERSION = 1  # SERVER_TOKENS_STATE_VERSION (tools/server/server-common.cpp)
HEADER_BYTES = 12  # magic, version, n
MAX_STREAMS = 1 << 16  # llama.cpp allows 256 sequences; more streams than this is damage
MAX_LAYERS = 1 << 16

# The ggml types a KV cache may hold (common/arg.cpp ``kv_cache_types``): id -> (name, block, bytes).
# Other types still parse (rows are opaque bytes); they only lack a name and cannot be transposed.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("f32", 1, 4),
    1: ("f16", 1, 2),
    2: ("q4_0", 32, 18),
    3: ("q4_1", 32, 20),
    6: ("q5_0", 32, 22),
    7: ("q5_1", 32, 24),
    8: ("q8_0", 32, 34),
    20: ("iq4_nl", 32, 18),
    30: ("bf16", 1, 2),
}

# Cell metadata when every cell has exactly one sequence id: parsed and written as one array.
CELL_DTYPE = np.dtype([("pos", "<i4"), ("n_seq_id", "<u4"), ("seq_id", "<i4")])
CELL_EXT_DTYPE = np.dtype(
    [("pos", "<i4"), ("n_seq_id", "<u4"), ("x", "<i4"), ("y", "<i4"), ("tok", "<i4"), ("seq_id", "<i4")]
)

_U32 = struct.Struct("<I")
_K_HEAD = struct.Struct("<iQ")  # type, row size
_VT_HEAD = struct.Struct("<iII")  # type, element size, n_embd_v_gqa
_CELL_HEAD = struct.Struct("<iI")  # pos, n_seq_id
_EXT = struct.Struct("<iii")  # llama_kv_cell_ext: x, y, tok
_TWO_U32 = struct.Struct("<II")


def ggml_type_name(type_id: int) -> str:
    return GGML_TYPES[type_id][0] if type_id in GGML_TYPES else f"type{type_id}"


def ggml_element_size(type_id: int) -> int | None:
    """``ggml_type_size`` of a type whose rows are plain elements (block size 1), else None.

    Only such types can be transposed: quantized V needs flash attention (rows) in llama.cpp.
    """
    info = GGML_TYPES.get(type_id)
    return info[2] if info is not None and info[1] == 1 else None


# -- the model ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenSection:
    """The token section: ``words`` exactly as stored, ``tokens`` the ids they carry (a view)."""

    words: np.ndarray  # int32, what write_state writes back
    tokens: np.ndarray  # int32 token ids
    packed: bool
    media_keys: np.ndarray  # uint32 start indices of media chunks (packed form only)
    media: tuple[memoryview, ...] = ()

    @classmethod
    def plain(cls, tokens: Sequence[int] | np.ndarray) -> TokenSection:
        arr = np.ascontiguousarray(np.asarray(tokens, dtype="<i4"))
        return cls(arr, arr, False, np.zeros(0, "<u4"))

    @property
    def has_media(self) -> bool:
        return self.media_keys.size > 0

    @property
    def format(self) -> str:
        return "packed" if self.packed else "plain"


@dataclass(frozen=True, slots=True)
class KVLayer:
    """One layer's K and V of one stream, as uint8 views into the parsed buffer.

    ``k`` is ``(n_cells, k_row_size)``. ``v`` is ``(n_cells, v_row_size)`` in the rows layout, or
    ``(n_embd_v_gqa, n_cells * v_el_size)`` when transposed; ``v_row_size`` is V bytes per cell in
    both layouts, ``v_el_size``/``n_embd_v_gqa`` are only stored in the file when transposed.
    """

    k_type: int
    k_row_size: int
    k: np.ndarray
    v_type: int
    v_row_size: int
    v_el_size: int
    n_embd_v_gqa: int
    v: np.ndarray


@dataclass(frozen=True, slots=True)
class KVStream:
    """One stream: cell metadata and, when it holds cells, the layers. Empty: ``n_cells == 0``."""

    n_cells: int
    pos: np.ndarray  # int32 (n_cells,)
    n_seq_id: np.ndarray  # uint32 (n_cells,)
    seq_ids: np.ndarray  # int32, all cells' sequence ids in order (sum of n_seq_id)
    ext: np.ndarray | None  # int32 (n_cells, 3): x, y, tok, when the cache writes llama_kv_cell_ext
    v_trans: bool
    layers: tuple[KVLayer, ...]

    @classmethod
    def empty(cls) -> KVStream:
        z = np.zeros(0, "<i4")
        return cls(0, z, z.view("<u4"), z, None, False, ())


@dataclass(frozen=True, slots=True)
class KVCache:
    streams: tuple[KVStream, ...]

    @property
    def n_stream(self) -> int:
        return len(self.streams)


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """What the bytes of one layer depend on (the V layout excluded: chunks record their own)."""

    k_type: int
    k_row_size: int
    v_type: int
    v_row_size: int  # V bytes per cell


@dataclass(frozen=True, slots=True)
class StateLayout:
    layers: tuple[LayerLayout, ...]

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def bytes_per_token(self) -> int:
        return sum(la.k_row_size + la.v_row_size for la in self.layers)


@dataclass(frozen=True, slots=True)
class SeqState:
    """A parsed sequence-state file.

    ``memory_kind`` is ``kv`` (one standard KV cache), ``kv_pair`` (two, as sliding-window models
    write) or ``opaque`` (recurrent, hybrid, no memory, anything else; only with ``allow_opaque``).
    ``memory`` is always the raw memory-state bytes.
    """

    version: int
    tokens: TokenSection
    memory_kind: str
    caches: tuple[KVCache, ...]
    cell_ext: bool
    memory: memoryview
    nbytes: int
    opaque_reason: str | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.tokens.size)

    @property
    def n_stream(self) -> int | None:
        return self.caches[0].n_stream if self.caches else None

    def cell_streams(self) -> list[KVStream]:
        """The non-empty streams of every cache."""
        return [s for c in self.caches for s in c.streams if s.n_cells]

    @property
    def layout(self) -> StateLayout | None:
        """Layer layout of the (first, for ``kv_pair`` both) caches; None without cells."""
        layers: list[LayerLayout] = []
        for cache in self.caches:
            full = next((s for s in cache.streams if s.n_cells), None)
            if full is None:
                return None
            layers.extend(LayerLayout(la.k_type, la.k_row_size, la.v_type, la.v_row_size) for la in full.layers)
        return StateLayout(tuple(layers)) if layers else None

    @property
    def v_trans(self) -> bool | None:
        full = self.cell_streams()
        return full[0].v_trans if full else None

    @property
    def split_reason(self) -> str | None:
        """Why this state cannot be split into prefix chunks, or None when it can."""
        if self.memory_kind != "kv":
            if self.memory_kind == "kv_pair":
                return "two KV caches (sliding-window attention)"
            return f"memory state is not a standard KV cache ({self.opaque_reason})"
        if self.cell_ext:
            return "cells carry llama_kv_cell_ext (M-RoPE or PLE model)"
        if self.tokens.has_media:
            return "token section holds media"
        full = self.cell_streams()
        if not full:
            return "no cells"
        if len(full) > 1:
            return "cells in more than one stream"
        s = full[0]
        if s.seq_ids.size != s.n_cells or (s.n_cells and not np.all(s.n_seq_id == 1)):
            return "cells shared by several sequences"
        if s.n_cells and not np.all(s.seq_ids == s.seq_ids[0]):
            return "more than one sequence"
        if not np.array_equal(s.pos, np.arange(s.n_cells, dtype=np.int32)):
            return "cell positions are not 0..n-1 in order"
        if s.n_cells != self.n_tokens:
            return f"{s.n_cells} cells for {self.n_tokens} tokens"
        if self.n_tokens and int(self.tokens.tokens.min()) < 0:
            return "token section holds null tokens"
        return None

    @property
    def splittable(self) -> bool:
        return self.split_reason is None


# -- parse ----------------------------------------------------------------------------------------


class _Reader:
    """Bounds-checked little-endian reads over a uint8 array; views, never copies."""

    __slots__ = ("arr", "end", "mv", "pos")

    def __init__(self, arr: np.ndarray, pos: int, end: int):
        self.arr = arr
        self.mv = arr.data
        self.pos = pos
        self.end = end

    @property
    def left(self) -> int:
        return self.end - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.end - self.pos:
            raise StateFormatError(f"{what} needs {n} bytes at offset {self.pos}, only {self.left} left")

    def unpack(self, st: struct.Struct, what: str) -> tuple[Any, ...]:
        self.need(st.size, what)
        out = st.unpack_from(self.mv, self.pos)
        self.pos += st.size
        return out

    def u32(self, what: str) -> int:
        return int(self.unpack(_U32, what)[0])

    def view(self, nbytes: int, what: str) -> np.ndarray:
        self.need(nbytes, what)
        out = self.arr[self.pos : self.pos + nbytes]
        self.pos += nbytes
        return out


def as_uint8(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """A flat uint8 view of any contiguous buffer (no copy)."""
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8) if data.flags.c_contiguous else np.ascontiguousarray(data).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def parse_state(data: bytes | bytearray | memoryview | np.ndarray, *, allow_opaque: bool = False) -> SeqState:
    """Parse a sequence-state file; every array in the result is a view into ``data``.

    Args:
        data: the file's bytes (kept alive by the views; a bytearray cannot be resized meanwhile).
        allow_opaque: accept a memory state that is not one or two standard KV caches (recurrent,
            hybrid, cell layouts this parser does not know) as raw bytes instead of raising.

    Raises:
        StateFormatError: wrong magic or version, truncated or damaged header, token section or
            (unless ``allow_opaque``) memory state.
    """
    arr = as_uint8(data)
    r = _Reader(arr, 0, arr.size)
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
        caches, cell_ext = _parse_memory(arr, mem_start, arr.size)
    except StateFormatError as exc:
        if not allow_opaque:
            raise
        return SeqState(version, tokens, "opaque", (), False, memory, int(arr.size), str(exc))
    kind = "kv" if len(caches) == 1 else "kv_pair"
    return SeqState(version, tokens, kind, tuple(caches), cell_ext, memory, int(arr.size))


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
    r = _Reader(words.view(np.uint8), 4 * (at + 1 + n_media), 4 * n)
    media: list[memoryview] = []
    for i in range(n_media):
        size = r.u32(f"media chunk {i} size")
        media.append(r.view(size, f"media chunk {i}").data)
    if r.left >= 4:
        raise StateFormatError(f"{r.left} trailing bytes in the packed token section")
    return TokenSection(words, tokens, True, media_keys, tuple(media))


def _parse_memory(arr: np.ndarray, start: int, end: int) -> tuple[list[KVCache], bool]:
    if start == end:
        # Only a context without memory writes nothing here; for a KV cache it is truncation.
        raise StateFormatError(f"no memory state after the token section (offset {start})")
    first_error: StateFormatError | None = None
    for cell_ext in (False, True):
        r = _Reader(arr, start, end)
        caches: list[KVCache] = []
        try:
            caches.append(_parse_kv_cache(r, cell_ext))
            if r.left:
                after = r.left
                try:  # sliding-window models write a second cache right after the first
                    caches.append(_parse_kv_cache(r, cell_ext))
                except StateFormatError as exc:
                    raise StateFormatError(f"{after} bytes after the KV cache state ({exc})") from None
            if r.left:
                raise StateFormatError(f"{r.left} bytes after two KV cache states")
            return caches, cell_ext
        except StateFormatError as exc:
            first_error = first_error or exc
    assert first_error is not None
    raise first_error


def _parse_kv_cache(r: _Reader, cell_ext: bool) -> KVCache:
    n_stream = r.u32("n_stream")
    if n_stream == 0 or n_stream > MAX_STREAMS or n_stream > r.left // 4:
        raise StateFormatError(f"implausible stream count {n_stream} ({r.left} bytes left)")
    streams = [_parse_stream(r, s, cell_ext) for s in range(n_stream)]
    return KVCache(tuple(streams))


def _parse_stream(r: _Reader, s: int, cell_ext: bool) -> KVStream:
    n = r.u32(f"stream {s} cell count")
    if n == 0:
        return KVStream.empty()
    cell_min = 20 if cell_ext else 8
    if n > r.left // cell_min:
        raise StateFormatError(f"stream {s}: cell count {n} exceeds the bytes left ({r.left})")
    pos, n_seq_id, seq_ids, ext = _parse_cells(r, n, cell_ext, s)
    v_trans, n_layer = r.unpack(_TWO_U32, f"stream {s} v_trans/n_layer")
    if v_trans > 1:
        raise StateFormatError(f"stream {s}: v_trans must be 0 or 1, got {v_trans}")
    if n_layer == 0 or n_layer > MAX_LAYERS or n_layer > r.left // 24:
        raise StateFormatError(f"stream {s}: implausible layer count {n_layer}")
    ks: list[tuple[int, int, np.ndarray]] = []
    for il in range(n_layer):
        k_type, k_row = r.unpack(_K_HEAD, f"stream {s} layer {il} K header")
        if k_row == 0 or k_row > r.left // n:
            raise StateFormatError(f"stream {s} layer {il}: K row size {k_row} x {n} cells exceeds the bytes left")
        ks.append((k_type, k_row, r.view(n * k_row, "K rows").reshape(n, k_row)))
    layers: list[KVLayer] = []
    for il, (k_type, k_row, k) in enumerate(ks):
        if not v_trans:
            v_type, v_row = r.unpack(_K_HEAD, f"stream {s} layer {il} V header")
            if v_row == 0 or v_row > r.left // n:
                raise StateFormatError(f"stream {s} layer {il}: V row size {v_row} x {n} cells exceeds the bytes left")
            v = r.view(n * v_row, "V rows").reshape(n, v_row)
            layers.append(KVLayer(k_type, k_row, k, v_type, v_row, 0, 0, v))
        else:
            v_type, el, n_embd = r.unpack(_VT_HEAD, f"stream {s} layer {il} V header")
            if el == 0 or n_embd == 0 or el * n_embd > r.left // n:
                raise StateFormatError(
                    f"stream {s} layer {il}: transposed V {n_embd} x {n} cells x {el} bytes exceeds the bytes left"
                )
            v = r.view(n * el * n_embd, "transposed V").reshape(n_embd, n * el)
            layers.append(KVLayer(k_type, k_row, k, v_type, el * n_embd, el, n_embd, v))
    return KVStream(n, pos, n_seq_id, seq_ids, ext, bool(v_trans), tuple(layers))


def _parse_cells(
    r: _Reader, n: int, cell_ext: bool, s: int
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
        p, k = r.unpack(_CELL_HEAD, f"stream {s} cell {i}")
        pos[i], nsq[i] = p, k
        if ext_rows is not None:
            ext_rows[i] = r.unpack(_EXT, f"stream {s} cell {i} ext")
        if k > r.left // 4:
            raise StateFormatError(f"stream {s} cell {i}: {k} sequence ids exceed the bytes left")
        seq_parts.append(r.view(4 * k, "sequence ids").view("<i4"))
    seq_ids = np.concatenate(seq_parts) if seq_parts else np.zeros(0, "<i4")
    return pos, nsq, seq_ids, ext_rows


# -- write ----------------------------------------------------------------------------------------


def state_size(state: SeqState) -> int:
    """Bytes ``write_state`` will produce."""
    size = HEADER_BYTES + 4 * int(state.tokens.words.size)
    if not state.caches:
        return size + state.memory.nbytes
    for cache in state.caches:
        size += 4 + 4 * cache.n_stream
        for s in cache.streams:
            if s.n_cells:
                size += s.n_cells * (8 + (12 if s.ext is not None else 0)) + 4 * int(s.seq_ids.size) + 8
                size += sum(24 + la.k.nbytes + la.v.nbytes for la in s.layers)
    return size


def alloc_buffer(size: int) -> tuple[np.ndarray, memoryview]:
    """An uninitialised byte buffer (every caller writes every byte) and its memoryview.

    ``np.empty`` rather than ``bytearray(size)``: a bytearray is zero-filled, and on these VMs
    faulting in 94 MB of zeroed 4 KiB pages costs ~100 ms; numpy asks for huge pages on large
    buffers, so the one pass that writes the data is the only pass.
    """
    arr = np.empty(size, np.uint8)
    return arr, arr.data


def out_buffer(out: bytearray | memoryview | np.ndarray | None, size: int) -> tuple[np.ndarray, memoryview]:
    """``out`` (which must be exactly ``size`` writable bytes) or a fresh buffer, as (array, view)."""
    if out is None:
        return alloc_buffer(size)
    arr = as_uint8(out)
    if arr.size != size:
        raise ValueError(f"out has {arr.size} bytes, {size} are needed")
    if not arr.flags.writeable:
        raise ValueError("out is read-only")
    return arr, arr.data


def write_state(state: SeqState, out: bytearray | memoryview | np.ndarray | None = None) -> memoryview:
    """Encode ``state`` as a sequence-state file (byte-identical to the parsed file it came from).

    Returns:
        The file's bytes: a view of ``out`` when given, else of a fresh buffer.
    """
    size = state_size(state)
    arr, out = out_buffer(out, size)
    struct.pack_into("<III", out, 0, GGSQ_MAGIC, state.version, state.tokens.words.size)
    at = HEADER_BYTES
    words = state.tokens.words
    arr[at : at + 4 * words.size] = words.view(np.uint8)
    at += 4 * int(words.size)
    if not state.caches:
        arr[at:] = np.frombuffer(state.memory, np.uint8)
        return out
    for cache in state.caches:
        _U32.pack_into(out, at, cache.n_stream)
        at += 4
        for s in cache.streams:
            _U32.pack_into(out, at, s.n_cells)
            at += 4
            if s.n_cells:
                at = _write_stream(out, arr, at, s)
    assert at == size
    return out


def _write_stream(out: memoryview, arr: np.ndarray, at: int, s: KVStream) -> int:
    n = s.n_cells
    if s.seq_ids.size == n and np.all(s.n_seq_id == 1):
        dtype = CELL_EXT_DTYPE if s.ext is not None else CELL_DTYPE
        cells = np.frombuffer(out, dtype, count=n, offset=at)
        cells["pos"], cells["n_seq_id"], cells["seq_id"] = s.pos, 1, s.seq_ids
        if s.ext is not None:
            cells["x"], cells["y"], cells["tok"] = s.ext[:, 0], s.ext[:, 1], s.ext[:, 2]
        at += n * dtype.itemsize
    else:
        j = 0
        for i in range(n):
            k = int(s.n_seq_id[i])
            _CELL_HEAD.pack_into(out, at, int(s.pos[i]), k)
            at += 8
            if s.ext is not None:
                _EXT.pack_into(out, at, *(int(x) for x in s.ext[i]))
                at += 12
            arr[at : at + 4 * k] = s.seq_ids[j : j + k].view(np.uint8)
            at += 4 * k
            j += k
    _TWO_U32.pack_into(out, at, int(s.v_trans), len(s.layers))
    at += 8
    for la in s.layers:
        _K_HEAD.pack_into(out, at, la.k_type, la.k_row_size)
        at = _put(arr, at + 12, la.k)
    for la in s.layers:
        if s.v_trans:
            _VT_HEAD.pack_into(out, at, la.v_type, la.v_el_size, la.n_embd_v_gqa)
        else:
            _K_HEAD.pack_into(out, at, la.v_type, la.v_row_size)
        at = _put(arr, at + 12, la.v)
    return at


def _put(arr: np.ndarray, at: int, src: np.ndarray) -> int:
    arr[at : at + src.nbytes].reshape(src.shape)[...] = src
    return at + src.nbytes
