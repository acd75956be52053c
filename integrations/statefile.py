"""llama.cpp sequence-state files ('ggsq' version 3): the format, and ``SeqState``, its parsed model.

``stateparse`` reads a file into a ``SeqState`` (zero-copy), ``statewrite`` writes one back
(byte-exact); ``chunksplit`` cuts one into prefix chunks. This module knows the layout and what a
state holds: whether it can be stored as prefix chunks, and where its *rest* starts.

What ``POST /slots/{id}?action=save`` writes (``llama_context::state_seq_save_file``)::

    u32 magic 'ggsq' (0x67677371), u32 version (3), u32 n, n x i32 token section, memory state

The token section is a plain token list, or the server's packed form (``server_tokens::serialize``):
``-1, u32 version (1), u32 n + n x i32 tokens, u32 n_media + keys, n_media x (u32 size + bytes)``,
zero-padded to whole i32 words. The memory state of a standard KV cache
(``llama_kv_cache::state_write``)::

    u32 n_stream
    per stream: u32 cell_count                                   (0: empty stream, nothing follows)
        per cell: i32 pos, u32 n_seq_id, [llama_kv_cell_ext: i32 x, i32 y, i32 tok], n_seq_id x i32
        u32 v_trans, u32 n_layer
        per layer K: i32 type, u64 row_size, cell_count rows
        per layer V, v_trans = 0: i32 type, u64 row_size, cell_count rows
                     v_trans = 1: i32 type, u32 el_size, u32 n_embd_v_gqa,
                                  n_embd_v_gqa x (cell_count x el_size)

Sliding-window models write two such caches back to back (``llama_kv_cache_iswa``: the
full-attention layers' cache, then the sliding-window layers'). Recurrent models (Mamba, RWKV)
write a recurrent state instead (``llama_memory_recurrent``, see ``recurrentstate``), and hybrid
models write their attention KV cache, or two of them with sliding windows, then the recurrent
state of their other layers (``llama_memory_hybrid`` / ``llama_memory_hybrid_iswa``)::

    memory_kind   memory state
    kv            KV cache
    kv_pair       KV cache, KV cache
    recurrent     recurrent state
    hybrid        KV cache [, KV cache], recurrent state

A memory state that fits none of these, or leaves bytes over, is *opaque*: kept as raw bytes,
reported with the parser's reason, never split (``stateparse``).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .memkind import MemoryKind
from .recurrentstate import RecurrentState

GGSQ_MAGIC = 0x67677371  # 'ggsq'
GGSQ_VERSION = 3  # LLAMA_STATE_SEQ_VERSION of the pinned llama.cpp
LLAMA_TOKEN_NULL = -1
SERVER_TOKENS_VERSION = 1  # SERVER_TOKENS_STATE_VERSION (tools/server/server-common.cpp)
HEADER_BYTES = 12  # magic, version, n
MAX_STREAMS = 1 << 16  # llama.cpp allows 256 sequences; more streams than this is damage
MAX_KV_CACHES = 2  # iSWA: base and sliding-window

# The ggml types a KV cache may hold (common/arg.cpp ``kv_cache_types``): id -> (name, block, bytes).
# Other types still parse (rows are opaque bytes); they only lack a name and cannot be transposed.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("f32", 1, 4),
    1: ("f16", 1, 2),
    2: ("q4_0", 32, 18),
    3: ("q4_1", 32, 20),
    6: ("q5_0", 32, 22),
    7: ("q5_1", 32, 24),
    8: ("q8_0", 32, 34),
    20: ("iq4_nl", 32, 18),
    30: ("bf16", 1, 2),
}

# Cell metadata when every cell has exactly one sequence id: parsed and written as one array.
CELL_DTYPE = np.dtype([("pos", "<i4"), ("n_seq_id", "<u4"), ("seq_id", "<i4")])
CELL_EXT_DTYPE = np.dtype(
    [("pos", "<i4"), ("n_seq_id", "<u4"), ("x", "<i4"), ("y", "<i4"), ("tok", "<i4"), ("seq_id", "<i4")]
)

V_TRANS_HEAD = struct.Struct("<iII")  # transposed V: type, element size, n_embd_v_gqa
CELL_EXT = struct.Struct("<iii")  # llama_kv_cell_ext: x, y, tok


def ggml_type_name(type_id: int) -> str:
    return GGML_TYPES[type_id][0] if type_id in GGML_TYPES else f"type{type_id}"


def ggml_element_size(type_id: int) -> int | None:
    """``ggml_type_size`` of a type whose rows are plain elements (block size 1), else None.

    Only such types can be transposed: quantized V needs flash attention (rows) in llama.cpp.
    """
    info = GGML_TYPES.get(type_id)
    return info[2] if info is not None and info[1] == 1 else None


# -- the model: what a parsed file holds ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenSection:
    """The token section: ``words`` exactly as stored, ``tokens`` the ids they carry (a view)."""

    words: np.ndarray  # int32, what write_state writes back
    tokens: np.ndarray  # int32 token ids
    packed: bool
    media_keys: np.ndarray  # uint32 start indices of media chunks (packed form only)
    media: tuple[memoryview, ...] = ()

    @classmethod
    def plain(cls, tokens: Sequence[int] | np.ndarray) -> TokenSection:
        arr = np.ascontiguousarray(np.asarray(tokens, dtype="<i4"))
        return cls(arr, arr, False, np.zeros(0, "<u4"))

    @property
    def has_media(self) -> bool:
        return self.media_keys.size > 0

    @property
    def format(self) -> str:
        return "packed" if self.packed else "plain"


@dataclass(frozen=True, slots=True)
class KVLayer:
    """One layer's K and V of one stream, as uint8 views into the parsed buffer.

    ``k`` is ``(n_cells, k_row_size)``. ``v`` is ``(n_cells, v_row_size)`` in the rows layout, or
    ``(n_embd_v_gqa, n_cells * v_el_size)`` when transposed; ``v_row_size`` is V bytes per cell in
    both layouts, ``v_el_size``/``n_embd_v_gqa`` are only stored in the file when transposed.
    """

    k_type: int
    k_row_size: int
    k: np.ndarray
    v_type: int
    v_row_size: int
    v_el_size: int
    n_embd_v_gqa: int
    v: np.ndarray


@dataclass(frozen=True, slots=True)
class KVStream:
    """One stream: cell metadata and, when it holds cells, the layers. Empty: ``n_cells == 0``."""

    n_cells: int
    pos: np.ndarray  # int32 (n_cells,)
    n_seq_id: np.ndarray  # uint32 (n_cells,)
    seq_ids: np.ndarray  # int32, all cells' sequence ids in order (sum of n_seq_id)
    ext: np.ndarray | None  # int32 (n_cells, 3): x, y, tok, when the cache writes llama_kv_cell_ext
    v_trans: bool
    layers: tuple[KVLayer, ...]

    @classmethod
    def empty(cls) -> KVStream:
        z = np.zeros(0, "<i4")
        return cls(0, z, z.view("<u4"), z, None, False, ())


@dataclass(frozen=True, slots=True)
class KVCache:
    streams: tuple[KVStream, ...]

    @property
    def n_stream(self) -> int:
        return len(self.streams)


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """What the bytes of one layer depend on (the V layout excluded: chunks record their own)."""

    k_type: int
    k_row_size: int
    v_type: int
    v_row_size: int  # V bytes per cell


@dataclass(frozen=True, slots=True)
class StateLayout:
    layers: tuple[LayerLayout, ...]

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def bytes_per_token(self) -> int:
        return sum(la.k_row_size + la.v_row_size for la in self.layers)


@dataclass(frozen=True, slots=True)
class SeqState:
    """A parsed sequence-state file.

    ``memory_kind`` is ``kv`` (one standard KV cache), ``kv_pair`` (two, as sliding-window models
    write), ``recurrent`` (a recurrent state only), ``hybrid`` (one or two KV caches, then a
    recurrent state) or ``opaque`` (no memory, anything else; only with ``allow_opaque``, the
    parser's reason in ``opaque_reason``). ``caches`` are the KV caches, ``recurrent`` the
    recurrent state; ``memory`` is always the raw memory-state bytes.
    """

    version: int
    tokens: TokenSection
    memory_kind: MemoryKind
    caches: tuple[KVCache, ...]
    cell_ext: bool
    memory: memoryview
    nbytes: int
    opaque_reason: str | None = None
    recurrent: RecurrentState | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.tokens.size)

    @property
    def n_stream(self) -> int | None:
        return self.caches[0].n_stream if self.caches else None

    def cell_streams(self) -> list[KVStream]:
        """The non-empty streams of every cache."""
        return [s for c in self.caches for s in c.streams if s.n_cells]

    @property
    def layout(self) -> StateLayout | None:
        """Layer layout of the (first, for ``kv_pair`` both) caches; None without cells.

        None for recurrent and hybrid memory too: a KV layout describes per-token bytes, and a
        recurrent state is not per token (kvtier stores such states whole, if at all).
        """
        if self.recurrent is not None:
            return None
        layers: list[LayerLayout] = []
        for cache in self.caches:
            full = next((s for s in cache.streams if s.n_cells), None)
            if full is None:
                return None
            layers.extend(LayerLayout(la.k_type, la.k_row_size, la.v_type, la.v_row_size) for la in full.layers)
        return StateLayout(tuple(layers)) if layers else None

    @property
    def v_trans(self) -> bool | None:
        full = self.cell_streams()
        return full[0].v_trans if full else None

    @property
    def split_reason(self) -> str | None:
        """Why this state cannot be split into prefix chunks, or None when it can."""
        if self.recurrent is not None:
            return _recurrent_reason(self.recurrent, len(self.caches))
        if self.memory_kind is not MemoryKind.KV:
            if self.memory_kind is MemoryKind.KV_PAIR:
                return "two KV caches (sliding-window attention; DSA and MSA models also write two)"
            return f"memory state is not a standard KV cache ({self.opaque_reason})"
        if self.cell_ext:
            return "cells carry llama_kv_cell_ext (M-RoPE or PLE model)"
        if self.tokens.has_media:
            return "token section holds media"
        full = self.cell_streams()
        if not full:
            return "no cells"
        if len(full) > 1:
            return "cells in more than one stream"
        s = full[0]
        if s.seq_ids.size != s.n_cells or (s.n_cells and not np.all(s.n_seq_id == 1)):
            return "cells shared by several sequences"
        if s.n_cells and not np.all(s.seq_ids == s.seq_ids[0]):
            return "more than one sequence"
        if not np.array_equal(s.pos, np.arange(s.n_cells, dtype=np.int32)):
            return "cell positions are not 0..n-1 in order"
        if s.n_cells != self.n_tokens:
            return f"{s.n_cells} cells for {self.n_tokens} tokens"
        if self.n_tokens and int(self.tokens.tokens.min()) < 0:
            return "token section holds null tokens"
        return None

    @property
    def splittable(self) -> bool:
        return self.split_reason is None

    @property
    def has_rest(self) -> bool:
        """Sliding-window, hybrid or recurrent memory: state that holds only the sequence's recent
        past (a window's cells, a recurrent state), the *rest*, after a KV cache with every cell or,
        for recurrent memory (``tail_only``), alone."""
        return (self.memory_kind.has_rest and bool(self.caches)) or self.tail_only

    @property
    def tail_only(self) -> bool:
        """Recurrent memory alone (Mamba, RWKV): no K/V per token, so no prefix chunk; the whole
        memory state is the rest, stored as one tail that holds every token."""
        return self.memory_kind.tail_only and self.recurrent is not None

    @property
    def first_cache(self) -> SeqState:
        """This state with its first KV cache alone (what prefix chunks of it hold)."""
        return dataclasses.replace(self, memory_kind=MemoryKind.KV, caches=self.caches[:1], recurrent=None)

    @property
    def store_reason(self) -> str | None:
        """Why kvtier cannot store this state as prefix chunks, or None when it can: a plain KV
        cache is cut whole (``split_reason``); with a rest (``has_rest``) the first cache is cut
        and its tail carries the rest, so only a prompt that continues the whole state restores it;
        recurrent memory alone (``tail_only``) is one tail."""
        if not self.has_rest:
            return self.split_reason
        if self.tail_only:
            return self._tail_only_reason()
        reason = self.first_cache.split_reason
        if reason is not None:
            return f"first KV cache: {reason}"
        if self.memory_kind is MemoryKind.KV_PAIR:
            window = [int(s.pos.min()) for s in self.caches[1].streams if s.n_cells]
            if not window or min(window) == 0:
                # Nothing lies below the window to pad (integrations.swa): llama-server recomputes
                # such a state after a restore on default flags; it is short, and cheap to compute.
                return "the sliding window is not full yet"
        return None

    @property
    def rest(self) -> memoryview:
        """The memory state's bytes after its first KV cache (all of them for recurrent memory
        alone, none without a rest)."""
        if self.tail_only:
            return self.memory
        return self.memory[cache_nbytes(self.caches[0]):] if self.has_rest else self.memory[:0]

    def _tail_only_reason(self) -> str | None:
        """Why a recurrent state cannot be stored as one tail: llama.cpp restores one sequence's
        state from one cell without sequence ids (``llama_memory_recurrent::state_read_meta``), and
        it must be as of the last token the file names."""
        rec = self.recurrent
        assert rec is not None
        if self.tokens.has_media:
            return "token section holds media"
        if not self.n_tokens:
            return "no tokens"
        if int(self.tokens.tokens.min()) < 0:
            return "token section holds null tokens"
        if rec.n_cells != 1 or int(rec.n_seq_id[0]) != 0:
            return f"recurrent state of {rec.n_cells} cells (a one-sequence save has one, without sequence ids)"
        if int(rec.pos[0]) != self.n_tokens - 1:
            return f"the recurrent state is as of position {int(rec.pos[0])}, the tokens end at {self.n_tokens - 1}"
        return None


def _recurrent_reason(rec: RecurrentState, n_caches: int) -> str:
    where = f"as of position {int(rec.pos.max())}" if rec.n_cells else "empty"
    state = f"{len(rec.layers)} of {rec.n_layer} layers, {where}"
    why = "one state per sequence as of its last token"
    if not n_caches:
        return f"recurrent memory ({state}): {why}, not K/V per token, so no shorter prefix can be cut from it"
    caches = "the KV cache holds" if n_caches == 1 else f"the {n_caches} KV caches hold"
    return (f"hybrid memory: {caches} K/V per token, but the recurrent state ({state}) is {why}, "
            "so no shorter prefix can be cut from it")


def cache_nbytes(cache: KVCache) -> int:
    """Bytes of one KV cache's state (``llama_kv_cache::state_write``)."""
    size = 4 + 4 * cache.n_stream
    for s in cache.streams:
        if s.n_cells:
            size += s.n_cells * (8 + (12 if s.ext is not None else 0)) + 4 * int(s.seq_ids.size) + 8
            size += sum(24 + la.k.nbytes + la.v.nbytes for la in s.layers)
    return size
