"""The fleet view: which prefixes each sidecar's slots hold hot, and how busy it is, in Redis.

A sidecar with ``--advertise-url`` publishes, under its model's namespace (no tenant salt):

- ``kvtier:{ns}:f:{node}``: a hash. Field ``status`` holds JSON (the advertise URL, slots, busy
  slots, queue, the time a request takes); each other field is the 16-byte hash of a chunk prefix
  some slot holds (``tiers.keys.prefix_chain`` of its tokens, under its tenant's namespace), its
  value the bitmask of the slots holding it. The key lives ``HEARTBEAT_TTL_S`` and is rewritten
  every ``HEARTBEAT_S`` (at once when a slot changes), so a sidecar that dies drops out within
  ``HEARTBEAT_TTL_S``: Redis expires it, no one has to notice. A sidecar whose llama-server fails
  its health check (dead or hung, ``ServerWatcher.up``) withdraws its entry until it answers again.
- ``kvtier:{ns}:fleet``: a sorted set of node ids (score: wall-clock expiry), the directory a
  forwarding sidecar reads once per heartbeat, in the background, to know whom to ask: at most
  ``DIRECTORY_READ_MAX`` ids a time, each kept only with a valid, fresh status (the others are
  removed), so the directory's size never reaches a request.

A lookup is one pipeline of ``HMGET`` per live peer, the status and the prompt's chain hashes:
only the relevant part of the view, in one round trip. A slot's partial tail (the tokens after
its last full chunk) is in its status as a hash, compared locally with the prompt's.

Why a hash per node rather than an index key per chunk hash: a node rewrites one key per change
(not one per chunk of every slot each second), a dead node's whole entry expires at once, and the
reader's cost grows with the number of peers, which for llama-server fleets is small. Tenants
need no rule here: a chain is rooted in the tenant's namespace, so another tenant's prompt can
never match it.

No pub/sub events: a reader reads the entries at lookup time and caches nothing of them, so there
is no view to invalidate; what events would add (freshness) the change-driven rewrite gives, within
``POLL_S`` of a slot changing.

Everything here is a hint: a garbled status is skipped, and a wrong one costs a request time
(the peer's own kvtier and llama-server check what they hold), never correctness. The status holds
the URL requests are sent to, with the client's headers: with ``--chunk-key`` (which ``--forward``
requires) it carries a keyed BLAKE2b MAC over its content and the time it was written, and a status
without a valid one, or written more than ``STATUS_MAX_AGE_S`` ago, is skipped. So whoever can write
to Redis but lacks the secret cannot steer requests to an address of its choosing, nor keep a dead
node's status alive by replaying it (forged chunk-hash fields can only send a request to a genuine,
live peer, which costs time).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from tiers.errors import KVTierError
from tiers.keys import ChunkHash, Namespace, fleet_key, fleet_node_key, prefix_chain, tail_hash_after
from tiers.redis_conn import RedisConnection

from .costmodel import Ewma
from .peerurl import PeerUrl, peer_url_or_none
from .slots import SlotTable
from .watcher import ServerWatcher

log = logging.getLogger("kvtier.fleet")

HEARTBEAT_S = 1.0  # a node's entry is rewritten this often
HEARTBEAT_TTL_S = 3.0  # and expires this long after its last write: a dead node's drop-out time
POLL_S = 0.25  # how often the slot table is compared with what was published
DIRECTORY_TTL_S = 30.0  # a node id stays in the directory this long (its entry's TTL is the truth)
STATUS_FIELD = b"status"  # never a chunk hash (those are 16 bytes)
SERVICE_PRIOR_S = 5.0  # seconds a request holds a slot, until this node has measured it
STATUS_MAX_AGE_S = 10.0  # a status written longer ago (or later, by the reader's clock) is stale:
# heartbeats rewrite it every HEARTBEAT_S; the rest allows for clock skew between nodes (NTP)
DIRECTORY_READ_MAX = 512  # node ids read from the directory per heartbeat: bounds the work an
# id list of any size costs (ids without a valid, fresh status are removed from it as they are read)
FORMAT = 2  # 2: the status carries the time it was written ("t"), inside its MAC


@dataclass(frozen=True, slots=True)
class SlotHeat:
    """One slot as peers see it: tokens held, whether a request could take it now, its tail's hash."""

    n_tokens: int
    idle: bool
    tail: bytes  # tail_hash_after(last full chunk, the tokens after it); b"" without such tokens


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """What a sidecar publishes about itself besides its prefixes."""

    node: str
    url: str
    slots: tuple[SlotHeat, ...]
    busy: int  # slots running a request (a save after the answer does not count)
    queue: int  # requests waiting for a slot
    service_s: float  # seconds a request holds a slot, on average (EWMA)
    ready: bool = True
    at: float = 0.0  # wall-clock time it was written (time.time()): a replayed old status is stale

    def encode(self, mac_key: bytes | None = None) -> bytes:
        """JSON, followed with ``mac_key`` by ``\n`` and its keyed BLAKE2b MAC (hex)."""
        raw = json.dumps({"v": FORMAT, "node": self.node, "url": self.url, "busy": self.busy, "queue": self.queue,
                           "service_s": round(self.service_s, 4), "ready": self.ready, "t": self.at,
                           "slots": [[s.n_tokens, int(s.idle), s.tail.hex()] for s in self.slots]}).encode()
        return raw if mac_key is None else raw + b"\n" + _mac(mac_key, raw).encode()

    @classmethod
    def parse(cls, raw: object, mac_key: bytes | None = None, now: float | None = None) -> NodeStatus | None:
        """The status a stored value holds; None for anything else: without a valid MAC when
        ``mac_key`` is given, written more than ``STATUS_MAX_AGE_S`` from ``now`` when it is
        given, or naming a URL ``peerurl`` refuses (a hint: never raises)."""
        if not isinstance(raw, bytes) or len(raw) > 1 << 16:
            return None
        if mac_key is not None:
            raw, _, mac = raw.rpartition(b"\n")
            if not hmac.compare_digest(mac, _mac(mac_key, raw).encode()):
                return None
        try:
            d = json.loads(raw)
            slots = tuple(SlotHeat(int(n), bool(idle), bytes.fromhex(tail)) for n, idle, tail in d["slots"])
            status = cls(str(d["node"]), str(d["url"]), slots, int(d["busy"]), int(d["queue"]),
                         float(d["service_s"]), bool(d.get("ready", True)), float(d["t"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        if d.get("v") != FORMAT or peer_url_or_none(status.url) is None or not status.service_s >= 0:
            return None
        if now is not None and not abs(now - status.at) <= STATUS_MAX_AGE_S:
            return None
        return status

    @property
    def peer_url(self) -> PeerUrl:
        """The URL's checked parts (``parse`` returns no status whose URL fails the check)."""
        url = peer_url_or_none(self.url)
        assert url is not None, self.url
        return url

    def wait_s(self, extra: int = 0) -> float:
        """Seconds a new request would wait for a slot here: queued requests (and ``extra`` more,
        sent but not yet seen in this status) ahead of it, served ``len(slots)`` at a time."""
        n = max(len(self.slots), 1)
        ahead = self.busy + self.queue + extra + 1 - n
        return max(ahead, 0) / n * self.service_s

    def sharing(self, extra: int = 0) -> int:
        """Requests a new one would be computed beside here (``sharing``), ``extra`` sent included."""
        return sharing(self.busy + extra, max(len(self.slots), 1))


@dataclass(frozen=True, slots=True)
class PeerHeat:
    """A live peer and how much of one prompt its idle slots hold."""

    status: NodeStatus
    hot_tokens: int


def _mac(key: bytes, raw: bytes) -> str:
    return hashlib.blake2b(raw, key=key[:64], digest_size=32, person=b"kvtier-fleet").hexdigest()


def slot_heat(namespace: Namespace, tokens: np.ndarray) -> tuple[list[ChunkHash], bytes]:
    """The chain of ``tokens``' full chunks and the hash of the partial tail after them."""
    chain = prefix_chain(namespace, tokens)
    start = len(chain) * namespace.chunk_tokens
    if start >= tokens.size:
        return chain, b""
    return chain, tail_hash_after(chain[-1] if chain else namespace.digest, tokens[start:])


def hot_tokens(status: NodeStatus, masks: list[int], namespace: Namespace, tokens: np.ndarray,
               chain: list[ChunkHash]) -> int:
    """How many of ``tokens`` the peer's idle slots hold: ``masks[j]`` is the bitmask of its slots
    holding ``chain[j]`` (0 for none)."""
    C = namespace.chunk_tokens
    best = 0
    for i, slot in enumerate(status.slots):
        if not slot.idle:
            continue
        bit = 1 << i
        depth = 0
        while depth < len(masks) and masks[depth] & bit:
            depth += 1
        held = depth * C
        if depth == slot.n_tokens // C and slot.tail and slot.n_tokens <= tokens.size:
            parent = chain[depth - 1] if depth else namespace.digest
            if tail_hash_after(parent, tokens[held: slot.n_tokens]) == slot.tail:
                held = slot.n_tokens
        best = max(best, held)
    return best


class Fleet:
    """This sidecar's entry in the fleet view (published) and its reading of the peers' entries.

    Args:
        connection: the Redis every node shares (its breaker guards each call; a failure leaves
            the view empty, never fails a request).
        node_id: this node's id (``--node-id``).
        url: the URL peers reach this sidecar at (``--advertise-url``); None: read the view, never
            appear in it.
        watcher: the llama-server and its slot table.
        mac_key: ``--chunk-key``: statuses are written with a keyed MAC and read only with a valid one.
        read_peers: read the directory every heartbeat (``--forward``); False: ``peers`` stays empty.
    """

    def __init__(self, connection: RedisConnection, node_id: str, url: str | None, watcher: ServerWatcher, *,
                 clock: Callable[[], float] = time.time, mac_key: bytes | None = None, read_peers: bool = True):
        self.connection = connection
        self.mac_key = mac_key
        self.node_id = node_id
        self.url = url
        self.watcher = watcher
        self.read_peers = read_peers
        self.service_s = Ewma(SERVICE_PRIOR_S)
        self.peers: list[str] = []  # the directory as last read (other nodes only)
        self._in_flight: dict[str, int] = {}  # requests this node forwarded, per peer, not answered yet
        self._clock = clock
        self._chains: dict[int, tuple[np.ndarray, str, list[ChunkHash], bytes]] = {}
        self._published: tuple[bytes, set[bytes]] | None = None  # (key, fields) last written
        self._signature: object = None
        self._last_write = 0.0
        self._last_read = 0.0
        self._nudged = asyncio.Event()  # a slot changed: compare now, not at the next poll

    # -- publishing -------------------------------------------------------------------------------

    def observe_service(self, seconds: float) -> None:
        """A request held a slot this long (it feeds the published ``service_s``)."""
        self.service_s.update(seconds)

    def _snapshot(self) -> tuple[Namespace, NodeStatus, dict[bytes, int]] | None:
        target, table = self.watcher.target, self.watcher.slots
        if target is None or table is None or self.url is None:
            return None
        heats: list[SlotHeat] = []
        fields: dict[bytes, int] = {}
        for s in table.slots:
            tokens, owner = s.hot()  # a slot being saved: the prompt it answered, at once
            chain, tail = self._slot_chain(s.id, tokens, owner, target.namespace_for(owner))
            for h in chain:
                fields[h] = fields.get(h, 0) | 1 << s.id
            heats.append(SlotHeat(int(tokens.size), not s.busy or s.saving, tail))
        status = NodeStatus(self.node_id, self.url, tuple(heats), table.computing, table.queue_depth,
                            self.service_s.value, at=self._clock())
        return target.namespace, status, fields

    def _slot_chain(self, slot: int, tokens: np.ndarray, owner: str,
                    namespace: Namespace) -> tuple[list[ChunkHash], bytes]:
        cached = self._chains.get(slot)
        if cached is not None and cached[0] is tokens and cached[1] == namespace.id:
            return cached[2], cached[3]
        chain, tail = slot_heat(namespace, tokens)
        self._chains[slot] = (tokens, namespace.id, chain, tail)
        return chain, tail

    async def publish(self, force: bool = False) -> bool:
        """Write this node's entry when it changed or a heartbeat is due; True when written."""
        snap = self._snapshot()
        if snap is None:
            return False
        namespace, status, fields = snap
        key = fleet_node_key(namespace, self.node_id)
        signature = (key, status.slots, status.busy, status.queue, tuple(sorted(fields.items())))
        now = time.monotonic()
        if not force and signature == self._signature and now - self._last_write < HEARTBEAT_S:
            return False
        old_key, old_fields = self._published or (b"", set())
        stale = old_fields - fields.keys() if old_key == key else set()
        ttl_ms = int(HEARTBEAT_TTL_S * 1000)
        expiry = self._clock() + DIRECTORY_TTL_S
        directory = fleet_key(namespace)
        mapping: dict[bytes, bytes] = {h: b"%d" % mask for h, mask in fields.items()}
        mapping[STATUS_FIELD] = status.encode(self.mac_key)

        def fill(pipe):  # type: ignore[no-untyped-def]
            if old_key and old_key != key:
                pipe.delete(old_key)  # another model or namespace since: the old entry is wrong
            if self._published is None:
                pipe.delete(key)  # a previous run of this node may have left fields
            # New fields first, stale ones after: a reader in between sees a superset (a hint
            # too many costs a misroute, one too few a restore).
            pipe.hset(key, mapping=mapping)
            if stale:
                pipe.hdel(key, *stale)
            pipe.pexpire(key, ttl_ms)
            pipe.zadd(directory, {self.node_id: expiry})

        await self.connection.pipeline("fleet publish", fill)
        self._published = (key, set(fields))
        self._signature = signature
        self._last_write = now
        return True

    async def read_directory(self) -> None:
        """Read the peers (a forwarding node, once per heartbeat, in the background): at most
        ``DIRECTORY_READ_MAX`` ids of the directory, each kept only when its entry holds a valid,
        fresh status of that node. The ids that do not are removed from the directory (a node
        re-adds itself with its next heartbeat), so forged or dead ids cost one read, once.
        Requests read only the result (``peers``): what the directory holds never adds to them."""
        target = self.watcher.target
        if target is None:
            return
        model, directory, now = target.namespace, fleet_key(target.namespace), self._clock()
        results = await self.connection.pipeline("fleet directory", lambda pipe: [
            pipe.zremrangebyscore(directory, "-inf", now),
            pipe.zrangebyscore(directory, now, "+inf", start=0, num=DIRECTORY_READ_MAX)])
        members = results[-1] if isinstance(results[-1], list) else []
        ids = [m.decode() for m in members if isinstance(m, bytes) and _NODE_ID.fullmatch(m)]
        ids = [node for node in ids if node != self.node_id]
        bad = [m for m in members if isinstance(m, bytes) and not _NODE_ID.fullmatch(m)]
        statuses = await self.connection.pipeline("fleet directory statuses", lambda pipe: [
            pipe.hget(fleet_node_key(model, node), STATUS_FIELD) for node in ids]) if ids else []
        peers: list[str] = []
        for node, raw in zip(ids, statuses):
            status = NodeStatus.parse(raw, self.mac_key, now)
            if status is not None and status.node == node:
                peers.append(node)
            else:
                bad.append(node.encode())
        self.peers = sorted(peers)
        if bad:
            await self.connection.pipeline("fleet directory prune", lambda pipe: pipe.zrem(directory, *bad))

    async def run_forever(self) -> None:
        """Publish on every change of the slot table (checked every ``POLL_S``) and every heartbeat."""
        while True:
            try:
                if self.url is not None and not self.watcher.up:
                    await self.withdraw()  # a hung or dead llama-server: peers must not send it requests
                elif self.url is not None:
                    await self.publish()
                if self.read_peers and time.monotonic() - self._last_read >= HEARTBEAT_S:
                    self._last_read = time.monotonic()
                    await self.read_directory()
            except KVTierError as exc:
                log.debug("fleet view not updated: %s", exc)
            except Exception:  # never let the heartbeat die: the view would silently go stale
                log.exception("fleet heartbeat failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._nudged.wait(), POLL_S)
            self._nudged.clear()

    def nudge(self) -> None:
        """A slot just finished an answer: publish what it holds now (a client's next turn may
        follow within milliseconds, to another node), not at the next poll."""
        self._nudged.set()

    async def withdraw(self) -> None:
        """Remove this node's entry (a graceful shutdown: peers stop forwarding to it at once)."""
        if self._published is None:
            return
        key = self._published[0]
        target = self.watcher.target
        directory = fleet_key(target.namespace) if target is not None else None

        def fill(pipe):  # type: ignore[no-untyped-def]
            pipe.delete(key)
            if directory is not None:
                pipe.zrem(directory, self.node_id)

        try:
            await self.connection.pipeline("fleet withdraw", fill)
        except KVTierError as exc:
            log.debug("fleet entry not withdrawn (it expires): %s", exc)
        self._published = None

    # -- forwarding -------------------------------------------------------------------------------

    @property
    def in_flight(self) -> Mapping[str, int]:
        """Requests this node forwarded and that are not answered yet, per peer (counted on top of
        what each peer's status says: it cannot show them yet)."""
        return self._in_flight

    @contextlib.contextmanager
    def sending(self, node: str) -> Iterator[None]:
        """One request forwarded to ``node``, in ``in_flight`` until its answer ends."""
        self._in_flight[node] = self._in_flight.get(node, 0) + 1
        try:
            yield
        finally:
            left = self._in_flight.get(node, 1) - 1
            if left > 0:
                self._in_flight[node] = left
            else:
                self._in_flight.pop(node, None)

    # -- reading ----------------------------------------------------------------------------------

    async def lookup(self, namespace: Namespace, tokens: np.ndarray, chain: list[ChunkHash]) -> list[PeerHeat]:
        """The live, ready peers that hold some of ``tokens`` hot in an idle slot (one round trip).

        Args:
            namespace: the request's namespace (its tenant's); the peers' entries are found under
                the model's.
            chain: ``prefix_chain(namespace, tokens)``, as far as a restore could use it.
        """
        peers = list(self.peers)
        if not peers:
            return []
        model = namespace.salted("")
        fields = [STATUS_FIELD, *chain]
        results = await self.connection.pipeline("fleet lookup", lambda pipe: [
            pipe.hmget(fleet_node_key(model, node), fields) for node in peers])
        out: list[PeerHeat] = []
        now = self._clock()
        for node, values in zip(peers, results):
            if not isinstance(values, list) or not values:
                continue
            status = NodeStatus.parse(values[0], self.mac_key, now)
            if status is None or status.node != node or not status.ready:
                continue
            masks = [_mask(v) for v in values[1:]]
            held = hot_tokens(status, masks, namespace, tokens, chain)
            if held:
                out.append(PeerHeat(status, held))
        return out

    async def alive(self, node: str) -> bool:
        """Whether ``node``'s entry still holds a valid status written within ``STATUS_MAX_AGE_S``
        (its heartbeat has not stopped: an old status, replayed, does not count); False when Redis
        cannot say."""
        target = self.watcher.target
        if target is None:
            return False
        key = fleet_node_key(target.namespace, node)
        try:
            results = await self.connection.pipeline("fleet alive", lambda pipe: pipe.hget(key, STATUS_FIELD))
        except KVTierError:
            return False
        status = NodeStatus.parse(results[0] if results else None, self.mac_key, self._clock())
        return status is not None and status.node == node


_NODE_ID = re.compile(rb"[A-Za-z0-9._-]{1,128}")  # what --node-id may be


def _mask(value: object) -> int:
    if not isinstance(value, bytes) or not value.isdigit() or len(value) > 20:
        return 0
    return int(value)


def local_wait_s(table: SlotTable, service_s: float) -> float:
    """Seconds a new request would wait for a slot on this node (as ``NodeStatus.wait_s``)."""
    ahead = table.computing + table.queue_depth + 1 - table.n_slots
    return max(ahead, 0) / table.n_slots * service_s


def sharing(computing: int, n_slots: int) -> int:
    """Requests a new one is computed beside on a node with ``computing`` slots running: all of
    them, or every other slot once it has waited for one (llama-server batches them together)."""
    return max(min(computing, n_slots - 1), 0)
