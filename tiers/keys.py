"""Prefix keys: a chained BLAKE2b-128 hash over fixed-size token chunks.

``h_0 = H(namespace)`` and ``h_i = H(h_{i-1} || int32-LE tokens of chunk i)``. The cells after the
last full chunk (a partial tail of ``t`` tokens) are keyed by ``H("tail\0" || h_k || their tokens)``:
``tail_hashes`` gives that hash for every length, so a lookup finds the longest stored tail a prompt
continues without knowing its length. Keys never use Python's ``hash()``, so they agree across
processes, machines and restarts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np

ChunkHash = NewType("ChunkHash", bytes)

DIGEST_SIZE = 16  # BLAKE2b-128
DEFAULT_CHUNK_TOKENS = 256
NAMESPACE_HEX_LEN = 16  # 8 bytes of the namespace digest in Redis keys and blob headers


@dataclass(frozen=True, slots=True)
class Namespace:
    """What a chunk's bytes depend on: the KV layout fingerprint plus an optional tenant salt.

    Chunks of another model, quantization, chunk size or tenant can never share a key.
    """

    fingerprint: str
    salt: str = ""
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    def __post_init__(self) -> None:
        if not self.fingerprint:
            raise ValueError("namespace fingerprint must not be empty")
        if self.chunk_tokens <= 0 or self.chunk_tokens > 1 << 20:
            raise ValueError(f"chunk_tokens must be in 1..{1 << 20}, got {self.chunk_tokens}")

    @property
    def digest(self) -> ChunkHash:
        """``h_0``: the root of every prefix chain in this namespace."""
        material = f"kvtier/1\0{self.fingerprint}\0{self.salt}\0{self.chunk_tokens}".encode()
        return ChunkHash(hashlib.blake2b(material, digest_size=DIGEST_SIZE).digest())

    @property
    def id(self) -> str:
        """Short hex id used in Redis keys, directory names and blob headers."""
        return self.digest.hex()[:NAMESPACE_HEX_LEN]

    def salted(self, salt: str) -> Namespace:
        """The same layout under another tenant salt."""
        return Namespace(self.fingerprint, salt, self.chunk_tokens)


def as_token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Tokens as a contiguous little-endian int32 array (a view when already so)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("tokens must be a 1-D sequence")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.dtype != np.dtype("<i4"):
        if arr.size and (arr.min() < -(1 << 31) or arr.max() >= 1 << 31):
            raise ValueError("token ids must fit in int32")
        arr = arr.astype("<i4")
    return np.ascontiguousarray(arr)


def hash_chunk(parent: bytes, chunk_tokens: np.ndarray) -> ChunkHash:
    """``H(parent || int32-LE tokens)`` for one chunk."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    h.update(chunk_tokens.data.cast("B"))
    return ChunkHash(h.digest())


def prefix_chain(
    namespace: Namespace, tokens: Sequence[int] | np.ndarray, max_chunks: int | None = None
) -> list[ChunkHash]:
    """Hashes of every full chunk of ``tokens``, in order (``h_1 .. h_n``).

    Args:
        namespace: the namespace whose digest roots the chain.
        tokens: the token sequence.
        max_chunks: stop after this many chunks.

    Returns:
        One hash per full chunk; a sequence shorter than one chunk gives an empty list.
    """
    arr = as_token_array(tokens)
    size = namespace.chunk_tokens
    n = arr.size // size
    if max_chunks is not None:
        n = min(n, max_chunks)
    # One reshape, then one hashlib call per chunk over a zero-copy row view: no per-token Python.
    rows = arr[: n * size].reshape(n, size)
    chain: list[ChunkHash] = []
    parent: bytes = namespace.digest
    blake2b = hashlib.blake2b
    for row in rows:
        h = blake2b(parent, digest_size=DIGEST_SIZE)
        h.update(row.data)
        parent = h.digest()
        chain.append(ChunkHash(parent))
    return chain


TAIL_DOMAIN = b"tail\0"  # keeps a partial tail's hash apart from a chunk's over the same tokens


def tail_hash_after(parent: bytes, tokens: Sequence[int] | np.ndarray) -> ChunkHash:
    """``H("tail\0" || parent || tokens)``: a partial tail after the chunk whose hash is ``parent``
    (the namespace digest before the first); automatic tails and sessions' tails alike."""
    return hash_chunk(TAIL_DOMAIN + parent, as_token_array(tokens))


def tail_hashes(parent: bytes, tokens: Sequence[int] | np.ndarray) -> list[ChunkHash]:
    """``tail_hash_after(parent, tokens[:t])`` for t = 1 .. len(tokens), in one pass."""
    arr = as_token_array(tokens)
    h = hashlib.blake2b(TAIL_DOMAIN + parent, digest_size=DIGEST_SIZE)
    out: list[ChunkHash] = []
    view = arr.data.cast("B")
    for t in range(arr.size):
        h.update(view[4 * t: 4 * t + 4])
        out.append(ChunkHash(h.copy().digest()))
    return out


def tail_key(namespace: Namespace, tail_hash: bytes) -> bytes:
    """Key of a partial tail stored by automatic mode (content-addressed, like chunks)."""
    return f"kvtier:{namespace.id}:a:{tail_hash.hex()}".encode()


def sequence_key(namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> ChunkHash:
    """Key of an exact whole token sequence (for states that cannot be split into chunks)."""
    arr = as_token_array(tokens)
    h = hashlib.blake2b(b"whole\0" + namespace.digest, digest_size=DIGEST_SIZE)
    h.update(arr.size.to_bytes(8, "little"))
    h.update(arr.data)
    return ChunkHash(h.digest())


def namespace_prefix(namespace: Namespace) -> bytes:
    """What every storage key of a namespace starts with: ``kvtier:{ns}:``."""
    return f"kvtier:{namespace.id}:".encode()


def chunk_key(namespace: Namespace, chunk_hash: bytes) -> bytes:
    """Storage key of a prefix chunk: ``kvtier:{ns}:c:{hex}``."""
    return f"kvtier:{namespace.id}:c:{chunk_hash.hex()}".encode()


def whole_key(namespace: Namespace, seq_hash: bytes) -> bytes:
    """Storage key of a whole, unsplittable state: ``kvtier:{ns}:w:{hex}``."""
    return f"kvtier:{namespace.id}:w:{seq_hash.hex()}".encode()


def pending_key(namespace: Namespace, prefix_hash: bytes) -> bytes:
    """Key of a pending-save marker: a save in flight will store the prefix ``prefix_hash``
    names (a chunk or partial-tail hash) and more: ``kvtier:{ns}:p:{hex}``."""
    return f"kvtier:{namespace.id}:p:{prefix_hash.hex()}".encode()


def fleet_key(namespace: Namespace) -> bytes:
    """The fleet's directory of sidecars serving one model (a sorted set of node ids):
    ``kvtier:{ns}:fleet``, ``ns`` being the model's namespace without a tenant salt."""
    return f"kvtier:{namespace.id}:fleet".encode()


def fleet_node_key(namespace: Namespace, node_id: str) -> bytes:
    """One sidecar's entry in the fleet view (its status and the prefixes its slots hold hot):
    ``kvtier:{ns}:f:{node}``."""
    return f"kvtier:{namespace.id}:f:{node_id}".encode()


def model_key(namespace: Namespace) -> bytes:
    """A model's record (its fingerprint and chunk size, JSON), so that an operator's tool can
    compute a tenant's namespace from its salt: ``kvtier:{ns}:model``, ``ns`` without a salt."""
    return f"kvtier:{namespace.id}:model".encode()


def session_key(namespace: Namespace, session_id: str) -> bytes:
    """Storage key of a session manifest: ``kvtier:{ns}:s:{session}``."""
    return f"kvtier:{namespace.id}:s:{session_id}".encode()


def session_tail_key(namespace: Namespace, session_id: str, tail_hash: bytes) -> bytes:
    """Storage key of one version of a session's partial tail: ``kvtier:{ns}:t:{session}:{hex}``.

    Each version has its own key, so a manifest never meets another version's tail.
    """
    return f"kvtier:{namespace.id}:t:{session_id}:{tail_hash.hex()}".encode()


def session_id_of(namespace: Namespace, key: bytes) -> str:
    """The session id in a manifest key made by ``session_key`` (the inverse of it)."""
    base = session_key(namespace, "")
    if not key.startswith(base):
        raise ValueError(f"{key!r} is not a session manifest key of namespace {namespace.id}")
    return key[len(base):].decode()


def glob_prefix(prefix: bytes) -> bytes:
    """A Redis glob (SCAN MATCH) of the keys that start with ``prefix``: ``* ? [ ] \\`` escaped."""
    escaped = bytearray()
    for byte in prefix:
        if byte in b"*?[]\\":
            escaped += b"\\"
        escaped.append(byte)
    return bytes(escaped) + b"*"


def events_channel(namespace: Namespace) -> str:
    """Pub/sub channel of a namespace: ``kvtier:{ns}:events``."""
    return f"kvtier:{namespace.id}:events"


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int32 token arrays (vectorised)."""
    n = min(a.size, b.size)
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n
