"""A circuit breaker: stop calling a backend that keeps failing, and probe it again later.

Without one, every request would wait out connect timeouts and retries of an unreachable Redis; with
one, the tier answers misses at once for a back-off window, then lets a single probe through
(half-open). A successful probe closes the breaker; a failed one reopens it for a longer window.
The window doubles up to ``max_reset_timeout`` because a caller's probe makes that caller wait on
a dead backend; probes no caller waits on (``background_probe_due``, every ``reset_timeout``)
let the owner notice a backend that is back long before a long window ends.
The clock is injected so tests can drive the windows without sleeping.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import ConfigError


class BreakerState(enum.Enum):
    CLOSED = "closed"  # calls go through
    OPEN = "open"  # calls are skipped until the window ends
    HALF_OPEN = "half_open"  # one probe call is in flight; the others are skipped


@dataclass(frozen=True, slots=True)
class BreakerStats:
    state: BreakerState
    consecutive_failures: int
    opened: int  # times the breaker opened
    skipped: int  # calls answered without touching the backend
    retry_in: float  # seconds until the next probe is allowed (0 when closed)


class CircuitBreaker:
    """Consecutive-failure circuit breaker with an exponentially growing open window.

    Args:
        failure_threshold: consecutive failures that open the breaker.
        reset_timeout: seconds the breaker stays open the first time.
        max_reset_timeout: cap of the window, which doubles after each failed probe.
        clock: monotonic clock in seconds.
    """

    def __init__(
        self,
        failure_threshold: int = 3,
        reset_timeout: float = 5.0,
        max_reset_timeout: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if isinstance(failure_threshold, bool) or not isinstance(failure_threshold, int) or failure_threshold < 1:
            raise ConfigError(f"breaker failure_threshold must be an integer >= 1, got {failure_threshold!r}")
        if not reset_timeout > 0:
            raise ConfigError(f"breaker reset_timeout must be positive seconds, got {reset_timeout!r}")
        if not max_reset_timeout >= reset_timeout:
            raise ConfigError("breaker max_reset_timeout must be >= reset_timeout")
        self.failure_threshold = failure_threshold
        self.reset_timeout = float(reset_timeout)
        self.max_reset_timeout = float(max_reset_timeout)
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._window = self.reset_timeout
        self._open_until = 0.0
        self._next_background = 0.0
        self._opened = 0
        self._skipped = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    @property
    def closed(self) -> bool:
        return self.state is BreakerState.CLOSED

    def allow(self) -> bool:
        """True when a call may go to the backend now; False means answer without it (counted)."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._clock() >= self._open_until:
                self._state = BreakerState.HALF_OPEN  # this caller is the probe
                return True
            self._skipped += 1
            return False

    def record_success(self) -> None:
        with self._lock:
            self._state = BreakerState.CLOSED
            self._failures = 0
            self._window = self.reset_timeout

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._state is BreakerState.HALF_OPEN:
                # The probe failed: back off longer before the next one.
                self._window = min(self._window * 2, self.max_reset_timeout)
                self._trip()
            elif self._state is BreakerState.CLOSED and self._failures >= self.failure_threshold:
                self._trip()

    def background_probe_due(self) -> bool:
        """True, at most once per ``reset_timeout``, while the breaker is open: time for a probe no
        caller waits on. Its owner runs it and calls ``record_success`` when it succeeds (a failed
        one changes nothing: callers are not kept out longer for it)."""
        with self._lock:
            if self._state is not BreakerState.OPEN:
                return False
            now = self._clock()
            if now < self._next_background:
                return False
            self._next_background = now + self.reset_timeout
            return True

    def release_probe(self) -> None:
        """The probe ended without a verdict (cancelled): let the next call probe at once."""
        with self._lock:
            if self._state is BreakerState.HALF_OPEN:
                self._state = BreakerState.OPEN
                self._open_until = self._clock()

    def _trip(self) -> None:
        self._state = BreakerState.OPEN
        now = self._clock()
        self._open_until = now + self._window
        self._next_background = now + self.reset_timeout
        self._opened += 1

    def stats(self) -> BreakerStats:
        with self._lock:
            retry_in = max(0.0, self._open_until - self._clock()) if self._state is BreakerState.OPEN else 0.0
            return BreakerStats(self._state, self._failures, self._opened, self._skipped, retry_in)
