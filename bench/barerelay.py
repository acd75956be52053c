"""A bare HTTP relay: the least a Python proxy on uvloop can add to a request (``bench overhead``,
``bench relays``).

    python -m bench.barerelay PORT UPSTREAM_HOST UPSTREAM_PORT [--aiohttp [--socket PATH] | --asyncio]
    python -m bench.barerelay PORT --stub [--socket PATH]

Bytes in, bytes out: each request is framed by its ``Content-Length`` and written unchanged to
a kept-alive connection to llama-server; the answer, framed the same way, is written back
unchanged. No JSON, no headers read beyond the framing, no logging, no metrics. What it adds to
a request is the second hop through the kernel and one wake of a Python process per direction:
the floor that a sidecar, which must read the request to place it, sits on. Benchmark use only
(no chunked bodies, no pipelining, no limits).

With ``--aiohttp`` it is the sidecar's HTTP layer and nothing else: an aiohttp application with one
handler that reads the body and relays it with the sidecar's own ``Upstream`` and ``relay`` (no
middleware, no JSON, no slots): what kvtier's web layer costs before any of its own logic.

With ``--asyncio`` it is ``Upstream`` and nothing of aiohttp's server: an ``asyncio.Protocol``
frames each request (as the bare relay does), a task relays it with ``Upstream`` and writes the
answer back in one buffer. Between the bare relay and the aiohttp one, it tells what kvtier's own
client costs and what aiohttp's server costs (``bench relays``).

With ``--stub`` it is no relay but the server behind them: every request gets the same JSON
answer at once, the size of llama-server's answer to a one-token completion, so that ``bench
relays`` measures the relays alone. With ``--socket`` the stub also listens on that Unix socket, and
the aiohttp relay connects to the server behind it there (as the sidecar does with ``--llama-socket``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import NamedTuple
from urllib.parse import urlsplit

import uvloop

from launch.binaries import free_port
from launch.processes import wait_port


def _framed(buf: bytearray) -> int:
    """The length of the first whole message in ``buf`` (head and body), or 0."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return 0
    length = 0
    for line in bytes(buf[:end]).split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    total = end + 4 + length
    return total if len(buf) >= total else 0


def _messages(buf: bytearray, data: bytes) -> Iterator[bytes]:
    """``data`` appended to ``buf``; the whole messages taken out of it, in order."""
    buf += data
    while n := _framed(buf):
        message = bytes(buf[:n])
        del buf[:n]
        yield message


class _Upstream(asyncio.Protocol):
    def __init__(self, client: _Client) -> None:
        self.client, self.buf = client, bytearray()
        self.transport: asyncio.Transport | None = None
        self.sent: bytes | None = None  # the request sent on this connection and not answered yet

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, message: bytes) -> None:
        assert self.transport is not None
        self.sent = message
        self.transport.write(message)

    def data_received(self, data: bytes) -> None:
        for answer in _messages(self.buf, data):
            head = answer[:answer.find(b"\r\n\r\n")].lower()
            if b"\r\nconnection: close" in head and self.client.up is self:
                self.client.up = None  # llama-server closes it after so many requests: not reused
            self.sent = None
            self.client.transport.write(answer)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.client.up is self:
            self.client.up = None
        if self.sent is not None:  # closed before it answered (an idle close racing a request)
            self.client.forward(self.sent)


class _Client(asyncio.Protocol):
    def __init__(self, host: str, port: int) -> None:
        self.addr, self.buf = (host, port), bytearray()
        self.up: _Upstream | None = None
        self.waiting: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    async def _connect(self) -> None:
        _, up = await asyncio.get_running_loop().create_connection(lambda: _Upstream(self), *self.addr)
        self.up = up
        waiting, self.waiting = self.waiting, []
        for message in waiting:
            self.forward(message)

    def forward(self, message: bytes) -> None:
        if self.up is None:
            self.waiting.append(message)
            if len(self.waiting) == 1:
                asyncio.get_running_loop().create_task(self._connect())
        else:
            self.up.send(message)

    def data_received(self, data: bytes) -> None:
        for message in _messages(self.buf, data):
            self.forward(message)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.close()


async def serve(port: int, host: str, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(host, upstream_port), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def serve_aiohttp(port: int, host: str, upstream_port: int, unix_socket: str | None = None) -> None:
    from aiohttp import web

    from sidecar.http.headers import for_llama_server
    from sidecar.http.relay import MAX_CAPTURE, Relay, relay
    from sidecar.http.upstream import Upstream

    upstream = Upstream(f"http://{host}:{upstream_port}", unix_socket=unix_socket)

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        answer = await upstream.request(request.method, request.raw_path, for_llama_server(request.headers.items()),
                                        body)
        return await relay(request, answer, Relay(), whole_max=MAX_CAPTURE)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


class _Framed(asyncio.Protocol):
    """A connection whose whole requests (framed by ``Content-Length``) go to ``handle``, in order."""

    def __init__(self, handle: Callable[[_Framed, bytes], Awaitable[None]]) -> None:
        self.handle, self.buf = handle, bytearray()
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.worker: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        for message in _messages(self.buf, data):
            if self.worker is None:
                self.worker = asyncio.get_running_loop().create_task(self._work())
            self.queue.put_nowait(message)

    async def _work(self) -> None:
        while True:
            await self.handle(self, await self.queue.get())

    def connection_lost(self, exc: Exception | None) -> None:
        if self.worker is not None:
            self.worker.cancel()


async def serve_asyncio(port: int, host: str, upstream_port: int) -> None:
    from sidecar.http.headers import end_to_end, for_llama_server
    from sidecar.http.upstream import Upstream

    upstream = Upstream(f"http://{host}:{upstream_port}")

    async def handle(conn: _Framed, message: bytes) -> None:
        end = message.find(b"\r\n\r\n")
        lines = message[:end].decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = [(name.strip(), value.strip()) for name, _, value in (line.partition(":") for line in lines[1:])]
        answer = await upstream.request(method, target, for_llama_server(headers), message[end + 4:])
        try:
            body = b"".join([piece async for piece in answer.iter_any()])
        except BaseException:
            answer.close()
            raise
        answer.release()
        head = [f"HTTP/1.1 {answer.status} {answer.reason}",
                *(f"{k}: {v}" for k, v in end_to_end(answer.headers.items())), f"Content-Length: {len(body)}"]
        conn.transport.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)

    server = await asyncio.get_running_loop().create_server(lambda: _Framed(handle), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


STUB_BODY = (b'{"index":0,"content":" the","tokens":[],"id_slot":0,"stop":true,"model":"stub",'
             b'"tokens_predicted":1,"tokens_evaluated":520,"generation_settings":{"n_predict":1,'
             b'"temperature":0.0,"top_k":40,"top_p":0.95,"min_p":0.05,"seed":4294967295},'
             b'"prompt":"","has_new_line":false,"truncated":false,"stop_type":"limit",'
             b'"stopping_word":"","tokens_cached":520,"timings":{"cache_n":512,"prompt_n":8,'
             b'"prompt_ms":40.1,"prompt_per_token_ms":5.01,"prompt_per_second":199.5,'
             b'"predicted_n":1,"predicted_ms":0.01,"predicted_per_token_ms":0.01,'
             b'"predicted_per_second":100000.0}}' + b" " * 600)


async def serve_stub(port: int, unix_socket: str | None = None) -> None:
    answer = (b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nContent-Type: application/json; charset=utf-8\r\n"
              b"Keep-Alive: timeout=5, max=100\r\nContent-Length: %d\r\n\r\n" % len(STUB_BODY)) + STUB_BODY

    async def handle(conn: _Framed, message: bytes) -> None:
        conn.transport.write(answer)

    loop = asyncio.get_running_loop()
    # The socket first: once the port accepts (what ``bare_relay`` waits for), both do.
    servers = [await loop.create_unix_server(lambda: _Framed(handle), unix_socket)] if unix_socket else []
    servers.append(await loop.create_server(lambda: _Framed(handle), "127.0.0.1", port))
    await asyncio.gather(*(server.serve_forever() for server in servers))


LAYERS = ("bytes", "asyncio", "aiohttp")  # bare_relay's kinds: bytes in and out, Upstream, aiohttp's server


class Relayed(NamedTuple):
    url: str
    pid: int  # its process: ``bench overhead`` reads the CPU time it spends on each request


@contextlib.contextmanager
def bare_relay(upstream_url: str | None, layer: str = "bytes", unix_socket: str | None = None) -> Iterator[Relayed]:
    """A bare relay in front of ``upstream_url`` (its own process, as a sidecar is). ``layer``: one
    of ``LAYERS`` (``bytes``: the byte relay; ``asyncio``, ``aiohttp``: as ``--asyncio``,
    ``--aiohttp``). ``upstream_url`` None: the stub server (``--stub``). ``unix_socket``: the stub
    listens there too, or the aiohttp relay connects there."""
    if layer not in LAYERS:
        raise ValueError(f"layer must be one of {LAYERS}, not {layer!r}")
    port = free_port()
    if upstream_url is None:
        args = [str(port), "--stub"]
    else:
        up = urlsplit(upstream_url)
        args = [str(port), up.hostname or "127.0.0.1", str(up.port), *([f"--{layer}"] if layer != "bytes" else [])]
    if unix_socket is not None:
        if upstream_url is not None and layer != "aiohttp":
            raise ValueError("only the stub and the aiohttp relay take a Unix socket")
        args += ["--socket", unix_socket]
    proc = subprocess.Popen([sys.executable, "-m", "bench.barerelay", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, proc=proc)
        yield Relayed(f"http://127.0.0.1:{port}", proc.pid)
    finally:
        proc.terminate()
        proc.wait(10)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.barerelay")
    p.add_argument("port", type=int)
    p.add_argument("upstream", nargs="*", help="UPSTREAM_HOST UPSTREAM_PORT (none with --stub)")
    kind = p.add_mutually_exclusive_group()
    for name in ("--stub", "--aiohttp", "--asyncio"):
        kind.add_argument(name, action="store_true")
    p.add_argument("--socket", help="a Unix socket: the stub listens there too, the aiohttp relay connects there")
    a = p.parse_args(argv)
    if a.stub != (not a.upstream) or len(a.upstream) not in (0, 2) or (a.socket and a.asyncio):
        p.error("give UPSTREAM_HOST UPSTREAM_PORT, or --stub alone; --socket with --stub or --aiohttp only")
    if a.stub:
        uvloop.run(serve_stub(a.port, a.socket))
        return 0
    host, upstream_port = a.upstream[0], int(a.upstream[1])
    if a.aiohttp:
        uvloop.run(serve_aiohttp(a.port, host, upstream_port, a.socket))
    else:
        uvloop.run((serve_asyncio if a.asyncio else serve)(a.port, host, upstream_port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
