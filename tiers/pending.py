"""PendingSaves: short-lived markers in Redis for saves in flight, so that a next turn on another
node can wait for a save instead of recomputing what it is about to store.

A node that has just answered marks, before it saves, the prefixes its save will store (keys from
``keys.pending_key``; which prefixes is ``integrations.kvflow``'s business). Each marker says how
many tokens the save covers at least, which node saves, and when that node expects Redis to hold
it (wall-clock time, from its own past saves; nodes' clocks are assumed to agree to well under a
save's duration, as NTP keeps them: a skewed clock only makes a reader wait when it need not, or
not when it could, always within its bound). It lives ``ttl`` seconds and is renewed
while the save runs, so the marker of a node that died is gone within ``ttl``; a save that ends,
well or not, deletes its markers at once. A reader polls the marker it waits for and stops as soon
as it is gone.

Markers are hints: one that cannot be parsed is treated as absent, and a forged one can make a
reader wait, never restore anything (what it then restores is looked up and checked as always).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from .errors import KVTierError
from .redis_conn import RedisConnection

log = logging.getLogger("kvtier.store")

MAGIC = b"KVP2"
_HEAD = struct.Struct("<4sIQ")  # magic, tokens the save covers at least, expected readable (unix ms, 0:
# no estimate); then the node id (UTF-8)
MAX_NODE_BYTES = 128
Lift = Callable[[], Awaitable[None]]  # deletes a save's markers before its block ends (``PendingSaves.held``)


@dataclass(frozen=True, slots=True)
class PendingMark:
    """One marker: a save in flight on ``node`` that stores at least ``covers`` tokens, readable
    in Redis at ``ready_at`` (``time.time()`` on ``node``; 0: the node has no estimate yet)."""

    covers: int
    node: str
    ready_at: float = 0.0

    def encode(self) -> bytes:
        ready_ms = max(0, min(int(self.ready_at * 1000), 2**64 - 1))
        return _HEAD.pack(MAGIC, self.covers, ready_ms) + self.node.encode()[:MAX_NODE_BYTES]

    @classmethod
    def parse(cls, raw: object) -> PendingMark | None:
        """The marker a stored value holds; None for anything else."""
        if not isinstance(raw, bytes) or not _HEAD.size <= len(raw) <= _HEAD.size + MAX_NODE_BYTES:
            return None
        magic, covers, ready_ms = _HEAD.unpack_from(raw)
        if magic != MAGIC:
            return None
        return cls(covers, raw[_HEAD.size:].decode(errors="replace"), ready_ms / 1000)


class PendingSaves:
    """Markers of saves in flight, in the Redis every node shares.

    Args:
        connection: the shared connection (its breaker guards every call; a call that fails
            raises ``TierUnavailable``: callers go on without markers).
        ttl: seconds a marker lives unless renewed.
    """

    def __init__(self, connection: RedisConnection, *, ttl: float = 2.0):
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        self.connection = connection
        self.ttl_ms = int(ttl * 1000)

    async def mark(self, keys: Sequence[bytes], mark: PendingMark) -> None:
        """Set ``mark`` under each key for ``ttl``."""
        value = mark.encode()
        await self.connection.pipeline("pending mark", lambda pipe: [pipe.set(k, value, px=self.ttl_ms)
                                                                    for k in keys])

    async def renew(self, keys: Sequence[bytes]) -> None:
        """Give the markers that still exist another ``ttl`` (never brings a deleted one back)."""
        await self.connection.pipeline("pending renew", lambda pipe: [pipe.pexpire(k, self.ttl_ms) for k in keys])

    @contextlib.asynccontextmanager
    async def held(self, keys: Sequence[bytes], mark: PendingMark) -> AsyncIterator[Lift]:
        """Markers for the duration of a save: set as the block begins, renewed every third of
        ``ttl``, deleted on exit however it ends, or before by the ``Lift`` the block is given (a
        save that will not run soon: no one should wait for it). Never raises for Redis: without
        markers, other nodes only do not wait.

        Neither the block nor a lift waits for Redis: a save waits a moment before it reads its
        slot, and a request that takes the slot over meanwhile (the same prompt again) must not wait
        for a round trip to Redis, nor for its timeouts when it hangs. A lift returns at once; the
        markers go as soon as Redis has them. The exit waits for them before it deletes them, then
        first lets the tasks that are ready run (that request, handed the slot as the save ended).
        """
        loop = asyncio.get_running_loop()
        was_set: asyncio.Future[bool] = loop.create_future()
        lifting = asyncio.Event()
        holder = loop.create_task(self._hold(keys, mark, was_set, lifting))
        holder.add_done_callback(lambda _: _settle(was_set, False))  # cancelled before it began

        async def lift() -> None:
            lifting.set()  # the holder deletes them once they are set, and renews them no more

        try:
            yield lift
        finally:
            if lifting.is_set():
                await _ended(holder)
            else:
                await self._release(keys, was_set, holder, first_the_ready=True)

    async def _release(self, keys: Sequence[bytes], was_set: asyncio.Future[bool], holder: asyncio.Task[None], *,
                       first_the_ready: bool = False) -> None:
        try:
            marked = await asyncio.shield(was_set)
        finally:
            holder.cancel()  # never left renewing, even when this wait is cancelled
        if marked:
            if first_the_ready:
                await asyncio.sleep(0)
            await self._clear_quietly(keys)

    async def _hold(self, keys: Sequence[bytes], mark: PendingMark, was_set: asyncio.Future[bool],
                    lifting: asyncio.Event) -> None:
        """Set the markers, say whether they may be set, then renew them until cancelled or lifted
        (deleted then)."""
        if lifting.is_set():  # lifted before they were sent
            was_set.set_result(False)
            return
        try:
            await self.mark(keys, mark)
        except KVTierError as exc:
            log.debug("pending-save markers not set: %s", exc)
            was_set.set_result(False)
            return
        except BaseException:  # cancelled (or failed) with the command sent: they may be set
            was_set.set_result(True)
            raise
        was_set.set_result(True)
        while not lifting.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(lifting.wait(), self.ttl_ms / 3000)
                break
            try:
                await self.renew(keys)
            except KVTierError as exc:
                log.debug("pending-save markers not renewed: %s", exc)
        await self._clear_quietly(keys)

    async def _clear_quietly(self, keys: Sequence[bytes]) -> None:
        try:
            await self.clear(keys)
        except KVTierError as exc:
            log.debug("pending-save markers not cleared (they expire): %s", exc)

    async def clear(self, keys: Sequence[bytes]) -> None:
        if keys:
            await self.connection.pipeline("pending clear", lambda pipe: [pipe.delete(k) for k in keys])

    async def read(self, keys: Sequence[bytes]) -> list[PendingMark | None]:
        """The marker under each key (None: none, or not a marker)."""
        if not keys:
            return []
        values = await self.connection.pipeline("pending read", lambda pipe: [pipe.get(k) for k in keys])
        return [PendingMark.parse(v) for v in values]

    async def wait_gone(self, key: bytes, timeout: float, *, poll: float = 0.02) -> bool:
        """Poll ``key`` until it is gone (True) or ``timeout`` passes (False)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            values = await self.connection.pipeline("pending poll", lambda pipe: pipe.exists(key))
            if not values or not values[0]:
                return True
            left = deadline - loop.time()
            if left <= 0:
                return False
            await asyncio.sleep(min(poll, left))


async def _ended(holder: asyncio.Task[None]) -> None:
    """Wait for a lifted block's holder to end (its markers set, then deleted); cancelled with the wait."""
    try:
        await asyncio.wait({holder})
    except asyncio.CancelledError:
        holder.cancel()
        raise
    if not holder.cancelled() and (exc := holder.exception()) is not None:
        log.warning("pending-save markers: %r", exc)


def _settle(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)
