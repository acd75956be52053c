"""The prefix chunk payload: its format, and reading and checking its header.

``chunksplit`` cuts a saved state into such payloads, ``chunkassemble`` builds a restore file from
them; both rely on the header read here.

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
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from tiers.errors import StateFormatError

from .buffers import BytesLike, as_uint8
from .statefile import LayerLayout, StateLayout, ggml_element_size

CHUNK_MAGIC = b"KVSC"
CHUNK_VERSION = 1
FLAG_V_TRANS = 1
FLAG_REST = 2
CHUNK_HEAD = struct.Struct("<4sHHIIII")  # 24 bytes
CHUNK_LAYER = struct.Struct("<iiQQII")  # 32 bytes


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


def layer_header(k_type: int, k_row: int, v_type: int, v_row: int, v_trans: bool, el: int, n_embd: int) -> bytes:
    """One layer's 32 header bytes; for V rows, ``el``/``n_embd`` come from the V type (0, 0 when quantized)."""
    if not v_trans:
        el = ggml_element_size(v_type) or 0
        n_embd = v_row // el if el and v_row % el == 0 else 0
        if not n_embd:
            el = 0
    return CHUNK_LAYER.pack(k_type, v_type, k_row, v_row, el, n_embd)


def read_chunk_header(payload: BytesLike) -> ChunkInfo:
    """Parse and check a chunk payload's header against its length.

    Raises:
        StateFormatError: not a chunk payload, unknown version, or a length that does not match.
    """
    mv = as_uint8(payload).data
    size = mv.nbytes
    if size < CHUNK_HEAD.size:
        raise StateFormatError(f"chunk payload too short ({size} bytes)")
    magic, version, flags, n_cells, first_pos, n_layer, rest = CHUNK_HEAD.unpack_from(mv, 0)
    if magic != CHUNK_MAGIC:
        raise StateFormatError("not a kvtier chunk payload (bad magic)")
    if version != CHUNK_VERSION:
        raise StateFormatError(f"unsupported chunk payload version {version}")
    if flags & ~(FLAG_V_TRANS | FLAG_REST):
        raise StateFormatError(f"unknown chunk flags {flags:#x}")
    if bool(flags & FLAG_REST) != bool(rest):
        raise StateFormatError("chunk rest flag and rest size disagree")
    if n_layer == 0 and rest and n_cells and first_pos == 0 and not flags & FLAG_V_TRANS:  # a recurrent state alone: its rest is all of it
        if CHUNK_HEAD.size + rest != size:
            raise StateFormatError(f"chunk payload is {size} bytes, its header describes {CHUNK_HEAD.size + rest}")
        return ChunkInfo(n_cells, 0, False, (), CHUNK_HEAD.size, size, rest)
    if n_layer == 0 or n_layer > (size - CHUNK_HEAD.size) // CHUNK_LAYER.size:
        raise StateFormatError(f"chunk layer count {n_layer} does not fit the payload")
    v_trans = bool(flags & FLAG_V_TRANS)
    layers = []
    per_cell = 0
    for il in range(n_layer):
        la = ChunkLayer(*CHUNK_LAYER.unpack_from(mv, CHUNK_HEAD.size + il * CHUNK_LAYER.size))
        if la.k_row_size == 0 or la.v_row_size == 0:
            raise StateFormatError(f"chunk layer {il}: zero row size")
        if (v_trans or la.v_el_size) and (la.v_el_size == 0 or la.v_el_size * la.n_embd_v_gqa != la.v_row_size):
            raise StateFormatError(f"chunk layer {il}: V element size x n_embd_v_gqa != V bytes per cell")
        per_cell += la.k_row_size + la.v_row_size
        layers.append(la)
    data_offset = CHUNK_HEAD.size + n_layer * CHUNK_LAYER.size
    if data_offset + n_cells * per_cell + rest != size:
        raise StateFormatError(
            f"chunk payload is {size} bytes, its header describes {data_offset + n_cells * per_cell + rest}"
        )
    return ChunkInfo(n_cells, first_pos, v_trans, tuple(layers), data_offset, size, rest)
