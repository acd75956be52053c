"""SharedTier: blobs as files in a node-local directory that several processes share.

The default directory is ``/dev/shm/kvtier`` (RAM, shared by every sidecar on the node); any path
works, an SSD for instance. The design rests on three file-system facts:

- A value is written to a temp file in the same directory and renamed over its key (``os.replace``),
  so a reader sees the old file or the new one, never a partial one. Files are never modified in
  place, so a mapping of one never changes under a reader.
- Reads map the file (``mmap``) and hand out a memoryview: no copy. On Linux a mapping outlives
  the file's name, so a value replaced or evicted while a reader holds it stays intact until the
  reader drops it.
- The last access time is the file's mtime (``os.utime`` on every hit). A writer that would go over
  the byte budget scans the directory and unlinks the oldest files; files that vanish meanwhile
  (another process evicted them) are simply skipped.

Usage is known exactly after a scan and estimated in between (this process's writes are added);
writers evict down to a low-water mark, so scans are rare, and writes of other processes since the
last scan can overshoot the budget by at most a few percent per writer for ``rescan_interval``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import mmap
import os
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .base import StatsCounter, TierRole, TierStats, Value, parse_size
from .errors import ConfigError

log = logging.getLogger("kvtier.shared")

DEFAULT_SHARED_DIR = "/dev/shm/kvtier"
DEFAULT_SHARED_CAPACITY = 4 << 30  # 4 GiB; keep it below the size of the file system (df /dev/shm)
MMAP_MIN_BYTES = 16 << 10  # smaller values are read with one read(): cheaper than a mapping
LOW_WATER = 0.95  # an eviction frees space down to this fraction of the capacity
RESCAN_SECONDS = 2.0  # at most this long between scans while writing (other processes' writes)
STALE_TEMP_SECONDS = 300.0  # temp files older than this are a crashed writer's: removed on scan
THREAD_PUT_BYTES = 1 << 20  # put_many of more bytes runs in a worker thread, off the event loop
MAX_PLAIN_KEY = 120  # longer keys are named by their BLAKE2b-160 digest instead of their hex
_TMP_PREFIX = ".tmp-"


def file_name(key: bytes) -> str:
    """A safe, injective file name for a key: its hex, or ``h`` + a digest for long keys.

    Hex names contain only ``0-9a-f``, so no key can produce a separator, ``..`` or a temp name,
    and the ``h`` of digest names keeps the two forms apart.
    """
    if not isinstance(key, bytes):
        raise TypeError(f"keys are bytes, got {type(key).__name__}")
    if 0 < len(key) <= MAX_PLAIN_KEY:  # the empty key would name the directory itself
        return key.hex()
    return "h" + hashlib.blake2b(key, digest_size=20).hexdigest()


class DirectoryBudget:
    """The byte budget of one shared directory: what it holds, and least-recently-used eviction.

    Usage is known exactly after a scan and estimated in between (this process's writes and
    deletes are added); a writer scans when the estimate says it would go over the capacity, or
    when the last scan is older than ``rescan_interval`` (other processes write too).

    Args:
        directory: the directory whose files count.
        capacity: bytes.
        rescan_interval: seconds between scans while writing.
        stats: the tier's counters, where evictions are counted.
    """

    def __init__(self, directory: str, capacity: int, rescan_interval: float, stats: StatsCounter):
        self.capacity = capacity
        self._dir = directory
        self._rescan = rescan_interval
        self._stats = stats
        self._lock = threading.Lock()
        self._used = 0
        self._entries = 0
        self._last_scan = float("-inf")
        self.rescan()

    def rescan(self) -> None:
        """Measure the directory now (and evict, should it be over the capacity)."""
        with self._lock:
            self._scan_and_evict(0)

    def make_room(self, incoming: int) -> None:
        """Before writing ``incoming`` bytes: scan, and evict down to the low-water mark, if needed."""
        with self._lock:
            if self._used + incoming > self.capacity or time.monotonic() - self._last_scan > self._rescan:
                self._scan_and_evict(incoming)

    def added(self, size: int, replaced: int) -> None:
        """A file of ``size`` bytes was installed over one of ``replaced`` bytes (-1: over none)."""
        with self._lock:
            self._used += size - max(replaced, 0)
            self._entries += replaced < 0

    def removed(self, size: int) -> None:
        """A file of ``size`` bytes was unlinked."""
        with self._lock:
            self._used -= size
            self._entries -= 1

    def usage(self) -> tuple[int, int]:
        """(entries, bytes used): estimates, never negative."""
        with self._lock:
            return max(self._entries, 0), max(self._used, 0)

    def _scan_and_evict(self, incoming: int) -> None:
        """Measure the directory; unlink the least recently used files until ``incoming`` fits.

        Called with ``self._lock`` held. Files that vanish during the scan were evicted or replaced
        by another process and are skipped.
        """
        files: list[tuple[int, int, str]] = []  # (mtime ns, size, name)
        used = 0
        now = time.time_ns()
        with os.scandir(self._dir) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if entry.name.startswith(_TMP_PREFIX):
                    if now - st.st_mtime_ns > STALE_TEMP_SECONDS * 1e9:
                        _unlink(entry.path)  # left by a writer that died
                    else:
                        used += st.st_size  # in flight: occupies space, cannot be evicted
                    continue
                if not entry.is_file(follow_symlinks=False):
                    continue
                files.append((st.st_mtime_ns, st.st_size, entry.name))
                used += st.st_size
        evicted = 0
        if used + incoming > self.capacity:
            target = max(0, int(self.capacity * LOW_WATER) - incoming)
            files.sort()
            for i, (_, size, fname) in enumerate(files):
                if used <= target:
                    files = files[i:]
                    break
                if _unlink(os.path.join(self._dir, fname)):
                    evicted += 1
                used -= size  # gone either way: by us, or by whoever raced us
            else:
                files = []
        self._used = used
        self._entries = len(files)
        self._last_scan = time.monotonic()
        if evicted:
            self._stats.add(evictions=evicted)


class SharedTier:
    """A tier of files in a directory shared by the processes of one node.

    Args:
        path: the directory; created if missing (mode 0700 unless it exists).
        capacity: byte budget of the directory (an int or a size such as ``"4G"``).
        name: tier name.
        file_mode: permission bits of the files (0600: only this user; widen to share across users).
        rescan_interval: seconds between scans while writing, to see other processes' writes.

    Raises:
        ConfigError: a bad capacity, or a path that is not a writable directory.
    """

    role = TierRole.NODE
    write_behind = False

    def __init__(
        self,
        path: str | os.PathLike[str] = DEFAULT_SHARED_DIR,
        capacity: int | str = DEFAULT_SHARED_CAPACITY,
        *,
        name: str = "shared",
        file_mode: int = 0o600,
        rescan_interval: float = RESCAN_SECONDS,
    ):
        self.capacity = parse_size(capacity, name="shared tier capacity")
        if self.capacity <= 0:
            raise ConfigError(f"shared tier capacity must be positive, got {capacity!r}")
        if not 0 <= file_mode <= 0o777:
            raise ConfigError(f"file_mode must be permission bits like 0o600, got {file_mode!r}")
        if not rescan_interval > 0:
            raise ConfigError(f"rescan_interval must be positive seconds, got {rescan_interval!r}")
        self.name = name
        self.path = Path(path)
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"shared tier directory {str(self.path)!r} cannot be created: {exc}") from None
        if not self.path.is_dir():
            raise ConfigError(f"shared tier path {str(self.path)!r} is not a directory")
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise ConfigError(f"shared tier directory {str(self.path)!r} is not writable")
        self._dir = str(self.path)
        fs = os.statvfs(self._dir)
        if self.capacity > fs.f_blocks * fs.f_frsize:
            log.warning("shared tier capacity %d exceeds the size of the file system of %s (%d bytes): "
                        "writes will fail before eviction starts", self.capacity, self._dir, fs.f_blocks * fs.f_frsize)
        self._file_mode = file_mode
        self._stamp_lock = threading.Lock()
        self._last_stamp = 0
        self._stats = StatsCounter(name)
        self._budget = DirectoryBudget(self._dir, self.capacity, float(rescan_interval), self._stats)

    def __repr__(self) -> str:
        return f"SharedTier(name={self.name!r}, path={self._dir!r}, capacity={self.capacity})"

    def _path(self, key: bytes) -> str:
        return os.path.join(self._dir, file_name(key))

    def _stamp(self) -> int:
        """A strictly increasing wall-clock time in ns (file times of one batch must not tie)."""
        with self._stamp_lock:
            now = max(time.time_ns(), self._last_stamp + 1)
            self._last_stamp = now
            return now

    # -- reads ----------------------------------------------------------------------------------

    async def get_many(self, keys: Sequence[bytes]) -> dict[bytes, bytes | memoryview]:
        # Mapping files costs a few syscalls each and copies nothing: fine on the event loop.
        return self.get_many_sync(keys)

    def get_many_sync(self, keys: Sequence[bytes]) -> dict[bytes, bytes | memoryview]:
        """Values of the keys present: memoryviews of mapped files (bytes for small ones)."""
        t0 = time.perf_counter()
        found: dict[bytes, bytes | memoryview] = {}
        errors = nbytes = 0
        # Deepest first, so the root of a chain gets the newest access time and is evicted last.
        for key in reversed(keys):
            try:
                value = self._read(self._path(key))
            except (OSError, ValueError):  # ValueError: mmap of a file changed by a foreign writer
                errors += 1
                continue
            if value is not None:
                found[key] = value
                nbytes += len(value)
        self._stats.add(hits=len(found), misses=len(keys) - len(found), bytes_out=nbytes, errors=errors,
                        get_seconds=time.perf_counter() - t0)
        return found

    def _read(self, path: str) -> bytes | memoryview | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return None  # never written by us: a rename only ever installs complete files
            value: bytes | memoryview
            if size >= MMAP_MIN_BYTES:
                # The mapping keeps the pages (and the inode) alive after fd is closed and after the
                # name is replaced or unlinked; the memoryview keeps the mapping alive.
                value = memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_READ))
            else:
                value = _read_exact(fd, size)
            stamp = self._stamp()
            try:
                os.utime(fd, ns=(stamp, stamp))
            except OSError:
                pass  # a file of another user: its access is not recorded, the value is still good
            return value
        finally:
            os.close(fd)

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [os.path.exists(self._path(k)) for k in keys]

    # -- writes ---------------------------------------------------------------------------------

    async def put_many(self, items: Mapping[bytes, Value]) -> int:
        if sum(len(v) for v in items.values()) > THREAD_PUT_BYTES:
            return await asyncio.to_thread(self.put_many_sync, items)
        return self.put_many_sync(items)

    def put_many_sync(self, items: Mapping[bytes, Value]) -> int:
        """Write the items (atomically each); returns how many were stored.

        Items are taken to be a prefix chain in order: when they do not all fit in the capacity,
        the leading ones that fit are stored, since a chunk is useless without its predecessors.
        """
        t0 = time.perf_counter()
        keep: list[tuple[bytes, Value]] = []
        total = 0
        for key, value in items.items():
            if total + len(value) > self.capacity:
                break
            keep.append((key, value))
            total += len(value)
        if not keep:
            return 0
        self._budget.make_room(total)
        stored = nbytes = errors = 0
        for key, value in reversed(keep):  # deepest first: the root gets the newest time
            try:
                replaced = self._write(self._path(key), value)
            except OSError:
                errors += 1
                continue
            self._budget.added(len(value), replaced)
            stored += 1
            nbytes += len(value)
        self._stats.add(puts=stored, bytes_in=nbytes, errors=errors, put_seconds=time.perf_counter() - t0)
        return stored

    def _write(self, path: str, value: bytes | bytearray | memoryview) -> int:
        """Atomically install ``value`` at ``path``; returns the size of the file it replaced, or -1."""
        tmp = os.path.join(self._dir, f"{_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self._file_mode)
        try:
            view = memoryview(value).cast("B")
            while view:
                n = os.write(fd, view)
                view = view[n:]
            stamp = self._stamp()
            os.utime(fd, ns=(stamp, stamp))
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        try:
            old = os.stat(path).st_size
        except FileNotFoundError:
            old = -1
        try:
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        return old

    async def delete(self, keys: Sequence[bytes]) -> int:
        removed = 0
        for key in keys:
            path = self._path(key)
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                continue
            if _unlink(path):
                removed += 1
                self._budget.removed(size)
        return removed

    async def expire(self, keys: Sequence[bytes], seconds: float) -> int:
        """Deleted now: only this node reads them (``Tier.expire``)."""
        return await self.delete(keys)

    def delete_prefix_sync(self, prefix: bytes) -> int:
        """Delete every value whose key starts with ``prefix`` (a namespace's, on a purge).

        Files are named by their key's hex, so a prefix is a prefix of the name too; keys longer
        than ``MAX_PLAIN_KEY`` are named by a digest and cannot be told apart by prefix (only
        session tails of ids near the 128-character limit): they leave by eviction, or by their
        own key (``delete``).
        """
        if not prefix:
            raise ValueError("an empty prefix would name every file: use clear()")
        name_prefix = prefix.hex()
        removed = 0
        with os.scandir(self._dir) as it:
            for entry in it:
                if entry.name.startswith(name_prefix) and entry.is_file(follow_symlinks=False):
                    try:
                        size = entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        continue
                    if _unlink(entry.path):
                        removed += 1
                        self._budget.removed(size)
        return removed

    async def delete_prefix(self, prefix: bytes) -> int:
        return await asyncio.to_thread(self.delete_prefix_sync, prefix)

    def clear(self) -> int:
        """Remove every value (not the directory); returns how many files were removed."""
        removed = 0
        with os.scandir(self._dir) as it:
            for entry in it:
                if entry.is_file(follow_symlinks=False) and _unlink(entry.path):
                    removed += 1
        self._budget.rescan()
        return removed

    def rescan(self) -> None:
        """Measure the directory now (stats otherwise lag other processes' writes)."""
        self._budget.rescan()

    def stats(self) -> TierStats:
        entries, used = self._budget.usage()
        return self._stats.snapshot(entries=entries, bytes_used=used, capacity=self.capacity,
                                    available=os.path.isdir(self._dir))

    async def aclose(self) -> None:
        """Nothing to release: the files are the point, and stay for the other processes."""


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _read_exact(fd: int, size: int) -> bytes:
    chunks: list[bytes] = []
    left = size
    while left > 0:
        chunk = os.read(fd, left)
        if not chunk:
            break  # cannot happen for a renamed-in file; a short value fails the codec's checks
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
