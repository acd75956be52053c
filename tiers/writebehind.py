"""WriteBehind: a bounded queue of writes to the slow tiers, drained by one background task."""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from .base import Prepare, Tier, Value, attempt

log = logging.getLogger("kvtier.store")

DEFAULT_QUEUE_LIMIT = 32  # pending background jobs (one per stored state); the oldest is dropped past this
BATCH_BYTES = 64 << 20  # bytes per background call to a tier: a large save is sent while the rest is cut
DEFAULT_WINDOW_BYTES = 64 << 20  # a large save's chunks cut and encoded at a time (``TieredStore.store``)

Announce = Callable[[list[bytes]], Awaitable[object]]


@dataclass(slots=True)
class _Job:
    """One pending background write: keys, and the encoded value of key ``i`` on demand."""

    keys: list[bytes]
    blob: Callable[[int], Value]
    enqueued: float = field(default_factory=time.monotonic)
    announce: Announce | None = None  # told the keys a background tier holds now that it did not before
    done: asyncio.Future[bool] | None = None  # a barrier: set once every job queued before it was written
    prepare: Prepare | None = None  # awaited with the first index asked for, before ``blob``
    failures_before: int = 0  # a barrier's or an expiry's: failed and dropped jobs when it was queued
    expire: float | None = None  # let ``keys`` go in that many seconds (``expire_after``) instead of writing them


class WriteBehind:
    """Writes to the tiers marked ``write_behind`` (Redis) from a bounded queue, off the request path.

    One worker task drains the queue, job by job and tier by tier. When the queue is full the
    oldest pending job is dropped and counted (``dropped``): a lost write to a cache costs a
    recompute later, a request waiting on a remote write costs now.

    Args:
        tiers: the background tiers, in the store's order; with none, nothing is ever queued.
        queue_limit: pending jobs before the oldest is dropped.
    """

    def __init__(self, tiers: Sequence[Tier], *, queue_limit: int = DEFAULT_QUEUE_LIMIT):
        if queue_limit <= 0:
            raise ValueError("queue_limit must be positive")
        self.tiers = list(tiers)
        self._queue: collections.deque[_Job] = collections.deque()
        self._queue_limit = queue_limit
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._idle: asyncio.Event | None = None
        self.dropped = 0  # jobs dropped from a full queue
        self.errors = 0  # background writes that failed, in part or whole

    @property
    def depth(self) -> int:
        """Jobs waiting (not the one being written)."""
        return len(self._queue)

    def submit(self, keys: list[bytes], blob: Callable[[int], Value], *,
               announce: Announce | None = None, prepare: Prepare | None = None) -> None:
        """Queue a write of ``keys`` (value ``blob(i)`` for key ``i``, asked for only if a tier lacks it).

        The worker probes each tier itself (EXISTS before SET) and encodes only what is missing
        there: a key seen once may be gone by now (TTL, eviction, a restarted Redis), so nothing
        is assumed. ``announce(keys)`` is awaited with the keys a tier holds now that it lacked.
        """
        if not self.tiers:
            return
        self._enqueue(_Job(keys, blob, announce=announce, prepare=prepare))

    def barrier(self) -> asyncio.Future[bool]:
        """A future set once every job queued so far has been written: True when each one
        reached every background tier, False when one failed or was dropped (also when this
        barrier itself was dropped from a full queue)."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if not self.tiers:
            done.set_result(True)
            return done
        self._enqueue(_Job([], lambda i: b"", done=done, failures_before=self.errors + self.dropped))
        return done

    def expire_after(self, keys: list[bytes], seconds: float) -> None:
        """Let ``keys`` go from the background tiers ``seconds`` after every job queued so far is
        written (``Tier.expire``), and only when each one was: a value replaced by one still
        queued stays readable until the new one is, and a while after for readers that looked
        the old one up (another node finds one or the other, never neither)."""
        if self.tiers and keys:
            self._enqueue(_Job(keys, lambda i: b"", expire=seconds, failures_before=self.errors + self.dropped))

    async def written(self, timeout: float | None = None) -> bool:
        """Wait for a ``barrier`` queued now; False when one of the jobs before it failed or was
        dropped, or ``timeout`` ran out first."""
        try:
            return await asyncio.wait_for(self.barrier(), timeout)
        except TimeoutError:
            return False

    def _enqueue(self, job: _Job) -> None:
        if len(self._queue) >= self._queue_limit:
            dropped = self._queue.popleft()
            self.dropped += 1
            if dropped.done is not None and not dropped.done.done():
                dropped.done.set_result(False)
        self._queue.append(job)
        self._ensure_worker()
        assert self._wakeup is not None and self._idle is not None
        self._idle.clear()
        self._wakeup.set()

    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._idle = asyncio.Event()
            # A context of its own: started by a write during a request, it must not carry that
            # request's deadline for Redis calls (``redis_conn.request_deadline``) past it.
            self._worker = asyncio.get_running_loop().create_task(self._drain_forever(), name="kvtier-write-behind",
                                                                  context=contextvars.Context())

    async def _drain_forever(self) -> None:
        assert self._wakeup is not None and self._idle is not None
        while True:
            if not self._queue:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            job = self._queue.popleft()
            if job.done is not None:
                if not job.done.done():
                    job.done.set_result(self.errors + self.dropped == job.failures_before)
                continue
            if job.expire is not None:
                if self.errors + self.dropped == job.failures_before:
                    for tier in self.tiers:
                        await attempt(tier.expire(job.keys, job.expire), "expire", tier)
                continue
            for tier in self.tiers:
                await self._write(tier, job)

    async def _write(self, tier: Tier, job: _Job) -> None:
        try:
            present = await tier.contains_many(job.keys)
            missing = [i for i, ok in enumerate(present) if not ok]
            # Pipelines of ~64 MB keep each round trip large but bounded, and go out as the
            # windows they are in are ready (``prepare``), while later ones are cut.
            batch: dict[bytes, Value] = {}
            size = 0
            written: list[bytes] = []
            ready = getattr(job.prepare, "ready", None)  # whether value i is prepared already
            for n, i in enumerate(missing):
                if job.prepare is not None:
                    if batch and ready is not None and not ready(i):  # send what is ready first
                        written += await self._put(tier, batch)
                        batch, size = {}, 0
                    await job.prepare(i)
                value = job.blob(i)
                batch[job.keys[i]] = value
                size += len(value)
                if size >= BATCH_BYTES or n == len(missing) - 1:
                    written += await self._put(tier, batch)
                    batch, size = {}, 0
        except Exception:
            self.errors += 1
            log.warning("background write to %s failed", tier.name, exc_info=True)
            return
        if written and job.announce is not None:
            try:
                await job.announce(written)
            except Exception:
                log.debug("announcing %d stored keys failed", len(written), exc_info=True)

    async def _put(self, tier: Tier, batch: dict[bytes, Value]) -> list[bytes]:
        """Write ``batch`` to ``tier``; its keys when all were stored, else none (counted)."""
        stored = await tier.put_many(batch)
        if stored < len(batch):
            # Tiers report failures as counts, not exceptions (a miss is not an error).
            self.errors += 1
            log.warning("background write to %s stored %d of %d values", tier.name, stored, len(batch))
            return []
        return list(batch)

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until the queue is empty; False if ``timeout`` ran out first."""
        if self._worker is None or self._idle is None:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def aclose(self, drain_timeout: float = 5.0) -> None:
        """Drain pending writes (bounded by ``drain_timeout``), then stop the worker."""
        if self._worker is None:
            return
        # Flush even with an empty queue: the worker may still be writing the job it took last.
        await self.flush(drain_timeout)
        # Cancel until it ends, but never wait on it unbounded: Python 3.11's asyncio.wait_for
        # (inside redis-py) can swallow a cancellation that races its inner task's completion,
        # and a worker that survived one cancel would otherwise be awaited forever.
        deadline = asyncio.get_running_loop().time() + 1.0
        while not self._worker.done() and asyncio.get_running_loop().time() < deadline:
            self._worker.cancel()
            await asyncio.wait({self._worker}, timeout=0.1)
        if not self._worker.done():
            log.warning("the background writer did not stop; abandoning it")
        self._worker = None
