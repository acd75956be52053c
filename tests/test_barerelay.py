"""``bench overhead``'s bare relays (the floors it compares the sidecar with): the byte relay's
framing, and real relay processes in front of a real HTTP server, kept alive across requests and
across the server closing its side after an answer (as llama-server does after so many requests)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from bench.barerelay import LAYERS, STUB_BODY, _framed, bare_relay
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


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("size", [0, 200_000])
def test_an_empty_and_a_large_body_pass_whole(size: int, layer: str) -> None:
    with _server() as upstream, bare_relay(upstream, layer) as (url, _):
        async def go() -> bytes:
            async with aiohttp.ClientSession() as s, s.post(url + "/echo", data=b"y" * size) as r:
                return await r.read()

        assert asyncio.run(go()) == b"y" * size


def test_every_layer_passes_the_stubs_answer_through(tmp_path: Path) -> None:
    # ``bench relays`` end to end, briefly: the stub's answer comes back whole on every path, and
    # each relay's figures are read from its own process.
    from bench import relays

    out = tmp_path / "relays.json"
    assert relays.main(["--requests", str(relays.BATCH), "--gaps", "0", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    paths = res["gaps"]["0.0"]
    relayed = relays.PATHS[1:]
    assert set(paths) == {"direct", *relayed} and set(LAYERS) < set(relayed) and "aiohttp-unix" in relayed
    assert all(paths[p]["wall_ms"]["n"] == relays.BATCH for p in paths)
    assert all(paths[path]["cpu_us_per_request"] > 0 for path in relayed)
    assert paths["direct"]["added_ms_p50"] is None and all(paths[path]["added_ms_p50"] is not None for path in relayed)
    with bare_relay(None) as stub, bare_relay(stub.url, "asyncio") as relayed:
        answer = relays.Client(int(relayed.url.rsplit(":", 1)[1])).ask()
    assert answer.endswith(STUB_BODY) and b"\r\nserver: llama.cpp\r\n" in answer.lower()


def test_the_aiohttp_relay_reaches_the_stub_on_its_unix_socket_alone(tmp_path: Path) -> None:
    from bench import relays

    sock = tmp_path / "s.sock"
    with bare_relay(None, unix_socket=str(sock)) as stub:
        # Told a wrong TCP port, it can only have reached the stub on the socket.
        with bare_relay(f"http://127.0.0.1:{free_port()}", "aiohttp", unix_socket=str(sock)) as relayed:
            assert relays.Client(int(relayed.url.rsplit(":", 1)[1])).ask().endswith(STUB_BODY)
        assert stub.pid


def test_a_layer_is_named_or_refused() -> None:
    with pytest.raises(ValueError, match="layer must be one of"), bare_relay(None, "uvicorn"):
        pass
    with pytest.raises(ValueError, match="Unix socket"), bare_relay("http://127.0.0.1:1", "bytes", unix_socket="x.sock"):
        pass
