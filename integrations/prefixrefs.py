"""Prefix references: the first cells of a stored chunk or tail, for prompts that share only them.

A prompt that shares only the start of a stored chunk (or tail), say a system prompt that ends
mid-chunk, restores those cells too, to within ``REF_STEP`` tokens: beside each new chunk and tail,
small references are stored under the partial-tail keys of its first 16, 32, ... tokens.
Attention is causal, so the first cells of a stored value are exactly what a prompt sharing only
those tokens computes.

A reference names no key. It carries the kind of value it points into (a chunk or a tail) and all
that value's tokens; on a restore those tokens must start with the prompt's, and the value's key
and hash are derived from the prompt's own prefix (the chain hash the reference was found after)
and them. So whatever a reference read from Redis says, it can only name the value stored for this
very prefix: a forged one is at most a miss (``check_ref`` says why it is refused).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from tiers.keys import ChunkHash, Namespace, chunk_key, hash_chunk, tail_hash_after, tail_hashes, tail_key

REF_STEP = 16  # tokens between prefix references into a stored chunk or tail
REF_MAGIC = b"KVR2"  # a reference payload (a chunk payload starts with b"KVSC")
OLD_REF_MAGIC = b"KVRF"  # references before they carried their tokens: refused, as forged ones are
_REF = struct.Struct("<4sIBI")  # magic, cells, kind (REF_CHUNK / REF_TAIL), n; then the value's n int32-LE tokens
REF_CHUNK, REF_TAIL = 0, 1  # what a reference names: a chunk (hash_chunk) or a partial tail (tail_hash_after)


def is_ref(payload: bytes | memoryview) -> bool:
    """Whether a value read under a partial-tail key is a reference (of any version) rather than
    a tail (a chunk payload starts with b"KVSC")."""
    return bytes(payload[:4]) in (REF_MAGIC, OLD_REF_MAGIC)


def ref_payload(kind: int, value_tokens: np.ndarray, n_cells: int) -> bytes:
    """A reference to the first ``n_cells`` cells of the value (a ``REF_CHUNK`` or ``REF_TAIL``)
    holding ``value_tokens`` after the reference's own parent."""
    tokens = np.ascontiguousarray(value_tokens, dtype="<i4")
    return _REF.pack(REF_MAGIC, n_cells, kind, int(tokens.size)) + tokens.tobytes()


@dataclass(frozen=True, slots=True)
class RefValue:
    """What a reference names, once it holds together: the value's key and hash, and its cells."""

    key: bytes
    hash: ChunkHash
    n_cells: int


def check_ref(namespace: Namespace, raw: bytes, parent: bytes, prompt: np.ndarray | None,
              n_cells: int) -> RefValue | str:
    """The value a reference found after ``parent``, under the partial-tail key of the prompt's
    ``n_cells`` tokens ``prompt``, names; else why it is refused. Its tokens must start with the
    prompt's, and the value's key is derived from ``parent`` and them: whatever a reference says,
    it can only name the value stored for this very prefix (and more tokens after it)."""
    if raw[:4] != REF_MAGIC or len(raw) < _REF.size:
        return "not a prefix reference of this version"
    _, cells, kind, n = _REF.unpack_from(raw)
    if kind not in (REF_CHUNK, REF_TAIL) or len(raw) != _REF.size + 4 * n:
        return "a malformed prefix reference"
    if cells != n_cells or not 0 < cells < n or (kind == REF_CHUNK and n != namespace.chunk_tokens):
        return f"a prefix reference to {cells} of {n} cells found for {n_cells}"
    tokens = np.frombuffer(raw, dtype="<i4", count=n, offset=_REF.size).astype(np.int32)
    if prompt is None or prompt.size < cells or not np.array_equal(tokens[:cells], prompt[:cells]):
        return "a prefix reference whose tokens are not the prompt's"
    if kind == REF_CHUNK:
        h = hash_chunk(parent, tokens)
        return RefValue(chunk_key(namespace, h), h, cells)
    h = tail_hash_after(parent, tokens)
    return RefValue(tail_key(namespace, h), h, cells)


def prefix_refs(parent: bytes, tokens: np.ndarray, kind: int) -> list[tuple[ChunkHash, bytes, int]]:
    """References to the first 16, 32, ... cells of a stored value (a ``REF_CHUNK`` or
    ``REF_TAIL`` after ``parent`` holding ``tokens``), as ``TieredStore.store_tails`` takes them."""
    hashes = tail_hashes(parent, tokens[: max(int(tokens.size) - 1, 0)])
    return [(hashes[n - 1], ref_payload(kind, tokens, n), n) for n in range(REF_STEP, len(hashes) + 1, REF_STEP)]
