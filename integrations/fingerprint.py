"""What a state is: model identity, KV layout fingerprint, and ``kvtier state inspect``.

``model_identity`` hashes a GGUF file's bytes (metadata and tensors) once per (realpath, size,
mtime) and remembers the answer in-process and in a small JSON file, so a 100 MB model is read
once per machine, not once per start. ``layout_fingerprint`` adds the KV layout (layer count, K/V
types and row sizes) but not the V layout: every chunk records its own and assembly converts it.
The fingerprint goes into ``tiers.keys.Namespace(fingerprint=...)``. ``inspect`` describes a slot
file for operators (and, given the model, the namespace its chunks are stored under).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tiers.errors import StateFormatError
from tiers.keys import Namespace

from .chunks import ChunkInfo, read_chunk_header
from .memkind import MemoryKind
from .recurrentstate import RecurrentState
from .statefile import KVCache, KVStream, LayerLayout, SeqState, StateLayout, ggml_type_name
from .stateparse import parse_state

BLOCK_BYTES = 8 << 20  # 8 MiB reads while hashing a model
CACHE_FILE = "model-ids.json"
IDENTITY_PREFIX = "gguf-xxh3-128:"
FINGERPRINT_VERSION = "kvtier-layout/1"

_lock = threading.Lock()
_memo: dict[tuple[str, int, int], str] = {}


def _cache_path() -> Path:
    root = os.environ.get("KVTIER_CACHE") or str(Path.home() / ".cache" / "kvtier")
    return Path(root) / CACHE_FILE


def _load(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(data, dict) else {}


def _store(path: Path, key: str, value: str) -> None:
    """Add one entry; the file is a cache, so any failure to write it is ignored."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load(path)
        data[key] = value
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".model-ids.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def hash_file(path: str | Path) -> str:
    """xxh3-128 hex digest of a whole file, read in ``BLOCK_BYTES`` blocks."""
    h = xxhash.xxh3_128()
    buf = bytearray(BLOCK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def model_identity(gguf_path: str | Path, *, cache_file: str | Path | None = None) -> str:
    """Identity of a model file: a hash of its bytes, cached by (realpath, size, mtime_ns).

    Args:
        gguf_path: the GGUF file llama-server loads.
        cache_file: the JSON cache (default ``$KVTIER_CACHE/model-ids.json`` or
            ``~/.cache/kvtier/model-ids.json``).

    Raises:
        OSError: the file cannot be read.
    """
    real = os.path.realpath(gguf_path)
    st = os.stat(real)
    key = (real, st.st_size, st.st_mtime_ns)
    with _lock:
        if key in _memo:
            return _memo[key]
    path = Path(cache_file) if cache_file is not None else _cache_path()
    skey = f"{real}|{st.st_size}|{st.st_mtime_ns}"
    ident = _load(path).get(skey)
    if ident is None or not ident.startswith(IDENTITY_PREFIX):
        ident = IDENTITY_PREFIX + hash_file(real)
        _store(path, skey, ident)
    with _lock:
        _memo[key] = ident
    return ident


def layout_of(source: SeqState | StateLayout | ChunkInfo | bytes | bytearray | memoryview) -> StateLayout:
    """The KV layout of a parsed state, a chunk (header or payload) or a layout itself.

    Raises:
        ValueError: a state without cells (an empty slot) has no layout yet.
    """
    if isinstance(source, StateLayout):
        return source
    if isinstance(source, ChunkInfo):
        return source.layout
    if isinstance(source, SeqState):
        layout = source.layout
        if layout is None:
            raise ValueError(f"a {source.memory_kind} state without cells has no KV layout")
        return layout
    return read_chunk_header(source).layout


def memory_identity(model_id: str, memory_kind: MemoryKind) -> str:
    """The model identity a namespace is keyed by: a state with a rest (``kv_pair``, ``hybrid``)
    is another format than a plain cache of the same layers, so it gets its own namespace."""
    return model_id if memory_kind is MemoryKind.KV else f"{model_id}|memory={memory_kind.value}"


def memory_layout(state: SeqState) -> StateLayout | None:
    """What a namespace of ``state``'s model is keyed by, with ``memory_identity``: the KV layout
    prefix chunks hold (the first cache's, for a state with a rest); for recurrent memory alone,
    what its one tail's bytes depend on instead, each recurrent layer's R (in the K fields) and S
    (in the V fields) type and row size. None when there is neither. The sidecar and the
    in-process cache both key by it, so their states cross."""
    if state.tail_only:
        assert state.recurrent is not None
        return StateLayout(tuple(LayerLayout(la.r_type, la.r_row_size, la.s_type, la.s_row_size)
                                 for la in state.recurrent.layers))
    kv = state.first_cache if state.has_rest else state
    return kv.layout if kv.memory_kind is MemoryKind.KV else None


def layout_fingerprint(
    model_id: str, state_or_layout: SeqState | StateLayout | ChunkInfo | bytes | bytearray | memoryview
) -> str:
    """Fingerprint of model identity + layer count + K/V types + K/V row sizes (not the V layout).

    A state with opaque, recurrent or hybrid memory has no KV layout: its fingerprint is the model
    identity's alone, for whole-state storage (the same as when such memory was read as opaque).

    Returns:
        32 hex characters (BLAKE2b-128), stable across processes and machines.
    """
    if isinstance(state_or_layout, SeqState) and not _has_kv_layout(state_or_layout):
        parts = [FINGERPRINT_VERSION, model_id, "opaque"]
    else:
        layout = layout_of(state_or_layout)
        parts = [FINGERPRINT_VERSION, model_id, str(layout.n_layer)]
        parts += [f"{la.k_type}:{la.k_row_size}:{la.v_type}:{la.v_row_size}" for la in layout.layers]
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).hexdigest()


def _has_kv_layout(state: SeqState) -> bool:
    return state.memory_kind in (MemoryKind.KV, MemoryKind.KV_PAIR)


# -- inspect --------------------------------------------------------------------------------------


def _pos_range(streams: list[KVStream] | list[RecurrentState]) -> list[int] | None:
    full = [s for s in streams if s.n_cells]
    return [int(min(s.pos.min() for s in full)), int(max(s.pos.max() for s in full))] if full else None


def _describe_cache(cache: KVCache) -> dict[str, Any]:
    full = next((s for s in cache.streams if s.n_cells), None)
    return {
        "n_stream": cache.n_stream,
        "stream_cells": [s.n_cells for s in cache.streams],
        "stream_pos_ranges": [_pos_range([s]) for s in cache.streams],
        "n_layer": len(full.layers) if full else None,
        "bytes_per_token": sum(la.k_row_size + la.v_row_size for la in full.layers) if full else None,
    }


def _describe_recurrent(rec: RecurrentState) -> dict[str, Any]:
    la = rec.layers[0]  # every recurrent layer has the same R and S types and row sizes
    return {
        "n_cells": rec.n_cells,
        "pos": rec.pos.tolist(),
        "seq_ids": rec.seq_ids.tolist(),
        "n_layer": rec.n_layer,
        "n_recurrent_layers": len(rec.layers),
        "r_type": ggml_type_name(la.r_type),
        "r_row_size": la.r_row_size,
        "s_type": ggml_type_name(la.s_type),
        "s_row_size": la.s_row_size,
        "bytes": rec.nbytes,
    }


def _stored_as(state: SeqState) -> str | None:
    """How kvtier stores the state (``integrations.chunks``), or None when it cannot."""
    if state.store_reason is not None:
        return None
    if state.tail_only:
        return "one tail: every token, with the recurrent state as its rest (restored whole)"
    if state.has_rest:
        return "the first KV cache in prefix chunks, the rest with the tail (restored whole)"
    return "prefix chunks and a tail"


def describe(state: SeqState) -> dict[str, Any]:
    """JSON-ready summary of a parsed state (what ``kvtier state inspect`` prints).

    The top-level K/V fields cover every KV cache; ``caches`` has the cells and positions of each
    (iSWA and hybrid-iSWA memory have two) and ``recurrent`` the recurrent state, or None.
    """
    layout = state.layout
    full = state.cell_streams()
    # One stream per cache describes the layers (every stream of a cache has the same ones).
    firsts = [next((s for s in c.streams if s.n_cells), None) for c in state.caches]
    layers = [la for s in firsts if s is not None for la in s.layers]
    return {
        "file_bytes": state.nbytes,
        "version": state.version,
        "token_format": state.tokens.format,
        "n_tokens": state.n_tokens,
        "n_media": int(state.tokens.media_keys.size),
        "memory_kind": state.memory_kind,
        "memory_bytes": state.memory.nbytes,
        "n_stream": state.n_stream,
        "stream_cells": [[s.n_cells for s in c.streams] for c in state.caches],
        "cells": sum(s.n_cells for s in full),
        "cell_ext": state.cell_ext,
        "seq_ids": sorted({int(x) for s in full for x in np.unique(s.seq_ids)}),
        "pos_range": _pos_range(full),
        "n_layer": layout.n_layer if layout else None,
        "v_trans": state.v_trans,
        "k_types": [ggml_type_name(la.k_type) for la in layers],
        "v_types": [ggml_type_name(la.v_type) for la in layers],
        "k_row_sizes": [la.k_row_size for la in layers],
        "v_row_sizes": [la.v_row_size for la in layers],
        "bytes_per_token": layout.bytes_per_token if layout else None,
        "splittable": state.splittable,
        "split_reason": state.split_reason,
        "stored_as": _stored_as(state),
        "store_reason": state.store_reason,
        "opaque_reason": state.opaque_reason,
        "caches": [_describe_cache(c) for c in state.caches],
        "recurrent": _describe_recurrent(state.recurrent) if state.recurrent is not None else None,
    }


def inspect(path: str | Path, *, model: str | Path | None = None, chunk_tokens: int | None = None) -> dict[str, Any]:
    """Parse the file at ``path`` (opaque memory allowed) and describe it.

    Args:
        path: a slot file.
        model: the GGUF the state belongs to; adds ``model_id``, ``fingerprint`` and ``namespace_id``.
        chunk_tokens: chunk size of the namespace (default: ``tiers.keys.DEFAULT_CHUNK_TOKENS``).

    Raises:
        StateFormatError: the file is not a readable sequence-state file.
        OSError: a file cannot be read.
    """
    state = parse_state(Path(path).read_bytes(), allow_opaque=True)
    info = describe(state)
    if model is not None and (state.layout is not None or not _has_kv_layout(state)):
        ident = model_identity(model)
        fp = layout_fingerprint(ident, state)
        ns = Namespace(fp, chunk_tokens=chunk_tokens) if chunk_tokens else Namespace(fp)
        info.update(model_id=ident, fingerprint=fp, namespace_id=ns.id, chunk_tokens=ns.chunk_tokens)
    return info


def _compact(values: list[Any]) -> str:
    uniq = list(dict.fromkeys(values))
    return str(uniq[0]) if len(uniq) == 1 else ",".join(map(str, values))


def _span(pos_range: list[int] | None) -> str:
    return f"{pos_range[0]}..{pos_range[1]}" if pos_range else "-"


def _table(file: str, info: dict[str, Any]) -> list[tuple[str, str]]:
    media = f", {info['n_media']} media" if info["n_media"] else ""
    rows = [
        ("file", f"{file} ({info['file_bytes']:,} bytes)"),
        ("tokens", f"{info['n_tokens']} ({info['token_format']}{media})"),
        ("memory", f"{info['memory_kind']} ({info['memory_bytes']:,} bytes)"),
    ]
    if info["opaque_reason"]:
        rows.append(("not parsed", info["opaque_reason"]))
    for i, c in enumerate(info["caches"]):
        name = "KV cache" if len(info["caches"]) == 1 else f"KV cache {i}"
        spans = ", ".join(_span(r) for r in c["stream_pos_ranges"])
        layers = f"{c['n_layer'] or '-'} layers, {c['bytes_per_token'] or '-'} bytes/token"
        rows.append((name, f"{c['n_stream']} stream(s), cells per stream {c['stream_cells']}, positions {spans}; {layers}"))
    if info["caches"]:
        rows += [
            ("cells", f"{info['cells']}  positions {_span(info['pos_range'])}  seq ids {info['seq_ids']}"),
            ("V layout", {None: "-", False: "rows (flash attention)", True: "transposed"}[info["v_trans"]]),
            ("K types", _compact(info["k_types"]) or "-"),
            ("V types", _compact(info["v_types"]) or "-"),
            ("K/V row bytes", f"{_compact(info['k_row_sizes']) or '-'} / {_compact(info['v_row_sizes']) or '-'}"),
        ]
    rec = info["recurrent"]
    if rec is not None:
        at = f"positions {rec['pos']}" if rec["n_cells"] else "no cells"
        rows += [
            ("recurrent", f"{rec['n_cells']} cell(s), {at}, seq ids {rec['seq_ids'] or '-'} ({rec['bytes']:,} bytes)"),
            ("recurrent layers", f"{rec['n_recurrent_layers']} of {rec['n_layer']}"),
            ("R (conv) rows", f"{rec['r_type']}, {rec['r_row_size']} bytes per cell and layer"),
            ("S (SSM) rows", f"{rec['s_type']}, {rec['s_row_size']} bytes per cell and layer"),
        ]
    rows += [
        ("bytes/token", str(info["bytes_per_token"] or "-")),
        ("splittable", "yes" if info["splittable"] else f"no: {info['split_reason']}"),
        ("kvtier stores", info["stored_as"] or f"nothing: {info['store_reason']}"),
    ]
    return rows


def inspect_main(argv: list[str]) -> int:
    """``kvtier state inspect FILE [--json]``; returns the exit status (0 ok, 1 bad file)."""
    ap = argparse.ArgumentParser(prog="kvtier state inspect", description="Describe a llama.cpp slot state file.")
    ap.add_argument("file")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--model", help="the model's GGUF: also print the layout fingerprint and namespace id")
    ap.add_argument("--chunk-tokens", type=int, default=None, help="chunk size of the namespace")
    args = ap.parse_args(argv)
    try:
        info = inspect(args.file, model=args.model, chunk_tokens=args.chunk_tokens)
    except (OSError, StateFormatError) as exc:
        print(f"kvtier state inspect: {args.file}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    rows = _table(args.file, info)
    if "fingerprint" in info:
        rows += [("model id", info["model_id"]), ("fingerprint", info["fingerprint"]),
                 ("namespace", f"{info['namespace_id']} ({info['chunk_tokens']}-token chunks)")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
