"""The pace of a save's work: while requests compute and the host's tasks wait for its CPUs, the
background pools (``tiers.threads.background_executor``) take at most a share of one core.

Why not a lower CPU priority alone: a save thread below the event loop's priority that holds the
GIL when the kernel takes its core away keeps it until it gets a core again, and on cores that
llama-server's threads keep busy that is tens to hundreds of milliseconds, during which the loop
relays no token (docs/scaling.md, "The save's threads and the event loop's GIL"). At the loop's
own priority the thread gets its core back within a scheduler period; the pace bounds the CPU it
takes from llama-server instead. Where a core is free (a GPU node, llama-server ``-t`` below the
host's cores) no one waits for it and nothing is paced: the save takes that core.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_T = TypeVar("_T")

__all__ = ["PACE", "CpuPressure", "Pace", "set_background_pace", "tell_busy"]


class CpuPressure:
    """The share of the time since the last look (at most every ``EVERY_S``) in which some
    runnable task on the host waited for a CPU: Linux's pressure stall information
    (``/proc/pressure/cpu``, "some"). It tells demand apart from use: a save on a core that
    llama-server's threads want makes them wait, one on a core no one wants does not. None where
    the file cannot be read (no PSI: the pace then takes the host as contended)."""

    EVERY_S = 0.1

    def __init__(self, path: str = "/proc/pressure/cpu", clock: Callable[[], float] = time.monotonic):
        self._path, self._clock = path, clock
        self._last: tuple[float, int] | None = None  # when, and the "some" total then (microseconds)
        self._share: float | None = None
        self._lock = threading.Lock()

    def share(self) -> float | None:
        with self._lock:
            now = self._clock()
            if self._last is not None and now - self._last[0] < self.EVERY_S:
                return self._share
            waited = self._some_total()
            if waited is None:
                return None
            if self._last is not None:
                self._share = min(1.0, (waited - self._last[1]) / 1e6 / (now - self._last[0]))
            self._last = (now, waited)
            return self._share

    def _some_total(self) -> int | None:
        try:
            with open(self._path, "rb") as f:
                line = f.readline()
        except OSError:
            return None
        fields = dict(part.split(b"=", 1) for part in line.split()[1:] if b"=" in part)
        try:
            return int(fields[b"total"]) if line.startswith(b"some ") else None
        except (KeyError, ValueError):
            return None


class Pace:
    """The share of one core the background pools' pieces of work take, all together, while
    ``busy``: a piece rests before it starts until the CPU the pieces before it took
    (``time.thread_time``: user and system) is ``share`` of the time since. When not busy, pieces
    run at once and owe nothing.

    Busy: a source (``tell_busy``: a node's engine) says requests compute, and tasks on the host
    wait for a CPU at least ``CONTENDED`` of the time (``CpuPressure``)."""

    REST_STEP_S = 0.02  # a resting piece looks again this often whether it still has to rest
    CONTENDED = 0.05

    def __init__(self, pressure: CpuPressure | None = None) -> None:
        self.share = 1.0  # 1: no bound
        self.pressure = pressure or CpuPressure()
        self._sources: list[Callable[[], bool]] = []
        self._resume = 0.0  # time.monotonic() before which no piece starts while busy
        self.rested_s = 0.0  # seconds pieces waited for their share, all together (a metric)
        self._lock = threading.Lock()

    def busy(self) -> bool:
        if not any(source() for source in list(self._sources)):
            return False
        waited = self.pressure.share()
        return waited is None or waited >= self.CONTENDED

    def run(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        if self.share >= 1.0:
            return fn(*args, **kwargs)
        rest_from, rested = time.monotonic(), False
        while (wait := self._resume - time.monotonic()) > 0 and self.busy():
            time.sleep(min(wait, self.REST_STEP_S))
            rested = True
        if rested:
            with self._lock:
                self.rested_s += time.monotonic() - rest_from
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            owed = (time.thread_time() - t0) * (1.0 / self.share - 1.0)
            busy = self.busy()
            with self._lock:
                self._resume = max(self._resume, time.monotonic()) + owed if busy else 0.0


PACE = Pace()  # the process's: its share is a process-wide setting, as the background niceness


def set_background_pace(share: float) -> None:
    """The share of one core (0-1] the background pools' work takes while busy (1: no bound)."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be within (0, 1], got {share}")
    PACE.share = share


def tell_busy(source: Callable[[], bool]) -> Callable[[], None]:
    """From now on ``source()`` tells whether requests compute (one of a node's engines); returns
    the call that stops it."""
    PACE._sources.append(source)
    return lambda: PACE._sources.remove(source)
