"""The slot directory's files: saved files kept as spares, and restore files written over them.

A restore file written over pages the slot dir holds already skips the kernel's allocation of
fresh pages. The spares are the files llama-server's saves wrote; one is written over only once no
mapping of the state it held is left (else a state being stored would change under its reader).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import numpy as np
import pytest

from integrations.chunksplit import split_state
from integrations.llama_server import LlamaServerClient
from integrations.stateparse import parse_state
from sidecar import slotfiles
from sidecar.config import Settings
from sidecar.slotfiles import FILE_PREFIX, SlotFiles, SpareFiles, _map
from tests.servers import LlamaServer, llama_server
from tests.sidecars import Sidecar, post, run_sidecar
from tiers.keys import Namespace

MB = 1 << 20
LONG_TEXT = "A longer prompt about boxes and shelves. " * 12


def spares_in(slot_dir: Path) -> dict[str, int]:
    """The spare files in ``slot_dir``, by name: their inode numbers."""
    return {p.name: p.stat().st_ino for p in slot_dir.glob(f"{FILE_PREFIX}spare-*.bin")}


def saved_file(slot_dir: Path, name: str, size: int) -> Path:
    path = slot_dir / name
    path.write_bytes(os.urandom(size))
    return path


async def complete_in(client: LlamaServerClient, slot: int, text: str) -> None:
    await client.completion({"prompt": text, "n_predict": 2, "id_slot": slot, "cache_prompt": True})


async def saved_bytes_of(client: LlamaServerClient, slot_dir: Path, slot: int) -> bytes:
    """llama-server's own save of ``slot``, read and removed."""
    await client.save_slot(slot, "check.bin")
    data = (slot_dir / "check.bin").read_bytes()
    (slot_dir / "check.bin").unlink()
    return data


def test_a_spare_is_taken_only_once_nothing_maps_it(tmp_path: Path) -> None:
    spares = SpareFiles(tmp_path)
    small, big = saved_file(tmp_path, "kvtier-save-0.bin", MB), saved_file(tmp_path, "kvtier-save-1.bin", 3 * MB)
    small_view = _map(small)
    assert spares.keep(small, small_view) and spares.keep(big, big.read_bytes())  # read, not mapped: free at once
    assert not small.exists() and not big.exists() and len(spares_in(tmp_path)) == 2
    assert spares.nbytes == 4 * MB
    inodes = set(spares_in(tmp_path).values())

    # Only the read one is free: a restore needing 1 MiB gets it though it is larger.
    first = tmp_path / "kvtier-restore-0.bin"
    assert spares.take(first, MB) and first.stat().st_size == 3 * MB and first.stat().st_ino in inodes
    assert not spares.take(tmp_path / "kvtier-restore-1.bin", MB)  # the other is still mapped
    assert spares.nbytes == MB
    del small_view
    gc.collect()
    second = tmp_path / "kvtier-restore-1.bin"
    assert spares.take(second, 2 * MB) and second.stat().st_size == MB  # the largest when none fits
    assert spares.nbytes == 0 and spares_in(tmp_path) == {}


def test_the_smallest_spare_that_fits_is_taken_and_drop_removes_mapped_ones(tmp_path: Path) -> None:
    spares = SpareFiles(tmp_path)
    for i, size in enumerate((4 * MB, 2 * MB, 3 * MB)):
        path = saved_file(tmp_path, f"kvtier-save-{i}.bin", size)
        assert spares.keep(path, path.read_bytes())
    target = tmp_path / "kvtier-restore-0.bin"
    assert spares.take(target, 2 * MB + 1) and target.stat().st_size == 3 * MB
    held = saved_file(tmp_path, "kvtier-save-9.bin", MB)
    content = held.read_bytes()
    view = _map(held)
    assert spares.keep(held, view)
    assert spares.drop() == 7 * MB and spares_in(tmp_path) == {} and spares.nbytes == 0
    assert bytes(view) == content  # the mapping still reads the state after its name went
    del view
    gc.collect()  # its finalizer finds it dropped: nothing to take
    assert not spares.take(tmp_path / "kvtier-restore-1.bin", 1)


def test_a_save_takes_only_a_spare_of_about_its_size(tmp_path: Path) -> None:
    spares = SpareFiles(tmp_path)
    for i, size in enumerate((MB, 5 * MB, 9 * MB)):
        path = saved_file(tmp_path, f"kvtier-save-{i}.bin", size)
        assert spares.keep(path, path.read_bytes())
    target = tmp_path / "kvtier-save-new.bin"
    assert not spares.take(target, 20 * MB, near=True)  # none from 10 to 40 MiB: the 9 MiB one stays
    assert not target.exists() and spares.nbytes == 15 * MB
    assert spares.take(target, 6 * MB, near=True) and target.stat().st_size == 5 * MB  # the closest of 5 and 9
    target.unlink()
    assert spares.take(target, 2 * MB, near=True) and target.stat().st_size == MB
    assert spares.nbytes == 9 * MB


def test_a_spare_is_leased_for_a_restore_of_the_state_it_holds(tmp_path: Path) -> None:
    ns, other_ns = Namespace("model-a"), Namespace("model-a", salt="tenant-b")
    tokens = np.arange(1000, dtype=np.int32)
    spares = SpareFiles(tmp_path)
    for i, n in enumerate((300, 500, 900)):  # three states of the same prompt, of 300, 500 and 900 tokens
        path = saved_file(tmp_path, f"kvtier-save-{i}.bin", n)
        assert spares.keep(path, path.read_bytes(), (ns, tokens[:n].copy()))
    untagged = saved_file(tmp_path, "kvtier-save-9.bin", 400)
    assert spares.keep(untagged, untagged.read_bytes())  # a probe's save: never leased

    def lease(n: int, exact: bool = False, namespace: Namespace = ns,
              prompt: np.ndarray = tokens) -> tuple[str, int, np.ndarray] | None:
        return spares.lease(namespace, prompt, n, exact=exact)

    got = lease(280)  # the fewest tokens from 280 to 560 that begin with the prompt's
    assert got is not None and got[1] == 300 and np.array_equal(got[2], tokens[:300])
    second = lease(280)  # the first is leased: the next fewest
    assert second is not None and second[1] == 500
    assert lease(280) is None  # 900 tokens are more than twice 280
    assert lease(500, exact=True) is None  # leased already
    spares.give_back(second[0])
    again = lease(500, exact=True)
    assert again is not None and again[0] == second[0]
    spares.give_back(again[0])
    assert lease(450, exact=True) is None and lease(950) is None  # none of exactly 450, none of 950 or more
    assert lease(280, namespace=other_ns) is None  # another tenant's namespace
    changed = tokens.copy()
    changed[100] += 1
    assert lease(280, prompt=changed) is None and lease(90, prompt=changed) is None  # 90: no spare of up to 180
    assert lease(280, prompt=tokens[:200]) is None  # a prompt shorter than the prefix asked for

    # A leased spare is not taken to be written over; one taken holds nothing to lease any more.
    target = tmp_path / "kvtier-restore-0.bin"
    assert spares.take(target, 300) and target.stat().st_size == 400  # the 300 is leased: the untagged 400
    target.unlink()
    spares.give_back(got[0], bad=True)  # its restore failed: never leased again, still a spare
    instead = lease(280)
    assert instead is not None and instead[1] == 500
    spares.give_back(instead[0])
    assert spares.take(target, 300) and target.stat().st_size == 300
    target.unlink()
    assert spares.take(target, 500) and target.stat().st_size == 500
    assert lease(440) is None and lease(800) is not None
    assert spares.drop() == 900 and lease(800) is None


def test_a_file_that_cannot_be_renamed_is_not_kept(tmp_path: Path) -> None:
    spares = SpareFiles(tmp_path)
    assert not spares.keep(tmp_path / "kvtier-save-gone.bin", b"x" * 10)
    assert spares.nbytes == 0


@pytest.mark.parametrize("mappable", [True, False])
def test_a_saved_slot_file_is_mapped_or_read(tmp_path: Path, mappable: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(3 * MB + 5)
    path = tmp_path / "kvtier-save-0.bin"
    path.write_bytes(data)
    if not mappable:
        def refuse(*args: object, **kwargs: object) -> None:
            raise OSError("no mmap here")
        monkeypatch.setattr(slotfiles.mmap, "mmap", refuse)
    got = _map(path)
    assert bytes(got) == data and isinstance(got, memoryview) == mappable
    empty = tmp_path / "kvtier-save-1.bin"
    empty.write_bytes(b"")
    assert _map(empty) == b""


async def test_a_restore_file_is_written_over_a_saved_one_byte_for_byte(tmp_path: Path) -> None:
    """Two saves leave two spares; a restore writes over one, and llama-server loads exactly the
    state written (its save of the restored slot is the same bytes)."""
    with llama_server(tmp_path, "-np", "2") as srv:
        client = LlamaServerClient(srv.url)

        def complete(slot: int, text: str) -> Awaitable[None]:
            return complete_in(client, slot, text)

        def saved_bytes(slot: int) -> Awaitable[bytes]:
            return saved_bytes_of(client, srv.slot_dir, slot)

        try:
            await complete(0, "A short prompt.")
            await complete(1, LONG_TEXT)
            files = SlotFiles(client, srv.slot_dir, 1 << 30)
            spare_of = {}
            for slot in (0, 1):
                state = await files.save(slot, "save")
                assert state.n_tokens > 0
                (spare_of[slot],) = set(spares_in(srv.slot_dir)) - set(spare_of.values())
                del state
            gc.collect()
            inodes = spares_in(srv.slot_dir)
            assert not list(srv.slot_dir.glob(f"{FILE_PREFIX}save-*"))
            # Slot 1 goes on, then serves another prompt. Its longer state fits neither spare, so it
            # is written over the larger (which held slot 1's first state), and restored into slot 1.
            await complete(1, LONG_TEXT + " And which shelf holds the jam?")
            longer = await saved_bytes(1)
            assert len(longer) > (srv.slot_dir / spare_of[1]).stat().st_size
            await complete(1, "Something else.")
            io = await files.restore(1, [longer])
            restored = srv.slot_dir / f"{FILE_PREFIX}restore-1.bin"
            assert io.nbytes == len(longer) and restored.stat().st_ino == inodes[spare_of[1]]
            assert set(spares_in(srv.slot_dir)) == {spare_of[0]}
            assert await saved_bytes(1) == longer  # a slot's save lays its cells out in its own stream
            # Over the budget, a save's file is removed as before.
            lean = SlotFiles(client, srv.slot_dir, 0)
            assert (await lean.save(0, "save")).n_tokens > 0
            assert set(spares_in(srv.slot_dir)) == {spare_of[0]}
            # A purge removes the spares, one still mapped among them, and the kept restore file.
            held = await files.save(0, "save")
            assert len(spares_in(srv.slot_dir)) == 2
            assert await files.drop_kept() > len(longer)
            assert spares_in(srv.slot_dir) == {} and not restored.exists()
            assert held.n_tokens > 0
        finally:
            await client.aclose()


async def test_a_save_is_written_over_a_file_the_slot_dir_holds(tmp_path: Path) -> None:
    """llama-server's save of a slot is written where a file kvtier holds was (emptied first): a
    spare of about the size expected, else a kept restore file of about that size, the slot's own
    first (the only one taken when no size is expected). What it then holds is llama-server's own
    save of that slot, byte for byte."""
    with llama_server(tmp_path, "-np", "2") as srv:
        client = LlamaServerClient(srv.url)

        def complete(slot: int, text: str) -> Awaitable[None]:
            return complete_in(client, slot, text)

        def saved_bytes(slot: int) -> Awaitable[bytes]:
            return saved_bytes_of(client, srv.slot_dir, slot)

        def restore_inode(slot: int) -> int:
            return (srv.slot_dir / f"{FILE_PREFIX}restore-{slot}.bin").stat().st_ino

        def only_new_spare(before: dict[str, int]) -> tuple[str, int]:
            ((name, inode),) = {k: v for k, v in spares_in(srv.slot_dir).items() if k not in before}.items()
            return name, inode

        try:
            await complete(0, LONG_TEXT)
            files = SlotFiles(client, srv.slot_dir, 1 << 30)
            first = await files.save(0, "save")  # nothing to write over yet: a new file, then a spare
            n_first = first.n_tokens
            del first
            gc.collect()
            ((spare, inode),) = spares_in(srv.slot_dir).items()
            await complete(0, LONG_TEXT + " Which shelf?")
            held = await files.save(0, "save", expect_tokens=n_first + 4)  # over that spare, of about its size
            name, again = only_new_spare({spare: inode})
            assert again == inode and (srv.slot_dir / name).read_bytes() == await saved_bytes(0)
            # Slot 1, restored into (a new restore file: the one spare is mapped, by ``held``), then
            # computing another prompt, is saved with no size expected: over its own restore file.
            await complete(1, "Something else entirely.")
            state_0 = await saved_bytes(0)
            await files.restore(1, [state_0])
            own = restore_inode(1)
            await complete(1, "Another prompt altogether, of a few more words.")
            assert (await files.save(1, "save")).n_tokens > 0
            assert not (srv.slot_dir / f"{FILE_PREFIX}restore-1.bin").exists()
            newest, newest_inode = only_new_spare({name: again})
            assert newest_inode == own and (srv.slot_dir / newest).read_bytes() == await saved_bytes(1)
            gc.collect()
            # Slot 1's next restore takes that spare; slot 0's next save, with no spare free, is
            # written over slot 1's restore file, of about its size.
            await files.restore(1, [state_0])
            assert restore_inode(1) == newest_inode
            await complete(0, LONG_TEXT + " Which shelf? And the jam?")
            assert (await files.save(0, "save", expect_tokens=n_first + 8)).n_tokens > 0
            assert not (srv.slot_dir / f"{FILE_PREFIX}restore-1.bin").exists()
            last, last_inode = only_new_spare({name: again})
            assert last_inode == newest_inode and (srv.slot_dir / last).read_bytes() == await saved_bytes(0)
            assert held.n_tokens > 0
        finally:
            await client.aclose()


DOC = " ".join(f"Entry {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7} coins." for i in range(30))


@contextlib.asynccontextmanager
async def node_that_saved_doc(tmp_path: Path) -> AsyncIterator[tuple[LlamaServer, Sidecar]]:
    """A one-slot llama-server and its sidecar, which saved ``DOC``'s answer and then another prompt's."""
    with llama_server(tmp_path) as llama:
        async with run_sidecar(Settings(llama_url=llama.url, slot_dir=str(llama.slot_dir), chunk_tokens=64,
                                        cache_size=256 << 20, prefill_tps_prior=100.0, node_id="a")) as node:
            for text in (DOC, "Something else entirely. " * 20):  # the one slot then holds another prompt
                assert (await post(node.url + "/completion", {"prompt": text, "n_predict": 2})).status == 200
                await node.engine.drain(60)
            yield llama, node


async def test_a_node_restores_over_the_file_its_own_save_left(tmp_path: Path) -> None:
    """In the sidecar, a save's state is let go once stored: its file is a spare the next restore
    writes over, so a node's first restore into a slot allocates no fresh pages. (The prompt keeps
    only a third of the saved one: a restore of most of a saved state loads its file as it is.)"""
    async with node_that_saved_doc(tmp_path) as (llama, node):
        before = spares_in(llama.slot_dir)
        again = await post(node.url + "/completion", {"prompt": DOC[:len(DOC) // 3] + " Which box?", "n_predict": 2})
        assert again.status == 200 and again.restored > 0, again.headers
        assert again.headers["X-KVTier-Restore-Tier"] == "memory"
        restored = llama.slot_dir / f"{FILE_PREFIX}restore-0.bin"
        assert restored.stat().st_ino in before.values(), (before, restored.stat().st_ino)


async def test_a_node_loads_the_file_its_own_save_left_as_it_is(tmp_path: Path) -> None:
    """A restore of most of a state a save on this node left as a spare loads that file: nothing
    fetched, no restore file written. The slot then holds the saved cells, byte for byte, and
    llama-server computes only what the prompt adds to the prefix they share."""
    async with node_that_saved_doc(tmp_path) as (llama, node):
        before = spares_in(llama.slot_dir)
        saved = max((llama.slot_dir / name for name in before), key=lambda p: p.stat().st_size).read_bytes()
        again = await post(node.url + "/completion", {"prompt": DOC + " Which box holds 63 coins?", "n_predict": 2})
        assert again.status == 200 and again.restored >= 4 * 64, again.headers
        assert again.headers["X-KVTier-Restore-Tier"] == "file"
        assert node.metric("kvtier_restores_total", tier="file", outcome="ok") == 1
        assert again.prompt_n < 20, again.body["timings"]  # the question only
        assert not (llama.slot_dir / f"{FILE_PREFIX}restore-0.bin").exists()
        assert set(before.items()) <= set(spares_in(llama.slot_dir).items())  # loaded, not written over
        await node.engine.drain(60)
        client = LlamaServerClient(llama.url)
        try:
            now = await saved_bytes_of(client, llama.slot_dir, 0)
        finally:
            await client.aclose()
    k = again.restored // 64
    ours, theirs = split_state(parse_state(now), 64).chunks[:k], split_state(parse_state(saved), 64).chunks[:k]
    assert len(ours) == k and [bytes(c) for c in ours] == [bytes(c) for c in theirs]
