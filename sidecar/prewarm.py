"""Pre-warming (``--prewarm``): copy the chunks other nodes announce into this node's local tiers,
so that a conversation hopping here restores from RAM instead of Redis."""

from __future__ import annotations

import asyncio

from tiers.events import EventBus
from tiers.keys import events_channel, namespace_prefix
from tiers.store import TieredStore

from .metrics import Metrics
from .watcher import ServerWatcher

MAX_KEYS_PER_EVENT = 4096  # an event naming more (a peer's whole history at once) is cut here


async def prewarm_forever(watcher: ServerWatcher, events: EventBus, store: TieredStore, metrics: Metrics) -> None:
    """Follow the namespace's events and copy announced chunks into the synchronous tiers."""
    while not await watcher.ensure_ready():
        await asyncio.sleep(2)
    target = watcher.target
    assert target is not None
    ours = namespace_prefix(target.namespace)
    async for event in events.events(events_channel(target.namespace)):
        if event.get("type") != "chunk_stored":
            continue
        keys = [key for k in event.get("keys", []) if isinstance(k, str) and (key := k.encode()).startswith(ours)]
        metrics.prewarmed.inc(await store.prefetch(keys[:MAX_KEYS_PER_EVENT]))
