"""Work a request starts and does not wait for, owned by the app and drained at shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("kvtier.app")


class Background:
    """The app's background tasks (a slot erased after a pass-through, ...).

    Each is kept until it ends, so none is collected mid-flight; ``drain`` waits for the rest at
    shutdown. The engine's pending saves are the engine's own (``KVEngine.drain``).
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` in the background."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the tasks to end, then cancel what is left; True
        when all ended in time."""
        if not self._tasks:
            return True
        _, late = await asyncio.wait(set(self._tasks), timeout=timeout)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)  # their own clean-up (a lease given back) runs before shutdown goes on
        return not late
