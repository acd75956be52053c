"""Listing and purging the automatic cache: ``kvtier cache ls|rm`` against real Valkey (one server
and a cluster), and the admin API of a real sidecar (``GET /v1/cache``, ``POST /v1/cache/purge``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import redis

from sidecar import cli
from sidecar.config import Settings
from tests.servers import RedisProc, llama_server
from tests.sidecars import post, run_sidecar
from tiers import purge
from tiers.codec import BlobCodec
from tiers.events import Event, EventBus
from tiers.keys import (
    Namespace,
    chunk_key,
    events_channel,
    fleet_key,
    model_key,
    prefix_chain,
)
from tiers.memory import MemoryTier
from tiers.redis_conn import RedisConnection
from tiers.redis_manifests import RedisManifests
from tiers.redis_tier import RedisTier
from tiers.sessions import SessionStore
from tiers.shared import SharedTier
from tiers.store import TieredStore

C = 16  # tokens per chunk: three chunks and a tail per conversation
MODEL = Namespace("cache-admin-test-model", chunk_tokens=C)
CONV = list(range(1000, 1053))  # 3 chunks + a 5-token tail
OTHER = list(range(2000, 2040))  # 2 chunks + an 8-token tail


def payload(n: int) -> bytes:
    return bytes([n % 251]) * 600


async def store_conversation(store: TieredStore, ns: Namespace, tokens: list[int]) -> list[bytes]:
    """Store ``tokens`` as automatic mode does (chunks, then the partial tail); returns the chunk keys."""
    chain = prefix_chain(ns, tokens)
    await store.store(ns, chain, lambda i: payload(i))
    await store.store_tail(ns, chain[-1], tokens[len(chain) * C:], payload(99))
    return [chunk_key(ns, h) for h in chain]


async def restores(store: TieredStore, ns: Namespace, tokens: list[int]) -> bool:
    """Whether every chunk and the tail of ``tokens`` read back verified from ``store``."""
    chain = prefix_chain(ns, tokens)
    fetched = await store.fetch(ns, chain, promote=False)
    tail = await store.lookup_tail(ns, chain[-1], tokens[len(chain) * C:])
    return fetched.n_chunks == len(chain) and tail is not None and tail.n_tokens == len(tokens) - len(chain) * C


def cache_keys(url: str, ns: Namespace | None = None) -> list[bytes]:
    """kvtier's cached-KV keys in the server (of one namespace), read with a plain client."""
    with redis.Redis.from_url(url) as r:
        pattern = f"kvtier:{ns.id}:*" if ns else "kvtier:*"
        return [k for k in r.scan_iter(match=pattern, count=1000)
                if (p := purge.parse_key(k)) is not None and p[1] in purge.CACHE_KINDS]


async def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    """``kvtier ARGV`` through its main function (in a thread: it runs its own event loop)."""
    rc = await asyncio.to_thread(cli.main, list(argv))
    out = capsys.readouterr().out
    try:
        return rc, json.loads(out)
    except ValueError:
        return rc, out


class Collected:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.task: asyncio.Task[None] | None = None

    async def follow(self, bus: EventBus, channel: str) -> None:
        async for event in bus.events(channel):
            self.events.append(event)

    async def wait_for(self, pred: Any, timeout: float = 5.0) -> Event:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            for e in self.events:
                if pred(e):
                    return e
            await asyncio.sleep(0.05)
        raise AssertionError(f"no such event among {self.events}")


async def test_cli_lists_and_purges_a_tenant_a_conversation_a_session_and_everything(
        redis_srv: RedisProc, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = redis_srv.url
    with redis.Redis.from_url(url) as r:
        r.flushall()
    conn = RedisConnection(url)
    store = TieredStore([RedisTier(conn, ttl=3600)], BlobCodec("none"))
    alice, bob = MODEL.salted("alice"), MODEL.salted("bob")
    seen = Collected()
    listener = RedisConnection(url)
    seen.task = asyncio.get_running_loop().create_task(seen.follow(EventBus(listener), events_channel(MODEL)))
    try:
        await purge.register_model(conn, MODEL)
        for ns in (MODEL, alice, bob):
            await store_conversation(store, ns, CONV)  # the same prompt in three namespaces
        await store_conversation(store, bob, OTHER)
        sessions = SessionStore(store, RedisManifests(conn, ttl=3600))
        sess = list(range(3000, 3037))
        await sessions.save(bob, "bob-s1", sess, lambda i: payload(i), payload(7), node="t")
        await store.flush(10)
        with redis.Redis.from_url(url) as r:
            r.zadd(fleet_key(MODEL), {"node-a": 1e12})  # the fleet directory: not cached KV, kept

        rc, listed = await run_cli(capsys, "cache", "ls", "--redis", url, "--json")
        assert rc == 0
        by_ns = {u["namespace"]: u for u in listed["namespaces"]}
        assert by_ns[MODEL.id]["model"] == MODEL.fingerprint and by_ns[MODEL.id]["chunk_tokens"] == C
        assert (by_ns[alice.id]["chunks"], by_ns[alice.id]["tails"]) == (3, 1)
        assert (by_ns[bob.id]["chunks"], by_ns[bob.id]["sessions"], by_ns[bob.id]["session_tails"]) == (7, 1, 1)
        assert by_ns[bob.id]["bytes"] > 7 * 600 and "model" not in by_ns[bob.id]
        rc, text = await run_cli(capsys, "cache", "ls", "--redis", url)
        assert rc == 0 and alice.id in text and MODEL.fingerprint in text

        # One tenant, by its salt: its namespace under every recorded model; the others stay.
        rc, out = await run_cli(capsys, "cache", "rm", "--salt", "alice", "--redis", url)
        assert rc == 0 and out["namespaces"] == [alice.id] and out["redis_keys_deleted"] == 4
        assert cache_keys(url, alice) == []
        assert await restores(store, bob, CONV) and await restores(store, MODEL, CONV)
        await seen.wait_for(lambda e: e["type"] == "cache_purged" and e["namespace"] == alice.id)

        # One conversation, by its tokens: its chunks and tail; the tenant's other one stays.
        tokens_file = tmp_path / "tokens.json"
        tokens_file.write_text(json.dumps(OTHER))
        rc, out = await run_cli(capsys, "cache", "rm", "--tokens", f"@{tokens_file}", "--salt", "bob", "--redis", url)
        assert rc == 0 and out["redis_keys_deleted"] == 3
        assert not await restores(store, bob, OTHER) and await restores(store, bob, CONV)
        event = await seen.wait_for(lambda e: e["type"] == "cache_purged" and e.get("keys"))
        assert chunk_key(bob, prefix_chain(bob, OTHER)[0]).decode() in event["keys"]

        # One session: manifest, tail and chunks.
        rc, out = await run_cli(capsys, "cache", "rm", "--session", "bob-s1", "--salt", "bob", "--redis", url)
        assert rc == 0 and out["redis_keys_deleted"] == 1 + 1 + 2
        assert (await sessions.list_page(bob)).manifests == []
        assert (await store.lookup(bob, sess)).n_chunks == 0
        rc, _ = await run_cli(capsys, "cache", "rm", "--session", "bob-s1", "--salt", "bob", "--redis", url)
        assert rc == 1
        assert await restores(store, bob, CONV)

        # One namespace by id (the model's own, unsalted): the tenant's stays.
        rc, out = await run_cli(capsys, "cache", "rm", "--namespace", MODEL.id, "--redis", url)
        assert rc == 0 and cache_keys(url, MODEL) == [] and await restores(store, bob, CONV)

        # Everything: no cached KV is left; the model record and the fleet directory stay.
        rc, out = await run_cli(capsys, "cache", "rm", "--all", "--redis", url)
        assert rc == 0 and out["redis_keys_deleted"] == 4
        assert cache_keys(url) == []
        with redis.Redis.from_url(url) as r:
            assert r.exists(model_key(MODEL), fleet_key(MODEL)) == 2
        await seen.wait_for(lambda e: e["type"] == "cache_purged" and e["namespace"] == "*")

        # Mistakes get a message and an exit status, never a traceback.
        for argv in (["--namespace", "XYZ"], ["--prompt", "hi"], ["--tokens", "[1, true]"], ["--tokens", "nope"],
                     ["--all", "--salt", "x"], ["--salt", ""]):
            rc, _ = await run_cli(capsys, "cache", "rm", *argv, "--redis", url)
            assert rc == 2, argv
            assert "Traceback" not in capsys.readouterr().err
    finally:
        seen.task.cancel()
        await listener.aclose()
        await conn.aclose()


async def test_cli_purges_in_a_cluster(redis_cluster: Any, capsys: pytest.CaptureFixture[str]) -> None:
    redis_cluster.flushall()
    url = redis_cluster.url
    conn = RedisConnection(url)
    store = TieredStore([RedisTier(conn, ttl=3600)], BlobCodec("none"))
    alice, bob = MODEL.salted("alice"), MODEL.salted("bob")
    try:
        await purge.register_model(conn, MODEL)
        for ns in (alice, bob):
            await store_conversation(store, ns, CONV)
            await store_conversation(store, ns, OTHER)
        await store.flush(10)
        keys = [k for n in redis_cluster.nodes for k in cache_keys(n.url, bob)]
        assert len({redis_cluster.owner(k).port for k in keys}) > 1  # spread over the nodes
        rc, listed = await run_cli(capsys, "cache", "ls", "--redis", url, "--json")
        assert rc == 0 and {u["namespace"]: u["chunks"] for u in listed["namespaces"]}[alice.id] == 5
        rc, out = await run_cli(capsys, "cache", "rm", "--salt", "alice", "--redis", url)
        assert rc == 0 and out["redis_keys_deleted"] == 7
        assert [k for n in redis_cluster.nodes for k in cache_keys(n.url, alice)] == []
        assert await restores(store, bob, CONV) and await restores(store, bob, OTHER)
        rc, out = await run_cli(capsys, "cache", "rm", "--tokens", json.dumps(OTHER), "--salt", "bob", "--redis", url)
        assert rc == 0 and out["redis_keys_deleted"] == 3 and await restores(store, bob, CONV)
        rc, out = await run_cli(capsys, "cache", "rm", "--all", "--redis", url)
        assert rc == 0 and out["redis_keys_deleted"] == 4
        assert [k for n in redis_cluster.nodes for k in cache_keys(n.url)] == []
    finally:
        await conn.aclose()


async def test_local_tiers_drop_one_namespace_and_forged_model_records_are_ignored(
        shm_dir: Path, redis_srv: RedisProc) -> None:
    memory, shared = MemoryTier(16 << 20), SharedTier(shm_dir, 16 << 20)
    store = TieredStore([memory, shared], BlobCodec("none"))
    alice, bob = MODEL.salted("alice"), MODEL.salted("bob")
    keys = {ns.id: await store_conversation(store, ns, CONV) for ns in (alice, bob)}
    removed = await store.purge_local(prefix=purge.namespace_keys_prefix(alice.id))
    assert removed == 2 * 4  # three chunks and a tail, from each tier
    for tier in (memory, shared):
        assert await tier.contains_many(keys[alice.id]) == [False] * 3
        assert await tier.contains_many(keys[bob.id]) == [True] * 3
    assert shared.stats().entries == 4 and await restores(store, bob, CONV)
    assert await store.purge_local(keys=keys[bob.id][:1]) == 2
    assert await store.purge_local(prefix=purge.namespace_keys_prefix(purge.ALL)) == 2 * 3
    assert memory.stats().entries == shared.stats().entries == 0

    # A model record that does not hash to its key's id is not a model's (nor a way to steer a purge).
    conn = RedisConnection(redis_srv.url)
    try:
        with redis.Redis.from_url(redis_srv.url) as r:
            r.flushall()
            r.set(b"kvtier:0123456789abcdef:model", json.dumps({"fingerprint": "x", "chunk_tokens": C}))
            r.set(model_key(MODEL).replace(b":model", b"x:model"), b"{}")
        await purge.register_model(conn, MODEL)
        assert await purge.models(conn) == [purge.ModelRecord(MODEL.id, MODEL.fingerprint, C)]
        with pytest.raises(ValueError):
            await purge.register_model(conn, alice)  # a tenant's salt never goes to Redis
    finally:
        await conn.aclose()


# -- through a sidecar ----------------------------------------------------------------------------

TOKEN = "t0k3n-for-cache-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DOC = " ".join(f"Entry {i}: river {['Po', 'Nile', 'Ob', 'Don'][i % 4]} is {i * 7} km from here." for i in range(16))


def chat(question: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": DOC}, {"role": "user", "content": question}],
            "max_tokens": 4, "temperature": 0}


async def call(method: str, url: str, body: Any = None, *, headers: dict[str, str] | None = None,
               raw: bytes | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        kwargs: dict[str, Any] = {"headers": AUTH if headers is None else headers}
        if raw is not None:
            kwargs["data"] = raw
        elif body is not None:
            kwargs["json"] = body
        async with s.request(method, url, **kwargs) as r:
            return r.status, await r.json(content_type=None)


async def memory_holds(sidecar: Any, ns: Namespace, tokens: np.ndarray) -> bool:
    keys = [chunk_key(ns, h) for h in prefix_chain(ns, tokens)]
    return bool(keys) and all(await sidecar.store.tiers[0].contains_many(keys))


@pytest.fixture
async def sidecar_with_valkey(redis_srv: RedisProc, tmp_path: Path) -> AsyncIterator[Any]:
    with redis.Redis.from_url(redis_srv.url) as r:
        r.flushall()
    with llama_server(tmp_path, "-np", "3") as llama:
        settings = Settings(llama_url=llama.url, slot_dir=str(llama.slot_dir), redis_url=redis_srv.url, node_id="a",
                            chunk_tokens=64, cache_size=256 << 20, auth_token=TOKEN, prefill_tps_prior=100.0)
        async with run_sidecar(settings) as sidecar:
            yield sidecar


@pytest.mark.llama
async def test_purge_endpoint_clears_redis_ram_and_slots_and_follows_the_cli(
        sidecar_with_valkey: Any, redis_srv: RedisProc, capsys: pytest.CaptureFixture[str]) -> None:
    sc = sidecar_with_valkey
    url = sc.url + "/v1/chat/completions"
    for salt in ("alice", "bob", "carol"):
        r = await post(url, chat("Which river is 21 km away?"), headers={"X-KVTier-Salt": salt})
        assert r.status == 200, r.text
    await sc.engine.drain(30)
    await sc.store.flush(10)
    target = sc.engine.target
    alice, bob, carol = (target.namespace_for(s) for s in ("alice", "bob", "carol"))
    held = {s.owner: s.tokens.copy() for s in sc.engine.slots.slots}
    assert await memory_holds(sc, alice, held["alice"]) and await memory_holds(sc, bob, held["bob"])

    # The admin API needs the token.
    assert (await call("GET", sc.url + "/v1/cache", headers={}))[0] == 401
    assert (await call("POST", sc.url + "/v1/cache/purge", {"all": True}, headers={}))[0] == 401
    status, listed = await call("GET", sc.url + "/v1/cache")
    assert status == 200 and listed["this_node"]["namespace"] == target.namespace.id
    by_ns = {u["namespace"]: u for u in listed["namespaces"]}
    assert by_ns[alice.id]["chunks"] >= 1 and by_ns[bob.id]["chunks"] == by_ns[alice.id]["chunks"]
    assert by_ns[target.namespace.id]["model"] == target.namespace.fingerprint  # recorded at start

    # A tenant: Redis, this node's RAM and the idle slot holding its conversation.
    status, out = await call("POST", sc.url + "/v1/cache/purge", {"salt": "alice"})
    assert status == 200, out
    assert out["scope"] == "tenant" and out["namespaces"] == [alice.id] and out["slots_erased"] == 1
    assert out["redis_keys_deleted"] > 0 and out["local_values_deleted"] > 0
    assert cache_keys(redis_srv.url, alice) == [] and not await memory_holds(sc, alice, held["alice"])
    assert cache_keys(redis_srv.url, bob) and await memory_holds(sc, bob, held["bob"])
    again = await post(url, chat("Which river is 21 km away?"), headers={"X-KVTier-Salt": "alice"})
    assert again.status == 200 and again.restored == 0 and again.body["timings"]["cache_n"] == 0
    await sc.engine.drain(30)

    # A purge from the CLI against Redis reaches this node's RAM and slots through its event.
    rc, out = await run_cli(capsys, "cache", "rm", "--salt", "bob", "--redis", redis_srv.url)
    assert rc == 0 and out["namespaces"] == [bob.id]
    for _ in range(100):
        if not await memory_holds(sc, bob, held["bob"]):
            break
        await asyncio.sleep(0.05)
    assert not await memory_holds(sc, bob, held["bob"]) and cache_keys(redis_srv.url, bob) == []
    assert all(s.tokens.size == 0 for s in sc.engine.slots.slots if s.owner == "bob")

    # One conversation, given as the chat it was.
    status, out = await call("POST", sc.url + "/v1/cache/purge",
                             {"messages": chat("Which river is 21 km away?")["messages"], "salt": "carol"})
    assert status == 200 and out["scope"] == "conversation" and out["redis_keys_deleted"] > 0, out
    assert cache_keys(redis_srv.url, carol) == [] and out["slots_erased"] == 1

    # Mistakes are 400s (404 for a session that does not exist), as JSON.
    for body in ({}, {"all": False}, {"all": True, "salt": "x"}, {"namespace": "zz"}, {"tokens": "abc"},
                 {"tokens": [1, 2**40]}, {"salt": ""}, {"prompt": 5}, {"bogus": 1}, {"session": "../x"},
                 {"tokens": [1], "prompt": "x"}):
        status, err = await call("POST", sc.url + "/v1/cache/purge", body)
        assert status == 400 and err["error"]["code"] == 400, (body, err)
    status, err = await call("POST", sc.url + "/v1/cache/purge", raw=b"{nope", headers={**AUTH})
    assert status == 400 and err["error"]["type"] == "invalid_request"
    assert (await call("POST", sc.url + "/v1/cache/purge", {"session": "none-such"}))[0] == 404
    assert (await call("GET", sc.url + "/v1/cache?namespace=xyz"))[0] == 400

    # Everything, through the CLI's sidecar mode.
    rc, out = await run_cli(capsys, "cache", "rm", "--all", "--url", sc.url, "--token", TOKEN)
    assert rc == 0 and out["scope"] == "all"
    assert cache_keys(redis_srv.url) == [] and sc.store.tiers[0].stats().entries == 0

    # A Redis that restarted empty is given the model record again (when the subscription
    # reconnects, not minutes later), so tenants' purges from the CLI keep working.
    redis_srv.stop()
    redis_srv.start()
    for _ in range(200):
        with redis.Redis.from_url(redis_srv.url) as r:
            if r.exists(model_key(target.namespace)):
                break
        await asyncio.sleep(0.1)
    with redis.Redis.from_url(redis_srv.url) as r:
        assert r.exists(model_key(target.namespace))
