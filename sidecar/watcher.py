"""What kvtier knows of its llama-server: the slots, the KV layout, the model's identity.

One llama-server process is one identity (a ``Target``, numbered by ``generation``). The health loop
and the request path move one state machine, written here once:

    UNKNOWN --probe--> KNOWN --doubt--> DOUBTED --check: same process--> KNOWN
       ^                                   |
       +------ check: another process ----+   (and from KNOWN, when the health loop's check says so)

- ``probe`` (RELEARNING while it runs) learns slots, layout and namespace, and numbers a new identity.
- Doubt comes from: the witness chain breaking (a connection kept open to llama-server for that
  alone, ``sidecar.http.witness``: a process that exits takes its sockets with it), a failed health
  check, and an answer that reused less than planned (a ``prompt_n`` surprise). A doubt alone
  never forgets anything. KNOWN lasts while the chain that was open before the last check or probe
  holds; a check that had no task id to compare takes no chain (the next request checks again).
- The check (``/props`` and ``/slots``) retires the identity only on evidence that another process
  answers: another model, build or slot count, or a slot's task id lower than recorded (task ids
  only grow within one process). However many parts notice one restart, it is learned once: the
  first check retires the old identity and the probe learns the new one; every later check
  compares against the new one and finds it unchanged. Requests that queue behind a check begun
  after they asked take its answer: a burst checks once, and reaches llama-server together.

A save is stored only when the identity its request was planned in is still the one confirmed when
the slot is read (``generation``); a relearn of the same process never happens, so it never
invalidates work planned against it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from integrations.fingerprint import layout_fingerprint, memory_identity, memory_layout, model_identity
from integrations.llama_server import LlamaServerClient, LlamaServerError
from integrations.memkind import LookupShape, MemoryKind
from integrations.statefile import SeqState
from tiers.errors import KVTierError
from tiers.keys import Namespace

from .config import Settings
from .llamacache import DEFAULT_MIB, LlamaPromptCache, detect
from .prompts import PromptTokens
from .slotfiles import SlotFiles
from .slots import SlotTable

log = logging.getLogger("kvtier.engine")


def _signature(props: Mapping[str, Any]) -> tuple[str, ...]:
    """What must stay the same for the learned namespace and slot table to stay valid."""
    return tuple(str(props.get(k, "")) for k in ("model_path", "build_info", "total_slots", "model_ftype"))


class Witness(Protocol):
    """Something whose ``closed`` turns true if llama-server restarts (``sidecar.http.witness.Chain``)."""

    @property
    def closed(self) -> bool: ...


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
    memory_kind: MemoryKind = MemoryKind.KV  # what a state holds, and so how it is looked up

    @property
    def shape(self) -> LookupShape:
        """How a prompt's prefix is looked up in the tiers for this server's slots."""
        return LookupShape(self.n_ctx_slot, self.memory_kind)

    def namespace_for(self, salt: str) -> Namespace:
        """The namespace of a tenant (its salt), or the server's own for none."""
        return self.namespace.salted(salt) if salt else self.namespace


class ServerState(enum.Enum):
    """Where the state machine of ``ServerWatcher`` stands (see the module's docstring)."""

    UNKNOWN = "unknown"  # nothing learned, or the process learned is gone: probe before use
    RELEARNING = "relearning"  # a probe runs
    KNOWN = "known"  # learned, and nothing since suggests another process
    DOUBTED = "doubted"  # learned, but check (``/props``, ``/slots``) before the next use


class ServerWatcher:
    """Learns the llama-server (``target``) and what its slots hold (``slots``), and keeps both true."""

    def __init__(self, settings: Settings, client: LlamaServerClient, files: SlotFiles, prompts: PromptTokens,
                 witness: Callable[[], Witness | None] | None = None):
        self.settings = settings
        self.client = client
        self.files = files
        self.prompts = prompts
        self.target: Target | None = None
        self.slots: SlotTable | None = None
        # llama-server's own prompt cache, as far as kvtier sees it (one per llama-server process)
        self.llama_cache = LlamaPromptCache(0, 1)
        self.last_error = ""
        # The identity kvtier plans for: bumped when a process is learned or found gone, never by
        # a check that finds the same one. A request's save is stored only within its generation.
        self.generation = 0
        self._signature: tuple[str, ...] = ()
        self._lock = asyncio.Lock()  # one check or probe at a time, whoever asks
        self._probing = False
        self._doubted = False
        self._witness_of = witness  # None: no such signal; the health watcher's checks alone
        self._witness: Witness | None = None
        # Checks and probes begun, and the number of the last one that confirmed llama-server: a
        # caller that queued behind a check begun after it asked takes that check's answer.
        self._begun = 0
        self._confirmed_by = 0
        self._warned_unreadable = False
        self.up = True  # llama-server answered the health watcher's last check

    @property
    def confirmed(self) -> bool:
        """Whether llama-server is known to be the process kvtier last checked."""
        if self.target is None or self._doubted:
            return False
        return self._witness_of is None or (self._witness is not None and not self._witness.closed)

    @property
    def state(self) -> ServerState:
        if self._probing:
            return ServerState.RELEARNING
        if self.target is None:
            return ServerState.UNKNOWN
        return ServerState.KNOWN if self.confirmed else ServerState.DOUBTED

    def doubt(self) -> None:
        """Something suggests llama-server changed (it failed a health check, an answer reused less
        than planned): check again before the next request. Forgets nothing."""
        self._witness = None
        self._doubted = True

    def _unsure_why(self) -> str:
        if self._doubted:
            return "doubted (a failed health check, or an answer that reused less than planned)"
        return "no witness held since the last check" if self._witness is None else "its witness closed"

    async def ensure_ready(self) -> bool:
        """Learn llama-server if not done yet, and confirm it is still the same one; False while
        it cannot be reached or learned."""
        if self.confirmed:
            return True
        asked = self._begun
        async with self._lock:
            if self._confirmed_by > asked and self.target is not None and not self._doubted:
                return True  # a check begun while this call waited confirmed it: once is enough
            try:
                if self.target is not None and not self.confirmed:
                    log.info("checking llama-server's identity before a request: %s", self._unsure_why())
                    await self._check_identity()
                if self.target is None:
                    await self.probe()
            except (KVTierError, OSError, ValueError) as exc:
                self.last_error = str(exc)
                log.warning("llama-server not ready for caching: %s", exc)
                return False
        return True

    async def probe(self) -> None:
        """Learn slots, n_stream, V layout and KV layout; build a new slot table (a new identity).

        Saves each idle slot once (an empty slot's file is a few dozen bytes and tells ``n_stream``;
        a full one also tells the layout and what the slot holds). A slot that is computing is not
        read: llama-server would defer the save until it is idle, and nothing may wait on that; its
        record starts unknown. When no idle slot holds anything, one 1-token completion fills an
        idle slot so the layout can be read, and the slot is erased again. Checks on the way that
        the slot dir is the directory llama-server writes to.
        """
        self._probing = True
        self._begun += 1
        try:
            await self._probe()
        finally:
            self._probing = False

    async def _probe(self) -> None:
        chain = self._chain()  # open before the probe and after it: the process it learned
        props = await self.client.props()
        n_slots = int(props.get("total_slots") or 0)
        if n_slots <= 0:
            raise LlamaServerError("llama-server reports no slots")
        model_path = str(props.get("model_path") or "")
        model_id = self._model_id(model_path, props)
        table = SlotTable(n_slots)
        computing = {info.get("id") for info in await self.client.slots() if info.get("is_processing")}
        layout_state: SeqState | None = None
        n_stream = 0
        idle = [slot for slot in range(n_slots) if slot not in computing]
        for slot in range(n_slots):
            if slot in computing:
                table.forget(slot)  # what it will hold is not known: another tenant's request erases it
                continue
            state = await self.files.save(slot, "probe")
            n_stream = state.n_stream or n_stream
            if memory_layout(state) is not None:
                layout_state = layout_state or state
                if state.store_reason is None:
                    table.set_tokens(slot, state.tokens.tokens.copy())
        if layout_state is None:
            if not idle:
                raise LlamaServerError("every slot is computing: the KV layout is learned once one is idle")
            await self.client.completion({"prompt": "kvtier", "n_predict": 1, "id_slot": idle[0],
                                          "cache_prompt": True, "temperature": 0})
            layout_state = await self.files.save(idle[0], "probe")
            await self.client.erase_slot(idle[0])
        layout = memory_layout(layout_state)
        v_trans = layout_state.v_trans if not layout_state.tail_only else False  # no V to lay out
        if layout is None or v_trans is None:
            raise LlamaServerError("could not learn the KV layout from a saved slot")
        memory = layout_state.memory_kind if layout_state.has_rest else MemoryKind.KV
        # Recurrent memory alone holds no bytes per token: its restores read one fixed-size state.
        bytes_per_token = 0 if layout_state.tail_only else layout.bytes_per_token
        table.note_tasks(await self.client.slots())  # each slot's last task id, this process's
        # A state with a rest is another format than a plain cache of the same layers: its own namespace.
        identity = memory_identity(model_id, memory)
        ns = Namespace(layout_fingerprint(identity, layout), chunk_tokens=self.settings.chunk_tokens)
        n_ctx = int(props.get("default_generation_settings", {}).get("n_ctx") or 0)
        await self.prompts.setup(props, self.settings.model or model_path)
        llama_cache = await _llama_cache(self.settings, self.client, table, idle, memory, bytes_per_token,
                                         n_ctx * n_slots)
        # No await from here on: a request that finds the target set must find the new slot table.
        self.target = Target(n_slots, n_stream or 1, v_trans, model_id, ns, bytes_per_token, n_ctx, memory)
        self._signature = _signature(props)
        self.slots = table
        self.llama_cache = llama_cache
        self.generation += 1
        self._confirm(chain)
        log.info("llama-server: %d slots, n_stream %d, v_trans %s, %d bytes/token, memory %s, namespace %s",
                 n_slots, self.target.n_stream, self.target.v_trans, bytes_per_token,
                 memory.label, ns.id)

    def _model_id(self, model_path: str, props: Mapping[str, Any]) -> str:
        if self.settings.model_id:
            return "id:" + self.settings.model_id
        path = self.settings.model or model_path
        if path and os.path.isfile(path):
            return model_identity(path)  # cached by the file's size and mtime: a replaced file is rehashed
        # The sidecar cannot read the model file: fall back to what llama-server says of it. Two
        # fine-tunes of one base with the same file name would collide, hence the warning.
        if not self._warned_unreadable:
            self._warned_unreadable = True
            log.warning("model file %r not readable here; identity from llama-server's metadata "
                        "(set --model or --model-id to be exact)", path)
        return "meta:" + "|".join(str(props.get(k, "")) for k in ("model_path", "model_ftype", "bos_token",
                                                                  "eos_token", "chat_template"))

    async def watch_forever(self, interval: float) -> None:
        """Every ``interval`` seconds: is llama-server up (a failed check is a doubt), is it the
        process kvtier learned (``check_server``), and, once one answers that is not, learn it."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.client.health()
                up = True
            except LlamaServerError:
                up = False
            if up != self.up:
                log.warning("llama-server %s its health check", "answers" if up else "does not answer")
            self.up = up
            if not up:
                # It may come back as another process: whoever uses it next checks first. The
                # identity stays until a check shows another process (a slow answer is no restart).
                self.doubt()
                continue
            try:
                await self.check_server()
                if self.target is None:
                    await self.ensure_ready()
            except (LlamaServerError, OSError) as exc:
                log.debug("health watcher: %s", exc)

    def _retire(self, why: str) -> None:
        """The process kvtier learned is gone (or serves another model): learn the next one."""
        log.warning("llama-server %s: relearning it", why)
        self.target = None
        self._witness = None
        self.generation += 1

    def _chain(self) -> Witness | None:
        return self._witness_of() if self._witness_of is not None else None

    def _confirm(self, witness: Witness | None) -> None:
        """A check or probe found the process it expects; ``witness``, a chain that was open
        before it began (else None), vouches for that process from now on while it holds."""
        self._doubted = False
        self._confirmed_by = self._begun
        self._witness = witness

    async def check_server(self) -> None:
        """Notice a llama-server that restarted or changed under us, and slots used without kvtier
        (the health watcher calls this every few seconds).

        The identity is checked under the lock that requests' checks and probes take, so one
        restart is learned once, whoever notices it. Then, outside the lock: a slot that is idle
        here but empty on the server lost its KV (someone erased it): forget what the table thought
        it held, so nothing is skipped on the strength of a stale belief. A slot that holds another
        count of tokens was used without kvtier (a client talking to llama-server directly): read
        what it holds now, so that kvtier neither skips a restore it needs nor restores a shorter
        prefix over a longer one.
        """
        async with self._lock:
            if self.target is None:
                return
            infos = await self._check_identity()
        table = self.slots
        if infos is not None and table is not None:
            await sync_slots(self.files, table, infos)

    async def _check_identity(self) -> list[dict[str, Any]] | None:
        """Compare llama-server with the identity kvtier learned (the lock held): confirm it, or
        retire it on evidence of another process. Returns ``/slots`` when confirmed."""
        target, table = self.target, self.slots
        assert target is not None and table is not None
        self._begun += 1
        chain = self._chain()
        props = await self.client.props()
        if (_signature(props) != self._signature
                or self._model_id(str(props.get("model_path") or ""), props) != target.model_id):
            self._retire("changed (model, build or slots)")
            return None
        infos = await self.client.slots()
        verdict = table.note_tasks(infos)
        if verdict:
            # Even a slot kvtier is saving now holds another process's KV (or none): relearn all.
            self._retire("restarted (a slot's task id went back)")
            return None
        # Without a task id to compare (no slot ran one yet) nothing tells this process from
        # another: confirmed for now, but a chain begun since a restart would vouch for the
        # wrong one, so none is taken and the next request checks again.
        self._confirm(chain if verdict is False else None)
        return infos


async def _llama_cache(settings: Settings, client: LlamaServerClient, table: SlotTable, idle: list[int],
                       memory: MemoryKind, bytes_per_token: int, n_ctx: int) -> LlamaPromptCache:
    """A mirror of llama-server's own prompt cache, its size as configured (``--llama-cache-ram``)
    or tested in the idle slot holding least (``llamacache.detect``: its content is given up).
    Mirrored for a plain KV cache only: a state with a rest is reused whole or not at all.
    ``n_ctx``: llama-server's whole context, what its cache keeps at most without a size limit."""
    mib = settings.llama_cache_ram
    if memory.has_rest:
        mib = 0
    elif mib is None:
        mib = 0
        if idle:
            slot = min(idle, key=lambda s: table.slots[s].tokens.size)
            try:
                mib = DEFAULT_MIB if await detect(client, slot) else 0
            except LlamaServerError as exc:
                log.warning("could not tell whether llama-server keeps a prompt cache (%s): taken as none", exc)
            table.set_tokens(slot, np.zeros(0, np.int32))
        log.info("llama-server's own prompt cache: %s", f"on, taken as {mib} MiB" if mib else "off")
    return LlamaPromptCache(mib, bytes_per_token, n_ctx)


async def sync_slots(files: SlotFiles, table: SlotTable, infos: list[dict[str, Any]]) -> None:
    """Bring the records of idle slots up to date with llama-server's ``/slots`` (see
    ``ServerWatcher.check_server``)."""
    lost = 0
    for info in infos:
        slot_id = info.get("id")
        if not isinstance(slot_id, int) or not 0 <= slot_id < table.n_slots:
            continue
        slot = table.slots[slot_id]
        if slot.busy or info.get("is_processing"):
            continue
        held = info.get("n_prompt_tokens")
        # A slot that never ran a task reports no count; one that did and now reports none
        # was emptied behind kvtier's back.
        if held is None and not slot.served:
            continue
        if not held and slot.tokens.size:
            table.emptied(slot_id)
            lost += 1
        elif held and int(held) != slot.tokens.size and slot.resynced != int(held):
            # Once per count: should a state's token count ever differ from the server's own
            # figure, this must not become a slot save every few seconds.
            table.resyncing(slot_id, int(held))
            if await _resync(files, table, slot_id):
                log.info("slot %d was used without kvtier: it now holds %d tokens", slot_id, int(held))
    if lost:
        log.info("%d slot(s) no longer hold what kvtier recorded", lost)


async def _resync(files: SlotFiles, table: SlotTable, slot_id: int) -> bool:
    """Learn what an idle slot holds from a save of it (its tokens are exact); False when busy."""
    lease = table.try_acquire(slot_id)
    if lease is None:
        return False
    with lease:
        try:
            state = await files.save(slot_id, "resync")
        except (KVTierError, LlamaServerError, OSError) as exc:
            log.info("slot %d: could not read what it holds (%s); forgetting it", slot_id, exc)
            table.set_tokens(slot_id, np.zeros(0, np.int32))
            return False
        # Still the tenant kvtier last served there (a slot it lost track of after a failure
        # may hold that tenant's KV): any other tenant's request erases it before use.
        table.set_tokens(slot_id, state.tokens.tokens.copy())
        return True
