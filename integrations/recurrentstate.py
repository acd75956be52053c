"""Recurrent memory in a sequence-state file (``llama_memory_recurrent::state_write``): parse, size, write.

Mamba, RWKV and the recurrent layers of hybrid models (LFM2's short convolutions, Granite 4,
Jamba, Falcon-H1, Qwen3-Next, ...) keep a fixed-size state per sequence, not K/V per token::

    u32 cell_count                 (the cells holding the sequence: 1 in a slot save, 0 when empty)
    per cell: i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id   (n_seq_id is 0 in a one-sequence save)
    u32 s_trans (always 0), u32 n_layer                      (the model's layers, attention included)
    per recurrent layer, R (conv state):       i32 type, u64 row_size, cell_count rows
    per recurrent layer, S (SSM or WKV state): i32 type, u64 row_size, cell_count rows

Which layers are recurrent is not written: llama.cpp skips the layers without recurrent state (a
hybrid model's attention layers), so the file holds m <= n_layer R blocks, then m S blocks. m is
read from the bytes themselves: the recurrent state is the last part of the memory, so row blocks
are read up to the end of the file; there must be 2m of them, the first m alike and the last m
alike (llama.cpp gives every layer the same R type and row size, ``n_embd_r``, and the same S type
and row size, ``n_embd_s``), and R unlike S: a file cut at a block boundary (R R S S cut to R R)
would otherwise read as fewer layers. The recurrent models of the pinned llama.cpp all have
``n_embd_r != n_embd_s`` (a row size may be 0: LFM2 has no S state); one where they matched would
stay opaque. A file that does not fit is not guessed at: the caller keeps the memory opaque. So
are ``s_trans = 1`` (the pinned llama.cpp never writes it), models with a PLE conv history (an
untyped ``u64 row_size`` and rows after some layers' R rows) and anything after the recurrent state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiers.errors import StateFormatError

from .statereader import CELL_HEAD, MAX_LAYERS, ROW_HEAD, TWO_U32, U32, StateReader


@dataclass(frozen=True, slots=True)
class RecurrentLayer:
    """One recurrent layer: ``r`` (conv state) and ``s`` (SSM state) rows, ``(n_cells, row_size)`` uint8 views."""

    r_type: int
    r_row_size: int
    r: np.ndarray
    s_type: int
    s_row_size: int
    s: np.ndarray


@dataclass(frozen=True, slots=True)
class RecurrentState:
    """The recurrent part of a memory state: its cells and, per recurrent layer, their R and S rows."""

    n_cells: int
    pos: np.ndarray  # int32 (n_cells,): the position of the last token each cell has seen
    n_seq_id: np.ndarray  # uint32 (n_cells,)
    seq_ids: np.ndarray  # int32, all cells' sequence ids in order (none in a one-sequence save)
    n_layer: int  # the model's layer count as written; the recurrent layers are len(layers) of them
    layers: tuple[RecurrentLayer, ...]

    @property
    def bytes_per_cell(self) -> int:
        return sum(la.r_row_size + la.s_row_size for la in self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes this part takes in the file."""
        meta = U32.size + self.n_cells * CELL_HEAD.size + 4 * int(self.seq_ids.size) + TWO_U32.size
        return meta + len(self.layers) * 2 * ROW_HEAD.size + self.n_cells * self.bytes_per_cell


def parse_recurrent(r: StateReader) -> RecurrentState:
    """Parse the recurrent state at ``r.pos``; it must end exactly at ``r.end``.

    Raises:
        StateFormatError: the bytes are not a recurrent state this parser reads (see the module doc).
    """
    n = r.u32("recurrent cell count")
    if n > r.left // CELL_HEAD.size:
        raise StateFormatError(f"recurrent state: cell count {n} exceeds the bytes left ({r.left})")
    pos = np.empty(n, "<i4")
    n_seq_id = np.empty(n, "<u4")
    seq_parts: list[np.ndarray] = []
    for i in range(n):  # one cell per sequence: a slot save has one
        pos[i], k = r.unpack(CELL_HEAD, f"recurrent cell {i}")
        if k > r.left // 4:
            raise StateFormatError(f"recurrent cell {i}: {k} sequence ids exceed the bytes left")
        n_seq_id[i] = k
        seq_parts.append(r.view(4 * k, "sequence ids").view("<i4"))
    seq_ids = np.concatenate(seq_parts) if seq_parts else np.zeros(0, "<i4")
    s_trans, n_layer = r.unpack(TWO_U32, "recurrent s_trans/n_layer")
    if s_trans != 0:
        raise StateFormatError(f"recurrent state: s_trans {s_trans} (the pinned llama.cpp writes only 0)")
    if n_layer == 0 or n_layer > MAX_LAYERS:
        raise StateFormatError(f"recurrent state: implausible layer count {n_layer}")
    blocks: list[tuple[int, int, np.ndarray]] = []
    while r.left:
        if len(blocks) == 2 * n_layer:
            raise StateFormatError(f"recurrent state: {r.left} bytes after {len(blocks)} row blocks "
                                   f"(at most an R and an S block for each of {n_layer} layers)")
        blocks.append(r.rows(n, f"recurrent row block {len(blocks)}"))
    if not blocks or len(blocks) % 2:
        raise StateFormatError(f"recurrent state: {len(blocks)} row blocks, expected an R and an S block "
                               "per recurrent layer")
    m = len(blocks) // 2
    heads: list[tuple[int, int]] = []
    for name, part in (("R", blocks[:m]), ("S", blocks[m:])):
        kinds = sorted({(t, row) for t, row, _ in part})
        if len(kinds) > 1:
            raise StateFormatError(f"recurrent state: {name} blocks of {m} layers differ in (type, row size): {kinds}")
        heads.append(kinds[0])
    if heads[0] == heads[1]:
        # R R S S cut after the second block would read as one layer: only R unlike S tells the halves apart.
        raise StateFormatError(f"recurrent state: R and S blocks alike {heads[0]}: cannot tell where the S blocks start")
    layers = tuple(RecurrentLayer(rt, rrow, rv, st, srow, sv)
                   for (rt, rrow, rv), (st, srow, sv) in zip(blocks[:m], blocks[m:]))
    return RecurrentState(n, pos, n_seq_id, seq_ids, int(n_layer), layers)


def write_recurrent(out: memoryview, arr: np.ndarray, at: int, state: RecurrentState) -> int:
    """Write ``state`` at ``at`` (``out`` and ``arr`` are the same buffer); returns the offset after it."""
    U32.pack_into(out, at, state.n_cells)
    at += U32.size
    j = 0
    for i in range(state.n_cells):
        k = int(state.n_seq_id[i])
        CELL_HEAD.pack_into(out, at, int(state.pos[i]), k)
        at += CELL_HEAD.size
        arr[at : at + 4 * k] = state.seq_ids[j : j + k].view(np.uint8)
        at += 4 * k
        j += k
    TWO_U32.pack_into(out, at, 0, state.n_layer)
    at += TWO_U32.size
    for type_id, row, rows in [(la.r_type, la.r_row_size, la.r) for la in state.layers] + \
            [(la.s_type, la.s_row_size, la.s) for la in state.layers]:
        ROW_HEAD.pack_into(out, at, type_id, row)
        at += ROW_HEAD.size
        arr[at : at + rows.nbytes].reshape(rows.shape)[...] = rows
        at += rows.nbytes
    return at
