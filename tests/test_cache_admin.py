"""Listing and purging the automatic cache: ``kvtier cache ls|rm`` against real Valkey (one server
and a cluster)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import redis

from sidecar import cli
from tests.servers import RedisProc
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
from tiers.redis_conn import RedisConnection
from tiers.redis_manifests import RedisManifests
from tiers.redis_tier import RedisTier
from tiers.sessions import SessionStore
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
