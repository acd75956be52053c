"""The relay's HTTP/1.1 client against raw scripted servers: framing, reuse, and broken answers.

Each test runs under asyncio's own loop and under uvloop (what ``kvtier serve`` runs on): their
transports differ. Real llama-server exchanges go through it in every sidecar test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvloop

import sidecar.http.upstream as upstream_module
import sidecar.http.witness as witness_module
from sidecar.config import Settings
from sidecar.http.upstream import MAX_HEAD, PAUSE_AT, Upstream, UpstreamError
from sidecar.http.witness import Witness
from tests.servers import free_port
from tests.sidecars import run_sidecar

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}

# A script: for each request on a connection, what to answer (raw bytes, or a list of pieces sent
# with a pause between them); None closes the connection without an answer.
Answer = bytes | list[bytes] | None


class ScriptedServer:
    """Answers requests with raw bytes from a script; records connections and requests."""

    def __init__(self, answers: list[Answer], close_after: bool = False) -> None:
        self.answers = list(answers)
        self.close_after = close_after  # close each connection after one answer (without saying so)
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0)
                if answer is None:
                    return
                for piece in answer if isinstance(answer, list) else [answer]:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.005)
                if self.close_after:
                    return
            if not self.answers:  # wait for the client to hang up
                await reader.read()
                self.closed_by_client.set()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        finally:
            writer.close()


async def until(condition: Callable[[], object], what: str, timeout: float = 5.0) -> None:
    """Let the loop turn until ``condition()`` holds; fail after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0)


class Turns(asyncio.Semaphore):
    """The client's ``max_active`` turns, telling the test when a request starts waiting for one."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.waiting = asyncio.Event()

    async def acquire(self) -> bool:
        if self.locked():
            self.waiting.set()
        return await super().acquire()


def run(loop: str, answers: list[Answer], body: Callable[[Upstream, ScriptedServer], Awaitable[Any]],
        close_after: bool = False, keepalive_s: float = 30.0, max_active: int = 256) -> ScriptedServer:
    server_script = ScriptedServer(answers, close_after)

    async def main() -> None:
        server = await asyncio.start_server(server_script.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        upstream = Upstream(f"http://127.0.0.1:{port}", keepalive_s=keepalive_s, max_active=max_active)
        try:
            await asyncio.wait_for(body(upstream, server_script), 10)
        finally:
            upstream.close()
            server.close()

    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        runner.run(main())
    return server_script


class FakeClock:
    """Stands in for the ``time`` module the client reads ``monotonic()`` from."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


def chunked(*pieces: bytes) -> list[bytes]:
    return [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
            *[b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces], b"0\r\nX-Trailer: t\r\n\r\n"]


async def post(upstream: Upstream, body: bytes = b"{}") -> tuple[int, bytes, Any]:
    response = await upstream.request("POST", "/completion?x=1", [("Content-Type", "application/json")], body)
    try:
        return response.status, await response.read(), response
    finally:
        response.release()


@pytest.fixture(params=list(LOOPS))
def loop(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_whole_answers_reuse_one_connection(loop: str) -> None:
    async def body(upstream: Upstream, server: ScriptedServer) -> None:
        for i in range(3):
            status, data, response = await post(upstream, b'{"n": %d}' % i)
            assert (status, data) == (200, b'{"n": %d}' % i)
            assert response.content_length == len(data) and response.headers["content-type"] == "application/json"

    server = run(loop, [ok(b'{"n": 0}'), ok(b'{"n": 1}'), ok(b'{"n": 2}')], body)
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /completion?x=1 HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nContent-Length: 8\r\n" in first and first.endswith(b'\r\n\r\n{"n": 0}')


def test_chunked_stream_arrives_piece_by_piece(loop: str) -> None:
    events = [b"data: {\"content\": \"%d\"}\n\n" % i for i in range(5)]

    async def body(upstream: Upstream, server: ScriptedServer) -> None:
        response = await upstream.request("POST", "/completion", [], b"{}")
        pieces = [piece async for piece in response.iter_any()]
        response.release()
        assert b"".join(pieces) == b"".join(events) and len(pieces) == len(events)
        assert response.complete and response.content_length is None
        _status, data, _ = await post(upstream)  # the connection was kept after the last chunk
        assert data == b"again"

    # Every byte of the framing in its own write as well: the parser resumes anywhere.
    bytewise = [bytes([b]) for b in b"".join(chunked(b"x", b"yz"))]
    server = run(loop, [chunked(*events), ok(b"again")], body)
    assert server.connections == 1

    async def split(upstream: Upstream, server: ScriptedServer) -> None:
        assert (await post(upstream))[1] == b"xyz"

    run(loop, [bytewise], split)


def test_answers_without_a_body_and_close_delimited_ones(loop: str) -> None:
    async def body(upstream: Upstream, server: ScriptedServer) -> None:
        head = await upstream.request("HEAD", "/health", [])
        assert head.status == 200 and head.content_length == 0 and await head.read() == b""
        head.release()
        assert (await post(upstream))[:2] == (204, b"")

    server = run(loop, [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", b"HTTP/1.1 204 No Content\r\n\r\n"], body)
    assert server.connections == 1
    assert server.requests[0].startswith(b"HEAD /health HTTP/1.1\r\n") and b"Content-Length" not in server.requests[0]

    async def until_close(upstream: Upstream, server: ScriptedServer) -> None:
        # An interim 100 answer is skipped; an answer without a length runs until the connection closes.
        status, data, response = await post(upstream)
        assert (status, data, response.keep_alive) == (200, b"until close", False)

    run(loop, [[b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\nuntil ", b"close"]], until_close,
        close_after=True)


def test_connection_close_and_dropped_idle_connections_are_not_reused(loop: str) -> None:
    async def body(upstream: Upstream, server: ScriptedServer) -> None:
        assert (await post(upstream))[1] == b"a"  # says Connection: close
        assert (await post(upstream))[1] == b"b"  # new connection; the server drops it unannounced
        assert len(upstream._idle) == 1
        await until(lambda: upstream._idle[0].closed, "the client sees the kept connection dropped")
        assert (await post(upstream))[1] == b"c"

    server = run(loop, [ok(b"a", b"Connection: close\r\n"), ok(b"b"), ok(b"c")], body, close_after=True)
    assert server.connections == 3


def test_a_kept_connection_closed_before_answering_is_retried_once(loop: str) -> None:
    async def body(upstream: Upstream, server: ScriptedServer) -> None:
        assert (await post(upstream))[1] == b"a"
        # The server reads the next request on the kept connection, then closes without a byte
        # (an idle timeout racing the request): the client retries on a new connection.
        assert (await post(upstream))[1] == b"b"
        # A new connection that closes without an answer is an error, not retried.
        fresh = Upstream(f"http://{upstream.host}:{upstream.port}", keepalive_s=30)
        with pytest.raises(UpstreamError, match="closed the connection"):
            await post(fresh)
        upstream.close()

    server = run(loop, [ok(b"a"), None, ok(b"b"), None], body)
    assert server.connections == 3


def test_idle_connections_expire(loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(upstream_module, "time", clock)

    async def body(upstream: Upstream, server: ScriptedServer) -> None:
        await post(upstream)
        clock.now += 29.9
        await post(upstream)  # idle for less than keepalive_s: reused
        assert server.connections == 1
        clock.now += 30.0
        await post(upstream)  # idle for keepalive_s: closed, and a new one opened
        assert server.connections == 2
        await asyncio.wait_for(server.closed_by_client.wait(), 5)

    assert run(loop, [ok(b"1"), ok(b"2"), ok(b"3")], body, keepalive_s=30.0).connections == 2


def test_a_connection_closed_after_its_answer_is_replaced_before_the_next_request(loop: str) -> None:
    # llama-server closes the connection after every streamed answer: the client opens the next one
    # in the background, so the next request finds it open and sends at once.
    async def body(upstream: Upstream, server: ScriptedServer) -> None:
        assert (await post(upstream))[1] == b"x"
        await until(lambda: server.connections == 2, "a replacement is opened without a request")
        await until(lambda: any(not c.closed for c in upstream._idle), "the replacement is idle in the pool")
        connect = upstream.connect

        async def no_connect() -> Any:
            raise AssertionError("the request opened a connection of its own")

        upstream.connect = no_connect  # type: ignore[method-assign]
        assert (await post(upstream))[1] == b"y"
        upstream.connect = connect  # type: ignore[method-assign]

    assert run(loop, [chunked(b"x"), chunked(b"y")], body, close_after=True).connections >= 2


async def stream_begun(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, opened: list[int],
                       seen: list[int], idle_s: float | None = None) -> bytes:
    """Numbers a connection the server took (``opened``), reads its request (within ``idle_s``, as a
    server's keep-alive), notes it in ``seen`` and writes its streamed answer but the last chunk,
    which it returns."""
    n = len(opened) + 1
    opened.append(n)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), idle_s)
    await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
    seen.append(n)
    *start, end = chunked(b"data: %d\n\n" % n)
    writer.write(b"".join(start))
    return end


def test_once_the_server_closes_after_streams_the_next_connection_opens_as_a_stream_ends(loop: str) -> None:
    # The server closes each connection a while after a chunked answer, as llama-server does (at
    # once there). Once the client saw it, it opens the next connection as a stream begins, and the
    # next request goes there, never on the connection about to close.
    opened: list[int] = []
    seen: list[int] = []  # per request answered, the connection it came on
    wasted: list[int] = []  # connections a request was written on after their answer, never read
    open_at_end: list[int] = []  # connections opened when each answer's last chunk was sent

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = len(opened) + 1
        try:
            end = await stream_begun(reader, writer, opened, seen)
            await writer.drain()
            await asyncio.sleep(0.2)  # computing (the spare connects meanwhile, on a busy machine too)
            open_at_end.append(len(opened))
            writer.write(end)
            await writer.drain()
            await asyncio.sleep(0.3)
            with contextlib.suppress(TimeoutError):
                if await asyncio.wait_for(reader.read(1 << 16), 0.01):
                    wasted.append(n)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        upstream = Upstream(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            assert (await post(upstream))[1] == b"data: 1\n\n"
            assert not upstream.closes_streams  # not known before a close is seen
            await until(lambda: upstream.closes_streams and len(opened) == 2, "the close seen, and replaced")
            for n in (2, 3):  # sent the moment the answer before ended
                assert (await post(upstream))[1] == b"data: %d\n\n" % n
            await asyncio.sleep(0.4)  # each connection answered on was closed by now
            assert seen == [1, 2, 3] and wasted == [] and len(opened) == 4
            assert open_at_end == [1, 3, 4]  # from the second stream on, the next one opened as it began
        finally:
            upstream.close()
            server.close()

    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        runner.run(asyncio.wait_for(main(), 10))


def test_a_stream_longer_than_the_keepalive_still_leaves_a_fresh_connection_at_its_end(
        loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The spare opened as a stream begins idles out if the stream outlasts the keep-alive. A long
    # answer refreshes it as it goes, so the request sent the moment it ends does not connect first.
    # The spares it outlived, closed by the server, leave the pool: they never fill MAX_IDLE (which
    # made every spare opened after them closed at once, and opened again: a storm of connections).
    monkeypatch.setattr(upstream_module, "MAX_IDLE", 2)
    opened: list[int] = []
    seen: list[int] = []  # per request answered, the connection it came on
    open_at_end: list[int] = []  # connections opened when each answer's last chunk was sent

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            end = await stream_begun(reader, writer, opened, seen, idle_s=1.2)  # as llama-server's 5 s
            for _ in range(50 if len(seen) == 2 else 0):  # the second answer: 2.5 s of tokens
                await asyncio.sleep(0.05)
                writer.write(b"2\r\n: \r\n")
                await writer.drain()
            open_at_end.append(len(opened))
            writer.write(end)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        upstream = Upstream(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", keepalive_s=1.0)
        try:
            await post(upstream)
            await until(lambda: upstream.closes_streams and len(opened) == 2, "the close seen, and replaced")
            status, body, _ = await post(upstream)  # outlasts the keep-alive
            assert status == 200 and body.startswith(b"data: 2")
            assert (await post(upstream))[1] == b"data: %d\n\n" % seen[2]  # sent the moment it ended
            assert seen[1] == 2 and seen[2] <= open_at_end[1]  # on a connection opened before the end
            assert len(opened) <= 8 and len(upstream._idle) <= 2  # refreshed every ~0.75 s, no storm
        finally:
            upstream.close()
            server.close()

    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        runner.run(asyncio.wait_for(main(), 15))


def test_a_connection_closed_for_idling_is_not_replaced(loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(upstream_module, "time", clock)

    async def body(upstream: Upstream, server: ScriptedServer) -> None:
        await post(upstream)
        clock.now += upstream_module.REFILL_S + 1  # the server's close comes after its keep-alive timeout
        await until(lambda: upstream._idle[0].closed, "the server's close is seen")
        for _ in range(20):
            await asyncio.sleep(0.005)
        assert server.connections == 1 and upstream._refilling is None

    run(loop, [ok(b"1"), ok(b"2")], body, close_after=True)


@pytest.mark.parametrize("answer, message", [
    (b"HTTP/2 200 OK\r\n\r\n", "not an HTTP/1.x status line"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 20 OK\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "bad header line"),
    (b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n", "bad header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nX-Big: " + b"x" * (MAX_HEAD + 10) + b"\r\n\r\n", "head too large"),
    (b"HTTP/1.1 200 OK\r\n" + b"X-A: 1\r\n" * 200 + b"\r\n", "too many headers"),
    (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "switched protocols"),
    (b"HTTP/1.1 200 OK\r\nContent-Le", "closed the connection"),
])
def test_malformed_heads_are_errors(loop: str, answer: bytes, message: str) -> None:
    async def body(upstream: Upstream, server: ScriptedServer) -> None:
        with pytest.raises(UpstreamError, match=message):
            await upstream.request("POST", "/completion", [], b"{}")

    run(loop, [answer, None], body, close_after=True)


@pytest.mark.parametrize("answer, message", [
    ([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf"], "mid-answer"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"], "mid-answer"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"], "bad chunk size"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"f" * 16 + b"\r\n"], "bad chunk size"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\n"], "bad chunk size"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 2000], "chunk-size line too large"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY"], "not followed by CRLF"),
])
def test_broken_bodies_are_errors_after_what_arrived(loop: str, answer: list[bytes], message: str) -> None:
    async def body(upstream: Upstream, server: ScriptedServer) -> None:
        response = await upstream.request("POST", "/completion", [], b"{}")
        with pytest.raises(UpstreamError, match=message):
            await response.read()
        response.release()
        assert not response.complete

    run(loop, [answer, None], body, close_after=True)


def test_a_large_body_flows_with_backpressure(loop: str) -> None:
    big = bytes(range(256)) * (3 * PAUSE_AT // 256)

    async def body(upstream: Upstream, server: ScriptedServer) -> None:
        response = await upstream.request("GET", "/big", [])
        # The sender is ahead: reading pauses, then resumes as pieces are taken.
        transport = response._conn.transport
        await until(lambda: not transport.is_reading(), "reading from the socket pauses")
        assert PAUSE_AT < response._buffered <= PAUSE_AT + (1 << 20)
        assert await response.read() == big
        response.release()

    run(loop, [ok(big)], body)


def test_closing_mid_answer_closes_the_connection(loop: str) -> None:
    async def body(upstream: Upstream, server: ScriptedServer) -> None:
        response = await upstream.request("POST", "/completion", [], b"{}")
        pieces = response.iter_any()
        assert await pieces.__anext__() == b"first"
        response.close()  # the client went away
        await asyncio.wait_for(server.closed_by_client.wait(), 5)
        assert not upstream._idle

    run(loop, [[b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n",
                b"6\r\nsecond\r\n", b"0\r\n\r\n"]], body)


def test_requests_beyond_max_active_wait_for_a_turn(loop: str) -> None:
    order: list[str] = []

    async def body(upstream: Upstream, server: ScriptedServer) -> None:
        async def one(name: str) -> None:
            status, data, _ = await post(upstream)
            order.append(f"{name} {status} {data.decode()}")

        turns = upstream._active = Turns(1)
        first = asyncio.create_task(one("first"))
        # The first holds the only turn while its answer trickles in.
        await until(lambda: len(server.requests) == 1, "the first request reaches the server")
        second = asyncio.create_task(one("second"))
        await asyncio.wait_for(turns.waiting.wait(), 5)
        assert not first.done()
        await asyncio.gather(first, second)
        # A waiter given up while waiting, and requests that fail, give their turn back.
        held = await upstream.request("GET", "/", [], b"")
        turns.waiting.clear()
        waiting = asyncio.create_task(upstream.request("GET", "/", [], b""))
        await asyncio.wait_for(turns.waiting.wait(), 5)
        assert held.status == 200 and not waiting.done()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await held.read()
        held.release()
        for _ in range(2):
            with pytest.raises(UpstreamError):
                await upstream.request("GET", "/", [], b"")
        status, _, _ = await post(upstream)
        assert status == 200

    slow = [b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n", b"sl", b"ow"]
    server = run(loop, [slow, ok(b"fast"), ok(b""), None, None, None, ok(b"")], body, max_active=1)
    assert order == ["first 200 slow", "second 200 fast"]
    # The second waited, then reused the first's connection (which the failures closed later).
    assert server.connections == 4


def test_requests_that_cannot_be_written_are_refused() -> None:
    upstream = Upstream("http://127.0.0.1:1/prefix/", keepalive_s=1)
    encoded = upstream._encode("POST", "/completion", [("X-A", "é")], b"{}")
    assert encoded.startswith(b"POST /prefix/completion HTTP/1.1\r\nHost: 127.0.0.1:1\r\nX-A: \xc3\xa9\r\n")
    for method, target, headers in [("POST", "/a b", []), ("POST", "no-slash", []), ("PO ST", "/", []),
                                    ("POST", "/", [("X-A", "1\r\nX-Injected: 1")]), ("POST", "/", [("Bad Name", "1")])]:
        with pytest.raises(ValueError):
            upstream._encode(method, target, headers, b"")
    for url in ("ftp://x", "http://", "127.0.0.1:8080"):
        with pytest.raises(ValueError):
            Upstream(url, keepalive_s=1)


async def test_the_sidecar_answers_502_or_cuts_the_client_off(tmp_path: Path) -> None:
    """Through a real sidecar: llama-server down or answering garbage gets a JSON 502; an answer
    that breaks off after it started reaches the client cut, not as a clean (truncated) end."""
    answers = {
        b"/garbage": b"SSH-2.0-not-http\r\n\r\n",
        b"/cut": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    }

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ")[1]
            writer.write(answers.get(path, b"HTTP/1.1 503 Unavailable\r\nContent-Length: 0\r\n\r\n"))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        for url, path in [(f"http://127.0.0.1:{port}", "/garbage"), (f"http://127.0.0.1:{free_port()}", "/slots")]:
            async with run_sidecar(Settings(llama_url=url, slot_dir=str(tmp_path))) as sc, \
                    aiohttp.ClientSession() as s, s.get(sc.url + path) as r:
                assert r.status == 502
                assert (await r.json())["error"]["type"] == "bad_gateway"
        async with run_sidecar(Settings(llama_url=f"http://127.0.0.1:{port}", slot_dir=str(tmp_path))) as sc, \
                aiohttp.ClientSession() as s, s.get(sc.url + "/cut") as r:
            assert r.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):  # (an error response written into it hung here)
                await asyncio.wait_for(r.read(), 10)
    finally:
        server.close()


def test_the_witness_keeps_one_chain_across_connections_until_one_breaks(
        loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The witness opens a connection of its own and asks ``/health`` on it; after
    ``PASS_ON_AFTER`` requests it opens the next and asks once more on the old one, and the chain
    goes on (llama-server caps requests per connection). A connection closed without an answer
    breaks the chain, and the next step starts another."""
    monkeypatch.setattr(witness_module, "PASS_ON_AFTER", 2)

    async def body(upstream: Upstream, server: ScriptedServer) -> None:
        witness = Witness(upstream)
        assert witness.current() is None
        await witness.keep()
        chain = witness.current()
        assert chain is not None and not chain.closed
        await witness.keep()
        await witness.keep()
        assert server.requests[0].startswith(b"GET /health HTTP/1.1\r\n")
        await witness.keep()  # passes the watch on: a second connection, the same chain
        await until(lambda: server.connections == 2, "the server sees the next connection")
        assert witness.current() is chain and not chain.closed and len(server.requests) == 3
        await witness.keep()  # closed without an answer
        assert chain.closed and witness.current() is None
        await witness.keep()
        assert witness.current() not in (None, chain)
        assert not upstream._idle  # never in the relay's pool

    run(loop, [ok(b'{"status":"ok"}')] * 3 + [None], body)


def test_a_witness_that_does_not_answer_in_time_breaks_its_chain(loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A health check not answered within its timeout breaks the chain (llama-server's identity is
    then checked before the next request) rather than wait on it."""
    monkeypatch.setattr(witness_module, "TIMEOUT_S", 0.05)

    async def body(upstream: Upstream, server: ScriptedServer) -> None:
        witness = Witness(upstream)
        await witness.keep()
        chain = witness.current()
        await witness.keep()  # the server never finishes the head
        assert chain is not None and chain.closed and witness.current() is None

    run(loop, [[b"HTTP/1.1 200 OK\r\n"]], body)
