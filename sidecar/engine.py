"""Automatic mode: the KV flow around one completion request.

prepare(): render + tokenize -> slot choice -> longest prefix in the tiers -> cost model ->
fetch + assemble + restore into the slot. finish(): after the answer was delivered, save the slot,
split it, store the chunks no tier holds yet, publish an event, release the slot.

Every cache step is best-effort: any failure is logged and counted, and the request goes on as an
ordinary recompute (llama-server compares the slot's tokens with the prompt itself, so a slot that
holds less than we hoped only costs time, never correctness).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from integrations.chunks import split_state, state_pieces, write_pieces
from integrations.fingerprint import layout_fingerprint, model_identity
from integrations.llama_server import LlamaServerClient, LlamaServerError, Timings, prefix_reused
from integrations.statefile import SeqState, parse_state
from tiers.errors import KVTierError
from tiers.keys import Namespace, events_channel, prefix_chain
from tiers.sessions import Manifest, SessionError, SessionStore
from tiers.store import FetchResult, TieredStore

from .config import Settings
from .costmodel import CostModel
from .metrics import Metrics
from .prompts import Prompt, PromptTokens
from .slots import FOLLOW_UP_MAX_CHARS, Asked, Lease, SlotTable, common_prefix

log = logging.getLogger("kvtier.engine")

FILE_PREFIX = "kvtier-"  # every file kvtier writes into the slot dir; names never come from clients


def _read_and_remove(path: Path) -> bytes:
    """A saved slot file's bytes; the file is removed in the same thread (freeing a large file's
    pages takes milliseconds, which the event loop would otherwise wait for)."""
    try:
        return path.read_bytes()
    finally:
        path.unlink(missing_ok=True)


def _signature(props: Mapping[str, Any]) -> tuple[str, ...]:
    """What must stay the same for the learned namespace and slot table to stay valid."""
    return tuple(str(props.get(k, "")) for k in ("model_path", "build_info", "total_slots", "model_ftype"))


@dataclass(frozen=True, slots=True)
class Target:
    """What kvtier learned about its llama-server at start-up (or after it restarted)."""

    n_slots: int
    n_stream: int
    v_trans: bool
    model_id: str
    namespace: Namespace
    bytes_per_token: int
    n_ctx_slot: int


SAVE_DELAY_S = 0.01  # between delivering an answer and saving its slot
NO_TOKENS = np.zeros(0, np.int32)
NO_TOKENS.flags.writeable = False


@dataclass(slots=True)
class RequestPlan:
    """One request's cache work: its tokens, its slot, and what was restored."""

    tokens: np.ndarray
    lease: Lease
    namespace: Namespace
    salt: str = ""
    session_id: str | None = None
    prompt: Prompt | None = None  # checked against the tokens llama-server saves
    restored_tokens: int = 0
    restore_tier: str = ""
    restore_ms: float = 0.0
    overhead_ms: float = 0.0
    fetched: FetchResult | None = None  # promoted into the local tiers after the answer
    asked: Asked = ()  # what the request asked, remembered with its slot (follow-ups)
    follow_up: bool = False  # sent to the slot holding what it continues, without tokens
    # A session restored for this request: the save after the answer records its use (a touch
    # when there is none), so the restore does not wait for a manifest write.
    restored_session: Manifest | None = None


class KVEngine:
    def __init__(self, settings: Settings, client: LlamaServerClient, store: TieredStore, metrics: Metrics,
                 events: Any | None = None):
        self.settings = settings
        self.client = client
        self.store = store
        self.metrics = metrics
        self.events = events  # a RedisTier (publish) or None
        self.cost = CostModel(settings.prefill_tps_prior, settings.restore_gbps_prior,
                              min_tokens=settings.restore_min_tokens)
        self.slot_dir = Path(settings.slot_dir or ".")
        self.target: Target | None = None
        self.slots: SlotTable | None = None
        self._probe_lock = asyncio.Lock()
        self._pending: set[asyncio.Task[None]] = set()
        self._resynced: dict[int, int] = {}  # slot -> llama-server's token count when last read again
        self._kept_files: dict[int, int] = {}  # slot -> bytes of its restore file left in the slot dir
        self._tails: dict[int, tuple[bytes, int]] = {}  # slot -> (key, end) of the tail it stored or restored last
        self._restore_locks: dict[int, asyncio.Lock] = {}
        self.last_error = ""
        self._server_signature: tuple[str, ...] = ()
        self._warned_unsplittable = False
        self.sessions = SessionStore(store, events)
        self.session_slots: dict[str, int] = {}  # session id -> the slot that served it last
        self.prompts = PromptTokens(client, metrics, in_process=settings.local_tokenizer != "off")

    # -- start-up -------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.target is not None

    async def ensure_ready(self) -> bool:
        """Probe llama-server if not done yet; False while it cannot be probed."""
        if self.target is not None:
            return True
        async with self._probe_lock:
            if self.target is not None:
                return True
            try:
                await self.probe()
            except (KVTierError, OSError, ValueError) as exc:
                self.last_error = str(exc)
                log.warning("llama-server not ready for caching: %s", exc)
                return False
        return True

    async def probe(self) -> None:
        """Learn slots, n_stream, V layout and KV layout; rebuild the slot table.

        Saves each slot once (an empty slot's file is a few dozen bytes and tells ``n_stream``; a
        full one also tells the layout and what the slot holds). When every slot is empty, one
        1-token completion fills slot 0 so the layout can be read, and the slot is erased again.
        Checks on the way that the slot dir is the directory llama-server writes to.
        """
        props = await self.client.props()
        n_slots = int(props.get("total_slots") or 0)
        if n_slots <= 0:
            raise LlamaServerError("llama-server reports no slots")
        model_path = str(props.get("model_path") or "")
        model_id = self._model_id(model_path, props)
        table = SlotTable(n_slots)
        layout_state: SeqState | None = None
        n_stream = 0
        for slot in range(n_slots):
            state = await self._save_and_read(slot, "probe")
            n_stream = state.n_stream or n_stream
            if state.layout is not None:
                layout_state = layout_state or state
                if state.splittable:
                    table.set_tokens(slot, state.tokens.tokens.copy())
        if layout_state is None:
            await self.client.completion({"prompt": "kvtier", "n_predict": 1, "id_slot": 0, "cache_prompt": True,
                                          "temperature": 0})
            layout_state = await self._save_and_read(0, "probe")
            await self.client.erase_slot(0)
        layout = layout_state.layout
        if layout is None or layout_state.v_trans is None:
            raise LlamaServerError("could not learn the KV layout from a saved slot")
        ns = Namespace(layout_fingerprint(model_id, layout), chunk_tokens=self.settings.chunk_tokens)
        n_ctx = int(props.get("default_generation_settings", {}).get("n_ctx") or 0)
        await self.prompts.setup(props, self.settings.model or model_path)
        # No await from here on: a request that finds the target set must find the new slot table.
        self.target = Target(n_slots, n_stream or 1, bool(layout_state.v_trans), model_id, ns,
                             layout.bytes_per_token, n_ctx)
        self._server_signature = _signature(props)
        self.slots = table
        log.info("llama-server: %d slots, n_stream %d, v_trans %s, %d bytes/token, namespace %s",
                 n_slots, self.target.n_stream, self.target.v_trans, layout.bytes_per_token, ns.id)

    def _model_id(self, model_path: str, props: Mapping[str, Any]) -> str:
        if self.settings.model_id:
            return "id:" + self.settings.model_id
        path = self.settings.model or model_path
        if path and os.path.isfile(path):
            return model_identity(path)
        # The sidecar cannot read the model file: fall back to what llama-server says of it. Two
        # fine-tunes of one base with the same file name would collide, hence the warning.
        log.warning("model file %r not readable here; identity from llama-server's metadata "
                    "(set --model or --model-id to be exact)", path)
        return "meta:" + "|".join(str(props.get(k, "")) for k in ("model_path", "model_ftype", "bos_token",
                                                                  "eos_token", "chat_template"))

    async def _save_and_read(self, slot: int, purpose: str) -> SeqState:
        name = f"{FILE_PREFIX}{purpose}-{slot}-{uuid.uuid4().hex[:12]}.bin"
        path = self.slot_dir / name
        try:
            await self.client.save_slot(slot, name)
            try:
                data = await asyncio.to_thread(_read_and_remove, path)
            except FileNotFoundError:
                raise KVTierError(
                    f"llama-server saved slot {slot} but {path} does not exist: --slot-dir must be the "
                    "directory llama-server was given as --slot-save-path"
                ) from None
            return parse_state(data)
        finally:
            path.unlink(missing_ok=True)  # when saving or reading failed (else already gone: cheap)

    # -- before the request ---------------------------------------------------------------------

    async def prompt_for(self, kind: str, body: Mapping[str, Any]) -> Prompt | None:
        """The prompt tokens the server will see, or None when this request is not cacheable."""
        return await self.prompts.prompt_for(kind, body)

    def follow_up(self, body: Mapping[str, Any], asked: Asked, *, want_slot: int | None = None, salt: str = "",
                  since: float | None = None) -> RequestPlan | None:
        """A plan for a request that continues what an idle slot answered last, or None.

        Such a request (``slots.continues``: a chat with another last message, or with one answer
        and one new message; a text prompt with another end) needs nothing from the tiers: they
        hold no more of it than the slot, unless this very request already ran on another node, and
        then only its short new end (at most ``FOLLOW_UP_MAX_CHARS`` characters, cheap to compute).
        So it goes to that slot as it is, without rendering, tokenizing or a lookup.
        """
        if self.slots is None or self.target is None:
            return None
        if isinstance(asked, tuple) and len(body["messages"][-1]["content"]) > FOLLOW_UP_MAX_CHARS:
            return None
        lease = self.slots.follow_up(asked, want=want_slot, owner=salt)
        if lease is None:
            return None
        ns = self.target.namespace.salted(salt) if salt else self.target.namespace
        plan = RequestPlan(NO_TOKENS, lease, ns, salt, asked=asked, follow_up=True)
        plan.overhead_ms = (time.perf_counter() - since) * 1000 if since is not None else 0.0
        self.metrics.overhead_seconds.observe(plan.overhead_ms / 1000)
        self.metrics.follow_ups.inc()
        return plan

    async def prepare(self, prompt: Prompt, *, want_slot: int | None = None, salt: str = "",
                      timeout: float | None = None, session_id: str | None = None,
                      since: float | None = None, asked: Asked = ()) -> RequestPlan:
        """Take a slot for ``prompt``'s tokens and restore the longest worthwhile prefix into it.

        Args:
            prompt: the request's tokens (what kvtier computed of them is checked after the answer).
            since: ``perf_counter()`` when the request's own work began (counted as overhead).
            salt: the tenant; it salts the namespace and only its own slots count as cached.
            session_id: restore this session first when it is a prefix of ``tokens`` (and save
                the request's result under it afterwards).
            asked: what the request asked (``prompts.asked_of``), remembered with the slot after
                the answer for its follow-ups.
        """
        assert self.target is not None and self.slots is not None
        t0 = time.perf_counter() if since is None else since
        tokens = prompt.tokens
        self.metrics.slot_queue.set(self.slots.queue_depth + 1)
        lease = await self.slots.acquire(tokens, want=want_slot, timeout=timeout, owner=salt)
        self.metrics.slot_queue.set(self.slots.queue_depth)
        ns = self.target.namespace.salted(salt) if salt else self.target.namespace
        plan = RequestPlan(tokens, lease, ns, salt, session_id, prompt, asked=asked)
        if session_id is not None:
            self.session_slots[session_id] = lease.slot
        t1 = time.perf_counter()
        try:
            if lease.foreign:
                # Another tenant's tokens: llama-server would reuse their common prefix by itself,
                # and the faster answer would tell this tenant what the other one asked.
                await self.client.erase_slot(lease.slot)
                self.slots.set_tokens(lease.slot, np.zeros(0, np.int32), owner=salt)
            if session_id is None or not await self._restore_session_prefix(plan):
                await self._restore(plan)
        except Exception as exc:  # best-effort: the request goes on as a recompute
            self.metrics.cache_errors.labels("restore").inc()
            log.warning("restore into slot %d failed, recomputing: %s", lease.slot, exc)
            self.slots.set_tokens(lease.slot, np.zeros(0, np.int32))
        plan.overhead_ms = ((t1 - t0) - lease.waited_s + (time.perf_counter() - t1)) * 1000
        self.metrics.overhead_seconds.observe(plan.overhead_ms / 1000)
        self.metrics.tokens_slot_reused.inc(lease.cached_tokens)
        return plan

    async def _restore_session_prefix(self, plan: RequestPlan) -> bool:
        """Restore the request's session when it is a prefix of the prompt and worth it."""
        assert plan.session_id is not None
        try:
            manifest = await self.sessions.load(plan.namespace, plan.session_id)
        except SessionError:
            return False
        m_tokens = manifest.tokens
        if not (plan.lease.cached_tokens < m_tokens.size < plan.tokens.size
                and common_prefix(m_tokens, plan.tokens) == m_tokens.size):
            return False
        gain = m_tokens.size - plan.lease.cached_tokens
        assert self.target is not None
        decision = self.cost.decide(gain, {"redis" if self.sessions.shared else "memory":
                                           gain * self.target.bytes_per_token})
        self.metrics.decisions.labels("restore" if decision.restore else "recompute").inc()
        if not decision.restore:
            return False
        await self.restore_session(plan.lease.slot, manifest, plan)
        return True

    async def restore_session(self, slot: int, manifest: Manifest, plan: RequestPlan | None = None,
                              namespace: Namespace | None = None, salt: str = "") -> tuple[int, str, float]:
        """Restore a whole session (chunks and tail) into ``slot``; returns (tokens, tier, ms)."""
        assert self.target is not None and self.slots is not None
        ns = plan.namespace if plan is not None else (namespace or self.target.namespace)
        t0 = time.perf_counter()
        payloads, tier = await self.sessions.fetch(ns, manifest)
        self.metrics.restore_phase_seconds.labels("fetch").observe(time.perf_counter() - t0)
        tokens = manifest.tokens
        nbytes, _ = await self._restore_payloads(slot, payloads, tokens)
        self.slots.set_tokens(slot, tokens.copy(), owner=plan.salt if plan is not None else salt)
        ms = (time.perf_counter() - t0) * 1000
        self.metrics.restores.labels(tier or "memory", "ok").inc()
        self.metrics.restore_seconds.observe(ms / 1000)
        self.metrics.bytes_restored.inc(nbytes)
        if plan is not None:
            self.metrics.tokens_restored.inc(tokens.size - plan.lease.cached_tokens)
            plan.restored_tokens, plan.restore_tier, plan.restore_ms = int(tokens.size), tier, ms
            plan.restored_session = manifest
        else:
            await self.sessions.touch(ns, manifest)
        return int(tokens.size), tier, ms

    async def _restore(self, plan: RequestPlan) -> None:
        assert self.target is not None and self.slots is not None
        C = plan.namespace.chunk_tokens
        cached = plan.lease.cached_tokens
        max_chunks = max(plan.tokens.size - 1, 0) // C  # leave one token to evaluate: fresh logits
        if self.target.n_ctx_slot:
            max_chunks = min(max_chunks, (self.target.n_ctx_slot - 1) // C)
        if max_chunks * C <= cached:
            return
        chain = prefix_chain(plan.namespace, plan.tokens, max_chunks)
        found = await self.store.lookup_chain(plan.namespace, chain)
        tail = None
        if found.n_chunks:
            # The cells a saved slot held after its last full chunk, when this prompt continues them.
            room = min(C - 1, plan.tokens.size - 1 - found.matched_tokens)
            if self.target.n_ctx_slot:
                room = min(room, self.target.n_ctx_slot - 1 - found.matched_tokens)
            if room > 0:
                start = found.matched_tokens
                tail = await self.store.lookup_tail(plan.namespace, found.chunks[-1],
                                                    plan.tokens[start: start + room])
        gain = found.matched_tokens + (tail.n_tokens if tail else 0) - cached
        if gain <= 0:
            return
        chunk_bytes = C * self.target.bytes_per_token
        by_tier: dict[str, int] = {}
        for tier in found.tiers:
            by_tier[tier] = by_tier.get(tier, 0) + chunk_bytes
        if tail is not None:
            by_tier[tail.tier] = by_tier.get(tail.tier, 0) + tail.n_tokens * self.target.bytes_per_token
        decision = self.cost.decide(gain, by_tier)
        self.metrics.decisions.labels("restore" if decision.restore else "recompute").inc()
        if not decision.restore:
            log.info("slot %d: recompute %d tokens (%s: %.0f ms vs %.0f ms)", plan.lease.slot, gain,
                     decision.reason, decision.predicted_recompute_s * 1e3, decision.predicted_restore_s * 1e3)
            return
        t0 = time.perf_counter()
        fetched, tail_payload = await self.store.fetch_with_tail(
            plan.namespace, found.chunks, (tail.key, tail.hash) if tail is not None else None, promote=False)
        payloads = list(fetched.payloads)
        n_tokens = fetched.n_tokens
        tiers = set(fetched.tiers)
        if tail is not None and tail_payload is not None and fetched.n_chunks == found.n_chunks:
            payloads.append(tail_payload)
            n_tokens += tail.n_tokens
            tiers.add(tail.tier)
        else:
            tail = None  # gone, damaged, or after a chunk that is: the chunks alone
        if n_tokens <= cached:
            self.metrics.restores.labels("none", "miss").inc()
            return
        self.metrics.restore_phase_seconds.labels("fetch").observe(time.perf_counter() - t0)
        for tier in set(fetched.tiers):
            share = fetched.tiers.count(tier) / max(fetched.n_chunks, 1)
            self.cost.observe_fetch(tier, int(fetched.bytes_read * share), fetched.seconds * share)
        nbytes, restore_s = await self._restore_payloads(plan.lease.slot, payloads, plan.tokens)
        self.cost.observe_restore(nbytes, restore_s)
        self.slots.set_tokens(plan.lease.slot, plan.tokens[:n_tokens].copy(), owner=plan.salt)
        if tail is not None:
            self._tails[plan.lease.slot] = (tail.key, n_tokens)
            self.metrics.tails.labels("restored").inc()
        plan.fetched = fetched
        plan.restored_tokens = n_tokens
        plan.restore_tier = max(tiers, key=[t.name for t in self.store.tiers].index)
        plan.restore_ms = (time.perf_counter() - t0) * 1000
        self.metrics.restores.labels(plan.restore_tier, "ok").inc()
        self.metrics.restore_seconds.observe(plan.restore_ms / 1000)
        self.metrics.bytes_restored.inc(nbytes)
        self.metrics.tokens_restored.inc(n_tokens - cached)
        log.info("slot %d: restored %d tokens from %s in %.1f ms", plan.lease.slot, n_tokens,
                 plan.restore_tier, plan.restore_ms)

    async def _restore_payloads(self, slot: int, payloads: list[Any], tokens: np.ndarray) -> tuple[int, float]:
        """Assemble ``payloads`` into a state file and have llama-server restore it into ``slot``.

        Returns the file's size and the seconds from payloads to restored slot (the cost model's
        restore rate: everything but the fetch and any wait in llama-server's task queue).
        """
        assert self.target is not None
        t0 = time.perf_counter()
        v_trans, n_stream = self.target.v_trans, self.target.n_stream
        # The file as a list of slices of the payloads (and of transposed V blocks, for a server
        # without flash attention), written without joining them; off the event loop, as a
        # transposition copies half the state.
        pieces = await asyncio.to_thread(state_pieces, payloads, tokens, v_trans=v_trans, n_stream=n_stream)
        t1 = time.perf_counter()
        # One file per slot, overwritten in place by the slot's next restore: writing into pages the
        # slot dir holds already is about twice as fast on tmpfs as a new file (whose pages the
        # kernel must allocate and zero; on some VMs first-touched pages cost ~10 us each, 300 ms
        # for a 94 MB state). Kept only within --keep-restore-files, and never written by two
        # restores at once.
        name = f"{FILE_PREFIX}restore-{slot}.bin"
        path = self.slot_dir / name
        kept = False
        async with self._restore_locks.setdefault(slot, asyncio.Lock()):
            try:
                nbytes = await asyncio.to_thread(write_pieces, path, pieces, overwrite=True)
                t2 = time.perf_counter()
                action = await self.client.restore_slot(slot, name)
                t3 = time.perf_counter()
                others = sum(n for s, n in self._kept_files.items() if s != slot)
                kept = others + nbytes <= self.settings.keep_restore_files
            finally:
                if kept:
                    self._kept_files[slot] = nbytes
                else:
                    self._kept_files.pop(slot, None)
                    path.unlink(missing_ok=True)
        phases = self.metrics.restore_phase_seconds
        phases.labels("assemble").observe(t1 - t0)
        phases.labels("write").observe(t2 - t1)
        phases.labels("llama").observe(t3 - t2)
        # The cost model learns the restore's own time: llama-server's restore_ms, not the wait in
        # its queue behind other slots' work (seconds under load, which would teach it that
        # restoring is slow and make it stop restoring).
        llama_s = action.ms / 1000 if action.ms > 0 else t3 - t2
        return nbytes, (t2 - t0) + min(llama_s, t3 - t2)

    # -- after the request ----------------------------------------------------------------------

    def finish(self, plan: RequestPlan, *, ok: bool, answer: bytes | None) -> None:
        """Save the slot in the background and release it; the answer (its end, for streams) is
        read for its timings there too, after it has been delivered."""
        assert self.slots is not None
        self.slots.slots[plan.lease.slot].served = True
        task = asyncio.get_running_loop().create_task(self._save_then_release(plan, ok, answer))
        self._pending.add(task)
        self.metrics.pending_saves.set(len(self._pending))
        task.add_done_callback(self._pending.discard)

    def _account(self, plan: RequestPlan, timings: Timings | None) -> None:
        if timings is None:
            return
        self.metrics.tokens_recomputed.inc(timings.prompt_n)
        if plan.follow_up:  # its slot's common prefix is known only now
            self.metrics.tokens_slot_reused.inc(timings.cache_n)
        self.cost.observe_prefill(timings.prompt_n, timings.prompt_ms)
        if plan.restored_tokens and not prefix_reused(timings, plan.tokens.size, plan.restored_tokens):
            self.metrics.reuse_failures.inc()
            log.warning("slot %d: restored %d tokens but the server recomputed %d of %d",
                        plan.lease.slot, plan.restored_tokens, timings.prompt_n, plan.tokens.size)

    async def _save_then_release(self, plan: RequestPlan, ok: bool, answer: bytes | None) -> None:
        assert self.slots is not None
        # Let the answer's last bytes reach the client first: on a small host the save (llama-server
        # writing the slot file, kvtier splitting it) would compete for the CPU with its delivery.
        await asyncio.sleep(SAVE_DELAY_S)
        try:
            if answer is not None:
                self._account(plan, Timings.from_answer(answer))
            if plan.fetched is not None:
                fetched, plan.fetched = plan.fetched, None
                await self.store.promote(fetched)
            if not ok:
                # Nothing from a failed request is cached; what the slot holds now is unknown.
                self.slots.set_tokens(plan.lease.slot, np.zeros(0, np.int32))
                if plan.restored_session is not None:  # no save records the session's use
                    await self.sessions.touch(plan.namespace, plan.restored_session)
                return
            if plan.session_id is not None:
                manifest = await self.save_session(plan.lease.slot, plan.namespace, plan.session_id,
                                                   owner=plan.salt)
                self.prompts.check(plan.prompt, manifest.tokens)
            else:
                state, _ = await self.save_slot(plan.lease.slot, plan.namespace, owner=plan.salt)
                self.prompts.check(plan.prompt, state.tokens.tokens)
            # After the save, which set the slot's tokens (and so forgot what it answered).
            self.slots.slots[plan.lease.slot].asked = plan.asked
        except Exception as exc:
            self.metrics.cache_errors.labels("save").inc()
            log.warning("saving slot %d failed: %s", plan.lease.slot, exc)
            self.slots.set_tokens(plan.lease.slot, np.zeros(0, np.int32))
        finally:
            self.slots.release(plan.lease.slot)
            self.metrics.pending_saves.set(max(len(self._pending) - 1, 0))

    async def save_session(self, slot: int, namespace: Namespace, session_id: str, *, owner: str = "") -> Manifest:
        """Save ``slot`` as session ``session_id``: its chunks, its partial tail, its manifest."""
        assert self.slots is not None
        t0 = time.perf_counter()
        state = await self._save_and_read(slot, "session")
        tokens = state.tokens.tokens
        self.slots.set_tokens(slot, tokens.copy(), owner=owner)
        if not state.splittable:
            raise SessionError(f"this slot's state cannot be split into chunks ({state.split_reason})")
        split = split_state(state, namespace.chunk_tokens, tail=True)
        manifest = await self.sessions.save(
            namespace, session_id, tokens, lambda i: split.chunks[i], split.tail,
            node=self.settings.node_id, kv_bytes=int(tokens.size) * split.layout.bytes_per_token,
        )
        self.session_slots[session_id] = slot
        self.metrics.save_seconds.observe(time.perf_counter() - t0)
        if self.events is not None:
            try:
                from tiers.keys import events_channel as channel

                await self.events.publish_session_saved(channel(namespace), session_id, tokens=int(tokens.size))
            except Exception as exc:
                log.debug("publishing an event failed: %s", exc)
        return manifest

    async def save_slot(self, slot: int, namespace: Namespace, *, owner: str = "") -> tuple[SeqState, Any]:
        """Save ``slot``, store its chunks (only the new ones), and record what it holds."""
        assert self.slots is not None
        t0 = time.perf_counter()
        state = await self._save_and_read(slot, "save")
        tokens = state.tokens.tokens
        previous = self.slots.tokens(slot)
        self.slots.set_tokens(slot, tokens.copy(), owner=owner)
        result = None
        if state.splittable:
            chain = prefix_chain(namespace, tokens)
            cache: dict[int, Any] = {}

            def payload(i: int) -> Any:
                if i not in cache:
                    split = split_state(state, namespace.chunk_tokens, first_chunk=i)
                    cache.update({split.first_chunk + j: p for j, p in enumerate(split.chunks)})
                return cache[i]

            announce = None
            if self.events is not None:
                async def announce(keys: list[bytes]) -> None:
                    await self._publish_stored(namespace, keys)
            result = await self.store.store(namespace, chain, payload, announce=announce)
            self.metrics.bytes_saved.inc(result.bytes_encoded)
            try:
                await self._store_tail(slot, namespace, state, chain, previous, announce)
            except Exception as exc:  # the chunks are stored: a hop recomputes the partial tail, no more
                self.metrics.cache_errors.labels("save").inc()
                log.warning("storing slot %d's partial tail failed: %s", slot, exc)
        elif state.n_tokens and not self._warned_unsplittable:
            # Prefix restore needs chunks; such states are kept only by explicit session saves.
            self._warned_unsplittable = True
            log.warning("slot states cannot be split into prefix chunks (%s): automatic restore is off",
                        state.split_reason)
        self.metrics.save_seconds.observe(time.perf_counter() - t0)
        return state, result

    async def _store_tail(self, slot: int, namespace: Namespace, state: SeqState, chain: list[Any],
                          previous: np.ndarray, announce: Any) -> None:
        """Store the cells a saved slot holds after its last full chunk, so that a prompt continuing
        this state on another node restores them too instead of recomputing up to a chunk's worth;
        delete the tail this slot stored or restored before once this state holds all of it and more."""
        C = namespace.chunk_tokens
        tokens = state.tokens.tokens
        start = len(chain) * C
        key = None
        if chain and tokens.size > start:
            tail = split_state(state, C, first_chunk=len(chain), tail=True).tail
            assert tail is not None
            key = await self.store.store_tail(namespace, chain[-1], tokens[start:], tail, announce=announce)
            self.metrics.tails.labels("stored").inc()
        old = self._tails.pop(slot, None)
        if key is not None:
            self._tails[slot] = (key, int(tokens.size))
        if old is not None and old[0] != key and tokens.size > old[1] and common_prefix(previous, tokens) >= old[1]:
            await self.store.delete_everywhere([old[0]])
            self.metrics.tails.labels("deleted").inc()

    async def _publish_stored(self, namespace: Namespace, keys: list[bytes]) -> None:
        """Tell peers (pre-warming) which chunks Redis holds now; sent once they are written."""
        try:
            await self.events.publish_chunks_stored(events_channel(namespace), keys)  # type: ignore[union-attr]
        except Exception as exc:
            log.debug("publishing an event failed: %s", exc)

    async def prewarm_forever(self) -> None:
        """Pre-warming: copy chunks other nodes announce into this node's local tiers."""
        if self.events is None:
            return
        while not await self.ensure_ready():
            await asyncio.sleep(2)
        assert self.target is not None
        async for event in self.events.events(events_channel(self.target.namespace)):
            if event.get("type") != "chunk_stored":
                continue
            keys = [k.encode() for k in event.get("keys", []) if isinstance(k, str) and k.startswith("kvtier:")]
            copied = await self.store.prefetch(keys[:4096])
            self.metrics.prewarmed.inc(copied)

    def remove_kept_files(self) -> None:
        """Remove the restore files kept for the next restores (at shutdown)."""
        for slot in list(self._kept_files):
            (self.slot_dir / f"{FILE_PREFIX}restore-{slot}.bin").unlink(missing_ok=True)
        self._kept_files.clear()

    async def drain(self, timeout: float) -> bool:
        """Wait for pending saves (graceful shutdown)."""
        if not self._pending:
            return True
        _, pending = await asyncio.wait(set(self._pending), timeout=timeout)
        return not pending

    async def check_server(self) -> None:
        """Notice a llama-server that restarted or changed under us (the health watcher calls this).

        Another model or build behind the same URL means another namespace: relearn everything. A
        slot that is idle here but empty on the server lost its KV (a restart): forget what the
        table thought it held, so nothing is skipped on the strength of a stale belief. A slot that
        holds another count of tokens was used without kvtier (a client talking to llama-server
        directly): read what it holds now, so that kvtier neither skips a restore it needs nor
        restores a shorter prefix over a longer one.
        """
        if self.target is None or self.slots is None:
            return
        props = await self.client.props()
        if _signature(props) != self._server_signature:
            log.warning("llama-server changed (model, build or slots): relearning it")
            self.forget_slots()
            return
        lost = 0
        for info in await self.client.slots():
            slot_id = info.get("id")
            if not isinstance(slot_id, int) or not 0 <= slot_id < self.slots.n_slots:
                continue
            slot = self.slots.slots[slot_id]
            if slot.busy or info.get("is_processing"):
                continue
            held = info.get("n_prompt_tokens")
            # A slot that never ran a task reports no count; one that did and now reports none
            # belongs to a restarted server.
            if held is None and not slot.served:
                continue
            if not held and slot.tokens.size:
                self.slots.set_tokens(slot_id, np.zeros(0, np.int32))
                slot.served = False
                lost += 1
            elif held and int(held) != slot.tokens.size and self._resynced.get(slot_id) != int(held):
                # Once per count: should a state's token count ever differ from the server's own
                # figure, this must not become a slot save every few seconds.
                self._resynced[slot_id] = int(held)
                if await self._resync(slot_id):
                    log.info("slot %d was used without kvtier: it now holds %d tokens", slot_id, int(held))
        if lost:
            log.info("%d slot(s) no longer hold what kvtier recorded (llama-server restarted?)", lost)

    async def _resync(self, slot_id: int) -> bool:
        """Learn what an idle slot holds from a save of it (its tokens are exact); False when busy."""
        assert self.slots is not None
        if not self.slots.try_acquire(slot_id):
            return False
        try:
            state = await self._save_and_read(slot_id, "resync")
            # Not any tenant's: a salted tenant sees it as foreign (erased before use).
            self.slots.set_tokens(slot_id, state.tokens.tokens.copy(), owner="")
            return True
        except (KVTierError, LlamaServerError, OSError) as exc:
            log.info("slot %d: could not read what it holds (%s); forgetting it", slot_id, exc)
            self.slots.set_tokens(slot_id, np.zeros(0, np.int32))
            return False
        finally:
            self.slots.release(slot_id)

    def forget_slots(self) -> None:
        """llama-server restarted: its slots are empty, and the layout must be learned again."""
        self.target = None
        self._resynced.clear()
