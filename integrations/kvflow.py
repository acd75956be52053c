"""The engine-independent KV flows, written once for every engine kvtier serves.

The sidecar (llama-server slots) and the llama-cpp-python cache (an in-process context) differ in
how they read and write a sequence state; what they do with one is the same, and lives here:

- ``restorable_tokens``: how much of a prompt may come from the tiers (one token is always left to
  compute, so sampling starts from fresh logits; never more than the context holds);
- ``find_prefix`` / ``fetch_prefix``: the longest stored prefix of a prompt, whole chunks and then
  the partial tail a saved state held after its last chunk, looked up and fetched with the tail
  beside the chunks;
- ``store_state``: a saved state's new chunks (split lazily, only those some tier lacks), its
  partial tail, the replaced tail let go, peers told once Redis holds them;
- prefix references (``integrations.prefixrefs``): a prompt that shares only the start of a
  stored chunk (or tail), say a system prompt that ends mid-chunk, restores those cells too, to
  within ``REF_STEP`` tokens; a reference is checked against the prompt, so a forged one can at
  most miss;
- ``save_session``: a state as a named session (chunks, tail, manifest), announced.

Pending saves (the marks a save sets before it runs, and the waits for them) are in
``integrations.pendingflow``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from tiers.codec import Framed
from tiers.errors import KVTierError
from tiers.keys import (
    Namespace,
    common_prefix,
    events_channel,
    prefix_chain,
)
from tiers.sessions import Manifest, SessionError, SessionStore
from tiers.store import (
    REPLACED_GRACE_S,
    Announce,
    FetchResult,
    LookupResult,
    StoreResult,
    TailHit,
    TieredStore,
    Verified,
)
from tiers.threads import in_background

from .chunks import read_chunk_header
from .chunksplit import chunks_of, first_cells, split_state
from .memkind import PLAIN_KV, LookupShape
from .prefixrefs import REF_CHUNK, REF_TAIL, check_ref, is_ref, prefix_refs
from .statefile import SeqState

log = logging.getLogger("kvtier.flow")


class Publisher(Protocol):
    """What the flows tell peers (the event bus of ``tiers``)."""

    async def publish_chunks_stored(self, channel: str, keys: Sequence[bytes]) -> int: ...

    async def publish_session_saved(self, channel: str, session: str, **fields: object) -> int: ...


def restorable_tokens(n_prompt: int, n_ctx: int = 0) -> int:
    """Tokens of an ``n_prompt``-token prompt a restore may provide: all but the last (its logits
    must be computed), and at most ``n_ctx - 1`` when the context holds ``n_ctx`` (0: no limit)."""
    limit = n_prompt - 1
    if n_ctx > 0:
        limit = min(limit, n_ctx - 1)
    return max(limit, 0)


@dataclass(frozen=True, slots=True)
class PrefixFound:
    """The longest prefix of a prompt the tiers hold: whole chunks, then maybe a partial tail."""

    chunks: LookupResult
    tail: TailHit | None
    whole: bool = False  # states with a rest: usable only with the tail, which carries it
    # The prompt's tokens the tail covers: a prefix reference found there is checked against them.
    tail_tokens: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def n_tokens(self) -> int:
        if self.whole and self.tail is None:
            return 0
        return self.chunks.matched_tokens + (self.tail.n_tokens if self.tail else 0)

    def bytes_by_tier(self, chunk_tokens: int, bytes_per_token: int) -> dict[str, int]:
        """KV bytes a restore would read from each tier (the cost model's input)."""
        out: dict[str, int] = {}
        for tier in self.chunks.tiers:
            out[tier] = out.get(tier, 0) + chunk_tokens * bytes_per_token
        if self.tail is not None:
            out[self.tail.tier] = out.get(self.tail.tier, 0) + self.tail.n_tokens * bytes_per_token
        return out


@dataclass(frozen=True, slots=True)
class PrefixFetched:
    """Verified payloads of a found prefix, in order (chunks, then the tail when it was intact)."""

    payloads: list[bytes | memoryview]
    n_tokens: int
    tiers: frozenset[str]
    chunks: FetchResult  # for a later promotion into faster tiers and the cost model's fetch rates
    tail: TailHit | None  # None when there was none, or it was gone or damaged


async def find_prefix(store: TieredStore, namespace: Namespace, tokens: np.ndarray,
                      shape: LookupShape = PLAIN_KV) -> PrefixFound:
    """The longest prefix of ``tokens`` the tiers hold, within ``restorable_tokens``.

    ``shape.whole``: the namespace's states have a rest (sliding-window, hybrid memory), so only a
    stored state's end, its tail, makes a prefix usable: when none follows the last chunk found
    (another conversation stored more chunks of the same start), the tails after the chunks before
    it are looked up, from the longest prefix down.

    ``shape.tail_only``: the namespace's states are recurrent memory alone, each stored as one tail of
    every token (``SeqState.tail_only``): the longest such tail ``tokens`` starts with. One
    existence check per candidate length, in one call per tier.
    """
    C, whole = namespace.chunk_tokens, shape.whole
    limit = restorable_tokens(int(tokens.size), shape.n_ctx)
    if shape.tail_only:
        tail = await store.lookup_tail(namespace, namespace.digest, tokens[:limit])
        return PrefixFound(LookupResult(0, [], []), tail, True,
                           tokens[: tail.n_tokens].copy() if tail is not None else None)
    chain = prefix_chain(namespace, tokens, limit // C)
    found = await store.lookup_chain(namespace, chain) if chain else LookupResult(0, [], [])
    for n in range(found.n_chunks, -1 if whole else found.n_chunks - 1, -1):
        start = n * C
        room = min(C, limit - start)  # a tail with a rest may hold a whole chunk's cells
        if room <= 0:
            continue
        tail = await store.lookup_tail(namespace, found.chunks[n - 1] if n else namespace.digest,
                                       tokens[start: start + room])
        if tail is not None:
            return PrefixFound(LookupResult(start, found.chunks[:n], found.tiers[:n]), tail, whole,
                               tokens[start: start + tail.n_tokens].copy())
    return PrefixFound(found, None, whole)


async def fetch_prefix(store: TieredStore, namespace: Namespace, found: PrefixFound, *,
                       promote: bool = False) -> PrefixFetched:
    """Fetch ``found``'s chunks and, beside them, its tail. A tail after a chunk that is gone or
    damaged is left out (it continues that chunk, not the shorter prefix).

    Each payload must hold what its key names: chunk ``i`` the ``chunk_tokens`` cells from
    position ``i * chunk_tokens``, the tail its token count from the end of the chunks. One that
    does not (intact bytes the codec passed, but another chunk's cells: a forged or misfiled value)
    is deleted from the tier it came from and counted like a damaged one, and the prefix ends
    before it: the chunks ahead of it are still restored.
    """
    C = namespace.chunk_tokens
    tail = found.tail
    if found.n_tokens == 0:
        return PrefixFetched([], 0, frozenset(), FetchResult([], [], 0, 0, 0.0), None)
    fetched, tail_value = await store.fetch_with_tail(
        namespace, found.chunks.chunks, (tail.key, tail.hash) if tail is not None else None, promote=False)
    fetched = await store.matching(fetched, content_mismatch, C)
    if promote:
        await store.promote(fetched)
    payloads = list(fetched.payloads)
    n_tokens = fetched.n_tokens
    tiers = set(fetched.tiers)
    if tail is None or tail_value is None or fetched.n_chunks < found.chunks.n_chunks:
        if found.whole:  # chunks without the rest their tail carries restore nothing
            return PrefixFetched([], 0, frozenset(), fetched.first(0, C), None)
        return PrefixFetched(payloads, n_tokens, frozenset(tiers), fetched, None)
    tail_payload, restored_tail = await checked_tail(store, namespace, found, tail, tail_value, n_tokens)
    if tail_payload is None:
        if found.whole:
            return PrefixFetched([], 0, frozenset(), fetched.first(0, C), None)
        return PrefixFetched(payloads, n_tokens, frozenset(tiers), fetched, None)
    payloads.append(tail_payload)
    tiers.add(tail_value.tier)
    return PrefixFetched(payloads, n_tokens + tail.n_tokens, frozenset(tiers), fetched, restored_tail)


async def checked_tail(store: TieredStore, namespace: Namespace, found: PrefixFound, tail: TailHit,
                       tail_value: Verified, first_pos: int) -> tuple[bytes | memoryview | None, TailHit | None]:
    """The payload of ``found``'s ``tail``, read as ``tail_value``, when it holds the tail's cells from
    ``first_pos`` (a prefix reference resolved to the value it names), and the tail a context then
    answers for (None for a reference: the value it names is no tail of this context); (None,
    None) when it is refused, which is counted and deleted."""
    if is_ref(tail_value.payload):
        parent = found.chunks.chunks[-1] if found.chunks.n_chunks else namespace.digest
        payload, reason = await _resolve_ref(store, namespace, tail_value.payload, parent,
                                             found.tail_tokens, first_pos, rest=found.whole)
        if reason is not None:  # forged, or of another prompt: a miss, counted, and deleted
            await store.reject(tail.key, tail_value.tier, reason)
        return payload, None
    reason = content_mismatch(tail_value.payload, first_pos, tail.n_tokens, rest=found.whole)
    if reason is not None:
        await store.reject(tail.key, tail_value.tier, reason)
        return None, None
    return tail_value.payload, tail


def content_mismatch(payload: bytes | memoryview, first_pos: int, n_cells: int,
                     rest: bool | None = None) -> str | None:
    """None when ``payload`` is a chunk payload of the ``n_cells`` cells from ``first_pos`` (what
    the key it was read under names), with a rest exactly when ``rest`` is True (the tail of a
    state with one; None: either), else what is wrong with it (a ``tiers.store.ContentCheck``).
    A rest anywhere but at a restore's end is refused when the restore file is built."""
    try:
        info = read_chunk_header(payload)
    except (KVTierError, ValueError) as exc:
        return f"not a chunk payload ({exc})"
    if info.first_pos != first_pos or info.n_cells != n_cells:
        return (f"it holds cells {info.first_pos}..{info.first_pos + info.n_cells - 1}, "
                f"its key names {first_pos}..{first_pos + n_cells - 1}")
    if rest is not None and bool(info.rest_nbytes) != rest:
        return "it carries a rest (a window, a recurrent state)" if info.rest_nbytes else "it lacks the rest"
    return None


def _chunk_cells(payload: bytes | memoryview) -> int:
    """The cell count a chunk payload's header gives (0 when it is no chunk payload)."""
    try:
        return read_chunk_header(payload).n_cells
    except (KVTierError, ValueError):
        return 0


async def _resolve_ref(store: TieredStore, namespace: Namespace, ref: bytes | memoryview, parent: bytes,
                       prompt: np.ndarray | None, first_pos: int, *,
                       rest: bool) -> tuple[bytes | memoryview | None, str | None]:
    """The first cells of the value a reference names (``check_ref``), which must start at
    ``first_pos``, and None; or None and why the reference is refused; or (None, None) when the
    value is gone or damaged (a miss). A value that holds other cells is rejected."""
    if rest:
        return None, "a prefix reference into a state with a rest"  # never stored: it would lack the rest
    checked = check_ref(namespace, bytes(ref), parent, prompt, prompt.size if prompt is not None else 0)
    if isinstance(checked, str):
        return None, checked
    value = await store.read_verified(checked.key, checked.hash, namespace)
    if value is None:
        return None, None
    reason = content_mismatch(value.payload, first_pos, _chunk_cells(value.payload))
    if reason is not None:
        await store.reject(checked.key, value.tier, reason)
        return None, None
    try:
        cut = first_cells(value.payload, checked.n_cells)
    except (ValueError, KVTierError) as exc:
        log.warning("a prefix reference names a value that cannot hold %d cells: %s", checked.n_cells, exc)
        return None, None
    return (cut, None) if read_chunk_header(cut).n_cells == checked.n_cells else (None, None)


@dataclass(frozen=True, slots=True)
class TailRecord:
    """The partial tail a context stored or restored last: its key and the token count it ends at."""

    key: bytes
    end: int


@dataclass(frozen=True, slots=True)
class StoredState:
    """What ``store_state`` did: the chunks' result, and the tail the context now answers for."""

    chunks: StoreResult | None  # None when the state holds no full chunk
    tail: TailRecord | None
    tail_stored: bool = False
    tail_deleted: bool = False
    tail_error: Exception | None = None  # the tail failed; the chunks stand


class LazyChunks:
    """``payloads(i)`` for ``TieredStore.store``: chunks are cut only when a tier lacks them (a
    prefix shared by many states is split once, when it is new), each into a buffer of its own with
    ``room`` for the codec's header (encoded in place, no copy).

    ``prepare(first, end)`` cuts chunks ``first`` to ``end - 1`` in a worker thread (numpy copies
    release the GIL): the event loop, which relays other users' tokens, never copies a saved
    gigabyte itself. The store awaits it a window at a time before it asks for those payloads, for
    its RAM tier and for Redis (which may lack chunks the RAM tier holds: a restarted Redis), so
    Redis is sent one window while the next is cut. A chunk not prepared is cut where asked for.
    """

    def __init__(self, state: SeqState, chunk_tokens: int, room: int = 0):
        self.state = state
        self.chunk_tokens = chunk_tokens
        self.room = room
        self._cut: dict[int, Framed] = {}

    @property
    def cut(self) -> list[int]:
        """The chunks cut so far: those some tier lacked."""
        return sorted(self._cut)

    async def prepare(self, first: int, end: int) -> None:
        if first < chunks_of(self.state, self.chunk_tokens) and first not in self._cut:
            await in_background(self._cut_from, first, end)

    def _cut_from(self, first: int, end: int) -> None:
        split = split_state(self.state, self.chunk_tokens, first_chunk=first, room=self.room, end_chunk=end)
        for j, payload in enumerate(split.chunks):
            self._cut[split.first_chunk + j] = split.framed(j) if split.frames else Framed(payload, 0)

    def size_of(self, i: int) -> int:
        """About how many bytes chunk ``i`` takes once cut and framed (the state's bytes per token),
        for the RAM tier to make room before the cut."""
        return self.room + self.state.nbytes * self.chunk_tokens // max(self.state.n_tokens, 1)

    def __call__(self, i: int) -> Framed:
        if i not in self._cut:
            self._cut_from(i, i + 1)
        return self._cut[i]


def announcer(events: Publisher | None, namespace: Namespace) -> Announce | None:
    """An ``announce`` for ``TieredStore.store``: peers (pre-warming) hear of chunks once Redis
    holds them. Publishing is best-effort."""
    if events is None:
        return None
    channel = events_channel(namespace)

    async def announce(keys: list[bytes]) -> None:
        try:
            await events.publish_chunks_stored(channel, keys)
        except Exception as exc:
            log.debug("publishing an event failed: %s", exc)

    return announce


async def store_state(store: TieredStore, namespace: Namespace, state: SeqState, *,
                      events: Publisher | None = None, previous: TailRecord | None = None,
                      previous_tokens: np.ndarray | None = None) -> StoredState:
    """Store a saved (splittable) state: its new chunks, then the cells after its last full chunk.

    The tail lets a prompt that continues this state on another node restore it whole instead of
    recomputing up to a chunk's worth. ``previous`` is the tail this context stored or restored
    before, and ``previous_tokens`` what it held then: once this state holds all of that tail and
    more, the old tail is let go (nothing continues it any more but this state), from Redis
    ``REPLACED_GRACE_S`` after the new one is there. A failed tail is reported in the result;
    the chunks stand.
    """
    C = namespace.chunk_tokens
    tokens = state.tokens.tokens
    chain = prefix_chain(namespace, tokens, chunks_of(state, C))
    announce = announcer(events, namespace)
    lazy = LazyChunks(state, C, store.codec.head_room)
    chunks = await store.store(namespace, chain, lazy, announce=announce) if chain else None
    start = len(chain) * C
    new = None
    try:
        parents = [namespace.digest, *chain]
        # A state with a rest is restored whole or not at all: no reference into its cells.
        refs = [] if state.has_rest else [ref for i in lazy.cut for ref in prefix_refs(
            parents[i], tokens[i * C: (i + 1) * C], REF_CHUNK)]
        if (chain or state.has_rest) and tokens.size > start:
            cut = await in_background(split_state, state, C, first_chunk=len(chain), tail=True,
                                      room=store.codec.head_room)
            tail = cut.framed_tail or cut.tail  # recurrent memory alone: one small tail, not framed
            assert tail is not None
            key = await store.store_tail(namespace, parents[-1], tokens[start:], tail, announce=announce)
            new = TailRecord(key, int(tokens.size))
            if not state.has_rest:
                refs += prefix_refs(parents[-1], tokens[start:], REF_TAIL)
        await store.store_tails(namespace, refs)
        deleted = False
        if (previous is not None and previous_tokens is not None and (new is None or previous.key != new.key)
                and tokens.size > previous.end and common_prefix(previous_tokens, tokens) >= previous.end):
            await store.delete_everywhere([previous.key], grace=REPLACED_GRACE_S)
            deleted = True
    except Exception as exc:
        return StoredState(chunks, new, tail_stored=new is not None, tail_error=exc)
    return StoredState(chunks, new, tail_stored=new is not None, tail_deleted=deleted)


async def save_session(sessions: SessionStore, namespace: Namespace, session_id: str, state: SeqState, *,
                       node: str, events: Publisher | None = None) -> Manifest:
    """Store ``state`` as session ``session_id`` (chunks, partial tail, manifest) and announce it.

    Raises:
        ValueError: a bad session id. SessionError / KVTierError: the state cannot be split, or the
            store failed.
    """
    if state.store_reason is not None:
        raise SessionError(f"this state cannot be split into chunks ({state.store_reason})")
    tokens = state.tokens.tokens
    # Cut off the event loop, each payload framed for the codec (as ``store_state`` does).
    split = await in_background(split_state, state, namespace.chunk_tokens, tail=True,
                                room=sessions.store.codec.head_room)
    manifest = await sessions.save(
        namespace, session_id, tokens, split.framed if split.frames else lambda i: split.chunks[i],
        split.framed_tail or split.tail,
        node=node, kv_bytes=int(tokens.size) * split.layout.bytes_per_token, n_chunks=split.n_chunks,
    )
    if events is not None:
        try:
            await events.publish_session_saved(events_channel(namespace), session_id, tokens=int(tokens.size))
        except Exception as exc:
            log.debug("publishing an event failed: %s", exc)
    return manifest
