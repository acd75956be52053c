"""The slot directory: the state files kvtier has llama-server save and restore.

llama-server reads and writes sequence-state files only by name, inside its ``--slot-save-path``;
the sidecar shares that directory (ideally on tmpfs). Every name kvtier uses starts with
``FILE_PREFIX`` and never comes from a client.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import os
import threading
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from integrations.chunkassemble import write_pieces
from integrations.chunkplace import Placed, write_placed
from integrations.llama_server import LlamaServerClient
from integrations.prefixstream import FileSink
from integrations.statefile import SeqState
from integrations.stateparse import parse_state
from tiers.errors import KVTierError
from tiers.keys import Namespace
from tiers.threads import in_thread

log = logging.getLogger("kvtier.engine")

FILE_PREFIX = "kvtier-"  # every file kvtier writes into the slot dir; names never come from clients
KEEP_SHARE_OF_FREE = 0.5  # kept restore files take at most this share of the slot dir's free space at start


def _map(path: Path) -> bytes | memoryview:
    """A saved slot file's bytes, mapped rather than read.

    The mapping shares the pages llama-server just wrote (the slot dir is on tmpfs in the chart):
    no copy and no new memory, where reading a gigabyte into a fresh buffer cost a copy and a page
    fault per 4 KiB. The pages stay while the file or any view of the state does.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return b""
        try:
            return memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                        prot=mmap.PROT_READ))
        except (OSError, ValueError):  # a file system that cannot map files: read it
            with os.fdopen(os.dup(fd), "rb") as f:
                return f.read()
    finally:
        os.close(fd)


def _about(nbytes: int, expect: int) -> bool:
    """Whether a file of ``nbytes`` is of about the ``expect`` bytes a save will write (half to twice)."""
    return expect <= 2 * nbytes <= 4 * expect


class SpareFiles:
    """Saved slot files kept once kvtier has read them, for a restore file or a later save to be
    written over.

    A save's file holds pages llama-server has just allocated. A file written over them costs a
    copy; a new one makes the kernel allocate and zero every page first (twice the time on tmpfs,
    and more on a VM whose fresh pages fault through to its host). A spare is taken only
    once nothing maps it any more (a finalizer on the mapping tells, from whichever thread drops
    the last view): until then its bytes are a state being split and stored.

    Until it is taken, a spare still holds the state its save wrote: a restore of that state on
    this node loads it as it is (``lease``), with nothing to fetch and no file to write.
    """

    def __init__(self, slot_dir: Path):
        self.slot_dir = slot_dir
        self._sizes: dict[str, int] = {}  # name -> bytes, for every spare (mapped or not)
        self._ready: set[str] = set()  # the spares nothing maps any more
        self._held: dict[str, tuple[Namespace, np.ndarray]] = {}  # name -> the state it holds: namespace, tokens
        self._busy: set[str] = set()  # the spares a restore loads from: not to be taken meanwhile
        self._lock = threading.Lock()  # finalizers run on any thread

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def keep(self, path: Path, data: bytes | memoryview, held: tuple[Namespace, np.ndarray] | None = None) -> bool:
        """Keep the saved file ``path``, just read as ``data``, as a spare; ``held``: the namespace
        and the tokens of the state it holds, when a restore may load it (False: it could not be
        renamed)."""
        name = f"{FILE_PREFIX}spare-{uuid.uuid4().hex[:12]}.bin"
        try:
            os.replace(path, self.slot_dir / name)
        except OSError:
            return False
        with self._lock:
            self._sizes[name] = len(data) if isinstance(data, bytes) else data.nbytes
            if held is not None:
                self._held[name] = held
        mapping = data.obj if isinstance(data, memoryview) else None
        if isinstance(mapping, mmap.mmap):
            weakref.finalize(mapping, self._released, name).atexit = False
        else:
            self._released(name)
        return True

    def _released(self, name: str) -> None:
        with self._lock:
            if name in self._sizes:  # else dropped meanwhile
                self._ready.add(name)

    def take(self, path: Path, need: int, *, near: bool = False) -> bool:
        """Rename a spare nothing maps to ``path``: the smallest of ``need`` bytes or more, else the
        largest; with ``near``, the closest in size of those from half to twice ``need`` only (a
        save's file: larger spares are left to restore files). False when there is none (or it is
        gone)."""
        with self._lock:
            size = self._sizes.__getitem__
            ready = self._ready - self._busy
            if near:
                name = min((n for n in ready if _about(size(n), need)),
                           key=lambda n: abs(size(n) - need), default=None)
            else:
                fits = [n for n in ready if size(n) >= need]
                name = min(fits, key=size) if fits else max(ready, key=size, default=None)
            if name is None:
                return False
            self._ready.discard(name)
            del self._sizes[name]
            self._held.pop(name, None)  # about to be written over
        try:
            os.replace(self.slot_dir / name, path)
        except OSError:
            return False
        return True

    def lease(self, namespace: Namespace, tokens: np.ndarray, n: int, *, exact: bool) -> tuple[str, int, np.ndarray] | None:
        """A spare holding a state of ``namespace`` whose tokens begin with ``tokens[:n]``: of just
        those with ``exact``, else of up to twice as many (the fewest), set aside from ``take``
        until ``give_back``. Returns its name, its size and the tokens it holds; None when none does."""
        if tokens.size < n:
            return None
        with self._lock:
            fits = [(held.size, name) for name, (ns, held) in self._held.items()
                    if name not in self._busy and ns == namespace and n <= held.size <= (n if exact else 2 * n)
                    and np.array_equal(held[:n], tokens[:n])]
            if not fits:
                return None
            name = min(fits)[1]
            self._busy.add(name)
            return name, self._sizes[name], self._held[name][1]

    def give_back(self, name: str, *, bad: bool = False) -> None:
        """End ``lease``'s hold on spare ``name``; ``bad``: its state failed to load (it is never leased again)."""
        with self._lock:
            self._busy.discard(name)
            if bad:
                self._held.pop(name, None)

    def drop(self) -> int:
        """Remove every spare (a mapped one's pages go with its mapping); returns the bytes freed."""
        with self._lock:
            names, self._sizes, self._ready = self._sizes, {}, set()
            self._held.clear()
        for name in names:
            (self.slot_dir / name).unlink(missing_ok=True)
        return sum(names.values())


class _FdSink:
    """A restore file being written at offsets (``integrations.prefixstream.FileSink``), off the loop."""

    def __init__(self, fd: int):
        self.fd = fd
        self.nbytes = 0

    async def size(self, nbytes: int) -> None:
        os.ftruncate(self.fd, nbytes)  # a longer file written here before keeps no tail; its pages stay
        self.nbytes = nbytes

    async def write(self, placed: Placed) -> None:
        await in_thread(write_placed, self.fd, placed)


@dataclass(frozen=True, slots=True)
class RestoreIO:
    """One restore file written and loaded: its size and the time of each step."""

    nbytes: int
    write_s: float  # writing the file
    llama_s: float  # the restore call, as llama-server measured it (else as waited for)
    waited_s: float  # the restore call as the sidecar waited for it (llama-server's queue included)


class SlotFiles:
    """Saves a slot into the slot dir and reads it back; writes restore files and restores them.

    Args:
        client: the llama-server the directory belongs to.
        slot_dir: the directory llama-server was given as ``--slot-save-path``.
        keep_bytes: restore files left in the directory for the slot's next restore, and saved
            files kept as spares for a restore file or a save to be written over (bytes, both
            together); at most half the directory's free space at start, so that a save of a state
            as large as a kept one still fits beside it.
        observe_write: told the bytes and seconds of each file llama-server saves (its own
            ``save_ms``): the stall a save causes its other slots (``CostModel.observe_slot_write``).

    Kept files yield to saves: a save or a restore file that fails while files are kept removes
    them and tries once more (llama-server tells no ENOSPC apart from other failures).
    """

    def __init__(self, client: LlamaServerClient, slot_dir: Path, keep_bytes: int,
                 observe_write: Callable[[int, float], None] | None = None):
        self.client = client
        self.observe_write = observe_write
        self.slot_dir = slot_dir
        free = _free_bytes(slot_dir)
        self.keep_bytes = keep_bytes if free is None else min(keep_bytes, int(free * KEEP_SHARE_OF_FREE))
        self._kept: dict[int, int] = {}  # slot -> bytes of its restore file left in the slot dir
        self._locks: dict[int, asyncio.Lock] = {}
        self._per_token = 0.0  # bytes per token of the last save: about what a save of n tokens writes
        self.spares = SpareFiles(slot_dir)

    def bytes_about(self, n_tokens: int) -> int:
        """About the bytes a save of ``n_tokens`` writes (0 before the first save)."""
        return int(n_tokens * self._per_token)

    def _restore_path(self, slot: int) -> Path:
        return self.slot_dir / f"{FILE_PREFIX}restore-{slot}.bin"

    def _room(self, nbytes: int, but: int | None = None) -> bool:
        """Whether ``nbytes`` more fit in the budget beside the kept files (but ``but``'s) and spares."""
        kept = sum(n for s, n in self._kept.items() if s != but)
        return kept + self.spares.nbytes + nbytes <= self.keep_bytes

    async def save(self, slot: int, purpose: str, expect_tokens: int = 0,
                   namespace: Namespace | None = None) -> SeqState:
        """Have llama-server save ``slot`` (over a file the slot dir holds, ``_lay_out``; the slot
        holds about ``expect_tokens``, 0 if not known) and parse what it wrote (the file is kept as
        a spare when the budget allows, else removed; one saved in ``namespace`` may be restored
        as it is, ``restore_saved``).

        Raises:
            KVTierError: the file is not where it should be (the slot dir is not llama-server's).
            StateFormatError / LlamaServerError: a state kvtier cannot read, a refused save.
        """
        name = f"{FILE_PREFIX}{purpose}-{slot}-{uuid.uuid4().hex[:12]}.bin"
        path = self.slot_dir / name
        try:
            await self._lay_out(slot, path, self.bytes_about(expect_tokens))
            try:
                action = await self.client.save_slot(slot, name)
            except Exception as exc:
                if not await self._free_kept(f"saving slot {slot} failed ({exc})"):
                    raise
                path.unlink(missing_ok=True)
                action = await self.client.save_slot(slot, name)
            try:
                data = await in_thread(_map, path)
            except FileNotFoundError:
                raise KVTierError(
                    f"llama-server saved slot {slot} but {path} does not exist: --slot-dir must be the "
                    "directory llama-server was given as --slot-save-path"
                ) from None
            state = parse_state(data)
            nbytes = len(data) if isinstance(data, bytes) else data.nbytes
            if state.n_tokens:
                self._per_token = nbytes / state.n_tokens
            if self.observe_write is not None and action.ms > 0:
                self.observe_write(nbytes, action.ms / 1000)
            if self._room(nbytes):
                self.spares.keep(path, data, None if namespace is None else (namespace, state.tokens.tokens.copy()))
            return state
        finally:
            path.unlink(missing_ok=True)  # not kept, or saving or reading failed

    async def _lay_out(self, slot: int, path: Path, expect: int) -> None:
        """Put a file kvtier holds at ``path``, emptied, for llama-server's save of ``slot`` to
        write: a spare of about the ``expect`` bytes the save will write, else a kept restore file
        of about that size, the slot's own first (a slot that is saved has moved on from the state
        restored into it; a slot's next restore takes a spare: the save's file, once read). With
        no size to expect, the slot's own restore file only.

        The save runs in llama-server's main loop: every other slot waits for it. Into a new file
        its writes get pages the kernel must allocate and zero, and on a VM whose free pages go
        back to the host (free page reporting), fault through to the host too: 0.7-1.0 s for a
        528 MB state here, against 0.4-0.5 s into the pages the truncation has just freed.
        """
        taken = bool(expect) and self.spares.take(path, expect, near=True)
        if not taken:
            near = sorted((s for s, n in self._kept.items() if _about(n, expect)),
                          key=lambda s: (s != slot, abs(self._kept[s] - expect)))
            for owner in near if expect else [slot]:
                if await self._take_kept(owner, path):
                    taken = True
                    break
        if taken:
            try:
                await in_thread(os.truncate, path, 0)  # off llama-server's loop: freeing pages takes time too
            except OSError:
                path.unlink(missing_ok=True)

    async def _take_kept(self, slot: int, path: Path) -> bool:
        """Rename ``slot``'s kept restore file to ``path``, unless a restore into ``slot`` is using it."""
        lock = self._locks.setdefault(slot, asyncio.Lock())
        if lock.locked():
            return False
        async with lock:
            if not self._kept.pop(slot, 0):
                return False
            restore_file = self._restore_path(slot)
            try:
                os.replace(restore_file, path)
            except OSError:
                restore_file.unlink(missing_ok=True)
                return False
            return True

    async def restore(self, slot: int, pieces: Sequence[bytes | memoryview]) -> RestoreIO:
        """Write ``pieces`` as ``slot``'s restore file and have llama-server restore it."""
        async def write(path: Path) -> int:
            try:
                return await asyncio.to_thread(write_pieces, path, pieces, overwrite=True)
            except OSError as exc:
                if exc.errno != errno.ENOSPC or not await self._free_kept(
                        f"writing slot {slot}'s restore file failed ({exc})", but=slot):
                    raise
                return await asyncio.to_thread(write_pieces, path, pieces, overwrite=True)

        return await self._restore(slot, sum(memoryview(p).nbytes for p in pieces), write)

    async def restore_placed(self, slot: int, expect: int, fill: Callable[[FileSink], Awaitable[object]]) -> RestoreIO:
        """Have ``fill`` write ``slot``'s restore file (of about ``expect`` bytes) piece by piece as
        its pieces arrive (``prefixstream``), then have llama-server restore it. A failure leaves no
        file; a full slot dir is not retried here (what was fetched is gone)."""
        async def write(path: Path) -> int:
            flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
            sink = _FdSink(os.open(path, flags, 0o644))
            try:
                await fill(sink)
            finally:
                os.close(sink.fd)
            return sink.nbytes

        return await self._restore(slot, expect, write)

    async def _restore(self, slot: int, expect: int, write: Callable[[Path], Awaitable[int]]) -> RestoreIO:
        """Write ``slot``'s restore file (``write``, of about ``expect`` bytes) and restore it."""
        # One file per slot, overwritten in place by the slot's next restore: writing into pages the
        # slot dir holds already is about twice as fast on tmpfs as a new file (whose pages the
        # kernel must allocate and zero; on some VMs first-touched pages cost ~10 us each, 300 ms
        # for a 94 MB state). A slot with none takes a spare. Kept only within keep_bytes, and never
        # written by two restores at once.
        path = self._restore_path(slot)
        kept = False
        async with self._locks.setdefault(slot, asyncio.Lock()):
            try:
                t0 = time.perf_counter()
                if slot not in self._kept:
                    self.spares.take(path, expect)
                nbytes = await write(path)
                t1 = time.perf_counter()
                action = await self.client.restore_slot(slot, path.name)
                t2 = time.perf_counter()
                kept = self._room(nbytes, but=slot)
            finally:
                if kept:
                    self._kept[slot] = nbytes
                else:
                    self._kept.pop(slot, None)
                    path.unlink(missing_ok=True)
        llama_s = action.ms / 1000 if action.ms > 0 else t2 - t1
        return RestoreIO(nbytes, t1 - t0, min(llama_s, t2 - t1), t2 - t1)

    async def restore_saved(self, slot: int, namespace: Namespace, tokens: np.ndarray, n: int, *,
                            exact: bool) -> tuple[RestoreIO, np.ndarray] | None:
        """Have llama-server restore into ``slot`` a spare that still holds a state saved in
        ``namespace`` beginning with ``tokens[:n]`` (``SpareFiles.lease``): nothing to fetch, no
        file to write. Returns the restore's times and the tokens the slot now holds; None when
        no spare holds such a state, or its restore failed (the spare is not leased again)."""
        leased = self.spares.lease(namespace, tokens, n, exact=exact)
        if leased is None:
            return None
        name, nbytes, held = leased
        bad = True
        try:
            t1 = time.perf_counter()
            action = await self.client.restore_slot(slot, name)
            t2 = time.perf_counter()
            bad = False
        except Exception as exc:  # the usual restore path follows: it writes and loads its own file
            log.warning("slot %d: restoring the saved file %s failed: %s", slot, name, exc)
            return None
        finally:
            self.spares.give_back(name, bad=bad)
        llama_s = action.ms / 1000 if action.ms > 0 else t2 - t1
        return RestoreIO(nbytes, 0.0, min(llama_s, t2 - t1), t2 - t1), held

    async def _free_kept(self, why: str, but: int | None = None) -> int:
        """Remove the kept restore files (but slot ``but``'s, whose lock the caller holds), each
        under its slot's lock; returns the bytes freed."""
        freed = await self.drop_kept(but)
        if freed:
            log.warning("%s: removed %d bytes of kept restore files and tried again", why, freed)
        return freed

    async def drop_kept(self, but: int | None = None) -> int:
        """Remove the kept restore files and the spares while serving (a purge: they hold KV), each
        restore file under its slot's lock, so none goes while its restore runs; returns the bytes freed."""
        freed = self.spares.drop()
        for slot in [s for s in self._kept if s != but]:
            async with self._locks.setdefault(slot, asyncio.Lock()):
                nbytes = self._kept.pop(slot, 0)
                if nbytes:
                    self._restore_path(slot).unlink(missing_ok=True)
                    freed += nbytes
        return freed

    def remove_kept(self) -> None:
        """Remove the restore files kept for the next restores and the spares (at shutdown)."""
        self.spares.drop()
        for slot in list(self._kept):
            self._restore_path(slot).unlink(missing_ok=True)
        self._kept.clear()


def _free_bytes(path: Path) -> int | None:
    """Bytes free for an unprivileged writer in ``path``'s file system (None when it cannot be told)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
