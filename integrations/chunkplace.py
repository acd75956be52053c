"""A restore file of plain KV laid out before its chunks arrive, so each is written as it comes.

``state_pieces`` needs every payload at hand: each layer's rows interleave all chunks. When the
cell count of each chunk and the layers are known (the first chunk's header), every chunk's rows
have fixed offsets in the file, and a chunk can be written there (``os.pwrite``) the moment it is
fetched, then dropped. The bytes are the same as ``assemble_state``'s.

Only plain KV in rows is placed so: no rest (a sliding window, a recurrent state) and no
transposed V on either side (an element row of transposed V interleaves all chunks).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from tiers.errors import StateFormatError
from tiers.keys import as_token_array

from .buffers import BytesLike, as_uint8
from .chunkassemble import restore_head
from .chunks import ChunkInfo, read_chunk_header
from .statereader import ROW_HEAD

Placed = list[tuple[int, memoryview]]  # (file offset, bytes) pieces, in any order


class PlacedFile:
    """Offsets of each chunk's rows in the restore file of ``tokens[:sum(cells)]``.

    Args:
        first: the first chunk's header (its layers stand for all: each chunk's must agree).
        cells: each chunk's cell count, in prefix order (a partial tail last).
        tokens: the prompt (at least ``sum(cells)`` tokens).
        n_stream: the target's stream count.

    Raises:
        StateFormatError: the chunks hold a rest, transposed V, or no KV layers.
    """

    def __init__(self, first: ChunkInfo, cells: Sequence[int], tokens: Sequence[int] | np.ndarray, *,
                 n_stream: int = 1):
        if first.rest_nbytes or first.v_trans or not first.layers:
            raise StateFormatError("only plain KV in rows is placed chunk by chunk")
        self.first = first
        self.cells = list(cells)
        self.starts = [int(c) for c in np.cumsum([0, *self.cells[:-1]])]
        n = sum(self.cells)
        toks = as_token_array(tokens)
        if toks.size < n or n_stream < 1:
            raise ValueError(f"{toks.size} tokens for {n} cells, {n_stream} streams")
        self._head = restore_head(toks[:n], n_stream, False, first.n_layer)
        at = self._head.nbytes
        self._rows: list[tuple[int, int, int]] = []  # (first row's offset, row size, type) per K, then V block
        for rows in ([(la.k_type, la.k_row_size) for la in first.layers],
                     [(la.v_type, la.v_row_size) for la in first.layers]):
            for ggml_type, row in rows:
                self._rows.append((at + ROW_HEAD.size, row, ggml_type))
                at += ROW_HEAD.size + n * row
        self._streams_at = at
        self.nbytes = at + 4 * (n_stream - 1)  # the other streams: cell_count = 0

    def head(self) -> Placed:
        """Everything but the chunks' rows: the header, tokens and cells, each block's row header,
        and the other streams' empty counts."""
        placed = [(0, self._head)]
        placed += [(at - ROW_HEAD.size, memoryview(ROW_HEAD.pack(t, row))) for at, row, t in self._rows]
        if self.nbytes > self._streams_at:
            placed.append((self._streams_at, memoryview(bytes(self.nbytes - self._streams_at))))
        return placed

    def chunk(self, index: int, payload: BytesLike) -> Placed:
        """Chunk ``index``'s rows at their offsets: views into ``payload``.

        Raises:
            StateFormatError: the payload is not chunk ``index`` as laid out (its first cell, cell
                count or layers differ, or it holds a rest or transposed V).
        """
        info = read_chunk_header(payload)
        start, n = self.starts[index], self.cells[index]
        if info.first_pos != start or info.n_cells != n:
            raise StateFormatError(f"chunk {index} holds cells {info.first_pos}+{info.n_cells}, laid out {start}+{n}")
        if info.layout != self.first.layout or info.rest_nbytes or info.v_trans:
            raise StateFormatError(f"chunk {index} has another KV layout than chunk 0 (layers, types, rest or V)")
        view = as_uint8(payload).data
        src = info.data_offset
        placed: Placed = []
        for at, row, _ in self._rows:  # the payload holds its K rows layer by layer, then its V rows
            placed.append((at + start * row, view[src : src + n * row]))
            src += n * row
        return placed


def write_placed(fd: int, placed: Placed) -> int:
    """Write each piece at its offset (``os.pwrite``, short writes continued); returns the bytes written."""
    total = 0
    for at, piece in placed:
        view = memoryview(piece).cast("B")
        while view.nbytes:
            n = os.pwrite(fd, view, at)
            if n <= 0:
                raise OSError("pwrite wrote nothing")
            view, at, total = view[n:], at + n, total + n
    return total
