"""Byte buffers the state codec reads and fills: flat uint8 views of any buffer, uninitialised outputs.

Shared by the sequence-state parser and writer, the chunk codec and the llama-cpp-python image
conversion: every reader takes any contiguous buffer without copying it, and every writer fills a
buffer it was given, or a fresh one, exactly once.
"""

from __future__ import annotations

import numpy as np

BytesLike = bytes | bytearray | memoryview | np.ndarray


def as_uint8(data: BytesLike) -> np.ndarray:
    """A flat uint8 view of any contiguous buffer (no copy)."""
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8) if data.flags.c_contiguous else np.ascontiguousarray(data).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


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

