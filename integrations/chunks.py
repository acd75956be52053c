"""Prefix chunks of a sequence state: split a saved state, assemble a restore file from chunks.

A chunk payload holds the K and V of cells ``[first_pos, first_pos + n_cells)`` of one sequence,
self-described by a small versioned header (little-endian)::

    0   4s  magic b"KVSC"
    4   H   payload version (1)
    6   H   flags: bit 0 = V transposed (saved without flash attention), bit 1 = a rest follows
    8   I   n_cells
    12  I   first_pos
    16  I   n_layer (0 only with a rest: a state without KV cache, see below)
    20  I   rest bytes (0 without a rest)
    24  n_layer x 32 bytes: i32 k_type, i32 v_type, u64 k_row_size, u64 v_row_size (V bytes per cell),
        u32 v_el_size, u32 n_embd_v_gqa (0, 0 for rows of a quantized V type)
    then per layer the K rows (n_cells x k_row_size), then per layer the V of those cells:
        rows (n_cells x v_row_size) or transposed (n_embd_v_gqa x n_cells x v_el_size)

Sliding-window and hybrid states (``SeqState.has_rest``) hold, after a KV cache with every cell,
state that only describes the sequence's recent past: the window's cells, a recurrent state (the
*rest*). Their chunks cut the first cache alone; their tail, which always holds at least one cell,
ends with the rest's bytes as llama.cpp wrote them (a cut window padded, ``swa.padded_for_restore``),
and a restore file built from it ends with them too. Such a tail is the whole state's end: only a
prompt that continues all of the state can use it, and no chunk alone is ever restored for it.

Recurrent memory alone (Mamba, RWKV: ``SeqState.tail_only``) has no K/V per token to cut: such a
state is one tail and no chunk. Its payload has no layers (``n_layer`` 0); ``n_cells`` counts the
positions it covers, all of the state's tokens from 0, and the rest is the whole memory state. A
restore file built from it is the token section and that memory state, nothing else.

Split and assemble copy whole blocks with numpy slice assignment into preallocated buffers: the
Python work is per (layer, chunk), never per cell. Assembly converts the V layout when a chunk and
the target disagree (flash attention on one side only) by an element-wise transpose; that is
impossible for quantized V, which llama.cpp only accepts with flash attention anyway.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiers.errors import StateFormatError
from tiers.keys import as_token_array

from .buffers import BytesLike, alloc_buffer, as_uint8, out_buffer
from .memkind import MemoryKind
from .statefile import (
    CELL_DTYPE,
    GGSQ_MAGIC,
    GGSQ_VERSION,
    HEADER_BYTES,
    KVStream,
    LayerLayout,
    SeqState,
    StateLayout,
    ggml_element_size,
    ggml_type_name,
)
from .stateparse import parse_state
from .swa import padded_for_restore

CHUNK_MAGIC = b"KVSC"
CHUNK_VERSION = 1
FLAG_V_TRANS = 1
FLAG_REST = 2
_HEAD = struct.Struct("<4sHHIIII")  # 24 bytes
_LAYER = struct.Struct("<iiQQII")  # 32 bytes
_K_HEAD = struct.Struct("<iQ")
_VT_HEAD = struct.Struct("<iII")
_UINT: dict[int, np.dtype[Any]] = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}

_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 16  # buffers per writev


@dataclass(frozen=True, slots=True)
class ChunkLayer:
    k_type: int
    v_type: int
    k_row_size: int
    v_row_size: int  # V bytes per cell
    v_el_size: int  # 0 when V rows are of a quantized type
    n_embd_v_gqa: int

    @property
    def layout(self) -> LayerLayout:
        return LayerLayout(self.k_type, self.k_row_size, self.v_type, self.v_row_size)


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """A verified chunk payload header."""

    n_cells: int
    first_pos: int
    v_trans: bool
    layers: tuple[ChunkLayer, ...]
    data_offset: int
    nbytes: int
    rest_nbytes: int = 0  # the rest's bytes at the payload's end (a tail of a state with a rest)

    @property
    def layout(self) -> StateLayout:
        return StateLayout(tuple(la.layout for la in self.layers))

    @property
    def n_layer(self) -> int:
        return len(self.layers)


@dataclass(frozen=True, slots=True)
class SplitResult:
    """Chunk payloads of one state; ``chunks[i]`` covers cells of chunk ``first_chunk + i``.

    The payloads (and the tail) are memoryviews into one shared buffer, which lives as long as any
    of them does; copy one (``bytes(p)``) to keep it alone for long.
    """

    tokens: np.ndarray  # int32, all tokens of the state
    chunk_tokens: int
    n_chunks: int  # full chunks in the state (including any skipped by first_chunk)
    first_chunk: int
    chunks: list[memoryview]
    tail: memoryview | None  # the cells after the last full chunk, when asked for and present
    layout: StateLayout
    v_trans: bool

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def tail_tokens(self) -> int:
        return self.n_tokens - self.n_chunks * self.chunk_tokens


def _layer_header(k_type: int, k_row: int, v_type: int, v_row: int, v_trans: bool, el: int, n_embd: int) -> bytes:
    if not v_trans:
        el = ggml_element_size(v_type) or 0
        n_embd = v_row // el if el and v_row % el == 0 else 0
        if not n_embd:
            el = 0
    return _LAYER.pack(k_type, v_type, k_row, v_row, el, n_embd)


def read_chunk_header(payload: BytesLike) -> ChunkInfo:
    """Parse and check a chunk payload's header against its length.

    Raises:
        StateFormatError: not a chunk payload, unknown version, or a length that does not match.
    """
    mv = as_uint8(payload).data
    size = mv.nbytes
    if size < _HEAD.size:
        raise StateFormatError(f"chunk payload too short ({size} bytes)")
    magic, version, flags, n_cells, first_pos, n_layer, rest = _HEAD.unpack_from(mv, 0)
    if magic != CHUNK_MAGIC:
        raise StateFormatError("not a kvtier chunk payload (bad magic)")
    if version != CHUNK_VERSION:
        raise StateFormatError(f"unsupported chunk payload version {version}")
    if flags & ~(FLAG_V_TRANS | FLAG_REST):
        raise StateFormatError(f"unknown chunk flags {flags:#x}")
    if bool(flags & FLAG_REST) != bool(rest):
        raise StateFormatError("chunk rest flag and rest size disagree")
    if n_layer == 0 and rest and n_cells and first_pos == 0 and not flags & FLAG_V_TRANS:  # a recurrent state alone: its rest is all of it
        if _HEAD.size + rest != size:
            raise StateFormatError(f"chunk payload is {size} bytes, its header describes {_HEAD.size + rest}")
        return ChunkInfo(n_cells, 0, False, (), _HEAD.size, size, rest)
    if n_layer == 0 or n_layer > (size - _HEAD.size) // _LAYER.size:
        raise StateFormatError(f"chunk layer count {n_layer} does not fit the payload")
    v_trans = bool(flags & FLAG_V_TRANS)
    layers = []
    per_cell = 0
    for il in range(n_layer):
        la = ChunkLayer(*_LAYER.unpack_from(mv, _HEAD.size + il * _LAYER.size))
        if la.k_row_size == 0 or la.v_row_size == 0:
            raise StateFormatError(f"chunk layer {il}: zero row size")
        if (v_trans or la.v_el_size) and (la.v_el_size == 0 or la.v_el_size * la.n_embd_v_gqa != la.v_row_size):
            raise StateFormatError(f"chunk layer {il}: V element size x n_embd_v_gqa != V bytes per cell")
        per_cell += la.k_row_size + la.v_row_size
        layers.append(la)
    data_offset = _HEAD.size + n_layer * _LAYER.size
    if data_offset + n_cells * per_cell + rest != size:
        raise StateFormatError(
            f"chunk payload is {size} bytes, its header describes {data_offset + n_cells * per_cell + rest}"
        )
    return ChunkInfo(n_cells, first_pos, v_trans, tuple(layers), data_offset, size, rest)


# -- split ----------------------------------------------------------------------------------------


def split_state(
    state: SeqState | BytesLike, chunk_tokens: int, *, tail: bool = False, first_chunk: int = 0
) -> SplitResult:
    """Cut a single-sequence state into prefix chunks of ``chunk_tokens`` cells.

    Args:
        state: a parsed state or the file's bytes.
        chunk_tokens: cells per chunk (the namespace's chunk size).
        tail: also return the cells after the last full chunk (a session's partial tail).
        first_chunk: skip materialising chunks before this index (already stored elsewhere).

    Raises:
        StateFormatError: the file is malformed or not splittable (``SeqState.split_reason``).
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if not isinstance(state, SeqState):
        state = parse_state(state)
    reason = state.store_reason
    if reason is not None:
        raise StateFormatError(f"state is not splittable: {reason}")
    if state.tail_only:
        return _split_tail_only(state, chunk_tokens, tail)
    rest: BytesLike = b""
    if state.has_rest:
        if tail and state.memory_kind is MemoryKind.KV_PAIR:  # the rest goes into the tail alone: pad it only then
            state = padded_for_restore(state)
        rest, state = state.rest, state.first_cache
    stream = state.cell_streams()[0]
    n = stream.n_cells
    n_chunks = chunk_count(n, chunk_tokens, rest=bool(rest))
    spans = [(i * chunk_tokens, (i + 1) * chunk_tokens) for i in range(max(first_chunk, 0), n_chunks)]
    if tail and n_chunks * chunk_tokens < n:
        spans.append((n_chunks * chunk_tokens, n))
    heads = b"".join(
        _layer_header(la.k_type, la.k_row_size, la.v_type, la.v_row_size, stream.v_trans, la.v_el_size, la.n_embd_v_gqa)
        for la in stream.layers
    )
    per_cell = sum(la.k_row_size + la.v_row_size for la in stream.layers)
    # One buffer for every payload: one allocation faults its pages in far faster than one per chunk
    # (4-5 GB/s against 2.5 GB/s for a 94 MB state here). The payloads are views into it.
    sizes = [_HEAD.size + len(heads) + (b - a) * per_cell for a, b in spans]
    with_tail = tail and n_chunks * chunk_tokens < n
    if with_tail:
        sizes[-1] += len(rest)
    arena, arena_mv = alloc_buffer(sum(sizes))
    payloads, at = [], 0
    for (a, b), size in zip(spans, sizes):
        payloads.append(_cut(stream, a, b, heads, arena[at : at + size], arena_mv[at : at + size]))
        at += size
    tail_payload = payloads.pop() if with_tail else None
    if tail_payload is not None and rest:
        _add_rest(tail_payload, rest)
    layout = state.layout
    assert layout is not None
    return SplitResult(
        state.tokens.tokens, chunk_tokens, n_chunks, max(first_chunk, 0), payloads, tail_payload, layout,
        stream.v_trans,
    )


def chunk_count(n_cells: int, chunk_tokens: int, *, rest: bool = False) -> int:
    """Full chunks a state of ``n_cells`` cells is cut into: with a rest, one cell at least is
    left to the tail, which carries the rest."""
    return (n_cells - 1) // chunk_tokens if rest else n_cells // chunk_tokens


def chunks_of(state: SeqState, chunk_tokens: int) -> int:
    """Full chunks ``split_state`` cuts ``state`` into: none for recurrent memory alone, whose
    one tail holds every token."""
    return 0 if state.tail_only else chunk_count(state.n_tokens, chunk_tokens, rest=state.has_rest)


def _split_tail_only(state: SeqState, chunk_tokens: int, tail: bool) -> SplitResult:
    """A recurrent state alone as its one tail: no layers, every token, the memory state as the rest."""
    payload = None
    if tail:
        rest = as_uint8(state.rest)
        arr, payload = alloc_buffer(_HEAD.size + rest.size)
        _HEAD.pack_into(payload, 0, CHUNK_MAGIC, CHUNK_VERSION, FLAG_REST, state.n_tokens, 0, 0, rest.size)
        arr[_HEAD.size:] = rest
    return SplitResult(state.tokens.tokens, chunk_tokens, 0, 0, [], payload, StateLayout(()), False)


def _add_rest(payload: memoryview, rest: BytesLike) -> None:
    """Put ``rest`` at the end of a tail payload sized for it, and say so in its header."""
    data = as_uint8(rest)
    payload[payload.nbytes - data.size:] = data.data
    magic, version, flags, n, first, n_layer, _ = _HEAD.unpack_from(payload, 0)
    _HEAD.pack_into(payload, 0, magic, version, flags | FLAG_REST, n, first, n_layer, data.size)


def _cut(stream: KVStream, a: int, b: int, heads: bytes, arr: np.ndarray, out: memoryview) -> memoryview:
    n = b - a
    data_offset = _HEAD.size + len(heads)
    flags = FLAG_V_TRANS if stream.v_trans else 0
    _HEAD.pack_into(out, 0, CHUNK_MAGIC, CHUNK_VERSION, flags, n, a, len(stream.layers), 0)
    out[_HEAD.size : data_offset] = heads
    at = data_offset
    for la in stream.layers:
        size = n * la.k_row_size
        arr[at : at + size].reshape(n, la.k_row_size)[...] = la.k[a:b]
        at += size
    for la in stream.layers:
        size = n * la.v_row_size
        if stream.v_trans:
            el = la.v_el_size
            arr[at : at + size].reshape(la.n_embd_v_gqa, n * el)[...] = la.v[:, a * el : b * el]
        else:
            arr[at : at + size].reshape(n, la.v_row_size)[...] = la.v[a:b]
        at += size
    return out


def first_cells(payload: bytes | memoryview, n: int) -> bytes | memoryview:
    """The first ``n`` cells of a chunk payload, as a payload of their own.

    Attention is causal: a cell's K and V depend only on the tokens up to it, so the first ``n``
    cells of a stored chunk (or tail) are exactly what a prompt sharing only those ``n`` tokens
    would have computed. Returns ``payload`` itself when it holds ``n`` cells or fewer.

    Raises:
        StateFormatError: ``payload`` is not a valid chunk payload.
    """
    info = read_chunk_header(payload)
    if info.rest_nbytes:
        raise StateFormatError("a tail with a rest cannot be cut: its rest belongs to its last cell")
    if n >= info.n_cells:
        return payload
    if n <= 0:
        raise ValueError(f"cannot cut a chunk to {n} cells")
    src = as_uint8(payload)
    per_cell = sum(la.k_row_size + la.v_row_size for la in info.layers)
    out = np.empty(info.data_offset + n * per_cell, np.uint8)
    out[: info.data_offset] = src[: info.data_offset]
    _HEAD.pack_into(out.data, 0, CHUNK_MAGIC, CHUNK_VERSION, FLAG_V_TRANS if info.v_trans else 0, n, info.first_pos,
                    info.n_layer, 0)
    at, to = info.data_offset, info.data_offset
    for la in info.layers:
        out[to : to + n * la.k_row_size] = src[at : at + n * la.k_row_size]
        at += info.n_cells * la.k_row_size
        to += n * la.k_row_size
    for la in info.layers:
        block = src[at : at + info.n_cells * la.v_row_size]
        if info.v_trans:
            el = la.v_el_size
            out[to : to + n * la.v_row_size].reshape(la.n_embd_v_gqa, n * el)[...] = (
                block.reshape(la.n_embd_v_gqa, info.n_cells * el)[:, : n * el])
        else:
            out[to : to + n * la.v_row_size] = block[: n * la.v_row_size]
        at += info.n_cells * la.v_row_size
        to += n * la.v_row_size
    return out.data


# -- assemble -------------------------------------------------------------------------------------


def assemble_state(
    payloads: Sequence[BytesLike],
    tokens: Sequence[int] | np.ndarray,
    *,
    v_trans: bool,
    n_stream: int = 1,
    out: bytearray | memoryview | np.ndarray | None = None,
) -> memoryview:
    """Build a restore file from consecutive chunk payloads (a prefix, optionally ending in a tail).

    The file holds cells ``0..L-1`` of sequence 0 in stream 0 (other streams empty), the plain token
    list ``tokens[:L]`` and the target's V layout; L is the payloads' total cell count.

    Args:
        payloads: chunk payloads in prefix order, the first starting at position 0.
        tokens: the token sequence (at least L tokens; only the first L are written).
        v_trans: the target's V layout (True: transposed, a server without flash attention).
        n_stream: the target's stream count (slots without ``--kv-unified``; 1 otherwise).
        out: optional writable buffer of exactly the resulting size to fill (``restore_size``).

    Returns:
        The restore file's bytes (a view of ``out`` when given).

    Raises:
        StateFormatError: a payload is malformed, out of order, disagrees with the others, or its
            quantized V would need transposing.
        ValueError: fewer tokens than cells, or a bad ``n_stream``.
    """
    pieces = state_pieces(payloads, tokens, v_trans=v_trans, n_stream=n_stream)
    arr, view = out_buffer(out, sum(p.nbytes for p in pieces))
    at = 0
    for p in pieces:
        arr[at : at + p.nbytes] = np.frombuffer(p, np.uint8)
        at += p.nbytes
    return view


def state_pieces(
    payloads: Sequence[BytesLike], tokens: Sequence[int] | np.ndarray, *, v_trans: bool, n_stream: int = 1,
) -> list[memoryview]:
    """The restore file ``assemble_state`` builds, as consecutive byte slices: written with ``writev``
    they make the file without joining it in memory.

    K rows, and V rows when no V is transposed, are views into ``payloads``. Where the target wants
    transposed V (a server without flash attention) or a chunk holds it, each element row of a layer
    interleaves all chunks: each layer's V block is built once, into one buffer for all layers
    (about half the state's bytes).

    Raises:
        StateFormatError: a payload is malformed, out of order, disagrees with the others, or its
            quantized V would need transposing.
        ValueError: fewer tokens than cells, or a bad ``n_stream``.
    """
    if n_stream < 1:
        raise ValueError(f"n_stream must be >= 1, got {n_stream}")
    infos = [read_chunk_header(p) for p in payloads]
    if any(i.rest_nbytes for i in infos[:-1]):
        raise StateFormatError("only the last payload of a restore may carry a rest")
    n_cells = sum(i.n_cells for i in infos)
    toks = as_token_array(tokens)
    if toks.size < n_cells:
        raise ValueError(f"{toks.size} tokens for {n_cells} cells")
    layers = _check_agree(infos)
    if infos and not layers:  # recurrent memory alone: the token section, then the memory state
        if len(infos) > 1:
            raise StateFormatError("a payload without KV layers is a whole state: it cannot follow chunks")
        head = np.empty(HEADER_BYTES + 4 * n_cells, np.uint8)
        struct.pack_into("<III", head.data, 0, GGSQ_MAGIC, GGSQ_VERSION, n_cells)
        head[HEADER_BYTES:].view("<i4")[:] = toks[:n_cells]
        return [head.data, as_uint8(payloads[0]).data[infos[0].data_offset:]]
    if n_cells == 0:
        empty = np.zeros(HEADER_BYTES + 4 + 4 * n_stream, np.uint8)
        struct.pack_into("<IIII", empty.data, 0, GGSQ_MAGIC, GGSQ_VERSION, 0, n_stream)
        return [empty.data]
    transposing = v_trans or any(i.v_trans for i in infos)
    els = [_target_el(la, infos, v_trans, il) for il, la in enumerate(layers)] if transposing else []
    # Everything before the first layer's K rows: header, tokens, stream count, cells, V layout.
    meta_at = HEADER_BYTES + 4 * n_cells + 8
    head = np.empty(meta_at + CELL_DTYPE.itemsize * n_cells + 8, np.uint8)
    struct.pack_into("<III", head.data, 0, GGSQ_MAGIC, GGSQ_VERSION, n_cells)
    head[HEADER_BYTES : HEADER_BYTES + 4 * n_cells].view("<i4")[:] = toks[:n_cells]
    struct.pack_into("<II", head.data, HEADER_BYTES + 4 * n_cells, n_stream, n_cells)
    cells = head[meta_at : meta_at + CELL_DTYPE.itemsize * n_cells].view(CELL_DTYPE)
    cells["pos"] = np.arange(n_cells, dtype=np.int32)
    cells["n_seq_id"] = 1
    cells["seq_id"] = 0
    struct.pack_into("<II", head.data, head.size - 8, int(v_trans), len(layers))
    pieces = [head.data]
    arrays = [as_uint8(p) for p in payloads]
    views = [a.data for a in arrays]
    at = [i.data_offset for i in infos]
    # The transposed V blocks, one buffer for all layers.
    v_blocks = np.empty(n_cells * sum(la.v_row_size for la in layers) if transposing else 0, np.uint8)
    v_used = 0
    for part in ("k", "v"):  # every layer's K block, then every layer's V block
        for il, la in enumerate(layers):
            if part == "v" and transposing:
                el = els[il]
                if v_trans:
                    pieces.append(memoryview(_VT_HEAD.pack(la.v_type, el, la.v_row_size // el)))
                else:
                    pieces.append(memoryview(_K_HEAD.pack(la.v_type, la.v_row_size)))
                end = _place_v(v_blocks, v_used, la.v_row_size, el, v_trans, n_cells, infos, arrays, at)
                pieces.append(v_blocks.data[v_used:end])
                v_used = end
                continue
            ggml_type, row = (la.k_type, la.k_row_size) if part == "k" else (la.v_type, la.v_row_size)
            pieces.append(memoryview(_K_HEAD.pack(ggml_type, row)))
            for j, info in enumerate(infos):
                nb = info.n_cells * row
                pieces.append(views[j][at[j] : at[j] + nb])
                at[j] += nb
    if n_stream > 1:
        pieces.append(memoryview(bytes(4 * (n_stream - 1))))  # the other streams: cell_count = 0
    if infos[-1].rest_nbytes:  # the window or recurrent state, as llama.cpp wrote it after the cache
        pieces.append(views[-1][infos[-1].nbytes - infos[-1].rest_nbytes:])
    return pieces


def write_pieces(path: str | os.PathLike[str], pieces: Sequence[BytesLike], *, overwrite: bool = False) -> int:
    """Write ``pieces`` one after the other as the file ``path`` (``writev``, no joined copy); returns its size.

    Args:
        overwrite: write over an existing file in place (its pages are reused, then it is cut to
            size) instead of creating a new one. A link at ``path`` is refused either way.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False (names are meant to be unique).
        OSError: the file cannot be written (it is removed again).
    """
    todo = [v for v in (as_uint8(p).data for p in pieces) if v.nbytes]
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags | (0 if overwrite else os.O_EXCL), 0o644)
    total = i = 0
    try:
        while i < len(todo):
            n = os.writev(fd, todo[i : i + _IOV_MAX])
            if n <= 0:
                raise OSError(f"writev wrote nothing to {path}")
            total += n
            while n:  # skip what was written; a short write leaves the rest of a piece
                if n >= todo[i].nbytes:
                    n -= todo[i].nbytes
                    i += 1
                else:
                    todo[i], n = todo[i][n:], 0
        if overwrite:
            os.ftruncate(fd, total)  # a longer file written here before keeps no tail
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return total


def _restore_size(infos: list[ChunkInfo], n_stream: int) -> int:
    n_cells = sum(i.n_cells for i in infos)
    if infos and not infos[0].layers:  # recurrent memory alone
        return HEADER_BYTES + 4 * n_cells + infos[0].rest_nbytes
    if not n_cells:
        return HEADER_BYTES + 4 + 4 * n_stream
    per_cell = sum(la.k_row_size + la.v_row_size for la in infos[0].layers)
    # header + tokens, n_stream + stream counts, cells, v_trans + n_layer, K/V headers, rows
    return (HEADER_BYTES + 4 * n_cells + 4 + 4 * n_stream + CELL_DTYPE.itemsize * n_cells + 8
            + 24 * len(infos[0].layers) + n_cells * per_cell + infos[-1].rest_nbytes)


def restore_size(payloads: Sequence[BytesLike], *, n_stream: int = 1) -> int:
    """Bytes of the file ``assemble_state`` builds from ``payloads`` (to size a reusable buffer)."""
    return _restore_size([read_chunk_header(p) for p in payloads], n_stream)


def _place_v(
    arr: np.ndarray, at: int, v_row: int, el: int, v_trans: bool, n_cells: int,
    infos: list[ChunkInfo], views: list[np.ndarray], v_at: list[int],
) -> int:
    size = n_cells * v_row
    block = arr[at : at + size]
    c0 = 0
    for j, info in enumerate(infos):
        n = info.n_cells
        nb = n * v_row
        src = views[j][v_at[j] : v_at[j] + nb]
        v_at[j] += nb
        if info.v_trans == v_trans:
            if v_trans:  # (n_embd, cells) element rows: a strided block copy
                block.reshape(v_row // el, n_cells * el)[:, c0 * el : (c0 + n) * el] = src.reshape(v_row // el, n * el)
            else:
                block.reshape(n_cells, v_row)[c0 : c0 + n] = src.reshape(n, v_row)
        else:
            dt = _UINT[el]
            n_embd = v_row // el
            if v_trans:  # chunk rows (cells, n_embd) -> target (n_embd, cells)
                block.view(dt).reshape(n_embd, n_cells)[:, c0 : c0 + n] = src.view(dt).reshape(n, n_embd).T
            else:  # chunk (n_embd, cells) -> target rows (cells, n_embd)
                block.view(dt).reshape(n_cells, n_embd)[c0 : c0 + n] = src.view(dt).reshape(n_embd, n).T
        c0 += n
    return at + size


def _check_agree(infos: list[ChunkInfo]) -> tuple[ChunkLayer, ...]:
    if not infos:
        return ()
    first = infos[0]
    layout = first.layout
    expect = 0
    for j, info in enumerate(infos):
        if info.first_pos != expect:
            raise StateFormatError(f"chunk {j} starts at position {info.first_pos}, expected {expect}")
        if info.layout != layout:
            raise StateFormatError(f"chunk {j} has another KV layout than chunk 0 (layers, types or row sizes)")
        expect += info.n_cells
    return first.layers


def _target_el(la: ChunkLayer, infos: list[ChunkInfo], v_trans: bool, il: int) -> int:
    """V element size for the target when any chunk needs its V transposed (0 when none does)."""
    needs = any(i.v_trans != v_trans for i in infos)
    if not needs and not v_trans:
        return la.v_el_size
    el = next((i.layers[il].v_el_size for i in infos if i.v_trans), 0) or ggml_element_size(la.v_type) or 0
    if not el or el not in _UINT or la.v_row_size % el:
        raise StateFormatError(
            f"layer {il}: V type {ggml_type_name(la.v_type)} cannot be transposed (quantized V needs flash "
            "attention on both sides: save and restore with -fa on)"
        )
    return el
