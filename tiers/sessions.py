"""Session manifests: a named conversation state that any node can restore.

A session is its token sequence, the prefix chunks of its full chunks (shared with every other
session and with automatic mode, content-addressed) and its partial tail (private to the session).
The manifest is small JSON under ``kvtier:{ns}:s:{id}`` in a ``ManifestStore``: ``RedisManifests``
when Redis is configured (any node can restore), else ``LocalManifests`` (node-local). Nothing read
back is ever unpickled: the manifest is JSON, validated field by field, and every chunk is checked
by the blob codec.

With shared manifests, the store also keeps a copy of the manifests this node saved
(``LocalManifests``, bounded), as the RAM tier keeps chunks beside Redis: while Redis cannot be
reached, a session saved here is still found here, and restored from the local tiers. Redis stays
the truth whenever it answers (a session another node deleted is gone here too).

A manifest that cannot be read (damaged, or not the session its key names) is ``SessionDamaged``:
it is reported, can be deleted or saved over, and a listing skips it and names it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import builtins
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from .codec import Flags, Framed
from .errors import KVTierError, TierUnavailable
from .keys import (
    ChunkHash,
    Namespace,
    as_token_array,
    prefix_chain,
    session_id_of,
    session_key,
    session_tail_key,
    tail_hash_after,
)
from .manifests import LocalManifests, ManifestStore
from .store import REPLACED_GRACE_S, ContentCheck, PayloadSource, TieredStore, Verified

log = logging.getLogger("kvtier.sessions")

SESSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20  # ~16M tokens; anything larger is damage
LOCAL_COPY_BYTES = 64 << 20  # manifests this node saved, kept beside shared ones (least recently used go first)


class SessionError(KVTierError):
    """A session is missing, incomplete or malformed."""


class SessionNotFound(SessionError):
    pass


class SessionIncomplete(SessionError):
    """Some of the session's chunks are gone (evicted or expired)."""


class SessionDamaged(SessionIncomplete):
    """The session's manifest cannot be read (damaged, or another session's): what it held cannot
    be restored. It can be deleted, or saved over."""


@dataclass(frozen=True, slots=True)
class SessionPage:
    """One page of a listing: the manifests, and the ids whose manifests are damaged (skipped)."""

    manifests: list[Manifest]
    damaged: list[str]


def validate_session_id(session_id: object) -> str:
    """Session ids: 1-128 of ``A-Z a-z 0-9 . _ : -``, not starting with punctuation."""
    if not isinstance(session_id, str) or not SESSION_ID_RE.fullmatch(session_id):
        raise ValueError("session id must be 1-128 characters of A-Z a-z 0-9 . _ : - and start with a letter or digit")
    return session_id


@dataclass(frozen=True, slots=True)
class Manifest:
    id: str
    namespace: str
    chunk_tokens: int
    n_tokens: int
    chunks: int
    tail_tokens: int
    tail_hash: str  # hex, "" without a tail
    bytes: int
    node: str
    created: float
    last_used: float
    tokens_b64: str = field(repr=False)

    @property
    def tokens(self) -> np.ndarray:
        return np.frombuffer(base64.b64decode(self.tokens_b64), dtype="<i4")

    def to_json(self) -> builtins.bytes:  # builtins: the field "bytes" shadows the type here
        return json.dumps({"version": MANIFEST_VERSION, **asdict(self)}, separators=(",", ":")).encode()

    def public(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("tokens_b64")
        return out

    @classmethod
    def from_json(cls, raw: builtins.bytes | str) -> Manifest:
        """Parse and check a stored manifest.

        Raises:
            SessionDamaged: not a manifest this version of kvtier wrote, or not self-consistent.
        """
        if len(raw) > MAX_MANIFEST_BYTES:
            raise SessionDamaged("session manifest is implausibly large")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SessionDamaged(f"session manifest is not JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
            raise SessionDamaged("session manifest of an unknown version")
        try:
            m = cls(
                id=validate_session_id(data["id"]), namespace=str(data["namespace"]),
                chunk_tokens=_int(data, "chunk_tokens"), n_tokens=_int(data, "n_tokens"), chunks=_int(data, "chunks"),
                tail_tokens=_int(data, "tail_tokens"), tail_hash=str(data["tail_hash"]), bytes=_int(data, "bytes"),
                node=str(data["node"]), created=float(data["created"]), last_used=float(data["last_used"]),
                tokens_b64=str(data["tokens_b64"]),
            )
            n_tokens = m.tokens.size  # base64 of whole int32s
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise SessionDamaged(f"session manifest is malformed: {exc}") from None
        if m.chunks * m.chunk_tokens + m.tail_tokens != m.n_tokens or n_tokens != m.n_tokens:
            raise SessionDamaged("session manifest is inconsistent")
        if (len(m.tail_hash) != 32) if m.tail_tokens else bool(m.tail_hash):
            raise SessionDamaged("session manifest's tail is inconsistent")
        try:
            builtins.bytes.fromhex(m.tail_hash)
        except ValueError:
            raise SessionDamaged("session manifest's tail hash is not hex") from None
        return m


def _int(data: dict[str, Any], key: str) -> int:
    value = data[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer")
    return value


def tail_hash(chain: Sequence[ChunkHash], namespace: Namespace, tail_tokens: np.ndarray) -> ChunkHash:
    parent = chain[-1] if chain else namespace.digest
    return tail_hash_after(parent, tail_tokens)


class SessionStore:
    """Save, load, list and delete session manifests; their chunks go through the TieredStore.

    Args:
        store: the tiered store chunks live in.
        manifests: where manifests live (``RedisManifests``); None keeps them in this process
            (``LocalManifests``, node-local).
        check: the engine's check that a payload holds the cells its key names (``ContentCheck``);
            a chunk or tail that fails it is deleted where it was read and counted as damaged.
        flush_timeout: seconds a save waits for its chunks to reach the shared tiers before a
            shared manifest is written (a manifest never points at chunks that are not there yet).
        local_copy_bytes: with shared manifests, bytes of this node's own saves kept here too, for
            when Redis cannot be reached (0: none).
        clock: wall clock of ``created`` and ``last_used``.
    """

    def __init__(self, store: TieredStore, manifests: ManifestStore | None = None, *,
                 check: ContentCheck | None = None, flush_timeout: float = 30.0,
                 local_copy_bytes: int = LOCAL_COPY_BYTES, clock: Callable[[], float] = time.time):
        self.store = store
        self.manifests: ManifestStore = manifests if manifests is not None else LocalManifests()
        self.check = check
        self.flush_timeout = flush_timeout
        self._clock = clock
        self._local = LocalManifests(max_bytes=local_copy_bytes) if self.shared and local_copy_bytes > 0 else None

    @property
    def shared(self) -> bool:
        """True when manifests are shared (Redis), so any node can restore any session."""
        return self.manifests.shared

    async def save(self, namespace: Namespace, session_id: str, tokens: Sequence[int] | np.ndarray,
                   payloads: PayloadSource, tail_payload: bytes | bytearray | memoryview | Framed | None,
                   *, node: str = "", kv_bytes: int = 0, n_chunks: int | None = None) -> Manifest:
        """Store the session's chunks and tail, then its manifest (over a damaged one, too).

        Args:
            payloads: chunk ``i``'s payload for each full chunk of ``tokens``.
            tail_payload: the cells after the last full chunk (None when there are none).
            n_chunks: fewer chunks than ``tokens`` holds, the rest in the tail (a state whose
                tail carries its rest always keeps one cell or more for it).
            kv_bytes: the session's KV bytes, for the manifest (default: the bytes this save wrote).

        Raises:
            TierUnavailable: the shared manifests cannot be reached; with a local copy the session
                is saved on this node only (restorable here, not elsewhere).
        """
        validate_session_id(session_id)
        toks = as_token_array(tokens)
        C = namespace.chunk_tokens
        chain = prefix_chain(namespace, toks, n_chunks)
        n_tail = toks.size - len(chain) * C
        if (n_tail > 0) != (tail_payload is not None):
            raise ValueError(f"{n_tail} tail tokens but {'a' if tail_payload is not None else 'no'} tail payload")
        result = await self.store.store(namespace, chain, payloads, flags=Flags.SESSION)
        nbytes = result.bytes_encoded
        t_hash = b""
        if tail_payload is not None:
            t_hash = tail_hash(chain, namespace, toks[len(chain) * C:])
            blob = self.store.codec.encode(tail_payload, chunk_hash=t_hash, namespace_id=namespace.digest[:8],
                                           n_tokens=n_tail, flags=Flags.SESSION)
            await self.store.put_raw(session_tail_key(namespace, session_id, t_hash), blob)
            nbytes += len(blob)
        if self.shared and not await self.store.flush(self.flush_timeout):
            raise TierUnavailable("session chunks did not reach the shared tiers in time")
        try:
            old = await self._get_manifest(namespace, session_id)
        except SessionDamaged as exc:
            log.warning("session %r: saving over its damaged manifest (%s)", session_id, exc)
            old = None
        now = self._clock()
        manifest = Manifest(
            id=session_id, namespace=namespace.id, chunk_tokens=C, n_tokens=int(toks.size), chunks=len(chain),
            tail_tokens=n_tail, tail_hash=t_hash.hex(), bytes=kv_bytes or nbytes, node=node,
            created=old.created if old else now, last_used=now,
            tokens_b64=base64.b64encode(toks.tobytes()).decode(),
        )
        await self._put_manifest(namespace, manifest)
        if old is not None and old.tail_hash and old.tail_hash != manifest.tail_hash:
            old_tail = session_tail_key(namespace, session_id, bytes.fromhex(old.tail_hash))
            await self.store.delete_everywhere([old_tail], grace=REPLACED_GRACE_S)  # a restore may be fetching it
        return manifest

    async def load(self, namespace: Namespace, session_id: str) -> Manifest:
        """The session's manifest.

        Raises:
            SessionNotFound: there is none. SessionDamaged: it cannot be read.
            TierUnavailable: the shared manifests cannot be reached, and this node saved no copy.
        """
        validate_session_id(session_id)
        manifest = await self._get_manifest(namespace, session_id)
        if manifest is None:
            raise SessionNotFound(f"no session {session_id!r}")
        return manifest

    async def fetch(self, namespace: Namespace, manifest: Manifest) -> tuple[list[bytes | memoryview], str]:
        """The payloads (chunks, then the tail) of a session, and the slowest tier they came from.

        Raises:
            SessionIncomplete: a chunk or the tail is gone or damaged, or holds other cells than
                its key names (then it is deleted where it was read, and counted).
        """
        C = namespace.chunk_tokens
        chain = prefix_chain(namespace, manifest.tokens, manifest.chunks)
        fetched, tail = await asyncio.gather(self.store.fetch(namespace, chain, promote=False),
                                             self.read_tail(namespace, manifest))
        if self.check is not None:
            fetched = await self.store.matching(fetched, self.check, C)
        await self.store.promote(fetched)
        if fetched.n_chunks < manifest.chunks:
            raise SessionIncomplete(
                f"session {manifest.id!r}: {manifest.chunks - fetched.n_chunks} of {manifest.chunks} chunks are gone"
            )
        payloads = list(fetched.payloads)
        tiers = list(fetched.tiers)
        if manifest.tail_tokens:
            if tail is None:
                raise SessionIncomplete(f"session {manifest.id!r}: its tail is gone")
            payloads.append(tail.payload)
            tiers.append(tail.tier)
        order = [t.name for t in self.store.tiers]
        slowest = max(tiers, key=order.index) if tiers else ""
        return payloads, slowest

    async def read_tail(self, namespace: Namespace, manifest: Manifest) -> Verified | None:
        """The session's tail when it is stored intact and holds the cells after its chunks (one
        that does not is deleted where it was read, and counted); None when it has none or it is gone."""
        if not manifest.tail_tokens:
            return None
        t_hash = bytes.fromhex(manifest.tail_hash)
        key = session_tail_key(namespace, manifest.id, t_hash)
        tail = await self.store.read_verified(key, t_hash, namespace)
        if tail is not None and self.check is not None:
            reason = self.check(tail.payload, manifest.chunks * namespace.chunk_tokens, manifest.tail_tokens)
            if reason is not None:
                await self.store.reject(key, tail.tier, reason)
                return None
        return tail

    async def touch(self, namespace: Namespace, manifest: Manifest) -> None:
        """Record a use of the session, unless it was deleted meanwhile (never brings it back)."""
        await self._put_manifest(namespace, replace(manifest, last_used=self._clock()), only_if_exists=True)

    async def delete(self, namespace: Namespace, session_id: str) -> bool:
        """Delete the manifest and the tail (shared chunks stay: other sessions may use them).
        A damaged manifest is deleted too (its tail, which it no longer names, expires)."""
        validate_session_id(session_id)
        try:
            manifest = await self._get_manifest(namespace, session_id)
        except SessionDamaged:
            manifest = None
        key = session_key(namespace, session_id)
        if self._local is not None:
            await self._local.delete(key)
        existed = await self.manifests.delete(key)
        if existed and manifest is not None and manifest.tail_hash:
            tail = session_tail_key(namespace, session_id, bytes.fromhex(manifest.tail_hash))
            await self.store.delete_everywhere([tail])
        return existed

    async def list(self, namespace: Namespace, prefix: str = "", *, after: str = "", limit: int = 100) -> list[Manifest]:
        """Manifests whose id starts with ``prefix``, sorted by id, after ``after`` (paging);
        damaged ones are skipped (``list_page`` names them)."""
        return (await self.list_page(namespace, prefix, after=after, limit=limit)).manifests

    async def list_page(self, namespace: Namespace, prefix: str = "", *, after: str = "",
                        limit: int = 100) -> SessionPage:
        """``list``, and the ids on the way whose manifests are damaged (skipped, logged)."""
        if prefix and not re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", prefix):
            raise ValueError("prefix may hold only A-Z a-z 0-9 . _ : -")
        keys = await self.manifests.keys(session_key(namespace, prefix))
        ids = sorted(session_id_of(namespace, k) for k in keys)
        out: list[Manifest] = []
        damaged: list[str] = []
        for sid in ids:
            if sid <= after:
                continue
            try:
                m = await self._get_manifest(namespace, sid)
            except SessionDamaged as exc:
                log.warning("session %r: its manifest is damaged (%s); left out of the listing", sid, exc)
                damaged.append(sid)
                continue
            if m is not None:
                out.append(m)
            if len(out) >= limit:
                break
        return SessionPage(out, damaged)

    async def _get_manifest(self, namespace: Namespace, session_id: str) -> Manifest | None:
        key = session_key(namespace, session_id)
        try:
            raw = await self.manifests.get(key)
        except TierUnavailable:
            raw = await self._local.get(key) if self._local is not None else None
            if raw is None:
                raise
            log.info("session %r: shared manifests unreachable; using the copy this node saved", session_id)
        else:
            if raw is None and self._local is not None:
                await self._local.delete(key)  # deleted or expired in the shared store: gone here too
        if raw is None:
            return None
        manifest = Manifest.from_json(raw)
        if (manifest.id, manifest.namespace, manifest.chunk_tokens) != (session_id, namespace.id,
                                                                        namespace.chunk_tokens):
            raise SessionDamaged(f"the manifest stored for session {session_id!r} is another session's")
        return manifest

    async def _put_manifest(self, namespace: Namespace, manifest: Manifest, *, only_if_exists: bool = False) -> None:
        key = session_key(namespace, manifest.id)
        value = manifest.to_json()
        if self._local is not None:  # first: a save Redis misses is still found on this node
            await self._local.set(key, value, only_if_exists=only_if_exists)
        try:
            await self.manifests.set(key, value, only_if_exists=only_if_exists)
        except TierUnavailable as exc:
            if self._local is None:
                raise
            raise TierUnavailable(f"session {manifest.id!r} saved on this node only: {exc}") from exc
