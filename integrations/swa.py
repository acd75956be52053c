"""Sliding-window states that a stock llama-server keeps after a restore: one masked cell more.

A sliding-window model (Gemma 2/3, gpt-oss, Cohere 2) writes two KV caches into a slot file
(``llama_kv_cache_iswa``): the full-attention layers' cache, every cell, then the sliding-window
layers' cache, only the cells a next query can still see. ``llama_kv_cache::state_write`` leaves
out every cell ``is_masked_swa(n_swa, swa_type, pos, pos_max)`` masks (``src/llama-hparams.h``;
standard windows: ``pos_max - pos >= n_swa``), so once a sequence is longer than the window its
saved window holds exactly ``n_swa`` cells, positions ``pos_max - n_swa + 1 .. pos_max``.

llama-server (``tools/server/server-context.cpp``, the "forcing full prompt re-processing"
branch) keeps a cached prefix of ``n_past`` tokens, next position ``pos_next``, only when the
memory's lowest position for the slot is below a threshold::

    pos_min_thold = max(0, pos_next - n_swa - (has_new_tokens ? 0 : 1))
    keep  if  seq_pos_min < pos_min_thold   (else: a context checkpoint, or recompute everything)

``n_swa`` is 0 there with ``--swa-full``, so any restore passes. On default flags a restored
window (``seq_pos_min = pos_max - n_swa + 1``, ``pos_next = pos_max + 1``) misses by one cell,
although the cell below it would be masked anyway: the next query, at ``pos_max + 1``, sees only
positions above ``pos_max + 1 - n_swa``. ``pad_swa_window`` adds cells below the window with zero
K/V rows. Two by default: one lowers ``seq_pos_min`` below the threshold of a next prompt that
adds tokens, the second below that of a prompt that repeats the saved tokens alone
(``has_new_tokens`` false), which llama-server answers by recomputing the last token, at
``pos_max``. Both cells are masked for every query from ``pos_max`` on (``p1 - p0 >= n_swa``), so
their contents never reach a result. A next prompt that leaves the saved tokens earlier has a
lower ``pos_next`` and is recomputed, as it must be: the window then lacks cells it needs.

What padding cannot do: a sequence no longer than the window (``pos_max < n_swa``) has no
position left to pad (``pos_min_thold`` is 0 and no ``seq_pos_min`` is below it); llama-server
recomputes it after a restore, as it would without one.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import BinaryIO

import numpy as np

from tiers.errors import StateFormatError

from .memkind import MemoryKind
from .statefile import KVCache, KVLayer, KVStream, SeqState
from .stateparse import parse_state
from .statewrite import write_state

PAD_CELLS = 2  # masked cells added below the window (see the module doc)


def swa_window(state: SeqState) -> KVStream:
    """The sliding-window cache's one stream of cells (the second KV cache of a ``kv_pair`` state).

    Raises:
        StateFormatError: the state is not two KV caches, or its window is not one sequence's
            cells at consecutive positions (several streams or sequences, shared cells).
    """
    if state.memory_kind is not MemoryKind.KV_PAIR:
        raise StateFormatError(f"not a sliding-window state (memory {state.memory_kind}, expected kv_pair)")
    streams = [s for s in state.caches[1].streams if s.n_cells]
    if len(streams) != 1:
        raise StateFormatError(f"sliding-window cache holds cells in {len(streams)} streams, expected 1")
    s = streams[0]
    if s.seq_ids.size != s.n_cells or not np.all(s.seq_ids == s.seq_ids[0]):
        raise StateFormatError("sliding-window cache holds more than one sequence or shared cells")
    # The cells come in cache order, which wraps around the window's ring of cells: sort to check.
    pos_min = int(s.pos.min())
    if not np.array_equal(np.sort(s.pos), np.arange(pos_min, pos_min + s.n_cells, dtype=np.int32)):
        raise StateFormatError("sliding-window cache positions are not consecutive")
    return s


def swa_padding(state: SeqState, n_swa: int, cells: int = PAD_CELLS) -> int:
    """How many of ``cells`` masked cells fit below the window: 0 when it is not cut.

    Raises:
        ValueError: ``n_swa`` is not positive.
        StateFormatError: as ``swa_window``, or the cut window does not hold ``n_swa`` cells (a
            wrong ``n_swa``, or a window that is not standard: chunked attention as Llama 4's).
    """
    if n_swa <= 0 or cells < 0:
        raise ValueError(f"n_swa must be positive and cells not negative, got {n_swa} and {cells}")
    s = swa_window(state)
    pos_min = int(s.pos.min())
    if pos_min == 0:
        return 0  # the whole sequence is in the window: below it there is no position to pad
    if s.n_cells != n_swa:
        raise StateFormatError(f"the cut sliding window holds {s.n_cells} cells, n_swa is {n_swa}")
    return min(cells, pos_min)


def pad_swa_window(state: SeqState, n_swa: int, cells: int = PAD_CELLS) -> memoryview:
    """``state`` written with its sliding window ``cells`` masked cells longer, as a state file.

    The cells go below the window, at ``pos_min - cells .. pos_min - 1`` (fewer when position 0
    comes first), for the window's sequence, with zero K and V in every sliding-window layer; the
    token section and the full-attention cache are unchanged. A window that is not cut
    (``swa_padding`` is 0) is written back as it was.

    Args:
        state: a parsed ``kv_pair`` state (``parse_state``).
        n_swa: the model's sliding window in tokens (GGUF ``{arch}.attention.sliding_window``).
        cells: how many masked cells to add (``PAD_CELLS``).

    Returns:
        The file's bytes (``write_state``).

    Raises:
        ValueError, StateFormatError: as ``swa_padding``.
    """
    n_pad = swa_padding(state, n_swa, cells)
    if n_pad == 0:
        return write_state(state)
    s = swa_window(state)
    pos_min = int(s.pos.min())
    padded = dataclasses.replace(
        s,
        n_cells=s.n_cells + n_pad,
        pos=np.concatenate([np.arange(pos_min - n_pad, pos_min, dtype="<i4"), s.pos]),
        n_seq_id=np.concatenate([np.ones(n_pad, "<u4"), s.n_seq_id]),
        seq_ids=np.concatenate([np.full(n_pad, s.seq_ids[0], "<i4"), s.seq_ids]),
        ext=None if s.ext is None else np.concatenate([_null_ext(s.ext, n_pad), s.ext]),
        layers=tuple(_pad_layer(la, n_pad, s.v_trans) for la in s.layers),
    )
    window = KVCache(tuple(padded if x is s else x for x in state.caches[1].streams))
    return write_state(dataclasses.replace(state, caches=(state.caches[0], window)))


def padded_for_restore(state: SeqState) -> SeqState:
    """``state`` as kvtier stores a sliding-window state: its window ``PAD_CELLS`` masked cells
    longer when it is cut (``pad_swa_window``), else as it is.

    The window's size is read from the state: a cut window holds exactly ``n_swa`` cells, and one
    is cut exactly when its first position is above 0. Whatever the kind of window, the cells
    below a cut one are masked for every later query, so zero cells there change no result.

    Raises:
        StateFormatError: as ``swa_window``.
    """
    s = swa_window(state)
    if int(s.pos.min()) == 0:
        return state
    return parse_state(pad_swa_window(state, s.n_cells))


def _null_ext(ext: np.ndarray, n: int) -> np.ndarray:
    """``llama_kv_cell_ext`` of padding cells: no 2D position, no token (LLAMA_TOKEN_NULL)."""
    rows = np.zeros((n, 3), "<i4")
    rows[:, 2] = -1
    return rows


def _pad_layer(la: KVLayer, n: int, v_trans: bool) -> KVLayer:
    """``la`` with ``n`` zero cells before its first: K rows, and V rows or transposed V columns."""
    k = np.concatenate([np.zeros((n, la.k_row_size), np.uint8), la.k])
    if v_trans:  # (n_embd_v_gqa, cells * el_size): each V component gets n zero elements in front
        v = np.concatenate([np.zeros((la.n_embd_v_gqa, n * la.v_el_size), np.uint8), la.v], axis=1)
    else:
        v = np.concatenate([np.zeros((n, la.v_row_size), np.uint8), la.v])
    return dataclasses.replace(la, k=k, v=v)


# -- the window size ------------------------------------------------------------------------------
#
# llama-server does not report n_swa (not in /props nor /slots), and llama-cpp-python's
# llama_model_n_swa answers 0 for a vocab-only load (hparams are not read then). The GGUF key is
# what most sliding-window architectures load it from (gemma2/3, cohere2, gpt-oss: the pinned
# llama.cpp's src/models/*.cpp); a few set it in code instead (exaone4, llama4), so a cut window's
# cell count, which swa_padding checks against n_swa, stays the last word.

_GGUF_MAGIC = b"GGUF"
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_INTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def gguf_sliding_window(path: str | os.PathLike[str]) -> int:
    """``{arch}.attention.sliding_window`` of a GGUF file, 0 when the model has no such key.

    Reads the metadata only, and stops once it has the architecture and the key.

    Raises:
        StateFormatError: not a GGUF file, or its metadata is truncated.
    """
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != _GGUF_MAGIC:
            raise StateFormatError(f"{path}: not a GGUF file")
        (n_kv,) = struct.unpack_from("<Q", head, 16)
        arch: str | None = None
        windows: dict[str, int] = {}
        for _ in range(n_kv):
            key = _gguf_string(f).decode("utf-8", "replace")
            (vtype,) = struct.unpack("<I", _gguf_read(f, 4))
            if key == "general.architecture" and vtype == _GGUF_STRING:
                arch = _gguf_string(f).decode("utf-8", "replace")
            elif key.endswith(".attention.sliding_window") and vtype in _GGUF_INTS:
                (windows[key],) = struct.unpack(_GGUF_INTS[vtype], _gguf_read(f, _GGUF_SCALARS[vtype]))
            else:
                _gguf_skip(f, vtype)
            if arch is not None and f"{arch}.attention.sliding_window" in windows:
                break
    return windows.get(f"{arch}.attention.sliding_window", 0)


def _gguf_read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise StateFormatError("GGUF metadata truncated")
    return data


def _gguf_string(f: BinaryIO) -> bytes:
    (n,) = struct.unpack("<Q", _gguf_read(f, 8))
    return _gguf_read(f, n)


def _gguf_skip(f: BinaryIO, vtype: int) -> None:
    if vtype in _GGUF_SCALARS:
        _gguf_read(f, _GGUF_SCALARS[vtype])
    elif vtype == _GGUF_STRING:
        _gguf_string(f)
    elif vtype == _GGUF_ARRAY:
        etype, n = struct.unpack("<IQ", _gguf_read(f, 12))
        if etype in _GGUF_SCALARS:
            f.seek(n * _GGUF_SCALARS[etype], os.SEEK_CUR)
        else:
            for _ in range(n):
                _gguf_skip(f, etype)
    else:
        raise StateFormatError(f"GGUF metadata: unknown value type {vtype}")
