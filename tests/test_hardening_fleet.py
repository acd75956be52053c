"""Hardening of the forwarding fleet against whoever can write to Redis (issue 30, items 8-12).

What a Redis writer could do before: plant a node that receives forwarded chats (no secret was
required), replay a dead node's signed status forever (its MAC had no expiry) and make requests
hang, slow every request down with a huge node directory, steer the forward URL with a URL the
reader never checked, and make a node restore another conversation's cells through a forged
prefix reference. Each test below shows one of those is gone: against a real Valkey, and for the
forwarding path a real llama-server and sidecar.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import redis

from integrations import kvflow, prefixrefs
from integrations.chunkassemble import assemble_state
from sidecar.appkeys import FORWARDER
from sidecar.config import Settings, load_settings
from sidecar.fleet import DIRECTORY_READ_MAX, STATUS_FIELD, STATUS_MAX_AGE_S, Fleet, NodeStatus, SlotHeat
from sidecar.peerurl import parse_peer_url
from tests.servers import RedisProc, llama_server
from tests.sidecars import post, run_sidecar
from tests.test_engine_parts import NS, memory_store, state_of
from tests.test_statefile import logical, ref_file
from tiers.errors import ConfigError
from tiers.keys import Namespace, chunk_key, fleet_key, fleet_node_key, prefix_chain, tail_hash_after
from tiers.redis_conn import RedisConnection

KEY = b"a-fleet-secret-of-the-tests"
C = NS.chunk_tokens


def status(node: str = "p", url: str = "http://10.0.0.2:8081", at: float | None = None,
           slots: tuple[SlotHeat, ...] = (SlotHeat(64, True, b""),)) -> NodeStatus:
    return NodeStatus(node, url, slots, 0, 0, 1.0, at=time.time() if at is None else at)


# ------------------------------------------------------------------ item 8: a fleet secret, always


def test_forward_needs_the_fleet_secret() -> None:
    """--forward sends prompts and bearer tokens to the URLs the fleet view names: without the
    secret whoever can write to Redis could name their own, so kvtier refuses to start."""
    base = ["--slot-dir", "slots", "--redis-url", "redis://127.0.0.1:6379/0", "--forward"]
    with pytest.raises(ConfigError, match="forward needs chunk_key"):
        load_settings(base, env={})
    assert load_settings(base, env={"KVTIER_CHUNK_KEY": KEY.decode()}).forward
    assert load_settings(["--slot-dir", "slots", "--redis-url", "redis://127.0.0.1:6379/0",
                          "--advertise-url", "http://10.0.0.2:8081"], env={}).advertise_url  # publishing alone: no


# ------------------------------------------------------- item 9: statuses expire inside their MAC


def test_a_replayed_status_is_stale_and_its_time_is_signed() -> None:
    now = time.time()
    fresh, old = status(at=now), status(at=now - STATUS_MAX_AGE_S - 1)
    assert NodeStatus.parse(fresh.encode(KEY), KEY, now) == fresh
    assert NodeStatus.parse(old.encode(KEY), KEY, now) is None  # a dead node's status, replayed
    assert NodeStatus.parse(status(at=now + STATUS_MAX_AGE_S + 1).encode(KEY), KEY, now) is None  # from the future
    signed = old.encode(KEY)
    moved = signed.replace(f'"t": {json.dumps(old.at)}'.encode(), f'"t": {json.dumps(now)}'.encode())
    assert moved != signed and NodeStatus.parse(moved, KEY, now) is None  # the time is under the MAC
    assert NodeStatus.parse(fresh.encode(KEY), KEY, now + STATUS_MAX_AGE_S + 1) is None  # it ages


# ----------------------------------------------------------- item 11: advertise URLs are checked


@pytest.mark.parametrize("url", [
    "http://10.0.0.2:8081/v1", "http://10.0.0.2:8081?x=1", "http://10.0.0.2:8081#f", "http://u@10.0.0.2:8081",
    "http://u:p@10.0.0.2", "ftp://10.0.0.2:8081", "http://:8081", "http://10.0.0.2:0", "http://10.0.0.2:99999",
    "http://10.0.0.2:", "http://10.0.0.2:80x", "http://bad_host:1", "http://h\n.x:1", "http://[::1:1",
    "http://evil.example%2f:1", "http://10.0.0.2:8081?",
])
def test_a_bad_advertise_url_is_refused_in_config_and_in_the_fleet_view(url: str) -> None:
    with pytest.raises(ConfigError, match="advertise_url"):
        load_settings(["--slot-dir", "slots", "--advertise-url", url], env={})
    assert NodeStatus.parse(status(url=url).encode(KEY), KEY, time.time()) is None


def test_the_forward_url_is_built_from_the_checked_parts() -> None:
    assert parse_peer_url("http://10.0.0.2").forward_url("/v1/chat/completions?a=1") == \
        "http://10.0.0.2:80/v1/chat/completions?a=1"
    assert parse_peer_url("https://node-1.fleet.svc/").forward_url("/completion") == \
        "https://node-1.fleet.svc:443/completion"
    assert parse_peer_url("http://[fd00::2]:8081").forward_url("/x") == "http://[fd00::2]:8081/x"
    with pytest.raises(ValueError):
        parse_peer_url("http://10.0.0.2:8081").forward_url("@evil.example/x")


# ------------------------------------------------- item 10: the directory's size costs no request


@pytest_asyncio.fixture
async def connection(redis_srv: RedisProc) -> AsyncIterator[RedisConnection]:
    with redis.Redis(port=redis_srv.port) as r:
        r.flushall()
    conn = RedisConnection(redis_srv.url)
    try:
        yield conn
    finally:
        await conn.aclose()


async def test_a_huge_directory_of_fake_ids_costs_requests_nothing(redis_srv: RedisProc,
                                                                    connection: RedisConnection) -> None:
    """100,000 ids in the directory: the heartbeat reads a bounded part of it in the background,
    keeps only ids with a valid, fresh signed status and removes the others; a request's lookup
    reads only the live peers."""
    model = Namespace("m" * 32, chunk_tokens=C)
    tokens = np.arange(1000, 1300, dtype=np.int32)
    chain = prefix_chain(model, tokens)
    r = redis.Redis(port=redis_srv.port)
    now = time.time()
    r.zadd(fleet_key(model), {f"fake-{i}": now + 3600 for i in range(100_000)})
    r.zadd(fleet_key(model), {"p": now + 30, "stale": now + 30, "unsigned": now + 30})
    r.hset(fleet_node_key(model, "p"), mapping={STATUS_FIELD: status("p", slots=(SlotHeat(256, True, b""),)).encode(KEY),
                                                **{h: b"1" for h in chain}})
    r.hset(fleet_node_key(model, "stale"), STATUS_FIELD, status("stale", at=now - 60).encode(KEY))
    r.hset(fleet_node_key(model, "unsigned"), STATUS_FIELD, status("unsigned").encode())
    watcher = SimpleNamespace(target=SimpleNamespace(namespace=model), up=True, slots=None)
    fleet = Fleet(connection, "me", None, watcher, mac_key=KEY)  # type: ignore[arg-type]
    reads = 0
    t0 = time.perf_counter()
    while "p" not in fleet.peers:  # the background reads (one per heartbeat) find the live peer
        await fleet.read_directory()
        reads += 1
        assert reads <= 100_000 // DIRECTORY_READ_MAX + 2
    per_read = (time.perf_counter() - t0) / reads
    assert fleet.peers == ["p"], fleet.peers
    assert r.zcard(fleet_key(model)) < 100_000 - (reads - 1) * DIRECTORY_READ_MAX  # the fakes are pruned
    t0 = time.perf_counter()
    for _ in range(10):
        peers = await fleet.lookup(model, tokens, chain)
    lookup_s = (time.perf_counter() - t0) / 10
    assert [(p.status.node, p.hot_tokens) for p in peers] == [("p", 256)]
    assert lookup_s < 0.05, lookup_s  # one HMGET of one live peer, not 100,000
    assert per_read < 0.5, per_read  # and each background read is bounded
    r.close()


# --------------------------------------------- item 12: a prefix reference cannot restore a wrong one


async def test_a_forged_prefix_reference_restores_nothing_wrong_and_is_counted() -> None:
    """Without a chunk key anyone who can write to Redis can write a reference. Before, one
    naming another conversation's chunk made a node restore that chunk's cells for this prompt.
    Now a reference carries the tokens of the value it names; they must start with the prompt's
    and the value's key is derived from the prompt's own prefix and them: a forged one is a miss,
    deleted and counted."""
    store = memory_store()
    mine, other = logical(200, seed=21), logical(200, seed=22)
    await kvflow.store_state(store, NS, state_of(mine))
    await kvflow.store_state(store, NS, state_of(other))
    prompt = np.asarray(mine.tokens[:100] + [7] * 60, np.int32)  # shares 100 tokens with `mine`
    found = await kvflow.find_prefix(store, NS, prompt)
    assert found.n_tokens == 96  # the genuine reference: cells 64..95 of mine's chunk 1
    genuine = await kvflow.fetch_prefix(store, NS, found)
    assert bytes(assemble_state(genuine.payloads, prompt, v_trans=False)) == ref_file(mine.prefix(96))
    mine_chain = prefix_chain(NS, np.asarray(mine.tokens, np.int32))
    other_chain = prefix_chain(NS, np.asarray(other.tokens, np.int32))
    under = tail_hash_after(mine_chain[0], prompt[C: C + 48])  # the prompt's key for 48 cells after chunk 0

    async def restored_with(forged: bytes, counted: bool) -> None:
        await store.store_tails(NS, [(under, forged, 48)])
        found = await kvflow.find_prefix(store, NS, prompt)
        assert found.n_tokens == C + 48  # the forged reference is what the lookup finds
        corrupt = store.counters.corrupt
        got = await kvflow.fetch_prefix(store, NS, found)
        assert got.n_tokens == C, got.n_tokens  # chunk 0 only: never the other conversation's cells
        assert bytes(assemble_state(got.payloads, prompt[:C + 1], v_trans=False)) == ref_file(mine.prefix(C))
        if counted:  # refused: counted and deleted (the genuine reference is found again)
            assert store.counters.corrupt == corrupt + 1
            assert (await kvflow.find_prefix(store, NS, prompt)).n_tokens == 96

    # The reference format before: it named another conversation's chunk by key and hash.
    await restored_with(struct.pack("<4sI16s", b"KVRF", 48, other_chain[1]) + chunk_key(NS, other_chain[1]), True)
    # Today's format carrying the other conversation's tokens: they are not the prompt's.
    others = np.asarray(other.tokens[C: 2 * C], np.int32)
    await restored_with(prefixrefs.ref_payload(prefixrefs.REF_CHUNK, others, 48), True)
    # The prompt's tokens, then others': the key they derive holds nothing (a plain miss).
    claimed = np.concatenate([prompt[C: C + 48], np.asarray(other.tokens[112:128], np.int32)])
    await restored_with(prefixrefs.ref_payload(prefixrefs.REF_CHUNK, claimed, 48), False)
    # A reference may only be shorter than the value it names, and a chunk is a whole chunk.
    await restored_with(prefixrefs.ref_payload(prefixrefs.REF_CHUNK, prompt[C: C + 48], 48), True)


# ------------------------------------- items 8 and 9 end to end: a real sidecar, planted peers


class Listener:
    """A TCP port that accepts connections and never answers (a peer that hangs), counting them."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await reader.read(-1)
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


def chat(variant: int) -> dict[str, Any]:
    """A ~900-token chat no slot or tier holds yet (one variant per request)."""
    doc = " ".join(f"Line {i}: the crate in bay {i} weighs {i * 7 + variant} kilograms." for i in range(60))
    return {"messages": [{"role": "system", "content": doc}, {"role": "user", "content": "Which bay is heaviest?"}],
            "max_tokens": 4, "temperature": 0}


@pytest.mark.llama
async def test_forwarding_reaches_only_fresh_signed_peers_and_never_hangs(
        redis_srv: RedisProc, tmp_path: Any) -> None:
    """A node holding the prompt hot, planted in the fleet view: unsigned, signed long ago
    (replayed), or signed and fresh but hanging. The first two never receive the request; the
    third gets it and the request is served here once the first-byte timeout passes, or, when
    its status is not renewed, once that status is stale (counted, logged)."""
    r = redis.Redis(port=redis_srv.port)
    r.flushall()
    hang = Listener()
    with llama_server(tmp_path) as la:
        settings = Settings(llama_url=la.url, slot_dir=str(la.slot_dir), redis_url=redis_srv.url, node_id="me",
                            chunk_tokens=64, prefill_tps_prior=50.0, save_wait=0.0, forward=True,
                            chunk_key=KEY.decode(), forward_first_byte_timeout=2.0)
        async with run_sidecar(settings) as me, hang as hang_url:
            assert await me.engine.ensure_ready()
            target = me.engine.target
            forwarder = me.app[FORWARDER]

            async def plant(node: str, variant: int, at: float, key: bytes | None) -> None:
                """``node`` in the fleet view, holding chat ``variant`` hot in an idle slot."""
                prompt = await me.engine.prompts.prompt_for("chat", chat(variant))
                chain = prefix_chain(target.namespace_for(""), prompt.tokens)
                assert len(chain) >= 8
                entry = status(node, hang_url, at=at, slots=(SlotHeat(len(chain) * 64, True, b""),))
                r.hset(fleet_node_key(target.namespace, node),
                       mapping={STATUS_FIELD: entry.encode(key), **{h: b"1" for h in chain}})
                r.zadd(fleet_key(target.namespace), {node: time.time() + 30})

            async def ask(variant: int) -> tuple[Any, float]:
                t0 = time.perf_counter()
                answer = await asyncio.wait_for(post(me.url + "/v1/chat/completions", chat(variant)), 60)
                assert answer.status == 200 and "X-KVTier-Forwarded-To" not in answer.headers
                return answer, time.perf_counter() - t0

            # Unsigned (a Redis writer without the secret) and replayed (signed, a minute old).
            await plant("unsigned", 1, time.time(), None)
            await plant("replayed", 1, time.time() - 60, KEY)
            await asyncio.sleep(2.5)  # two heartbeats: the directory was read (and pruned)
            assert forwarder.fleet.peers == [] and not r.zscore(fleet_key(target.namespace), "unsigned")
            await ask(1)
            assert hang.connections == 0  # neither received anything
            # Signed and fresh, but its port never answers: the first-byte timeout (2 s) ends it.
            await plant("hangs", 2, time.time(), KEY)
            await until(lambda: forwarder.fleet.peers == ["hangs"])
            _, waited = await ask(2)
            assert hang.connections == 1
            assert me.metric("kvtier_route_forward_failures_total", reason="timeout") == 1
            assert waited >= 2.0, waited
            # Signed a while ago and never renewed (a dead node's status, replayed): the request
            # waits only until the status is stale, however long the first-byte timeout.
            r.delete(fleet_node_key(target.namespace, "hangs"))
            forwarder.first_byte_timeout = 120.0
            await plant("dying", 3, time.time() - STATUS_MAX_AGE_S + 4, KEY)
            await until(lambda: forwarder.fleet.peers == ["dying"])
            _, waited = await ask(3)
            assert hang.connections == 2
            assert me.metric("kvtier_route_forward_failures_total", reason="gone") == 1
            assert me.metric("kvtier_route_decisions_total", decision="fallback") == 2
            assert me.metric("kvtier_route_decisions_total", decision="forwarded") == 0
    r.close()


async def until(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not in time"
        await asyncio.sleep(0.05)

