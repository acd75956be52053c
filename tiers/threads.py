"""Work in a worker thread whose result is handed over, not left behind.

``asyncio.to_thread`` leaves its result in two futures that refer to each other (asyncio's and the
executor's, chained by callbacks): a cycle that only the garbage collector breaks, at a time of its
choosing. A result left there stays alive after the caller has dropped it: a parsed slot state holds
its mapped save file, whose pages on a tmpfs slot dir count against that dir's space until then, and
a fetched or cut state holds hundreds of MiB at real KV sizes. ``in_thread`` returns the result
through a box the caller empties, so the futures hold ``None`` and the result goes when the caller
drops it.

A save's work (cutting a saved state into chunks, sending them to Redis) runs ``in_background``:
on threads below the process's CPU priority (``set_background_nice``), so that on a CPU-only node the
llama-server threads computing other users' tokens take the cores first; a restore's work, which a
request waits for, runs at the process's own. While other requests compute on a host with no core
to spare, that work also keeps to a share of one core (``tiers.pace``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from .pace import PACE

_P = ParamSpec("_P")
_T = TypeVar("_T")


async def in_thread(fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """``fn(*args, **kwargs)`` in the loop's default executor (as ``asyncio.to_thread``, but for
    context variables, which no caller here needs), its result held by the caller alone."""
    return await in_pool(None, fn, *args, **kwargs)


async def in_pool(pool: concurrent.futures.Executor | None, fn: Callable[_P, _T], /, *args: _P.args,
                  **kwargs: _P.kwargs) -> _T:
    """``fn(*args, **kwargs)`` in ``pool`` (None: the loop's default executor), its result held by
    the caller alone."""
    box: list[_T] = []

    def call() -> None:
        box.append(fn(*args, **kwargs))

    await asyncio.get_running_loop().run_in_executor(pool, call)
    return box.pop()


_nice = [0]  # set once at start (``set_background_nice``)
_save_pool: list[concurrent.futures.ThreadPoolExecutor] = []  # ``in_background``'s, made on first use


def set_background_nice(nice: int) -> None:
    """How far below the process's CPU priority background threads run (0-19; a process-wide
    setting, made once at start, before the first background work: threads started earlier keep
    theirs)."""
    if not 0 <= nice <= 19:
        raise ValueError(f"nice must be within 0-19, got {nice}")
    _nice[0] = nice


def _lower_priority(nice: int) -> None:
    """Run the calling thread ``nice`` steps below its priority now (a pool's initializer). Linux
    sets the niceness of one thread by its id; elsewhere, or where it is refused, nothing changes."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


class _BackgroundPool(concurrent.futures.ThreadPoolExecutor):
    """Threads at the background priority whose every task runs at the background pace."""

    def submit(self, fn: Callable[..., _T], /, *args: object, **kwargs: object) -> concurrent.futures.Future[_T]:
        return super().submit(PACE.run, fn, *args, **kwargs)


def background_executor(workers: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A pool of ``workers`` threads named ``name`` at the background priority and pace (a save's work)."""
    return _BackgroundPool(workers, thread_name_prefix=name, initializer=_lower_priority, initargs=(_nice[0],))


async def in_background(fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """``fn(*args, **kwargs)`` on a background thread (a save's work), its result held by the caller alone."""
    if not _save_pool:
        _save_pool.append(background_executor(max(2, os.cpu_count() or 2), "kvtier-save"))
    return await in_pool(_save_pool[0], fn, *args, **kwargs)
