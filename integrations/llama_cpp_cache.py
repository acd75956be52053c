"""kvtier as llama-cpp-python's cache: ``llm.set_cache(KVTierCache(llm, redis_url=...))``.

llama-cpp-python's own caches (``LlamaRAMCache``, ``LlamaDiskCache``) keep one whole-context state
per completion, keyed by its token tuple, scan every key for the longest prefix and pickle to local
disk. ``KVTierCache`` keeps the KV of the context's sequence cut into the prefix chunks of the
llama-server path: the same namespace, keys and chunk payloads as the sidecar, in the same tiers
(this process's memory, a node-shared directory, Redis). A prefix is stored once however many
conversations share it, a lookup is one hash per chunk and one probe per tier, and any process,
machine or llama-server of the same model and KV layout can restore what another computed.

How it plugs in. ``Llama._create_completion`` asks ``cache[prompt_tokens]`` for the longest stored
prefix and hands the answer to ``Llama.load_state``, which calls ``llama_state_set_data`` (a
whole-context state). ``__getitem__`` therefore assembles the chunks into a slot-file image and
prefixes its memory with the model's architecture header: in this llama.cpp a whole-context state
is exactly that (no logits, no embeddings), so the value is the prefix's KV and nothing more, and an
unmodified ``Llama`` restores it. After the answer, ``cache[prompt + completion] = llm.save_state()``
calls ``__setitem__``, which reads the sequence itself (``llama_state_seq_get_data``) and stores
only the chunks no tier holds yet. For explicit control (your own ``generate`` loop, sessions),
``restore``/``save`` and ``restore_session``/``save_session`` work per sequence
(``llama_state_seq_set_data``) and set the ``Llama`` object's token bookkeeping themselves.

Sliding-window (Gemma 3) and hybrid (LFM2) models store as on the sidecar: the first KV cache in
prefix chunks, the rest (the window, the recurrent state) in the tail, in a namespace of their own,
so a lookup restores a stored state whole or not at all. Two things differ from llama-server:
``Llama.load_state`` reads a whole-context state, whose recurrent cells must name their sequence
(``whole_state_bytes``), and ``Llama.generate`` reuses any common prefix without checking the
memory's lowest position, so after restoring a sliding window the cache empties the context
before a prompt that would reuse less of it than the window allows (``WindowGuard``). The
padding kvtier adds below a cut window is not needed here, and harmless (masked).

Recurrent-only models (Mamba 2, RWKV) store as on the sidecar too: no chunk, one tail of every
token whose rest is the whole recurrent state, looked up as the longest stored state the prompt
continues (``kvflow.find_prefix`` with ``MemoryKind.RECURRENT``), in the sidecar's namespace for them (keyed by
the recurrent layers' types and row sizes: ``fingerprint.memory_layout``). Each completion
stores its whole state (replacing the one this context stored before, when it continues it); a
prompt that stops inside a stored state, ends with it, or leaves it, is computed from the start:
llama.cpp cannot rewind a recurrent state, and the last prompt token is always evaluated.

Every cache step is best-effort: a miss, a damaged or foreign chunk, an unreachable Redis or an
error only means the prompt is evaluated as without a cache. A lookup waits for Redis no longer
than evaluating the prompt would take (``redis_conn.deadline_past``): a server that hangs costs a completion
a second or so, not its socket timeouts and retries. Nothing read from a store is unpickled:
values are checked blobs (``tiers.codec``), their payloads raw KV rows.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any, Self

import numpy as np
from llama_cpp.llama import Llama, LlamaState
from llama_cpp.llama_cache import BaseLlamaCache

from tiers.errors import ConfigError
from tiers.keys import Namespace, as_token_array, common_prefix
from tiers.pending import PendingSaves
from tiers.redis_conn import SESSION_CALL_S, deadline_past, request_deadline, within_call_budget
from tiers.sessions import Manifest
from tiers.store import StoreResult, TieredStore

from . import flows, kvflow
from .chunkassemble import assemble_state
from .fingerprint import layout_fingerprint, memory_identity, model_identity
from .llama_cpp_saves import CacheCounters, ContextSaves
from .llama_cpp_state import (
    ContextInfo,
    context_tokens,
    load_seq_image,
    prefill_seconds,
    probe_context,
    read_seq_image,
    state_to_store,
    whole_state_bytes,
)
from .memkind import LookupShape, MemoryKind
from .stateparse import parse_state
from .syncstore import DEFAULT_CAPACITY, DEFAULT_SHARED_CAPACITY, DEFAULT_TIMEOUT, DRAIN_TIMEOUT, SyncStore

__all__ = ["CacheCounters", "KVTierCache", "SyncStore", "WindowGuard", "restore_session", "save_session"]

log = logging.getLogger("kvtier.llama_cpp")

# Defaults, with units.
DEFAULT_CHUNK_TOKENS = 256  # tokens per prefix chunk; must equal the sidecar's to share chunks

# Scores of a restored state: Llama.load_state broadcasts them into its score rows. Sampling reads
# llama.cpp's logits of the (always re-evaluated) last prompt token, never these.
_NO_SCORES = np.zeros((1, 1), dtype=np.single)


# -- the cache ------------------------------------------------------------------------------------


def _lora_salt(llm: Llama, salt: str) -> str:
    """A LoRA adapter changes every K and V: its identity and scale go into the namespace salt."""
    path = getattr(llm, "lora_path", None)
    if not path:
        return salt
    lora = f"lora:{model_identity(path)}:{float(getattr(llm, 'lora_scale', 1.0))!r}"
    return f"{salt}\0{lora}" if salt else lora


class WindowGuard:
    """How far back the context of a ``Llama`` may be reused after a sliding-window restore.

    A restored window holds the ``n_swa`` cells its last token sees and no more (a sequence's save
    leaves the masked ones out; kvtier adds two masked zero cells below them). Queries from
    position ``n - 1`` on see only those; an earlier one would attend over a cut window. Unlike
    llama-server, ``Llama.generate`` does not check the memory's lowest position before it reuses a
    prefix, so ``check`` empties the context before it would reuse less than ``n - 1`` tokens of
    it. Recurrent memory needs no bound: llama.cpp refuses to rewind it and ``Llama.generate`` then
    evaluates the prompt from the start.
    """

    def __init__(self, llm: Llama):
        self.llm = llm
        self.floor = 0  # the fewest tokens of the context a next prompt may reuse (0: no bound)

    def restored(self, n: int, memory_kind: MemoryKind) -> None:
        self.floor = n - 1 if memory_kind is MemoryKind.KV_PAIR else 0

    def check(self, tokens: np.ndarray) -> None:
        """Reset the ``Llama`` when its next ``generate(tokens)`` would reuse fewer tokens of a
        restored window than ``floor`` (it then evaluates all of them)."""
        if not self.floor:
            return
        have = common_prefix(context_tokens(self.llm), tokens)
        reused = have - 1 if have == tokens.size else have  # generate replays a fully cached prompt's last token
        if reused >= self.floor:
            return
        if have:
            log.debug("dropping the context: reusing %d tokens would cut the restored window", reused)
            self.llm.reset()  # type: ignore[no-untyped-call]
        self.floor = 0


class KVTierCache(BaseLlamaCache):
    """A llama-cpp-python cache backed by kvtier's tiers; pass it to ``llm.set_cache``.

    The cache is bound to one ``Llama``: it learns the context's KV layout, V layout and stream
    count from it at construction (a fresh context evaluates two tokens for that, then is reset),
    reads the sequence from it after each completion, and restores into it.

    Args:
        llm: the ``llama_cpp.Llama`` this cache serves.
        redis_url: share chunks through Redis/Valkey (``redis://``, ``rediss://``, sentinel, cluster).
        capacity_bytes: capacity of the in-process memory tier.
        chunk_tokens: tokens per prefix chunk; equal to the sidecar's ``chunk_tokens`` to share
            prefixes with llama-servers.
        salt: tenant salt: caches with different salts never share a chunk.
        shared_dir, shared_capacity: a directory tier shared by the processes of one node.
        redis_ttl: seconds a chunk lives in Redis after its last use (None: no expiry).
        redis_options: further ``RedisTier`` keyword arguments.
        compression: the blob codec's compression.
        mac_key: a secret shared by every node (see ``SyncStore``); ignored with ``store``.
        model_id: an explicit model identity (the sidecar's ``--model-id``); default: a hash of the
            GGUF file (``integrations.fingerprint.model_identity``), as the sidecar computes it.
        store: an existing ``SyncStore`` to share between caches (not closed by this cache).
        timeout: seconds one lookup or save may wait on the store before it counts as a miss.
        save_wait: the longest a lookup waits for another node's save in flight that holds more
            of the prompt than the tiers do (the sidecar's ``--save-wait``; 0: never wait).

    Sliding-window, hybrid and recurrent-only models are served too (see the module doc); after restoring a
    sliding window, a prompt that leaves it early is computed from the start only when this cache
    is set on the ``Llama`` (``llm.set_cache``): it is the cache's lookup that notices.

    Raises:
        ConfigError: the model's memory cannot be cut into prefix chunks (M-RoPE or PLE cells).
        StateFormatError: its memory is none kvtier can read a layout from (opaque).
    """

    def __init__(
        self,
        llm: Llama,
        *,
        redis_url: str | None = None,
        capacity_bytes: int = DEFAULT_CAPACITY,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        salt: str = "",
        shared_dir: str | os.PathLike[str] | None = None,
        shared_capacity: int | str = DEFAULT_SHARED_CAPACITY,
        redis_ttl: float | None = None,
        redis_options: Mapping[str, Any] | None = None,
        compression: str = "adaptive",
        mac_key: bytes | None = None,
        model_id: str | None = None,
        store: SyncStore | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        save_wait: float = 2.0,
    ):
        super().__init__(capacity_bytes)
        self.llm = llm
        self.info: ContextInfo = probe_context(llm)
        if self.info.split_reason is not None:
            raise ConfigError(f"KVTierCache needs a KV cache it can cut into prefix chunks: {self.info.split_reason}")
        identity = memory_identity("id:" + model_id if model_id else model_identity(llm.model_path),
                                   self.info.memory_kind)
        self.namespace = Namespace(layout_fingerprint(identity, self.info.layout), _lora_salt(llm, salt), chunk_tokens)
        self.timeout = timeout
        self._owns_store = store is None
        self.store = store if store is not None else SyncStore(
            memory_bytes=capacity_bytes, redis_url=redis_url, redis_ttl=redis_ttl, redis_options=redis_options,
            shared_dir=shared_dir, shared_bytes=shared_capacity, compression=compression, mac_key=mac_key,
        )
        self.counters = CacheCounters()
        self.save_wait = save_wait
        self.node_id = getattr(self.store.events, "node_id", None) or f"{socket.gethostname()}:{os.getpid()}"
        self.saves = ContextSaves(self.store, self.namespace, self.node_id, self.counters, self._failed, timeout)
        self._window = WindowGuard(llm)  # how far back a restored sliding window may be reused

    def __repr__(self) -> str:
        return (f"KVTierCache(namespace={self.namespace.id}, chunk_tokens={self.namespace.chunk_tokens}, "
                f"tiers={[t.name for t in self.store.store.tiers]})")

    # -- BaseLlamaCache -------------------------------------------------------------------------

    @property
    def cache_size(self) -> int:
        """Bytes held in this process's memory tier."""
        return self.store.memory.stats().bytes_used

    def __contains__(self, key: Sequence[int]) -> bool:
        """True when at least one chunk of ``key``'s prefix is stored (``kvflow.restorable_tokens``);
        for states with a rest, which chunks alone do not restore, a whole state ``key`` continues."""
        try:
            found = self._find(as_token_array(key))
            return found.n_tokens > 0 if self.info.memory_kind.has_rest else found.chunks.n_chunks > 0
        except Exception as exc:
            self._failed("lookup", exc)
            return False

    def __getitem__(self, key: Sequence[int]) -> LlamaState:
        """The longest stored prefix of ``key`` as a whole-context ``LlamaState`` for ``load_state``.

        Only a prefix longer than what the bound ``Llama`` already holds of ``key`` is returned (the
        ``Llama`` would ignore a shorter one), and never all of ``key``: one token is always left to
        evaluate, so sampling starts from fresh logits.

        Raises:
            KeyError: no such prefix (or the store failed: the cache never fails a completion).
        """
        self.counters.lookups += 1
        tokens = as_token_array(key)
        self._window.check(tokens)
        try:
            fetched = self._fetch_prefix(tokens, common_prefix(context_tokens(self.llm), tokens))
            if fetched is None:
                raise KeyError("no stored prefix longer than what the context holds")
            image = assemble_state(fetched.payloads, tokens, v_trans=self.info.v_trans, n_stream=self.info.n_stream)
            whole = whole_state_bytes(image, self.info.arch_header)
        except KeyError:
            raise
        except Exception as exc:
            self._failed("restore", exc)
            raise KeyError("kvtier lookup failed") from None
        n = self._restored(fetched)
        input_ids = np.full(len(self.llm.input_ids), -1, dtype=np.intc)  # -1 never matches a prompt token
        input_ids[:n] = tokens[:n]
        log.debug("restoring %d of %d tokens (%s)", n, tokens.size, ",".join(sorted(fetched.tiers)))
        return LlamaState(input_ids=input_ids, scores=_NO_SCORES, n_tokens=n, llama_state=whole,  # type: ignore[arg-type]
                          llama_state_size=whole.nbytes, seed=self.llm._seed)

    def __setitem__(self, key: Sequence[int], value: LlamaState) -> None:
        """Store the chunks of the context that ``value`` was saved from (only the new ones)."""
        try:
            self._save(as_token_array(key), value)
        except Exception as exc:
            self._failed("save", exc)

    # -- explicit, per-sequence use ---------------------------------------------------------------

    def lookup(self, tokens: Sequence[int] | np.ndarray) -> int:
        """How many leading tokens of ``tokens`` the tiers hold (chunks and a partial tail, one
        token left over)."""
        return self._find(as_token_array(tokens)).n_tokens

    def restore(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Restore the longest stored prefix of ``tokens`` into the bound ``Llama`` (its sequence 0).

        The ``Llama``'s token bookkeeping is set, so ``llm.generate(tokens)`` or
        ``llm.create_completion(prompt)`` then evaluates only the rest.

        Returns:
            Tokens the context now holds of ``tokens`` (what it held already when nothing better
            is stored).
        """
        toks = as_token_array(tokens)
        have = common_prefix(context_tokens(self.llm), toks)
        try:
            fetched = self._fetch_prefix(toks, have)
            if fetched is None:
                return have
            image = assemble_state(fetched.payloads, toks, v_trans=self.info.v_trans, n_stream=self.info.n_stream)
            load_seq_image(self.llm, image)
        except Exception as exc:
            self._failed("restore", exc)
            return common_prefix(context_tokens(self.llm), toks)
        return self._restored(fetched)

    def save(self) -> StoreResult | None:
        """Store the full chunks of what the bound ``Llama`` holds now (only those not stored yet),
        and its tail; the chunks' result, None when it holds no full chunk or no chunk is cut
        (recurrent memory alone: its one tail is stored all the same)."""
        return self._save(context_tokens(self.llm), None)

    # -- sessions -------------------------------------------------------------------------------

    def save_session(self, session_id: str) -> Manifest:
        """``save_session(self.llm, session_id)``."""
        return save_session(self.llm, session_id, cache=self)

    def restore_session(self, session_id: str) -> int:
        """``restore_session(self.llm, session_id)``."""
        return restore_session(self.llm, session_id, cache=self)

    # -- lifecycle and stats --------------------------------------------------------------------

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until queued Redis writes are done; False if ``timeout`` passed first."""
        return self.store.flush(timeout)

    def close(self) -> None:
        """Drain queued writes, stop the store (unless it was passed in) and unset the cache. Idempotent."""
        if getattr(self.llm, "cache", None) is self:
            self.llm.set_cache(None)
        self.saves.drain(DRAIN_TIMEOUT)  # its saves' pending marks are cleared, not left to expire
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        """Counters of this cache, per-tier statistics and the store's counters."""
        return {
            "namespace": self.namespace.id,
            **asdict(self.counters),
            "tiers": {name: asdict(s) for name, s in self.store.store.stats().items()},
            "store": asdict(self.store.store.counters),
        }

    # -- internals ------------------------------------------------------------------------------

    def _find(self, tokens: np.ndarray) -> kvflow.PrefixFound:
        return self.store.call(kvflow.find_prefix(self.store.store, self.namespace, tokens, self.info.shape),
                               self.timeout)

    def _fetch_prefix(self, tokens: np.ndarray, have: int) -> kvflow.PrefixFetched | None:
        """Verified payloads of the longest stored prefix of ``tokens`` (chunks and a partial tail)
        when longer than ``have``."""
        if kvflow.restorable_tokens(int(tokens.size), self.info.n_ctx) <= have:
            return None
        pending = self.store.pending if self.save_wait > 0 else None
        fetched = self.store.call(_lookup_and_fetch(self.store.store, pending, self.namespace, tokens, self.info.shape,
                                                    have, _waits(self.llm, self.save_wait, int(tokens.size) - have)),
                                  self.timeout)
        if fetched is None or fetched.n_tokens <= have:
            return None
        return fetched

    def _restored(self, fetched: kvflow.PrefixFetched) -> int:
        """Count a restore; remember its tail (the next save replaces it)."""
        self.counters.hits += 1
        self._note_restore(fetched.n_tokens)
        self.saves.restored(fetched)
        return fetched.n_tokens

    def _note_restore(self, n: int) -> None:
        """Count ``n`` restored tokens; a sliding window bounds how far back they may be reused."""
        self.counters.tokens_restored += n
        self._window.restored(n, self.info.memory_kind)

    def _save(self, key: np.ndarray, value: LlamaState | None) -> StoreResult | None:
        picked = state_to_store(self.llm, self.info, key, value, self.namespace.chunk_tokens)
        return self.saves.store_state(*picked) if picked is not None else None

    def _failed(self, step: str, exc: BaseException) -> None:
        self.counters.errors += 1
        log.warning("kvtier %s failed, the prompt is evaluated without it: %s", step, exc)


# -- module-level helpers -------------------------------------------------------------------------


def _waits(llm: Llama, save_wait: float, n_tokens: int) -> tuple[float, float]:
    """How long a lookup of a prompt that would evaluate ``n_tokens`` may wait for another node's
    save in flight (``save_wait`` at most, never longer than evaluating it), and for Redis in all
    (``redis_conn.deadline_past``)."""
    recompute = prefill_seconds(llm, n_tokens)
    wait = save_wait if recompute is None else min(save_wait, recompute)
    return wait, deadline_past(wait if recompute is None else recompute)


async def _lookup_and_fetch(store: TieredStore, pending: PendingSaves | None, namespace: Namespace,
                            tokens: np.ndarray, shape: LookupShape, have: int,
                            waits: tuple[float, float]) -> kvflow.PrefixFetched | None:
    """On the store's loop: the longest stored prefix of ``tokens`` longer than ``have``, fetched
    and verified, after waiting up to ``waits[0]`` for another node's save that holds more, all
    of it bounded by ``waits[1]`` seconds of waiting for Redis."""
    save_wait, redis_wait = waits
    with request_deadline(redis_wait):
        found = (await flows.find_prefix_waiting(store, pending, namespace, tokens, shape, have=have,
                                                 limit=lambda _save, _known: save_wait)).found
        if found.n_tokens <= have:
            return None
        return await kvflow.fetch_prefix(store, namespace, found, promote=True)


def _cache_of(llm: Llama, cache: KVTierCache | None) -> KVTierCache:
    cache = cache if cache is not None else getattr(llm, "cache", None)
    if not isinstance(cache, KVTierCache):
        raise TypeError("pass cache=KVTierCache(...) or call llm.set_cache(KVTierCache(llm, ...)) first")
    if cache.llm is not llm:
        raise ValueError("this KVTierCache is bound to another Llama")
    return cache


def save_session(llm: Llama, session_id: str, *, cache: KVTierCache | None = None) -> Manifest:
    """Save what ``llm`` holds as session ``session_id``: chunks, partial tail, manifest.

    Uses ``cache`` or the ``KVTierCache`` set on ``llm``. The manifest is the sidecar's
    (``tiers.sessions``): with Redis, a sidecar's ``POST /v1/sessions/{id}/restore`` restores it into
    a llama-server, and the reverse.

    Raises:
        ValueError: a bad session id or an empty context. KVTierError: the store failed.
        SessionError: the state cannot be stored (``SeqState.store_reason``; e.g. a sliding window
            that is not full yet: llama-server could not reuse it, so it is not stored at all).
    """
    c = _cache_of(llm, cache)
    tokens = context_tokens(llm)
    if tokens.size == 0:
        raise ValueError("the context holds no tokens to save")
    state = parse_state(read_seq_image(llm, tokens=tokens))
    return c.store.call(within_call_budget(SESSION_CALL_S, kvflow.save_session(
        c.store.sessions, c.namespace, session_id, state, node=c.node_id, events=c.store.events)), None)


def restore_session(llm: Llama, session_id: str, *, cache: KVTierCache | None = None) -> int:
    """Restore session ``session_id`` into ``llm``; returns the tokens it now holds.

    The next completion whose prompt starts with the session's tokens evaluates only the rest.

    Raises:
        tiers.sessions.SessionNotFound / SessionIncomplete: no such session, or chunks are gone.
        RestoreError: llama.cpp rejected the state (the context is then empty).
    """
    c = _cache_of(llm, cache)
    ns, sessions = c.namespace, c.store.sessions
    image = c.store.call(within_call_budget(SESSION_CALL_S, flows.session_image(
        sessions, ns, session_id, v_trans=c.info.v_trans, n_stream=c.info.n_stream)), c.timeout)
    n = load_seq_image(llm, image.joined())
    c._note_restore(n)
    try:
        c.store.call(within_call_budget(SESSION_CALL_S, sessions.touch(ns, image.manifest)), c.timeout)
    except Exception as exc:  # only last_used is lost
        log.debug("touching session %s failed: %s", session_id, exc)
    return n
