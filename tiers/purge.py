"""Listing and purging the automatic cache in Redis/Valkey: what each namespace holds, and the
deletion of a namespace, of every namespace, or of one conversation's keys.

Keys are found with SCAN (never KEYS: it blocks a large server) and deleted with UNLINK (the
server frees the values in the background) in batches; in cluster mode SCAN visits every primary
and each batch is unlinked slot by slot on the nodes that own them. What is not cached KV stays:
the fleet directory (``fleet``, ``f:``) and the model records (``model``) that let a tenant's
namespace be computed from its salt (``register_model``, ``models``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .keys import (
    Namespace,
    as_token_array,
    chunk_key,
    glob_prefix,
    model_key,
    prefix_chain,
    sequence_key,
    session_key,
    session_tail_key,
    tail_hashes,
    tail_key,
    whole_key,
)
from .redis_conn import RedisConnection
from .sessions import Manifest, SessionDamaged, validate_session_id

SCAN_COUNT = 1000  # keys the server looks at per SCAN step
UNLINK_BATCH = 500  # keys per UNLINK (per pipeline in cluster mode)
STRLEN_BATCH = 1000  # keys per pipeline of STRLEN when sizes are listed
ALL = "*"  # the namespace of a purge of everything

NAMESPACE_ID_RE = re.compile(r"^[0-9a-f]{16}$")
_KEY_RE = re.compile(rb"^kvtier:([0-9a-f]{16}):([A-Za-z]+)(?::|$)")
# What each kind of key under a namespace holds (tiers.keys); the others are kept by a purge.
CACHE_KINDS = {b"c": "chunks", b"a": "tails", b"w": "wholes", b"s": "sessions", b"t": "session_tails",
               b"p": "pending"}


def validate_namespace_id(value: object) -> str:
    """A namespace id as it appears in keys: 16 lowercase hex digits."""
    if not isinstance(value, str) or not NAMESPACE_ID_RE.fullmatch(value):
        raise ValueError("a namespace id is 16 lowercase hex digits (kvtier cache ls lists them)")
    return value


def parse_key(key: bytes) -> tuple[str, bytes] | None:
    """(namespace id, kind) of one of kvtier's keys, None for any other key."""
    m = _KEY_RE.match(key)
    return None if m is None else (m.group(1).decode(), m.group(2))


@dataclass(frozen=True, slots=True)
class ModelRecord:
    """A model namespace some node serves: enough to compute any tenant's namespace from a salt."""

    namespace: str  # the id of the unsalted namespace
    fingerprint: str
    chunk_tokens: int

    def salted(self, salt: str = "") -> Namespace:
        return Namespace(self.fingerprint, salt, self.chunk_tokens)


@dataclass(frozen=True, slots=True)
class NamespaceUsage:
    """What one namespace holds in Redis: keys by kind and the bytes of their values."""

    namespace: str
    counts: dict[str, int] = field(default_factory=dict)  # CACHE_KINDS' names -> keys
    bytes: int = 0
    model: ModelRecord | None = None  # set when the namespace is a model's own (no tenant salt)

    def public(self) -> dict[str, object]:
        out: dict[str, object] = {"namespace": self.namespace, "bytes": self.bytes,
                                  **{name: self.counts.get(name, 0) for name in CACHE_KINDS.values()}}
        if self.model is not None:
            out["model"] = self.model.fingerprint
            out["chunk_tokens"] = self.model.chunk_tokens
        return out


# -- model records ------------------------------------------------------------------------------

async def register_model(conn: RedisConnection, namespace: Namespace) -> None:
    """Record a model's unsalted namespace (its fingerprint is no secret: model identity and KV
    layout), so ``kvtier cache rm --salt`` can compute the tenant's namespace of every model.

    Raises:
        ValueError: a salted namespace (a tenant's salt is never written to Redis).
        KVTierError: Redis cannot be reached or refused.
    """
    if namespace.salt:
        raise ValueError("only a model's own namespace is recorded, never a tenant's")
    value = json.dumps({"fingerprint": namespace.fingerprint, "chunk_tokens": namespace.chunk_tokens})
    await conn.run("register model", lambda: conn.client.set(model_key(namespace), value))


async def models(conn: RedisConnection) -> list[ModelRecord]:
    """The recorded model namespaces; a record that does not hash to its key's id is skipped.

    Raises:
        KVTierError: Redis cannot be reached or refused.
    """
    keys = await _scan(conn, b"kvtier:????????????????:model")
    if not keys:
        return []
    values = await conn.pipeline("models", lambda pipe: [pipe.get(k) for k in keys])
    out: list[ModelRecord] = []
    for key, raw in zip(keys, values):
        parsed = parse_key(key)
        try:
            data = json.loads(raw)
            ns = Namespace(str(data["fingerprint"]), "", int(data["chunk_tokens"]))
        except (TypeError, ValueError, KeyError):
            continue
        if parsed is not None and ns.id == parsed[0]:
            out.append(ModelRecord(ns.id, ns.fingerprint, ns.chunk_tokens))
    return sorted(out, key=lambda m: m.namespace)


# -- listing --------------------------------------------------------------------------------------

async def usage(conn: RedisConnection, namespace: str | None = None) -> list[NamespaceUsage]:
    """Keys by kind and value bytes of every namespace (or one), sorted by bytes, largest first.
    A full SCAN of kvtier's keys: seconds on a server of millions of keys.

    Raises:
        KVTierError: Redis cannot be reached or refused.
    """
    pattern = glob_prefix(f"kvtier:{validate_namespace_id(namespace)}:".encode()) if namespace else b"kvtier:*"
    records = {m.namespace: m for m in await models(conn)}
    counts: dict[str, dict[str, int]] = {}
    sizes: dict[str, int] = {}

    async def call() -> None:
        batch: list[tuple[str, bytes]] = []
        async for key in conn.client.scan_iter(match=pattern, count=SCAN_COUNT):
            parsed = parse_key(key)
            if parsed is None or parsed[1] not in CACHE_KINDS:
                continue
            ns, kind = parsed
            per = counts.setdefault(ns, {})
            per[CACHE_KINDS[kind]] = per.get(CACHE_KINDS[kind], 0) + 1
            batch.append((ns, key))
            if len(batch) >= STRLEN_BATCH:
                await _add_sizes(conn, batch, sizes)
                batch = []
        await _add_sizes(conn, batch, sizes)

    await conn.run("cache usage", call)
    for ns in records:
        counts.setdefault(ns, {})
    out = [NamespaceUsage(ns, c, sizes.get(ns, 0), records.get(ns)) for ns, c in counts.items()]
    return sorted(out, key=lambda u: (-u.bytes, u.namespace))


async def _add_sizes(conn: RedisConnection, batch: list[tuple[str, bytes]], sizes: dict[str, int]) -> None:
    if not batch:
        return
    pipe = conn.client.pipeline(transaction=False)
    for _, key in batch:
        pipe.strlen(key)
    results = await pipe.execute(raise_on_error=False)
    for (ns, _), n in zip(batch, results):
        if isinstance(n, int):
            sizes[ns] = sizes.get(ns, 0) + n


# -- purging --------------------------------------------------------------------------------------

async def purge_namespace(conn: RedisConnection, namespace: str) -> int:
    """Unlink every cached key of one namespace (an id), or of every namespace (``ALL``); the
    fleet directory and model records stay. Returns the keys deleted.

    Raises:
        ValueError: not a namespace id. KVTierError: Redis cannot be reached or refused (run it
            again: what was deleted is gone, the rest is found again).
    """
    if namespace == ALL:
        pattern = b"kvtier:*"
    else:
        pattern = glob_prefix(f"kvtier:{validate_namespace_id(namespace)}:".encode())
    deleted = 0

    async def call() -> int:
        nonlocal deleted
        batch: list[bytes] = []
        async for key in conn.client.scan_iter(match=pattern, count=SCAN_COUNT):
            parsed = parse_key(key)
            if parsed is None or parsed[1] not in CACHE_KINDS:
                continue
            batch.append(key)
            if len(batch) >= UNLINK_BATCH:
                deleted += await _unlink(conn, batch)
                batch = []
        deleted += await _unlink(conn, batch)
        return deleted

    return await conn.run("purge", call)


async def purge_keys(conn: RedisConnection, keys: Sequence[bytes]) -> int:
    """Unlink the given keys in batches; returns how many existed.

    Raises:
        KVTierError: Redis cannot be reached or refused.
    """
    async def call() -> int:
        deleted = 0
        for i in range(0, len(keys), UNLINK_BATCH):
            deleted += await _unlink(conn, list(keys[i: i + UNLINK_BATCH]))
        return deleted

    return await conn.run("purge", call)


async def _unlink(conn: RedisConnection, keys: list[bytes]) -> int:
    """One UNLINK of ``keys``. In cluster mode redis-py sends one per hash slot, side by side (a
    namespace's keys carry no hash tag, so they lie in many slots)."""
    if not keys:
        return 0
    return int(await conn.client.unlink(*keys))


async def _scan(conn: RedisConnection, pattern: bytes) -> list[bytes]:
    async def call() -> list[bytes]:
        return list(dict.fromkeys([k async for k in conn.client.scan_iter(match=pattern, count=SCAN_COUNT)]))

    return await conn.run("scan", call)


# -- one conversation -----------------------------------------------------------------------------

def conversation_keys(namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
    """Every key under which a conversation of ``tokens`` (or a prefix of it) can be cached.

    Its prefix chunks (shared with every conversation that starts the same way: a purge takes
    them from those too), the partial tails and prefix references after each chunk (at most one
    chunk's cells each), the tails of a state stored whole from the root (recurrent memory), and
    the whole-sequence key. About two keys per token: UNLINK of absent keys costs little.
    """
    toks = as_token_array(tokens)
    C = namespace.chunk_tokens
    chain = prefix_chain(namespace, toks)
    keys = [chunk_key(namespace, h) for h in chain]
    for k, parent in enumerate([namespace.digest, *chain]):
        keys += [tail_key(namespace, h) for h in tail_hashes(parent, toks[k * C: (k + 1) * C])]
    if toks.size > C:
        keys += [tail_key(namespace, h) for h in tail_hashes(namespace.digest, toks)[C:]]
    keys.append(whole_key(namespace, sequence_key(namespace, toks)))
    return keys


async def session_purge_keys(conn: RedisConnection, namespace: Namespace, session_id: str) -> list[bytes] | None:
    """The keys of a session (its manifest, every version of its tail) and of its conversation
    (``conversation_keys`` of the manifest's tokens); None when there is no such session. A
    manifest that cannot be read gives its own keys only.

    Raises:
        KVTierError: Redis cannot be reached or refused.
    """
    validate_session_id(session_id)
    manifest_key = session_key(namespace, session_id)
    raw = await conn.run("get", lambda: conn.client.get(manifest_key))
    if raw is None:
        return None
    tails = await _scan(conn, glob_prefix(session_tail_key(namespace, session_id, b"")))
    try:
        tokens = Manifest.from_json(raw).tokens
    except SessionDamaged:
        tokens = np.zeros(0, np.int32)
    return [manifest_key, *tails, *conversation_keys(namespace, tokens)]


def namespace_keys_prefix(namespace: str) -> bytes:
    """What every key of a namespace id (or of all, ``ALL``) starts with, for the local tiers."""
    if namespace == ALL:
        return b"kvtier:"
    return f"kvtier:{validate_namespace_id(namespace)}:".encode()

