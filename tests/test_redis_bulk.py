"""The bulk lane (``tiers.redis_bulk``): chunk values over blocking sockets, against real Valkey and
against hostile or broken servers (split replies, absurd lengths, garbage, a close mid-value); and
the zero-copy pieces around it (codec framing, framed splits, what the memory tier keeps, the
saved slot file mapped)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import os
import socket
import threading
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis

from integrations.chunksplit import split_state
from integrations.stateparse import parse_state
from tests.servers import RedisProc, redis_server
from tests.test_statefile import logical, ref_file
from tiers.codec import HEADER_SIZE, BlobCodec, Framed
from tiers.memory import MemoryTier
from tiers.redis_bulk import READ_SIZE, _balanced
from tiers.redis_tier import RedisTier
from tiers.threads import in_pool, in_thread

MB = 1 << 20


def lane_clients(srv: RedisProc) -> list[str]:
    """Names of the server's clients that are bulk-lane sockets."""
    return [c["name"] for c in redis.Redis(port=srv.port).client_list() if c["name"].startswith("kvtier-bulk")]


async def test_values_cross_between_the_lane_and_redis_py(redis_srv: RedisProc) -> None:
    rng = np.random.default_rng(1)
    values = {f"bulk:{n}".encode(): rng.bytes(n) for n in (0, 1, READ_SIZE - 1, READ_SIZE, READ_SIZE + 1, 32 * MB)}
    values[b"bulk:\r\n$5\r\n"] = b"a key that looks like RESP"
    lane = RedisTier(redis_srv.url, ttl=60)
    plain = RedisTier(redis_srv.url, ttl=60, bulk_connections=0)
    assert lane.connection.bulk is not None and plain.connection.bulk is None
    assert await lane.put_many(values) == len(values)
    assert lane_clients(redis_srv)  # the values went over the lane's own sockets
    assert await plain.get_many([*values, b"bulk:missing"]) == values
    await lane.delete(list(values))
    assert await plain.put_many(values) == len(values)
    got = await lane.get_many([b"bulk:missing", *values])
    assert got == values and b"bulk:missing" not in got
    assert lane.stats().errors == 0
    await lane.aclose()
    await plain.aclose()


async def test_the_lane_authenticates_and_selects_the_database() -> None:
    with redis_server("--requirepass", "pw") as srv:
        tier = RedisTier(f"redis://:pw@127.0.0.1:{srv.port}/3")
        big = os.urandom(2 * MB)
        assert await tier.put_many({b"k": big}) == 1
        assert redis.Redis(port=srv.port, password="pw", db=3).get(b"k") == big
        assert redis.Redis(port=srv.port, password="pw", db=0).get(b"k") is None
        assert await tier.get_many([b"k"]) == {b"k": big}
        wrong = RedisTier(f"redis://:nope@127.0.0.1:{srv.port}/3", retries=0)
        assert await wrong.get_many([b"k"]) == {} and await wrong.put_many({b"k2": big}) == 0
        assert wrong.stats().errors >= 1
        await tier.aclose()
        await wrong.aclose()


# -- servers that misbehave ------------------------------------------------------------------------


@contextlib.contextmanager
def fake_server(answer: Callable[[socket.socket, bytes], None]) -> Iterator[int]:
    """A loopback server that reads a command's first bytes and lets ``answer`` reply to it; it
    answers the lane's CLIENT SETNAME itself with +OK."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while not stop.is_set():
                try:
                    data = conn.recv(1 << 20)
                except OSError:
                    return
                if not data:
                    return
                if b"SETNAME" in data:
                    conn.sendall(b"+OK\r\n")
                else:
                    answer(conn, data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()


async def test_replies_split_into_single_bytes_are_read_whole() -> None:
    value = os.urandom(3 * READ_SIZE + 7)

    def answer(conn: socket.socket, data: bytes) -> None:
        for b in b"$%d\r\n%s\r\n" % (len(value), value):
            conn.sendall(bytes([b]))

    with fake_server(answer) as port:
        tier = RedisTier(f"redis://127.0.0.1:{port}/0", retries=0)
        assert await tier.get_many([b"k"]) == {b"k": value}
        await tier.aclose()


@pytest.mark.parametrize("reply", [
    b"$5368709120\r\n",  # 5 GiB announced: refused before anything is allocated
    b"%3\r\nnot RESP2\r\n",  # a type the lane never asks for
    b"$abc\r\n",  # no length
    b"$100\r\nonly part of it",  # the server goes away mid-value
    b"$3\r\nabcXY",  # a value not followed by CRLF
], ids=["huge", "resp3", "no-length", "cut", "no-crlf"])
async def test_a_broken_reply_is_a_miss_and_an_error(reply: bytes) -> None:
    def answer(conn: socket.socket, data: bytes) -> None:
        conn.sendall(reply)
        conn.shutdown(socket.SHUT_WR)

    with fake_server(answer) as port:
        tier = RedisTier(f"redis://127.0.0.1:{port}/0", retries=0, socket_timeout=2)
        assert await tier.get_many([b"k"]) == {}
        assert tier.stats().errors == 1
        await tier.aclose()


def test_balanced_groups_are_contiguous_and_cover_every_index() -> None:
    for sizes, n in [([1] * 7, 2), ([100, 1, 1, 1], 2), ([5], 4), ([], 3), ([1, 2, 3, 4, 5, 6], 3)]:
        groups = _balanced(sizes, n)
        assert [i for g in groups for i in g] == list(range(len(sizes)))
        assert len(groups) <= n and all(groups)
    assert _balanced([1] * 8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


# -- framing and what the memory tier keeps ----------------------------------------------------------


@pytest.mark.parametrize("keyed", [False, True])
def test_a_framed_payload_encodes_to_the_same_blob_in_place(keyed: bool) -> None:
    codec = BlobCodec("adaptive", mac_key=b"k" * 32 if keyed else None)
    payload = np.random.default_rng(2).bytes(1 * MB)
    buf = np.empty(codec.head_room + len(payload), np.uint8)
    buf[codec.head_room:] = np.frombuffer(payload, np.uint8)
    framed = codec.encode(Framed(buf.data, codec.head_room), chunk_hash=b"h" * 16, namespace_id=b"n" * 8,
                          n_tokens=256)
    assert isinstance(framed, memoryview) and framed.readonly and framed.obj is buf
    assert bytes(framed) == codec.encode(payload, chunk_hash=b"h" * 16, namespace_id=b"n" * 8, n_tokens=256)
    assert bytes(codec.decode(framed, chunk_hash=b"h" * 16).payload) == payload


def test_a_framed_payload_that_compresses_or_lacks_room_is_encoded_apart() -> None:
    codec = BlobCodec("lz4")
    zeros = np.zeros(HEADER_SIZE + MB, np.uint8)
    blob = codec.encode(Framed(zeros.data, HEADER_SIZE), chunk_hash=b"h" * 16, namespace_id=b"n" * 8, n_tokens=1)
    assert isinstance(blob, bytes) and len(blob) < MB // 10
    assert bytes(codec.decode(blob).payload) == bytes(MB)
    short = np.zeros(8 + 100, np.uint8)  # room for another codec's header
    other = BlobCodec("none").encode(Framed(short.data, 8), chunk_hash=b"h" * 16, namespace_id=b"n" * 8, n_tokens=1)
    assert isinstance(other, bytes) and bytes(BlobCodec("none").decode(other).payload) == bytes(100)


async def test_the_memory_tier_keeps_a_whole_buffer_and_copies_a_slice() -> None:
    tier = MemoryTier(8 * MB)
    whole = np.arange(1000, dtype=np.uint8)
    bigger = bytearray(b"x" * 2000)
    await tier.put_many({b"whole": whole.data.toreadonly(), b"slice": memoryview(bigger)[:1000],
                         b"writable": memoryview(bytearray(b"y" * 10))})
    bigger[:1000] = b"z" * 1000  # the caller reuses its buffer: the stored value does not change
    got = await tier.get_many([b"whole", b"slice", b"writable"])
    assert got[b"whole"] == whole.tobytes() and got[b"slice"] == b"x" * 1000 and got[b"writable"] == b"y" * 10
    assert tier.stats().bytes_used == 2010


def test_a_split_with_room_cuts_the_same_payloads_into_buffers_of_their_own() -> None:
    state = parse_state(ref_file(logical(600, n_layer=2)))
    plain = split_state(state, 256, tail=True)
    room = split_state(state, 256, tail=True, room=HEADER_SIZE)
    assert [bytes(p) for p in room.chunks] == [bytes(p) for p in plain.chunks]
    assert room.tail is not None and plain.tail is not None and bytes(room.tail) == bytes(plain.tail)
    assert len(room.frames) == len(room.chunks) + 1
    for i, payload in enumerate(room.chunks):
        frame = room.framed(i)
        assert frame.buffer.nbytes == HEADER_SIZE + payload.nbytes and bytes(frame.payload) == bytes(payload)
    assert room.framed_tail is not None and bytes(room.framed_tail.payload) == bytes(plain.tail)


# -- results of worker threads --------------------------------------------------------------------------


class Big:
    """Stands for a mapped save file or a fetched state: weakly referable."""


async def test_a_worker_threads_result_goes_when_its_caller_drops_it() -> None:
    """asyncio.to_thread's futures keep its result in a cycle until the garbage collector runs (a
    mapped save file then holds its tmpfs space); in_thread and in_pool hand it over."""
    gc.disable()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            for call in (lambda: in_thread(Big), lambda: in_pool(pool, Big)):
                got = await call()
                gone = weakref.ref(got)
                del got
                assert gone() is None
    finally:
        gc.enable()
