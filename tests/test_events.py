"""EventBus against real Valkey: compact JSON, peers' events, best-effort publishing, subscriptions
that survive restarts of Valkey and end with the consumer or the shared connection, Cluster."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from tests.conftest import ValkeyCluster
from tests.servers import RedisProc, free_port, redis_server
from tests.test_redis_tier import raw, wait_for
from tiers.events import EventBus
from tiers.keys import Namespace, events_channel
from tiers.redis_backend import RedisBackend
from tiers.redis_conn import RedisConnection


def bus(url: str, node_id: str, *, wall_clock: Callable[[], float] = time.time, **options: Any) -> EventBus:
    return EventBus(RedisConnection(url, **options), node_id=node_id, wall_clock=wall_clock)


async def collect(it: AsyncIterator[dict[str, Any]], into: list[dict[str, Any]]) -> None:
    async for event in it:
        into.append(event)


def subscribers(srv: RedisProc, channel: str) -> int:
    return int(raw(srv).pubsub_numsub(channel)[0][1])


async def test_publish_compact_json(redis_srv: RedisProc) -> None:
    events = bus(redis_srv.url, "node-a", wall_clock=lambda: 1700000000.123456)
    channel = events_channel(Namespace("fp-events"))
    sub = raw(redis_srv).pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
    sub.subscribe(channel)
    assert await events.publish_chunks_stored(channel, [b"kvtier:x:c:01", b"kvtier:x:c:02"]) == 1
    assert await events.publish_session_saved(channel, "s-42", tokens=700) == 1
    messages: list[bytes] = []
    deadline = time.monotonic() + 5
    while len(messages) < 2:
        assert time.monotonic() < deadline, "no event arrived"
        msg = sub.get_message(timeout=0.5)  # None for the subscribe confirmation too
        if msg:
            messages.append(msg["data"])
    assert messages[0] == (b'{"type":"chunk_stored","node":"node-a","keys":["kvtier:x:c:01","kvtier:x:c:02"],'
                           b'"ts":1700000000.123}')
    assert json.loads(messages[1]) == {"type": "session_saved", "node": "node-a", "session": "s-42",
                                       "tokens": 700, "ts": 1700000000.123}
    sub.close()
    await events.connection.aclose()


async def test_publishing_is_best_effort() -> None:
    events = bus(f"redis://127.0.0.1:{free_port()}/0", "a", retries=0, connect_timeout=0.2)
    assert await events.publish("ch", "chunk_stored", keys=[]) == 0
    assert await events.publish_session_saved("ch", "s1") == 0
    assert events.connection.errors == 2
    await events.connection.aclose()


async def test_peers_receive_what_a_node_publishes(redis_srv: RedisProc) -> None:
    a, b = bus(redis_srv.url, "a"), bus(redis_srv.url, "b")
    channel = events_channel(Namespace("fp-peers"))
    got: list[dict[str, Any]] = []
    task = asyncio.create_task(collect(b.events(channel), got))
    await wait_for(lambda: subscribers(redis_srv, channel) == 1)
    assert await a.publish_chunks_stored(channel, [b"kvtier:n:c:01"]) == 1
    assert await a.publish_session_saved(channel, "s1", tokens=3) == 1
    await wait_for(lambda: len(got) == 2, what=got)
    assert [(e["type"], e["node"]) for e in got] == [("chunk_stored", "a"), ("session_saved", "a")]
    assert got[0]["keys"] == ["kvtier:n:c:01"] and got[1]["session"] == "s1" and got[1]["tokens"] == 3
    await b.connection.aclose()  # ends the subscription within POLL_SECONDS
    await asyncio.wait_for(task, 2)
    await a.connection.aclose()


async def test_closing_the_tier_ends_subscriptions_on_its_connection(redis_srv: RedisProc) -> None:
    backend = RedisBackend.open(redis_srv.url, node_id="n")
    channel = "kvtier:test:shared-conn"
    task = asyncio.create_task(collect(backend.events.events(channel), []))
    await wait_for(lambda: subscribers(redis_srv, channel) == 1)
    await backend.tier.aclose()  # what TieredStore.aclose does
    await asyncio.wait_for(task, 2)
    await wait_for(lambda: subscribers(redis_srv, channel) == 0)


async def test_subscriber_gets_peer_events_and_survives_a_restart() -> None:
    with redis_server() as srv:
        me = bus(srv.url, "me")
        peer = bus(srv.url, "peer")  # retries reconnect stale pooled connections
        channel = "kvtier:test:events"
        events: list[dict[str, Any]] = []
        task = asyncio.create_task(collect(me.events(channel), events))
        await wait_for(lambda: subscribers(srv, channel) == 1)
        await me.publish(channel, "chunk_stored", keys=["own"])  # not delivered to its own node
        raw(srv).publish(channel, b"not json")  # skipped, counted
        await peer.publish(channel, "chunk_stored", keys=["k1"])
        await wait_for(lambda: len(events) == 1)
        assert events[0]["node"] == "peer" and events[0]["keys"] == ["k1"]
        assert me.connection.errors == 1

        srv.restart()  # same port, empty server
        await wait_for(lambda: subscribers(srv, channel) == 1, timeout=10)
        await peer.publish(channel, "session_saved", session="s1")
        await wait_for(lambda: len(events) == 3, timeout=5, what=events)
        assert events[1]["type"] == "reconnected"
        assert events[2]["type"] == "session_saved" and events[2]["session"] == "s1"

        srv.stop()  # down long enough for redis-py's own reconnect to give up
        await asyncio.sleep(0.7)
        srv.start()
        await wait_for(lambda: subscribers(srv, channel) == 1, timeout=10)
        await peer.publish(channel, "session_saved", session="s2")
        await wait_for(lambda: len(events) == 5, timeout=5, what=events)
        assert [e["type"] for e in events[3:]] == ["reconnected", "session_saved"]
        assert me.connection.errors >= 2  # the malformed message and the lost subscription

        await me.connection.aclose()  # ends the subscription cleanly
        await asyncio.wait_for(task, 2)
        await peer.connection.aclose()


async def test_subscription_ends_when_the_consumer_stops(redis_srv: RedisProc) -> None:
    me = bus(redis_srv.url, "a")
    peer = bus(redis_srv.url, "b")
    channel = "kvtier:test:stop"
    it = me.events(channel, include_own=True)

    async def first() -> dict[str, Any]:
        async for event in it:
            return event
        raise AssertionError("ended early")

    task = asyncio.create_task(first())
    await wait_for(lambda: subscribers(redis_srv, channel) == 1)
    await me.publish(channel, "chunk_stored", keys=[])
    assert (await asyncio.wait_for(task, 2))["node"] == "a"  # include_own
    await it.aclose()  # type: ignore[attr-defined]
    await wait_for(lambda: subscribers(redis_srv, channel) == 0)
    await me.connection.aclose()
    await peer.connection.aclose()


async def test_cluster_events_reach_subscribers(redis_cluster: ValkeyCluster) -> None:
    a = bus(redis_cluster.url, "a")
    b = bus(redis_cluster.url, "b")
    events: list[dict[str, Any]] = []
    task = asyncio.create_task(collect(a.events("kvtier:test:cluster-events"), events))
    deadline = time.monotonic() + 5
    while not events:  # the subscription needs a moment; publish until it sees one
        assert time.monotonic() < deadline, "no event over the cluster"
        await b.publish("kvtier:test:cluster-events", "chunk_stored", keys=["x"])
        await asyncio.sleep(0.05)
    assert events[0]["node"] == "b"
    await a.connection.aclose()
    await asyncio.wait_for(task, 2)
    await b.connection.aclose()


