"""The blob codec: every value kvtier stores is a fixed header followed by a payload.

Header (little-endian, 56 bytes)::

    0   4s  magic  b"KVTB"
    4   B   format version (1; 2 with a MAC, below)
    5   B   codec: 0 none, 1 lz4 (block), 2 zstd
    6   H   flags (see ``Flags``)
    8   Q   raw payload length
    16  I   token count the payload covers
    20  I   reserved (0)
    24  16s chunk hash (the key's hash; a value stored under another key is foreign)
    40  8s  namespace id (first 8 bytes of the namespace digest)
    48  Q   xxh3-64 of header bytes 0..47 and the stored payload

Format version 2 (a keyed codec, ``mac_key``) adds 32 bytes after that header::

    56  32s BLAKE2b-256 keyed with the shared secret, of header bytes 0..55 and the stored payload

A reader checks magic, version, codec, hash, namespace and checksum (and, when keyed, the MAC)
before it returns a byte, so a damaged or foreign value is a ``CodecError``, never data. The
checksum finds damage, not intent: anyone who can write to the store can write a value with a
valid checksum. Only the MAC tells a value kvtier wrote from one written by someone without the
secret. Readers are strict both ways: a keyed codec refuses unkeyed (version 1) values, an unkeyed
one refuses keyed (version 2) values it cannot check. Nothing is ever pickled.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import lz4.block
import xxhash

from .errors import CodecError, ConfigError

MAGIC = b"KVTB"
FORMAT_VERSION = 1  # checksum only
FORMAT_VERSION_MAC = 2  # checksum and a keyed MAC (BlobCodec(mac_key=...))
_HEAD = struct.Struct("<4sBBHQII16s8s")
_SUM = struct.Struct("<Q")
HEADER_SIZE = _HEAD.size + _SUM.size  # 56
MAC_SIZE = 32  # BLAKE2b-256
MIN_MAC_KEY_BYTES = 16  # a shorter shared secret is a configuration mistake
MAX_RAW_BYTES = 1 << 34  # 16 GiB: anything larger in a header is damage, not data

# Adaptive mode compresses a sample first and keeps the raw payload when compression saves less than
# MIN_SAVING: real f16 KV compresses 1.01x with lz4, so compressing it would only cost CPU. A small
# saving never pays either: lz4 ran at ~0.5 GB/s on a 2-core node, slower than the network it would
# spare, and its CPU is taken from inference (bench datapath: a generated model's KV, ~5% saved for
# ~1 s of CPU per 500 MB). What compresses a quarter or more (empty cells, zeros) still is.
MIN_SAVING = 0.25
SAMPLE_BYTES = 256 * 1024


class CodecId(enum.IntEnum):
    NONE = 0
    LZ4 = 1
    ZSTD = 2


class Flags(enum.IntFlag):
    NONE = 0
    KEPT_RAW = 1  # adaptive mode tried to compress and kept the raw payload
    WHOLE = 2  # a whole, unsplit state keyed by its exact token sequence
    SESSION = 4  # a session manifest or a session's partial tail
    TAIL = 8  # a partial tail stored by automatic mode (after the last full chunk of a saved slot)


@dataclass(frozen=True, slots=True)
class Framed:
    """A payload with room for the codec's header before it, in a buffer of its own: ``encode``
    writes the header into the room and hands the buffer out whole, without copying the payload
    (at an 8B model's 32 MiB chunks, that copy was most of a save's CPU)."""

    buffer: memoryview  # writable: ``room`` bytes, then the payload; nothing else lives in it
    room: int

    @property
    def payload(self) -> memoryview:
        return self.buffer[self.room:]


Compression = Literal["adaptive", "lz4", "zstd", "none"]
COMPRESSIONS: tuple[str, ...] = ("adaptive", "lz4", "zstd", "none")


@dataclass(frozen=True, slots=True)
class Blob:
    """A decoded, verified value."""

    payload: bytes | memoryview
    n_tokens: int
    flags: Flags
    codec: CodecId
    stored_bytes: int


def _zstd_module() -> ModuleType:
    try:
        import zstandard
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ConfigError("compression 'zstd' needs the 'zstandard' package (pip install kvtier[zstd])") from exc
    return zstandard


class BlobCodec:
    """Encodes and verifies blobs; one instance is shared by every tier of a store.

    Args:
        compression: ``adaptive`` (lz4 only when it saves at least ``min_saving``), ``lz4``, ``zstd``
            or ``none``.
        min_saving: fraction of bytes compression must save to be kept.
        zstd_level: level for ``zstd``.
        mac_key: a secret shared by every node (at least 16 bytes): values are written with a keyed
            BLAKE2b MAC (format version 2) and only values carrying a valid one are read. None:
            checksum only (format version 1).

    Raises:
        ConfigError: an unknown compression, a bad ``min_saving``, a short ``mac_key``.
    """

    def __init__(self, compression: str = "adaptive", *, min_saving: float = MIN_SAVING, zstd_level: int = 1,
                 mac_key: bytes | None = None):
        if mac_key is not None and len(mac_key) < MIN_MAC_KEY_BYTES:
            raise ConfigError(f"the chunk MAC key must be at least {MIN_MAC_KEY_BYTES} bytes")
        # Keys of any length become one 32-byte BLAKE2b key (its limit is 64 bytes).
        self._mac_key = None if mac_key is None else hashlib.blake2b(
            mac_key, digest_size=32, person=b"kvtier-mac-key").digest()
        if compression not in COMPRESSIONS:
            raise ConfigError(f"unknown compression {compression!r}; choose one of {', '.join(COMPRESSIONS)}")
        if not 0.0 <= min_saving < 1.0:
            raise ConfigError(f"min_saving must be in [0, 1), got {min_saving}")
        self.compression = compression
        self.min_saving = min_saving
        self._zstd_c = self._zstd_d = None
        if compression == "zstd":
            zstd = _zstd_module()
            self._zstd_c = zstd.ZstdCompressor(level=zstd_level)
        self._zstd_level = zstd_level

    @property
    def head_room(self) -> int:
        """Bytes a ``Framed`` payload leaves before it for this codec's header (and MAC)."""
        return HEADER_SIZE + (MAC_SIZE if self._mac_key is not None else 0)

    @property
    def keyed(self) -> bool:
        """True when values carry (and must carry) a keyed MAC."""
        return self._mac_key is not None

    def _mac(self, *parts: bytes | memoryview) -> bytes:
        assert self._mac_key is not None
        m = hashlib.blake2b(key=self._mac_key, digest_size=MAC_SIZE)
        for part in parts:
            m.update(part)
        return m.digest()

    # -- encode ---------------------------------------------------------------------------------

    def encode(
        self,
        payload: bytes | bytearray | memoryview | Framed,
        *,
        chunk_hash: bytes,
        namespace_id: bytes,
        n_tokens: int,
        flags: Flags = Flags.NONE,
    ) -> bytes | memoryview:
        """Header + (possibly compressed) payload. A ``Framed`` payload with ``head_room`` bytes
        of room that is stored raw comes back as its own buffer (read-only), the header written
        into the room: no copy."""
        if len(chunk_hash) != 16:
            raise ValueError("chunk_hash must be 16 bytes")
        if len(namespace_id) != 8:
            raise ValueError("namespace_id must be 8 bytes")
        if not 0 <= n_tokens < 1 << 32:
            raise ValueError("n_tokens out of range")
        raw = memoryview(payload.payload if isinstance(payload, Framed) else payload).cast("B")
        codec, body, flags = self._compress(raw, flags)
        version = FORMAT_VERSION if self._mac_key is None else FORMAT_VERSION_MAC
        head = _HEAD.pack(MAGIC, version, codec, int(flags), raw.nbytes, n_tokens, 0, chunk_hash, namespace_id)
        h = xxhash.xxh3_64(head)
        h.update(body)
        head += _SUM.pack(h.intdigest())
        mac = b"" if self._mac_key is None else self._mac(head, body)
        if isinstance(payload, Framed) and body is raw and payload.room == self.head_room:
            payload.buffer[: payload.room] = head + mac
            return payload.buffer.toreadonly()
        return b"".join((head, mac, body))

    def _compress(self, raw: memoryview, flags: Flags) -> tuple[CodecId, bytes | memoryview, Flags]:
        mode = self.compression
        if mode == "none" or raw.nbytes == 0:
            return CodecId.NONE, raw, flags
        if mode == "adaptive" and raw.nbytes > SAMPLE_BYTES:
            # Try a sample from the middle before paying for the whole payload.
            start = (raw.nbytes - SAMPLE_BYTES) // 2
            sample = raw[start : start + SAMPLE_BYTES]
            if len(lz4.block.compress(sample, store_size=False)) > SAMPLE_BYTES * (1 - self.min_saving):
                return CodecId.NONE, raw, flags | Flags.KEPT_RAW
        if mode == "zstd":
            assert self._zstd_c is not None
            body: bytes = self._zstd_c.compress(raw)
            codec = CodecId.ZSTD
        else:
            body = lz4.block.compress(raw, store_size=False)
            codec = CodecId.LZ4
        threshold = raw.nbytes * (1 - self.min_saving) if mode == "adaptive" else raw.nbytes
        if len(body) >= threshold:
            return CodecId.NONE, raw, flags | Flags.KEPT_RAW
        return codec, body, flags

    # -- decode ---------------------------------------------------------------------------------

    def decode(
        self,
        blob: bytes | bytearray | memoryview,
        *,
        chunk_hash: bytes | None = None,
        namespace_id: bytes | None = None,
    ) -> Blob:
        """Verify and decode a blob.

        Raises:
            CodecError: the blob is truncated, damaged, of another format version, belongs to
                another key or namespace, or lacks the valid MAC a keyed codec asks for.
        """
        view = memoryview(blob).cast("B")
        if view.nbytes < HEADER_SIZE:
            raise CodecError(f"blob too short ({view.nbytes} bytes)")
        magic, version, codec, flags, raw_len, n_tokens, _, stored_hash, stored_ns = _HEAD.unpack_from(view)
        if magic != MAGIC:
            raise CodecError("not a kvtier blob (bad magic)")
        if version not in (FORMAT_VERSION, FORMAT_VERSION_MAC):
            raise CodecError(f"unsupported blob format version {version}")
        if self._mac_key is not None and version != FORMAT_VERSION_MAC:
            raise CodecError("blob carries no MAC, and this codec is keyed")
        if self._mac_key is None and version == FORMAT_VERSION_MAC:
            raise CodecError("blob carries a MAC, and this codec has no key to check it")
        body_at = HEADER_SIZE + (MAC_SIZE if version == FORMAT_VERSION_MAC else 0)
        if view.nbytes < body_at:
            raise CodecError(f"blob too short ({view.nbytes} bytes)")
        if codec not in CodecId._value2member_map_:
            raise CodecError(f"unknown codec id {codec}")
        if raw_len > MAX_RAW_BYTES:
            raise CodecError(f"implausible raw length {raw_len}")
        if chunk_hash is not None and stored_hash != chunk_hash:
            raise CodecError("blob belongs to another key")
        if namespace_id is not None and stored_ns != namespace_id:
            raise CodecError("blob belongs to another namespace")
        (checksum,) = _SUM.unpack_from(view, _HEAD.size)
        body = view[body_at:]
        h = xxhash.xxh3_64(view[: _HEAD.size])
        h.update(body)
        if h.intdigest() != checksum:
            raise CodecError("checksum mismatch")
        if self._mac_key is not None and not hmac.compare_digest(
                self._mac(view[:HEADER_SIZE], body), view[HEADER_SIZE:body_at]):
            raise CodecError("MAC mismatch (not written with this deployment's key)")
        payload: bytes | memoryview
        if codec == CodecId.NONE:
            if body.nbytes != raw_len:
                raise CodecError("raw length mismatch")
            payload = body
        else:
            payload = self._decompress(CodecId(codec), body, raw_len)
        return Blob(payload, n_tokens, Flags(flags), CodecId(codec), view.nbytes)

    def _decompress(self, codec: CodecId, body: memoryview, raw_len: int) -> bytes:
        try:
            if codec == CodecId.LZ4:
                out = lz4.block.decompress(body, uncompressed_size=raw_len)
            else:
                if self._zstd_d is None:
                    self._zstd_d = _zstd_module().ZstdDecompressor()
                out = self._zstd_d.decompress(body, max_output_size=raw_len)  # type: ignore[attr-defined]
        except CodecError:
            raise
        except Exception as exc:  # the libraries raise assorted types on damage
            raise CodecError(f"cannot decompress payload: {exc}") from exc
        if len(out) != raw_len:
            raise CodecError("raw length mismatch after decompression")
        return bytes(out)


def peek_header(blob: bytes | memoryview) -> tuple[bytes, bytes, int, int]:
    """(chunk hash, namespace id, raw length, token count) without verifying the payload."""
    view = memoryview(blob).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise CodecError("blob too short")
    magic, _, _, _, raw_len, n_tokens, _, chunk_hash, ns = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise CodecError("not a kvtier blob (bad magic)")
    return chunk_hash, ns, raw_len, n_tokens
