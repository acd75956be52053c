"""Assemble chunk payloads (the format: ``chunks``) into a llama.cpp sequence-state file to restore.

The file holds cells ``0..L-1`` of sequence 0 in stream 0 (other streams empty), the plain token
list and the target's V layout. ``state_pieces`` gives it as consecutive byte slices, most of them
views into the payloads, for ``write_pieces`` to write with ``writev`` without joining them;
``assemble_state`` joins them into one buffer (``restore_size`` sizes a reusable one).

Assembly converts the V layout when a chunk and the target disagree (flash attention on one side
only) by an element-wise transpose; that is impossible for quantized V, which llama.cpp only
accepts with flash attention anyway.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from tiers.errors import StateFormatError
from tiers.keys import as_token_array

from .buffers import BytesLike, as_uint8, out_buffer
from .chunks import ChunkInfo, ChunkLayer, read_chunk_header
from .statefile import (
    CELL_DTYPE,
    GGSQ_MAGIC,
    GGSQ_VERSION,
    HEADER_BYTES,
    V_TRANS_HEAD,
    ggml_element_size,
    ggml_type_name,
)
from .statereader import ROW_HEAD

_UINT: dict[int, np.dtype[Any]] = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 16  # buffers per writev


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
        return _recurrent_pieces(payloads, infos, toks[:n_cells])
    if n_cells == 0:
        return [_empty_state(n_stream)]
    transposing = v_trans or any(i.v_trans for i in infos)
    els = [_target_el(la, infos, v_trans, il) for il, la in enumerate(layers)] if transposing else []
    pieces = [restore_head(toks[:n_cells], n_stream, v_trans, len(layers))]
    arrays = [as_uint8(p) for p in payloads]
    views = [a.data for a in arrays]
    at = [i.data_offset for i in infos]  # where each payload's next block starts
    pieces += _row_blocks([(la.k_type, la.k_row_size) for la in layers], infos, views, at)
    if transposing:
        pieces += _transposed_v_blocks(layers, els, v_trans, infos, arrays, at)
    else:
        pieces += _row_blocks([(la.v_type, la.v_row_size) for la in layers], infos, views, at)
    if n_stream > 1:
        pieces.append(memoryview(bytes(4 * (n_stream - 1))))  # the other streams: cell_count = 0
    if infos[-1].rest_nbytes:  # the window or recurrent state, as llama.cpp wrote it after the cache
        pieces.append(views[-1][infos[-1].nbytes - infos[-1].rest_nbytes:])
    return pieces


def _recurrent_pieces(payloads: Sequence[BytesLike], infos: list[ChunkInfo], toks: np.ndarray) -> list[memoryview]:
    """The restore file of a recurrent state alone: the header and tokens, then its memory state."""
    if len(infos) > 1:
        raise StateFormatError("a payload without KV layers is a whole state: it cannot follow chunks")
    head = np.empty(HEADER_BYTES + 4 * toks.size, np.uint8)
    struct.pack_into("<III", head.data, 0, GGSQ_MAGIC, GGSQ_VERSION, toks.size)
    head[HEADER_BYTES:].view("<i4")[:] = toks
    return [head.data, as_uint8(payloads[0]).data[infos[0].data_offset:]]


def _empty_state(n_stream: int) -> memoryview:
    """A restore file of no tokens: the header and ``n_stream`` empty streams."""
    empty = np.zeros(HEADER_BYTES + 4 + 4 * n_stream, np.uint8)
    struct.pack_into("<IIII", empty.data, 0, GGSQ_MAGIC, GGSQ_VERSION, 0, n_stream)
    return empty.data


def restore_head(toks: np.ndarray, n_stream: int, v_trans: bool, n_layer: int) -> memoryview:
    """Everything before the first layer's K rows: header, tokens, stream count, cells, V layout.

    One cell per token, at positions ``0..n-1``, of sequence 0, in stream 0.
    """
    n_cells = int(toks.size)
    meta_at = HEADER_BYTES + 4 * n_cells + 8
    head = np.empty(meta_at + CELL_DTYPE.itemsize * n_cells + 8, np.uint8)
    struct.pack_into("<III", head.data, 0, GGSQ_MAGIC, GGSQ_VERSION, n_cells)
    head[HEADER_BYTES : HEADER_BYTES + 4 * n_cells].view("<i4")[:] = toks
    struct.pack_into("<II", head.data, HEADER_BYTES + 4 * n_cells, n_stream, n_cells)
    cells = head[meta_at : meta_at + CELL_DTYPE.itemsize * n_cells].view(CELL_DTYPE)
    cells["pos"] = np.arange(n_cells, dtype=np.int32)
    cells["n_seq_id"] = 1
    cells["seq_id"] = 0
    struct.pack_into("<II", head.data, head.size - 8, int(v_trans), n_layer)
    return head.data


def _row_blocks(
    heads: list[tuple[int, int]], infos: list[ChunkInfo], views: list[memoryview], at: list[int],
) -> list[memoryview]:
    """Each layer's rows as the payloads hold them: its ``(type, row size)`` header, then each
    payload's rows of it, views into the payloads (``at``: where each payload's next block starts)."""
    pieces = []
    for ggml_type, row in heads:
        pieces.append(memoryview(ROW_HEAD.pack(ggml_type, row)))
        for j, info in enumerate(infos):
            nb = info.n_cells * row
            pieces.append(views[j][at[j] : at[j] + nb])
            at[j] += nb
    return pieces


def _transposed_v_blocks(
    layers: tuple[ChunkLayer, ...], els: list[int], v_trans: bool, infos: list[ChunkInfo],
    arrays: list[np.ndarray], at: list[int],
) -> list[memoryview]:
    """Each layer's V header and V block in the target's layout, built into one buffer for all layers
    (each element row of a transposed layer interleaves all payloads)."""
    n_cells = sum(i.n_cells for i in infos)
    v_blocks = np.empty(n_cells * sum(la.v_row_size for la in layers), np.uint8)
    pieces: list[memoryview] = []
    used = 0
    for la, el in zip(layers, els):
        if v_trans:
            pieces.append(memoryview(V_TRANS_HEAD.pack(la.v_type, el, la.v_row_size // el)))
        else:
            pieces.append(memoryview(ROW_HEAD.pack(la.v_type, la.v_row_size)))
        end = _place_v(v_blocks, used, la.v_row_size, el, v_trans, n_cells, infos, arrays, at)
        pieces.append(v_blocks.data[used:end])
        used = end
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
