"""The tier protocol, a call on a tier that never fails its caller, per-tier statistics, and size
parsing shared by every tier."""

from __future__ import annotations

import enum
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, Self, TypeVar, runtime_checkable

from .errors import ConfigError

log = logging.getLogger("kvtier.store")
_T = TypeVar("_T")


class TierRole(enum.Enum):
    """Who sees a tier's values."""

    LOCAL = "local"  # this process only (RAM)
    NODE = "node"  # every process of this node (a shared directory)
    REMOTE = "remote"  # every node (Redis), over the network


Value = bytes | memoryview  # an encoded value as tiers take and give it (a view: a buffer of its own)
# Awaited before value ``i`` is asked for: a payload source that must cut its payloads (a saved
# state's chunks) does it then, off the event loop, a window at a time.
Prepare = Callable[[int], Awaitable[None]]


@runtime_checkable
class Tier(Protocol):
    """A key -> blob store. Keys are the full storage keys (bytes); values are encoded blobs.

    A miss is an absent key in the returned mapping, never an exception; a tier that cannot be
    reached answers with misses and counts an error.

    Attributes:
        name: the tier's name in stats, metrics and headers (``memory``, ``shared``, ``redis``).
        role: who sees its values.
        write_behind: the ``TieredStore`` writes it from a background queue, never in a request.
    """

    name: str
    role: TierRole
    write_behind: bool

    async def get_many(self, keys: Sequence[bytes]) -> dict[bytes, bytes | memoryview]: ...

    async def put_many(self, items: Mapping[bytes, Value]) -> int:
        """Store the items; returns how many were stored."""
        ...

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...

    async def delete(self, keys: Sequence[bytes]) -> int: ...

    async def expire(self, keys: Sequence[bytes], seconds: float) -> int:
        """Let ``keys`` go within ``seconds``; returns how many were held. A tier with expiry keeps
        them readable until then (Redis: another node may be fetching one it looked up); the
        others, whose readers are this node's alone, delete them now."""
        ...

    def stats(self) -> TierStats: ...

    async def aclose(self) -> None: ...


async def attempt(op: Awaitable[_T], what: str, tier: Tier) -> _T | None:
    """``await op``, or None once its failure is logged: a failing tier never fails the store."""
    try:
        return await op
    except Exception:
        log.warning("%s on tier %s failed", what, tier.name, exc_info=True)
        return None


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of one tier's counters."""

    tier: str
    hits: int = 0
    misses: int = 0
    puts: int = 0
    bytes_in: int = 0  # bytes written into the tier
    bytes_out: int = 0  # bytes read from the tier
    evictions: int = 0
    errors: int = 0
    corrupt: int = 0  # damaged or foreign values found (and deleted)
    entries: int = 0
    bytes_used: int = 0
    capacity: int = 0  # 0 = unbounded / managed elsewhere (Redis maxmemory)
    get_seconds: float = 0.0
    put_seconds: float = 0.0
    available: bool = True

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class StatsCounter:
    """Mutable, thread-safe counters behind ``TierStats`` snapshots."""

    _fields = ("hits", "misses", "puts", "bytes_in", "bytes_out", "evictions", "errors", "corrupt")

    def __init__(self, tier: str):
        self.tier = tier
        self._lock = threading.Lock()
        self.values: dict[str, float] = {f: 0 for f in self._fields}
        self.values["get_seconds"] = 0.0
        self.values["put_seconds"] = 0.0

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.values[k] += v

    def snapshot(self, **extra: object) -> TierStats:
        with self._lock:
            vals = dict(self.values)
        ints = {k: int(v) for k, v in vals.items() if k in self._fields}
        return TierStats(
            tier=self.tier, get_seconds=vals["get_seconds"], put_seconds=vals["put_seconds"], **ints, **extra  # type: ignore[arg-type]
        )


class Timer:
    """``with Timer() as t: ...; t.seconds``; the clock is injectable for tests."""

    def __init__(self, clock: object = time.perf_counter):
        self._clock = clock
        self.seconds = 0.0

    def __enter__(self) -> Self:
        self._t0 = self._clock()  # type: ignore[operator]
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = self._clock() - self._t0  # type: ignore[operator]


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: str | int, *, name: str = "size") -> int:
    """``"2G"``, ``"512MiB"``, ``"1.5g"`` or an int -> bytes (binary units). Rejects negatives."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size like 2G, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}: size must not be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{name}: expected a size like 2G, got {value!r}")
    m = _SIZE_RE.match(value)
    if not m:
        raise ConfigError(f"{name}: cannot parse size {value!r} (examples: 512M, 2G, 1.5GiB)")
    number, unit, _ = m.groups()
    result = int(float(number) * _UNITS[unit.lower()])
    if result > 1 << 50:
        raise ConfigError(f"{name}: size {value!r} is implausibly large")
    return result


def chunked(items: Iterable[bytes], size: int) -> Iterable[list[bytes]]:
    """Split an iterable of keys into lists of at most ``size``."""
    batch: list[bytes] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
