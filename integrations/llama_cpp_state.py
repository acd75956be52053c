"""A llama-cpp-python ``Llama`` context as sequence-state file images, and back.

llama-server's slot files and an in-process context share one memory-state format
(``llama_kv_cache::state_write``); only the wrapping differs:

* slot file (``state_seq_save_file``): ``u32 'ggsq', u32 version, u32 n, n x i32 tokens``, memory
* ``llama_state_seq_get_data``:        ``u32 io_magic 0xaf143cd8, i32 seq_id``, memory
* ``llama_state_get_data`` (whole context, what ``Llama.save_state`` / ``load_state`` move):
  ``u32 len + arch name``, memory of every sequence (this llama.cpp writes no logits or embeddings)

So this module reads a sequence straight into a buffer laid out as a slot-file image (the 8-byte
seq header lands on the last two words of the token section, which are then overwritten), and the
rest of kvtier (``parse_state``, ``split_state``, ``assemble_state``, the sidecar) works on it
unchanged. Restoring does the reverse in place: the 8-byte seq header, or the arch header for a
whole-context state, is written over the end of the token section of an assembled image. Neither
direction copies the KV bytes in Python.

``llama_cpp`` is imported lazily: importing this module does not need it.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiers.errors import KVTierError, StateFormatError
from tiers.keys import as_token_array

from .buffers import alloc_buffer, as_uint8
from .fingerprint import memory_layout
from .memkind import LookupShape, MemoryKind
from .statefile import GGSQ_MAGIC, GGSQ_VERSION, HEADER_BYTES, SeqState, StateLayout
from .stateparse import parse_state

IO_MAGIC = 0xAF143CD8  # llama_context::state_seq_{get,set}_data: io_magic, then the i32 seq id
_SEQ_HEAD = struct.Struct("<Ii")
_GGSQ_HEAD = struct.Struct("<III")
_U32 = struct.Struct("<I")
_CELL = struct.Struct("<iI")  # a recurrent cell of a one-sequence save: pos, n_seq_id (0)
_CELL_SEQ = struct.Struct("<iIi")  # the same cell naming its sequence: pos, n_seq_id (1), seq id


class RestoreError(KVTierError):
    """llama.cpp refused a state (the context was left empty for that sequence)."""


@dataclass(frozen=True, slots=True)
class ContextInfo:
    """What restoring into a ``Llama`` context needs, learned from the context itself.

    ``arch_header`` is the start of every whole-context state of this model (``u32 len`` + the
    architecture name, as ``llama_context::state_write_data`` writes it).
    """

    arch_header: bytes
    n_stream: int
    v_trans: bool
    layout: StateLayout  # what the namespace is keyed by: ``memory_layout``
    n_ctx: int
    split_reason: str | None  # why this model's states cannot be cut into prefix chunks, or None
    memory_kind: MemoryKind = MemoryKind.KV

    @property
    def shape(self) -> LookupShape:
        """How a prompt's prefix is looked up in the tiers for this context."""
        return LookupShape(self.n_ctx, self.memory_kind)


MIN_MEASURED_PROMPT_TOKENS = 32  # prompt tokens a context must have evaluated before its rate is used


def prefill_seconds(llm: Any, n_tokens: int) -> float | None:
    """What evaluating ``n_tokens`` of prompt takes ``llm``'s context, at the rate llama.cpp's own
    counters measured over every prompt it evaluated; None before it has evaluated enough."""
    perf = _api().llama_perf_context(llm.ctx)
    if perf.n_p_eval < MIN_MEASURED_PROMPT_TOKENS or perf.t_p_eval_ms <= 0:
        return None
    return max(0, n_tokens) * float(perf.t_p_eval_ms) / 1000.0 / int(perf.n_p_eval)


def _api() -> Any:
    import llama_cpp  # lazy: the core package works without llama-cpp-python

    return llama_cpp


def _ctx(llm: Any) -> Any:
    return llm._ctx.ctx  # llama_context_p of a llama_cpp.Llama


def memory_offset(image: bytes | bytearray | memoryview | np.ndarray) -> int:
    """Offset of the memory state in a slot-file image (after the header and the token section)."""
    arr = as_uint8(image)
    if arr.size < HEADER_BYTES:
        raise StateFormatError("not a sequence-state image")
    magic, _, n_words = _GGSQ_HEAD.unpack_from(arr.data, 0)
    if magic != GGSQ_MAGIC:
        raise StateFormatError("not a sequence-state image (bad magic)")
    at = HEADER_BYTES + 4 * n_words
    if at > arr.size:
        raise StateFormatError("token section runs past the image")
    return int(at)


def context_tokens(llm: Any) -> np.ndarray:
    """The tokens a ``Llama`` has evaluated (its bookkeeping: ``input_ids[:n_tokens]``), int32."""
    return as_token_array(np.asarray(llm.input_ids[: llm.n_tokens]))


def read_seq_image(llm: Any, seq_id: int = 0, tokens: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """The sequence ``seq_id`` of ``llm``'s context as a slot-file image (what llama-server saves).

    Args:
        llm: a ``llama_cpp.Llama``.
        seq_id: the sequence (a ``Llama`` uses 0).
        tokens: the token section to write (default: the tokens ``llm`` has evaluated).

    Returns:
        A uint8 array: ``ggsq`` header, tokens, then the memory state exactly as llama.cpp wrote it.

    Raises:
        StateFormatError: llama.cpp wrote fewer bytes than it announced, or an unexpected header.
    """
    lib = _api()
    ctx = _ctx(llm)
    toks = context_tokens(llm) if tokens is None else as_token_array(tokens)
    size = int(lib.llama_state_seq_get_size(ctx, seq_id))
    if size < _SEQ_HEAD.size:
        raise StateFormatError(f"llama_state_seq_get_size returned {size}")
    mem_at = HEADER_BYTES + 4 * int(toks.size)
    arr, view = alloc_buffer(mem_at - _SEQ_HEAD.size + size)
    dst = (ctypes.c_uint8 * size).from_buffer(arr.data, mem_at - _SEQ_HEAD.size)
    try:
        got = int(lib.llama_state_seq_get_data(ctx, dst, size, seq_id))
    finally:
        del dst  # release the buffer export
    if got != size:
        raise StateFormatError(f"llama_state_seq_get_data wrote {got} of {size} bytes")
    magic, sid = _SEQ_HEAD.unpack_from(view, mem_at - _SEQ_HEAD.size)
    if magic != IO_MAGIC or sid != seq_id:
        raise StateFormatError(f"unexpected sequence-state header {magic:#x}/{sid}")
    _GGSQ_HEAD.pack_into(view, 0, GGSQ_MAGIC, GGSQ_VERSION, int(toks.size))
    arr[HEADER_BYTES:mem_at].view("<i4")[:] = toks  # overwrites the seq header: it was scratch
    return arr


def image_from_llama_state(state: Any, arch_header: bytes) -> np.ndarray:
    """A slot-file image from a whole-context ``LlamaState`` (``Llama.save_state()``).

    Valid for a single-sequence context only (the caller checks ``split_reason`` on the parse).

    Raises:
        StateFormatError: the state is of another model architecture or too short.
    """
    data = as_uint8(memoryview(state.llama_state).cast("B"))[: int(state.llama_state_size)]
    if bytes(data[: len(arch_header)]) != arch_header:
        raise StateFormatError("LlamaState of another model architecture")
    toks = as_token_array(np.asarray(state.input_ids[: state.n_tokens]))
    memory = data[len(arch_header):]
    mem_at = HEADER_BYTES + 4 * int(toks.size)
    arr, view = alloc_buffer(mem_at + memory.size)
    _GGSQ_HEAD.pack_into(view, 0, GGSQ_MAGIC, GGSQ_VERSION, int(toks.size))
    arr[HEADER_BYTES:mem_at].view("<i4")[:] = toks
    arr[mem_at:] = memory
    return arr


def _writable(image: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    arr = as_uint8(image)
    return arr if arr.flags.writeable else arr.copy()


def whole_state_bytes(image: bytes | bytearray | memoryview | np.ndarray, arch_header: bytes) -> memoryview:
    """The whole-context state (``llama_state_set_data``) of a single-sequence slot-file image.

    Writes ``arch_header`` over the end of the token section, so the result is a view of ``image``'s
    buffer (a copy only when the token section is shorter than the header, or the image holds a
    recurrent state: see ``_recurrent_for_sequence_0``).
    """
    arr = _writable(image)
    mem_at = memory_offset(arr)
    named = _recurrent_for_sequence_0(arr, mem_at, len(arch_header))
    if named is not None:
        named[: len(arch_header)] = np.frombuffer(arch_header, np.uint8)
        return named.data
    start = mem_at - len(arch_header)
    if start < 0:
        out = np.empty(len(arch_header) + arr.size - mem_at, np.uint8)
        out[: len(arch_header)] = np.frombuffer(arch_header, np.uint8)
        out[len(arch_header):] = arr[mem_at:]
        return out.data
    arr[start:mem_at] = np.frombuffer(arch_header, np.uint8)
    return arr.data[start:]


def _recurrent_for_sequence_0(arr: np.ndarray, mem_at: int, head: int) -> np.ndarray | None:
    """The memory of a slot-file image whose recurrent cells name no sequence, rewritten so that
    they name sequence 0, after ``head`` bytes left free; None when the memory holds no such cells.

    A one-sequence save writes its recurrent cells without sequence ids, and reading one back
    gives them the sequence it is restored into; a whole-context read (``dest_seq_id == -1``,
    ``llama_memory_recurrent::state_read_meta``) takes the ids from the cells, and a cell without
    any would belong to no sequence. KV cells always carry their sequence id.
    """
    state = parse_state(arr)
    rec = state.recurrent
    if rec is None or not rec.n_cells or rec.seq_ids.size:
        return None
    rec_at = arr.size - rec.nbytes  # the recurrent state ends the memory
    cells_end = rec_at + _U32.size + rec.n_cells * _CELL.size
    out = np.empty(head + (rec_at - mem_at) + _U32.size + rec.n_cells * _CELL_SEQ.size + (arr.size - cells_end),
                   np.uint8)
    at = head + rec_at - mem_at
    out[head:at] = arr[mem_at:rec_at]
    out[at: at + _U32.size] = arr[rec_at: rec_at + _U32.size]  # the cell count
    at += _U32.size
    for pos in rec.pos.tolist():
        _CELL_SEQ.pack_into(out.data, at, pos, 1, 0)
        at += _CELL_SEQ.size
    out[at:] = arr[cells_end:]
    return out


def load_seq_image(llm: Any, image: bytes | bytearray | memoryview | np.ndarray, seq_id: int = 0) -> int:
    """Restore a slot-file image into sequence ``seq_id`` of ``llm`` and set its token bookkeeping.

    After this, ``llm.input_ids[:n]`` holds the image's tokens, ``llm.n_tokens == n`` and the next
    ``generate``/``create_completion`` whose prompt starts with them evaluates only the rest (at
    least one token: llama-cpp-python replays the last one when the prompt is fully cached, so the
    logits it samples from are always fresh). The image's buffer is modified (its token section
    end is scratch for the 8-byte sequence header).

    Returns:
        The number of tokens restored.

    Raises:
        RestoreError: llama.cpp rejected the state; the sequence is then empty and ``llm`` reset.
        StateFormatError: the image is malformed.
    """
    lib = _api()
    arr = _writable(image)
    mem_at = memory_offset(arr)
    n = (mem_at - HEADER_BYTES) // 4
    if n > len(llm.input_ids):
        raise StateFormatError(f"{n} tokens do not fit the context ({len(llm.input_ids)})")
    tokens = arr[HEADER_BYTES:mem_at].view("<i4").copy()  # read before the header overwrites them
    start = mem_at - _SEQ_HEAD.size
    _SEQ_HEAD.pack_into(arr.data, start, IO_MAGIC, seq_id)
    size = int(arr.size - start)
    src = (ctypes.c_uint8 * size).from_buffer(arr.data, start)
    try:
        got = int(lib.llama_state_seq_set_data(_ctx(llm), src, size, seq_id))
    finally:
        del src
    if got != size:
        llm._ctx.kv_cache_seq_rm(seq_id, -1, -1)
        llm.reset()
        raise RestoreError(f"llama_state_seq_set_data read {got} of {size} bytes")
    llm.input_ids[:n] = tokens
    llm.n_tokens = n
    llm._requires_eval = True  # restored memory carries no logits: decode before sampling
    return n


def probe_context(llm: Any) -> ContextInfo:
    """Learn the V layout, stream count and KV layout (``memory_layout``) of ``llm``'s context.

    A fresh context holds no cells to read a layout from: two tokens are evaluated, read back and
    removed (a few milliseconds; ``llm`` is reset afterwards, as it was). A context that already
    holds tokens is read as it is.
    """
    lib = _api()
    fresh = llm.n_tokens == 0
    if fresh:
        # Two tokens, not one: a hybrid state as of position 0 starts its recurrent part with the
        # words 1, 0, which also read as an empty second KV cache (parse_state takes that reading).
        probe = (llm.tokenize(b"kvtier", add_bos=False, special=False) + [0, 0])[:2]
        llm.eval(probe)
    try:
        state: SeqState = parse_state(read_seq_image(llm), allow_opaque=True)
        if fresh:
            size = int(lib.llama_state_get_size(_ctx(llm)))
            buf = (ctypes.c_uint8 * size)()
            got = int(lib.llama_state_get_data(_ctx(llm), buf, size))
            whole = bytes(buf)[:got]
            (name_len,) = _U32.unpack_from(whole, 0)
            arch_header = whole[: 4 + name_len]
        else:
            name = str(getattr(llm, "metadata", {}).get("general.architecture", "")).encode()
            arch_header = _U32.pack(len(name)) + name
    finally:
        if fresh:
            llm._ctx.kv_cache_clear()
            llm.reset()
    layout = memory_layout(state)
    if state.tail_only and layout is not None:
        # Recurrent memory alone: no V to lay out and no KV stream; its one tail is the whole state.
        return ContextInfo(arch_header, 1, False, layout, int(llm.n_ctx()), None, state.memory_kind)
    if layout is None or state.v_trans is None or state.n_stream is None:
        raise StateFormatError(f"cannot learn the KV layout of this context ({state.memory_kind} memory: "
                               f"{state.opaque_reason or state.split_reason or 'no cells'})")
    # Sliding-window and hybrid memory: prefix chunks hold the first KV cache, the rest rides along.
    # Only what the model imposes counts here (what a context happens to hold may change).
    kv = state.first_cache if state.has_rest else state
    reason = kv.split_reason if kv.cell_ext else None
    return ContextInfo(arch_header, state.n_stream, bool(state.v_trans), layout, int(llm.n_ctx()), reason,
                       state.memory_kind)


def state_to_store(llm: Any, info: ContextInfo, key: np.ndarray, value: Any,
                   chunk_tokens: int) -> tuple[np.ndarray, SeqState] | None:
    """The state ``cache[key] = value`` should store: the bound context's sequence when it holds
    ``key``'s start (read per sequence, cheaper than ``value``'s whole-context copy), else the
    value's own bytes (another ``Llama`` shares this cache); None when it holds no full chunk.

    A state with a rest is read per sequence only: a whole-context state keeps a sliding window's
    masked cells too (``llama_kv_cache::state_write`` drops them only for one sequence), which a
    cut window must not hold."""
    held = context_tokens(llm)
    if held.size and held.size <= key.size and np.array_equal(held, key[: held.size]):
        tokens, image = held, None
    elif value is not None and int(value.n_tokens) >= chunk_tokens and not info.memory_kind.has_rest:
        tokens, image = as_token_array(np.asarray(value.input_ids[: value.n_tokens])), value
    else:
        return None
    if tokens.size < chunk_tokens and not info.memory_kind.has_rest:  # a state with a rest is stored as a tail alone
        return None
    raw = read_seq_image(llm, tokens=tokens) if image is None else image_from_llama_state(image, info.arch_header)
    return tokens, parse_state(raw)
