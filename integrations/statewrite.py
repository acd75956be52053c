"""Write a ``SeqState`` as a llama.cpp sequence-state file (the format: ``statefile``), byte-exact.

A parsed state written back is the file it was parsed from, byte for byte: the writer follows
``llama_kv_cache::state_write`` (and ``recurrentstate.write_recurrent`` for the recurrent part)
field by field, and copies K/V blocks with numpy slice assignment, never cell by cell when every
cell holds one sequence.
"""

from __future__ import annotations

import struct

import numpy as np

from tiers.errors import StateFormatError

from .buffers import BytesLike, out_buffer
from .recurrentstate import write_recurrent
from .statefile import (
    CELL_DTYPE,
    CELL_EXT,
    CELL_EXT_DTYPE,
    GGSQ_MAGIC,
    HEADER_BYTES,
    V_TRANS_HEAD,
    KVCache,
    KVStream,
    SeqState,
    cache_nbytes,
)
from .stateparse import parse_state
from .statereader import CELL_HEAD, ROW_HEAD, TWO_U32, U32


def state_size(state: SeqState) -> int:
    """Bytes ``write_state`` will produce."""
    size = HEADER_BYTES + 4 * int(state.tokens.words.size)
    if not state.caches and state.recurrent is None:
        return size + state.memory.nbytes
    if state.recurrent is not None:
        size += state.recurrent.nbytes
    for cache in state.caches:
        size += cache_nbytes(cache)
    return size


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
    if not state.caches and state.recurrent is None:
        arr[at:] = np.frombuffer(state.memory, np.uint8)
        return out
    for cache in state.caches:
        U32.pack_into(out, at, cache.n_stream)
        at += 4
        for s in cache.streams:
            U32.pack_into(out, at, s.n_cells)
            at += 4
            if s.n_cells:
                at = _write_stream(out, arr, at, s)
    if state.recurrent is not None:
        at = write_recurrent(out, arr, at, state.recurrent)
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
            CELL_HEAD.pack_into(out, at, int(s.pos[i]), k)
            at += 8
            if s.ext is not None:
                CELL_EXT.pack_into(out, at, *(int(x) for x in s.ext[i]))
                at += 12
            arr[at : at + 4 * k] = s.seq_ids[j : j + k].view(np.uint8)
            at += 4 * k
            j += k
    TWO_U32.pack_into(out, at, int(s.v_trans), len(s.layers))
    at += 8
    for la in s.layers:
        ROW_HEAD.pack_into(out, at, la.k_type, la.k_row_size)
        at = _put(arr, at + 12, la.k)
    for la in s.layers:
        if s.v_trans:
            V_TRANS_HEAD.pack_into(out, at, la.v_type, la.v_el_size, la.n_embd_v_gqa)
        else:
            ROW_HEAD.pack_into(out, at, la.v_type, la.v_row_size)
        at = _put(arr, at + 12, la.v)
    return at


def _put(arr: np.ndarray, at: int, src: np.ndarray) -> int:
    arr[at : at + src.nbytes].reshape(src.shape)[...] = src
    return at + src.nbytes


def retarget_state(state: SeqState | BytesLike, n_stream: int) -> memoryview:
    """Rewrite a whole state for a target with another stream count (cells move to stream 0).

    Raises:
        StateFormatError: opaque, recurrent or hybrid memory, or cells in more than one stream of a cache.
    """
    if not isinstance(state, SeqState):
        state = parse_state(state)
    if not state.caches or state.recurrent is not None:  # a recurrent state has no streams to move
        raise StateFormatError(f"cannot change the stream count of {state.memory_kind} memory")
    caches = []
    for cache in state.caches:
        full = [s for s in cache.streams if s.n_cells]
        if len(full) > 1:
            raise StateFormatError("cells in more than one stream")
        caches.append(KVCache(tuple(full + [KVStream.empty()] * (n_stream - len(full)))))
    return write_state(
        SeqState(state.version, state.tokens, state.memory_kind, tuple(caches), state.cell_ext, state.memory, 0)
    )
