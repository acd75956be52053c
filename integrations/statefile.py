"""llama.cpp sequence-state files ('ggsq' version 3): strict zero-copy parse, byte-exact write, inspect.

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

The parser is strict: the memory state must be one of these and consume every byte, or it is
*opaque* (kept as raw bytes, reported with the reason, never split): a context without memory,
three KV caches (``llama_kv_cache_dsa_iswa``), an indexer cache after the recurrent state
(``llama_memory_hybrid_idx``), K-only caches (V skipped for some layers), anything else.
Every count is checked against the bytes left before it is used, so a damaged header can never
cause a large allocation, and all K/V/R/S data are numpy views into the caller's buffer.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tiers.errors import StateFormatError

from .memkind import MemoryKind
from .recurrentstate import RecurrentState, parse_recurrent, write_recurrent
from .statereader import CELL_HEAD as _CELL_HEAD
from .statereader import MAX_LAYERS, StateReader
from .statereader import ROW_HEAD as _K_HEAD
from .statereader import TWO_U32 as _TWO_U32
from .statereader import U32 as _U32

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

_VT_HEAD = struct.Struct("<iII")  # type, element size, n_embd_v_gqa
_EXT = struct.Struct("<iii")  # llama_kv_cell_ext: x, y, tok


def ggml_type_name(type_id: int) -> str:
    return GGML_TYPES[type_id][0] if type_id in GGML_TYPES else f"type{type_id}"


def ggml_element_size(type_id: int) -> int | None:
    """``ggml_type_size`` of a type whose rows are plain elements (block size 1), else None.

    Only such types can be transposed: quantized V needs flash attention (rows) in llama.cpp.
    """
    info = GGML_TYPES.get(type_id)
    return info[2] if info is not None and info[1] == 1 else None


# -- the model ------------------------------------------------------------------------------------


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


# -- parse ----------------------------------------------------------------------------------------


def as_uint8(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """A flat uint8 view of any contiguous buffer (no copy)."""
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8) if data.flags.c_contiguous else np.ascontiguousarray(data).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def parse_state(data: bytes | bytearray | memoryview | np.ndarray, *, allow_opaque: bool = False) -> SeqState:
    """Parse a sequence-state file; every array in the result is a view into ``data``.

    Args:
        data: the file's bytes (kept alive by the views; a bytearray cannot be resized meanwhile).
        allow_opaque: accept a memory state that fits none of the layouts this parser knows (see
            the module doc) as raw bytes instead of raising.

    Raises:
        StateFormatError: wrong magic or version, truncated or damaged header, token section or
            (unless ``allow_opaque``) memory state.
    """
    arr = as_uint8(data)
    r = StateReader(arr, 0, arr.size)
    if arr.size < HEADER_BYTES:
        raise StateFormatError(f"not a sequence-state file: {arr.size} bytes, the header alone is {HEADER_BYTES}")
    magic, version, n_words = struct.unpack_from("<III", r.mv, 0)
    if magic != GGSQ_MAGIC:
        raise StateFormatError(f"not a sequence-state file (magic {magic:#010x}, expected {GGSQ_MAGIC:#010x} 'ggsq')")
    if version != GGSQ_VERSION:
        raise StateFormatError(f"unsupported sequence-state version {version} (this build reads {GGSQ_VERSION})")
    r.pos = HEADER_BYTES
    if n_words > r.left // 4:
        raise StateFormatError(f"token count {n_words} exceeds the file size ({arr.size} bytes)")
    words = r.view(4 * n_words, "token section").view("<i4")
    tokens = _parse_token_section(words)
    mem_start = r.pos
    memory = arr[mem_start:].data
    try:
        mem = _parse_memory(arr, mem_start, arr.size)
    except StateFormatError as exc:
        if not allow_opaque:
            raise
        return SeqState(version, tokens, MemoryKind.OPAQUE, (), False, memory, int(arr.size), str(exc))
    return SeqState(version, tokens, mem.kind, mem.caches, mem.cell_ext, memory, int(arr.size),
                    recurrent=mem.recurrent)


def _parse_token_section(words: np.ndarray) -> TokenSection:
    if words.size == 0 or words[0] != LLAMA_TOKEN_NULL:
        return TokenSection(words, words, False, np.zeros(0, "<u4"))
    # The server's packed form: -1, version, vector<token>, vector<u32 media key>, media chunks.
    n = int(words.size)
    if n < 3:
        raise StateFormatError("packed token section truncated")
    if int(words[1]) != SERVER_TOKENS_VERSION:
        raise StateFormatError(f"unsupported packed token section version {int(words[1])}")
    n_tok = int(words[2]) & 0xFFFFFFFF
    if n_tok > n - 3 - 1:  # the media-key count must follow
        raise StateFormatError(f"packed token count {n_tok} exceeds the token section ({n} words)")
    tokens = words[3 : 3 + n_tok]
    at = 3 + n_tok
    n_media = int(words[at]) & 0xFFFFFFFF
    if n_media > n - at - 1:
        raise StateFormatError(f"packed media count {n_media} exceeds the token section")
    media_keys = words[at + 1 : at + 1 + n_media].view("<u4")
    r = StateReader(words.view(np.uint8), 4 * (at + 1 + n_media), 4 * n)
    media: list[memoryview] = []
    for i in range(n_media):
        size = r.u32(f"media chunk {i} size")
        media.append(r.view(size, f"media chunk {i}").data)
    if r.left >= 4:
        raise StateFormatError(f"{r.left} trailing bytes in the packed token section")
    return TokenSection(words, tokens, True, media_keys, tuple(media))


@dataclass(frozen=True, slots=True)
class _Memory:
    caches: tuple[KVCache, ...]
    cell_ext: bool
    recurrent: RecurrentState | None

    @property
    def kind(self) -> MemoryKind:
        if self.recurrent is not None:
            return MemoryKind.HYBRID if self.caches else MemoryKind.RECURRENT
        return MemoryKind.KV if len(self.caches) == 1 else MemoryKind.KV_PAIR


def _parse_memory(arr: np.ndarray, start: int, end: int) -> _Memory:
    """Up to two KV caches, then, unless they end the file, a recurrent state that must.

    Each reading is tried without and with ``llama_kv_cell_ext``; when none fits, the error is the
    one of the reading that got furthest into the file (the likeliest to name the damage).
    """
    if start == end:
        # Only a context without memory writes nothing here; for a KV cache it is truncation.
        raise StateFormatError(f"no memory state after the token section (offset {start})")
    failures: list[tuple[int, str]] = []
    for cell_ext in (False, True):
        r = StateReader(arr, start, end)
        caches: list[KVCache] = []
        ends = [r.pos]  # where the recurrent state would start after 0, 1, ... caches
        kv_failure: tuple[int, str] | None = None
        while r.left and len(caches) < MAX_KV_CACHES:
            at = r.pos
            try:
                caches.append(_parse_kv_cache(r, cell_ext))
                ends.append(r.pos)
            except StateFormatError as exc:
                kv_failure, r.pos = (r.pos, str(exc)), at
                break
        if not r.left:
            return _Memory(tuple(caches), cell_ext, None)
        # The recurrent state after as many caches as read; else after fewer: its first words can
        # read as an empty KV cache (a one-token hybrid state starts 1, 0: a stream of no cells).
        rec_failure: tuple[int, str] | None = None
        for n in range(len(caches), -1, -1):
            r.pos = ends[n]
            try:
                return _Memory(tuple(caches[:n]), cell_ext, parse_recurrent(r))
            except StateFormatError as exc:
                rec_failure = rec_failure or (r.pos, str(exc))
        assert rec_failure is not None
        failures.append(_why_not(caches, end - ends[-1], kv_failure, rec_failure))
    raise StateFormatError(max(failures)[1])


def _why_not(caches: list[KVCache], left: int, kv: tuple[int, str] | None, rec: tuple[int, str]) -> tuple[int, str]:
    """(how far the furthest reading got, the message) for memory that fits no known layout."""
    furthest = max(rec[0], kv[0] if kv else 0)
    if not caches:
        assert kv is not None
        readings = sorted([(kv[0], f"as a KV cache: {kv[1]}"), (rec[0], f"as a recurrent state: {rec[1]}")],
                          reverse=True)
        return furthest, "memory state fits no known layout; " + "; ".join(m for _, m in readings)
    what = f"{left} bytes after {'the KV cache state' if len(caches) == 1 else 'two KV cache states'}"
    if kv is None:
        return furthest, f"{what} are not a recurrent state ({rec[1]})"
    return furthest, f"{what} are neither a KV cache ({kv[1]}) nor a recurrent state ({rec[1]})"


def _parse_kv_cache(r: StateReader, cell_ext: bool) -> KVCache:
    n_stream = r.u32("n_stream")
    if n_stream == 0 or n_stream > MAX_STREAMS or n_stream > r.left // 4:
        raise StateFormatError(f"implausible stream count {n_stream} ({r.left} bytes left)")
    streams = [_parse_stream(r, s, cell_ext) for s in range(n_stream)]
    return KVCache(tuple(streams))


def _parse_stream(r: StateReader, s: int, cell_ext: bool) -> KVStream:
    n = r.u32(f"stream {s} cell count")
    if n == 0:
        return KVStream.empty()
    cell_min = 20 if cell_ext else 8
    if n > r.left // cell_min:
        raise StateFormatError(f"stream {s}: cell count {n} exceeds the bytes left ({r.left})")
    pos, n_seq_id, seq_ids, ext = _parse_cells(r, n, cell_ext, s)
    v_trans, n_layer = r.unpack(_TWO_U32, f"stream {s} v_trans/n_layer")
    if v_trans > 1:
        raise StateFormatError(f"stream {s}: v_trans must be 0 or 1, got {v_trans}")
    if n_layer == 0 or n_layer > MAX_LAYERS or n_layer > r.left // 24:
        raise StateFormatError(f"stream {s}: implausible layer count {n_layer}")
    ks: list[tuple[int, int, np.ndarray]] = []
    for il in range(n_layer):
        k_type, k_row = r.unpack(_K_HEAD, f"stream {s} layer {il} K header")
        if k_row == 0 or k_row > r.left // n:
            raise StateFormatError(f"stream {s} layer {il}: K row size {k_row} x {n} cells exceeds the bytes left")
        ks.append((k_type, k_row, r.view(n * k_row, "K rows").reshape(n, k_row)))
    layers: list[KVLayer] = []
    for il, (k_type, k_row, k) in enumerate(ks):
        if not v_trans:
            v_type, v_row = r.unpack(_K_HEAD, f"stream {s} layer {il} V header")
            if v_row == 0 or v_row > r.left // n:
                raise StateFormatError(f"stream {s} layer {il}: V row size {v_row} x {n} cells exceeds the bytes left")
            v = r.view(n * v_row, "V rows").reshape(n, v_row)
            layers.append(KVLayer(k_type, k_row, k, v_type, v_row, 0, 0, v))
        else:
            v_type, el, n_embd = r.unpack(_VT_HEAD, f"stream {s} layer {il} V header")
            if el == 0 or n_embd == 0 or el * n_embd > r.left // n:
                raise StateFormatError(
                    f"stream {s} layer {il}: transposed V {n_embd} x {n} cells x {el} bytes exceeds the bytes left"
                )
            v = r.view(n * el * n_embd, "transposed V").reshape(n_embd, n * el)
            layers.append(KVLayer(k_type, k_row, k, v_type, el * n_embd, el, n_embd, v))
    return KVStream(n, pos, n_seq_id, seq_ids, ext, bool(v_trans), tuple(layers))


def _parse_cells(
    r: StateReader, n: int, cell_ext: bool, s: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    dtype = CELL_EXT_DTYPE if cell_ext else CELL_DTYPE
    if n * dtype.itemsize <= r.left:
        # Fast path: one seq id per cell (every single-sequence save) is one structured array.
        cells = np.frombuffer(r.arr, dtype, count=n, offset=r.pos)
        if np.all(cells["n_seq_id"] == 1):
            r.pos += n * dtype.itemsize
            ext_arr = np.stack([cells["x"], cells["y"], cells["tok"]], axis=1) if cell_ext else None
            return cells["pos"], cells["n_seq_id"], cells["seq_id"], ext_arr
    # Fallback: cells with 0 or several sequence ids (whole-cache saves); one Python step per cell.
    pos = np.empty(n, "<i4")
    nsq = np.empty(n, "<u4")
    ext_rows: np.ndarray | None = np.empty((n, 3), "<i4") if cell_ext else None
    seq_parts: list[np.ndarray] = []
    for i in range(n):
        p, k = r.unpack(_CELL_HEAD, f"stream {s} cell {i}")
        pos[i], nsq[i] = p, k
        if ext_rows is not None:
            ext_rows[i] = r.unpack(_EXT, f"stream {s} cell {i} ext")
        if k > r.left // 4:
            raise StateFormatError(f"stream {s} cell {i}: {k} sequence ids exceed the bytes left")
        seq_parts.append(r.view(4 * k, "sequence ids").view("<i4"))
    seq_ids = np.concatenate(seq_parts) if seq_parts else np.zeros(0, "<i4")
    return pos, nsq, seq_ids, ext_rows


# -- write ----------------------------------------------------------------------------------------


def cache_nbytes(cache: KVCache) -> int:
    """Bytes of one KV cache's state (``llama_kv_cache::state_write``)."""
    size = 4 + 4 * cache.n_stream
    for s in cache.streams:
        if s.n_cells:
            size += s.n_cells * (8 + (12 if s.ext is not None else 0)) + 4 * int(s.seq_ids.size) + 8
            size += sum(24 + la.k.nbytes + la.v.nbytes for la in s.layers)
    return size


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
        _U32.pack_into(out, at, cache.n_stream)
        at += 4
        for s in cache.streams:
            _U32.pack_into(out, at, s.n_cells)
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
            _CELL_HEAD.pack_into(out, at, int(s.pos[i]), k)
            at += 8
            if s.ext is not None:
                _EXT.pack_into(out, at, *(int(x) for x in s.ext[i]))
                at += 12
            arr[at : at + 4 * k] = s.seq_ids[j : j + k].view(np.uint8)
            at += 4 * k
            j += k
    _TWO_U32.pack_into(out, at, int(s.v_trans), len(s.layers))
    at += 8
    for la in s.layers:
        _K_HEAD.pack_into(out, at, la.k_type, la.k_row_size)
        at = _put(arr, at + 12, la.k)
    for la in s.layers:
        if s.v_trans:
            _VT_HEAD.pack_into(out, at, la.v_type, la.v_el_size, la.n_embd_v_gqa)
        else:
            _K_HEAD.pack_into(out, at, la.v_type, la.v_row_size)
        at = _put(arr, at + 12, la.v)
    return at


def _put(arr: np.ndarray, at: int, src: np.ndarray) -> int:
    arr[at : at + src.nbytes].reshape(src.shape)[...] = src
    return at + src.nbytes
