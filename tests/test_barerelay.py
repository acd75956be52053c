"""``bench overhead``'s bare relays (the floors it compares the sidecar with): the byte relay's
framing, and real relay processes in front of a real HTTP server, kept alive across requests and
across the server closing its side after an answer (as llama-server does after so many requests)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import aiohttp
import pytest
from aiohttp import web

from bench.barerelay import _framed, bare_relay
from launch.binaries import free_port


def test_a_message_is_whole_once_its_head_and_content_length_are_in() -> None:
    head = b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n"
    assert _framed(bytearray(head[:-2])) == 0
    assert _framed(bytearray(head + b"abc")) == 0
    assert _framed(bytearray(head + b"abcde")) == len(head) + 5
    assert _framed(bytearray(head + b"abcdeGET")) == len(head) + 5  # the next message's start stays
    bare = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    assert _framed(bytearray(bare)) == len(bare)  # no body


@contextlib.contextmanager
def _server() -> Iterator[str]:
    """A real aiohttp server on a free port, in a thread of its own: echoes POST bodies; every
    third answer closes its connection."""
    import threading

    port = free_port()
    answered = 0
    ready = threading.Event()
    stop: list[asyncio.AbstractEventLoop] = []

    async def echo(request: web.Request) -> web.Response:
        nonlocal answered
        answered += 1
        body = await request.read()
        response = web.Response(body=body)
        if answered % 3 == 0:
            response.force_close()
        return response

    def run() -> None:
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/echo", echo)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        stop.append(loop)
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop[0].call_soon_threadsafe(stop[0].stop)
        thread.join(10)


def test_the_relay_passes_answers_through_on_one_kept_alive_connection() -> None:
    with _server() as upstream, bare_relay(upstream) as (url, _):
        port = int(url.rsplit(":", 1)[1])

        async def go() -> list[bytes]:
            # One client connection for all (a raw socket: aiohttp's client would quietly reconnect).
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            out = []
            for i in range(7):  # the server closes after the 3rd and the 6th: the relay reconnects
                body = b"x" * (i * 1000 + 1)
                writer.write(b"POST /echo HTTP/1.1\r\nHost: relay\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200")
                length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
                out.append(await reader.readexactly(length))
            writer.close()
            return out

        bodies = asyncio.run(go())
    assert [len(b) for b in bodies] == [i * 1000 + 1 for i in range(7)]


@pytest.mark.parametrize("web_layer", [False, True])
@pytest.mark.parametrize("size", [0, 200_000])
def test_an_empty_and_a_large_body_pass_whole(size: int, web_layer: bool) -> None:
    with _server() as upstream, bare_relay(upstream, web_layer=web_layer) as (url, _):
        async def go() -> bytes:
            async with aiohttp.ClientSession() as s, s.post(url + "/echo", data=b"y" * size) as r:
                return await r.read()

        assert asyncio.run(go()) == b"y" * size
