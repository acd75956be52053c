"""A large restore's file written window by window as its chunks arrive (``integrations.prefixstream``).

Pure logic on synthetic states (``tests.test_statefile``'s reference encoder) and in-process
memory tiers; test_sidecar.py streams real llama-server states between two nodes through Valkey.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from integrations import kvflow
from integrations.chunkassemble import assemble_state
from integrations.chunkplace import Placed, PlacedFile, write_placed
from integrations.chunks import read_chunk_header
from integrations.chunksplit import split_state
from integrations.prefixstream import StreamStopped, stream_prefix, stream_session, window_chunks
from integrations.stateparse import parse_state
from tests.test_statefile import logical, ref_file
from tiers.codec import BlobCodec
from tiers.keys import Namespace, chunk_key, prefix_chain, session_tail_key
from tiers.memory import MemoryTier
from tiers.sessions import SessionIncomplete, SessionStore
from tiers.store import TieredStore

C = 64
NS = Namespace("e" * 32, chunk_tokens=C)


class FileSink:
    """A restore file on disk, written as ``SlotFiles`` writes one (over whatever was there)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.writes = 0

    async def size(self, nbytes: int) -> None:
        os.ftruncate(self.fd, nbytes)

    async def write(self, placed: Placed) -> None:
        write_placed(self.fd, placed)
        self.writes += 1

    def bytes(self) -> bytes:
        os.close(self.fd)
        return self.path.read_bytes()


def two_tiers() -> TieredStore:
    """A RAM tier above a slower one (standing in for Redis)."""
    return TieredStore([MemoryTier(256 << 20), MemoryTier(256 << 20, name="far")], BlobCodec("none"))


async def stored_state(store: TieredStore, n: int, seed: int, **kw: object) -> tuple[kvflow.PrefixFound, np.ndarray, bytes]:
    """A state of ``n`` cells stored, found by a prompt that continues it: (found, prompt, its file)."""
    lg = logical(n, seed=seed)
    raw = ref_file(lg, **kw)  # type: ignore[arg-type]
    await kvflow.store_state(store, NS, parse_state(raw))
    tokens = np.asarray(lg.tokens + [5, 6, 7], np.int32)
    return await kvflow.find_prefix(store, NS, tokens), tokens, raw


def test_placed_chunks_land_where_assemble_state_puts_them() -> None:
    lg = logical(5 * C + 9, seed=11)
    split = split_state(parse_state(ref_file(lg)), C, tail=True)
    payloads = [*split.chunks, split.tail]
    tokens = np.asarray(lg.tokens, np.int32)
    for n_stream in (1, 3):
        layout = PlacedFile(read_chunk_header(payloads[0]), [read_chunk_header(p).n_cells for p in payloads],
                            tokens, n_stream=n_stream)
        out = bytearray(b"\xee" * layout.nbytes)
        placed = layout.head() + [p for i in reversed(range(len(payloads))) for p in layout.chunk(i, payloads[i])]
        for at, piece in placed:
            out[at : at + piece.nbytes] = piece
        assert bytes(out) == bytes(assemble_state(payloads, tokens, v_trans=False, n_stream=n_stream))


async def test_a_streamed_prefix_writes_the_file_of_the_state_and_promotes_it(tmp_path: Path) -> None:
    store = two_tiers()
    found, tokens, raw = await stored_state(store, 10 * C + 22, seed=3)  # ten chunks and a 22-token tail
    await store.tiers[0].delete([chunk_key(NS, h) for h in found.chunks.chunks])  # only the far tier has them
    found = await kvflow.find_prefix(store, NS, tokens)
    (tmp_path / "restore").write_bytes(b"\xff" * (len(raw) + 4096))  # a longer file written here before
    sink = FileSink(tmp_path / "restore")
    got = await stream_prefix(store, NS, found, tokens, sink, window=3)
    assert sink.bytes() == raw  # byte for byte the state's own file
    assert got.n_tokens == 10 * C + 22 and got.nbytes == len(raw) and got.tail == found.tail
    assert sink.writes == 4  # windows of 3, 3, 3 and 1 chunks
    assert set(got.bytes_by_tier) == {"far"} and got.tiers == frozenset({"far", "memory"})
    # A slot holding more than the chunks: with the tail gone, nothing is written over it.
    await store.delete_everywhere([found.tail.key])
    sink = FileSink(tmp_path / "restore2")
    with pytest.raises(StreamStopped, match="no more than the slot holds"):
        await stream_prefix(store, NS, found, tokens, sink, window=3, have=10 * C + 5)
    assert sink.writes == 0
    # Each window was promoted once written: the chunks are in the RAM tier now.
    assert (await store.lookup(NS, tokens)).tiers == ["memory"] * 10


async def test_a_chunk_gone_midway_stops_the_stream_and_the_whole_fetch_ends_before_it(tmp_path: Path) -> None:
    store = two_tiers()
    found, tokens, _ = await stored_state(store, 9 * C, seed=4)
    chain = prefix_chain(NS, tokens, 9)
    await store.delete_everywhere([chunk_key(NS, chain[6])])
    with pytest.raises(StreamStopped, match="chunk 6"):
        await stream_prefix(store, NS, found, tokens, FileSink(tmp_path / "restore"), window=2)
    got = await kvflow.fetch_prefix(store, NS, found)  # what the restorer falls back to
    assert got.n_tokens == 6 * C


async def test_a_forged_chunk_in_a_later_window_stops_the_stream_and_is_deleted(tmp_path: Path) -> None:
    store = two_tiers()
    found, tokens, _ = await stored_state(store, 8 * C, seed=5)
    chain = prefix_chain(NS, tokens, 8)
    far = store.tiers[1]
    moved = (await far.get_many([chunk_key(NS, chain[2])]))[chunk_key(NS, chain[2])]
    codec = BlobCodec("none")
    payload = codec.decode(moved).payload  # chunk 2's cells under chunk 5's key, with a valid checksum
    await store.delete_everywhere([chunk_key(NS, chain[5])])
    await far.put_many({chunk_key(NS, chain[5]): codec.encode(payload, chunk_hash=chain[5],
                                                               namespace_id=NS.digest[:8], n_tokens=C)})
    with pytest.raises(StreamStopped, match="chunk 5"):
        await stream_prefix(store, NS, found, tokens, FileSink(tmp_path / "restore"), window=2)
    assert store.counters.corrupt == 1 and not (await far.contains_many([chunk_key(NS, chain[5])]))[0]


async def test_a_state_of_transposed_v_is_not_placed(tmp_path: Path) -> None:
    store = two_tiers()
    found, tokens, _ = await stored_state(store, 6 * C, seed=6, v_trans=True)
    with pytest.raises(StreamStopped, match="plain KV in rows"):
        await stream_prefix(store, NS, found, tokens, FileSink(tmp_path / "restore"), window=2)


async def test_a_streamed_session_writes_its_file_and_a_lost_tail_stops_it(tmp_path: Path) -> None:
    store = two_tiers()
    lg = logical(7 * C + 30, seed=7)
    raw = ref_file(lg)
    sessions = SessionStore(store, check=kvflow.content_mismatch)
    manifest = await kvflow.save_session(sessions, NS, "s1", parse_state(raw), node="a")
    assert (manifest.chunks, manifest.tail_tokens) == (7, 30)
    sink = FileSink(tmp_path / "restore")
    got = await stream_session(sessions, NS, manifest, sink, window=2)
    assert sink.bytes() == raw and got.n_tokens == 7 * C + 30 and sink.writes == 4
    # The session's tail gone: the stream stops before it writes a chunk; the whole fetch says why.
    t_hash = bytes.fromhex(manifest.tail_hash)
    await store.delete_everywhere([session_tail_key(NS, "s1", t_hash)])
    sink = FileSink(tmp_path / "restore2")
    with pytest.raises(StreamStopped, match="its tail is gone"):
        await stream_session(sessions, NS, manifest, sink, window=2)
    assert sink.writes == 0
    with pytest.raises(SessionIncomplete):
        await sessions.fetch(NS, manifest)


def test_a_window_is_about_its_bytes_and_two_chunks_at_least() -> None:
    assert window_chunks(64 << 20, 256, 131072) == 2  # 8B: 32 MiB chunks
    assert window_chunks(64 << 20, 256, 327680) == 2  # 70B: 80 MiB chunks
    assert window_chunks(64 << 20, 256, 23040) == 11  # SmolLM2: 5.6 MiB chunks
