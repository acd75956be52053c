"""Work in a worker thread whose result is handed over, not left behind.

``asyncio.to_thread`` leaves its result in two futures that refer to each other (asyncio's and the
executor's, chained by callbacks): a cycle that only the garbage collector breaks, at a time of its
choosing. A result left there stays alive after the caller has dropped it: a parsed slot state holds
its mapped save file, whose pages on a tmpfs slot dir count against that dir's space until then, and
a fetched or cut state holds hundreds of MiB at real KV sizes. ``in_thread`` returns the result
through a box the caller empties, so the futures hold ``None`` and the result goes when the caller
drops it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import ParamSpec, TypeVar

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
