"""EventBus: pub/sub events on the shared ``RedisConnection``, through which peers learn what is
stored where (pre-warming) and which sessions were saved.

An event is compact JSON, ``{"type", "node", ...fields, "ts"}``. Publishing is best-effort (an
unreachable Redis answers 0 receivers); a subscription survives restarts of Redis.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import suppress
from typing import Any

import redis.exceptions as rex
from redis.backoff import ExponentialWithJitterBackoff

from .errors import KVTierError
from .redis_conn import UNAVAILABLE, RedisConnection

log = logging.getLogger("kvtier.events")

MAX_EVENT_BYTES = 1 << 20  # larger pub/sub messages are not events of ours
PURGE_KEYS_PER_EVENT = 8000  # keys of ~70 bytes: an event stays well under MAX_EVENT_BYTES
POLL_SECONDS = 0.5  # a subscriber notices ``aclose`` of the connection within this
RESUBSCRIBE_BASE = 0.1  # s, first delay before subscribing again after a lost subscription
RESUBSCRIBE_CAP = 5.0  # s, longest such delay

Event = dict[str, Any]
# A subscription lost: the server is unreachable, or answered with an error.
_LOST: tuple[type[BaseException], ...] = (*UNAVAILABLE, rex.RedisError)


class EventBus:
    """Publish and receive events of this deployment.

    Args:
        connection: the shared connection; its ``aclose`` ends every subscription.
        node_id: this process's id in published events (default ``hostname:pid``); a subscriber
            skips events of its own node unless asked for them.
        wall_clock: timestamps of events (tests fix it).
    """

    def __init__(self, connection: RedisConnection, *, node_id: str | None = None,
                 wall_clock: Callable[[], float] = time.time):
        self.connection = connection
        self.node_id = node_id or f"{socket.gethostname()}:{os.getpid()}"
        self._wall = wall_clock

    def __repr__(self) -> str:
        return f"EventBus(url={self.connection.url!r}, node_id={self.node_id!r})"

    def event_json(self, event_type: str, **fields: Any) -> str:
        """The compact JSON of one event: ``{"type", "node", ...fields, "ts"}``."""
        body = {"type": event_type, "node": self.node_id, **fields, "ts": round(self._wall(), 3)}
        return json.dumps(body, separators=(",", ":"), default=_json_default)

    async def publish(self, channel: str, event_type: str, **fields: Any) -> int:
        """Publish one event; returns the number of receivers (0 when Redis is unreachable)."""
        message = self.event_json(event_type, **fields)
        client = self.connection.client
        try:
            return int(await self.connection.run("publish", lambda: client.publish(channel, message)))
        except KVTierError:
            return 0

    async def publish_chunks_stored(self, channel: str, keys: Sequence[bytes]) -> int:
        """``chunk_stored``: the shared tier holds ``keys`` now."""
        return await self.publish(channel, "chunk_stored", keys=[k.decode("ascii", "replace") for k in keys])

    async def publish_session_saved(self, channel: str, session: str, **fields: Any) -> int:
        """``session_saved``: a session's manifest was written."""
        return await self.publish(channel, "session_saved", session=session, **fields)

    async def publish_cache_purged(self, channel: str, namespace: str, keys: Sequence[bytes] | None = None) -> int:
        """``cache_purged``: an operator deleted cached KV from the shared tier; each node drops
        the same from its own tiers. ``namespace`` is a namespace id, or ``*`` for every one;
        ``keys``, when given, are the only keys purged (one conversation's), sent in events of at
        most ``PURGE_KEYS_PER_EVENT`` keys. Returns the receivers of the first event."""
        if keys is None:
            return await self.publish(channel, "cache_purged", namespace=namespace)
        names = [k.decode("ascii", "replace") for k in keys]
        first = -1
        for i in range(0, max(len(names), 1), PURGE_KEYS_PER_EVENT):
            n = await self.publish(channel, "cache_purged", namespace=namespace, keys=names[i: i + PURGE_KEYS_PER_EVENT])
            first = n if first < 0 else first
        return first

    async def events(self, channel: str, *, include_own: bool = False) -> AsyncIterator[Event]:
        """Events published on ``channel`` by peers, as dicts, until the connection is closed.

        The subscription survives restarts of Redis: it reconnects with backoff and then yields
        ``{"type": "reconnected"}``, since events sent while it was away are lost (pub/sub keeps
        nothing). Malformed messages are skipped and counted as errors of the connection. Breaking
        out of the loop, or ``aclose()`` of the connection (within ``POLL_SECONDS``), ends it cleanly.
        """
        conn = self.connection
        backoff = ExponentialWithJitterBackoff(cap=RESUBSCRIBE_CAP, base=RESUBSCRIBE_BASE)
        failures = 0
        subscribed_before = False
        while not conn.closed:
            client, owned = conn.pubsub_client(failures)
            pubsub = client.pubsub()
            try:
                await pubsub.subscribe(channel)
                while not conn.closed:
                    msg = await pubsub.get_message(timeout=POLL_SECONDS)
                    if msg is None:
                        continue
                    if msg.get("type") == "subscribe":
                        # Also seen when redis-py reconnected and resubscribed by itself.
                        failures = 0
                        if subscribed_before:
                            yield {"type": "reconnected", "node": None, "ts": round(self._wall(), 3)}
                        subscribed_before = True
                        continue
                    if msg.get("type") != "message":
                        continue
                    event = self._parse_event(msg.get("data"))
                    if event is not None and (include_own or event.get("node") != self.node_id):
                        yield event
            except _LOST as exc:
                failures += 1
                conn.count_error()
                level = logging.DEBUG if isinstance(exc, UNAVAILABLE) else logging.WARNING
                log.log(level, "subscription to %s on %s lost: %s", channel, conn.url, exc)
            finally:
                with suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # unannotated before redis-py 8.2
                if owned:
                    with suppress(Exception):
                        await client.aclose()
            if failures and not conn.closed:
                await conn.wait_closed(backoff.compute(failures))

    def _parse_event(self, data: object) -> Event | None:
        """A message of ours as a dict; anything else (not JSON, no "type", too large) is counted."""
        event: object = None
        if isinstance(data, (bytes, str)) and len(data) <= MAX_EVENT_BYTES:
            with suppress(ValueError):
                event = json.loads(data)
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            self.connection.count_error()
            return None
        return event


def _json_default(value: object) -> object:
    if isinstance(value, bytes):
        return value.decode("ascii", "replace")
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"cannot put {type(value).__name__} in an event")
