"""Bounds-checked reads over a sequence-state file, shared by the KV cache and recurrent parsers.

Every read names what it reads, so a damaged file fails with the field, the offset and the bytes
left. Arrays are numpy views into the caller's buffer, never copies.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from tiers.errors import StateFormatError

MAX_LAYERS = 1 << 16  # llama.cpp's LLAMA_MAX_LAYERS is 512; more than this is damage
MAX_ROW_BYTES = 1 << 40  # a row size checked against no bytes (zero rows follow it) is still no larger

U32 = struct.Struct("<I")
TWO_U32 = struct.Struct("<II")
ROW_HEAD = struct.Struct("<iQ")  # ggml type, row size: what K rows, V rows, R rows and S rows start with
CELL_HEAD = struct.Struct("<iI")  # pos, n_seq_id


class StateReader:
    """Little-endian reads over ``arr[pos:end]`` (a uint8 array) that check the bytes left first."""

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
        return int(self.unpack(U32, what)[0])

    def view(self, nbytes: int, what: str) -> np.ndarray:
        self.need(nbytes, what)
        out = self.arr[self.pos : self.pos + nbytes]
        self.pos += nbytes
        return out

    def rows(self, n_rows: int, what: str) -> tuple[int, int, np.ndarray]:
        """``i32 type, u64 row_size`` and ``n_rows`` rows of that size: (type, row size, (n_rows, row) view)."""
        type_id, row = self.unpack(ROW_HEAD, f"{what} header")
        # Checked before any multiplication: a damaged row size must not become a huge view or shape.
        if row > (self.left // n_rows if n_rows else MAX_ROW_BYTES):
            raise StateFormatError(f"{what}: row size {row} x {n_rows} rows exceeds the bytes left ({self.left})")
        return type_id, row, self.view(n_rows * row, what).reshape(n_rows, row)
