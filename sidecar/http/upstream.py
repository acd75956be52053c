"""``Upstream``: a minimal HTTP/1.1 client for relaying requests to llama-server.

Why kvtier has its own client rather than aiohttp's, for this one job:

- Cost. Every proxied request is two HTTP exchanges, and aiohttp's client spends ~0.3 ms of Python
  on each (URL objects, timers, trace hooks, cookies, redirects), a large share of what the sidecar
  adds to a request. This client writes a request as one buffer on a kept-alive connection and
  reads the answer's head and framing (``Content-Length``, chunked, or until the connection
  closes) itself. Body pieces reach the caller as they arrive (SSE is never held back); closing a
  response that is still being read closes its connection, which makes llama-server cancel the
  generation.
- No handshake on a request's path after a streamed answer (llama-server then closes the connection):
  one ending within ``REFILL_S`` of its answer, none idle beside it, is replaced (``_refill``),
  and once the server was seen to close one after a chunked answer, a stream keeps a replacement
  open that is still fresh when it ends (``_keep_spare``), and its own connection is closed on our side.
- A witness of the process: a connection of its own, kept open to llama-server, which dies with the
  process behind it (``sidecar.http.witness``). This client opens it (``connect``) and asks
  ``/health`` on it (``health_on``), outside the pool.

kvtier's own calls to llama-server (slot save, restore and erase, tokenize, props, health) go through
aiohttp's pool in ``integrations.llama_server.LlamaServerClient``, not this one. The two are kept
apart on purpose: that client sits in ``integrations`` (below the sidecar: imports flow one
way), it sends JSON with a timeout per call (5 s for a health check, 600 s for a slot save), and a slot action must never queue behind the ``MAX_ACTIVE`` relayed answers here,
which hold their slots until they end. Each pool has one keep-alive setting: ``KEEPALIVE_S``
here, ``integrations.llama_server.KEEPALIVE_S`` there.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import socket
import ssl
import time
from collections.abc import AsyncIterator, Iterable
from urllib.parse import urlsplit

from multidict import CIMultiDict

from .answerhead import MAX_HEAD, TOKEN_RE, UpstreamError, parse_head

__all__ = ["MAX_HEAD", "PAUSE_AT", "Connection", "Upstream", "UpstreamError", "UpstreamResponse"]

MAX_CHUNK_LINE = 1024  # a chunk-size line, extensions included
PAUSE_AT = 1 << 20  # body bytes buffered before reading from the socket pauses
MAX_IDLE = 32  # idle connections kept
# Seconds an idle connection is kept. llama-server closes them after 5 s; a request sent on one it
# has just closed is retried once on a new connection (``Upstream.request``), so they are kept
# closer to that limit than aiohttp's pool keeps its own (which cannot retry).
KEEPALIVE_S = 4.0
# Requests in flight at once (each holds a connection until its answer is read or dropped); more
# wait their turn rather than open ever more sockets to llama-server (which queues them anyway).
MAX_ACTIVE = 256
REFILL_S = 1.0  # a connection ending this soon after its answer was closed for it, not for idling
SPARE_FRESH = 0.75  # a stream's spare is replaced past this share of ``keepalive_s`` (it outlived it)

_CHUNK_SIZE_RE = re.compile(rb"[0-9A-Fa-f]{1,15}")


class Upstream:
    """Kept-alive connections to one HTTP server (llama-server), ``keepalive_s`` seconds each."""

    def __init__(self, base_url: str, *, keepalive_s: float = KEEPALIVE_S, connect_timeout: float = 10.0,
                 max_active: int = MAX_ACTIVE, unix_socket: str | None = None) -> None:
        parts = urlsplit(base_url)
        self.unix_socket = unix_socket  # connect here; ``base_url`` then names the Host header and a prefix
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = parts.scheme == "https"
        self.prefix = parts.path.rstrip("/")
        netloc = parts.netloc.rsplit("@", 1)[-1]
        self.host_header = netloc.encode("idna") if not netloc.isascii() else netloc.encode()
        self.keepalive_s = keepalive_s
        self.connect_timeout = connect_timeout
        self._idle: collections.deque[Connection] = collections.deque()
        self._active = asyncio.Semaphore(max_active)
        self._closed = False
        self._refilling: asyncio.Task[None] | None = None  # a connection opened for the idle pool
        self.closes_streams = False  # the server closed a connection after a chunked answer (``_keep_spare``)

    async def request(self, method: str, target: str, headers: Iterable[tuple[str, str]],
                      body: bytes = b"") -> UpstreamResponse:
        """Send one request and return once the answer's head is in (its body is read from the result).

        ``target`` is the path and query as the client sent them. A kept connection that turns
        out to be closed by the server before any byte of an answer is retried once on a new one.
        Waits while ``max_active`` answers are being read; the answer holds its turn until it is
        released or closed.
        """
        data = self._encode(method, target, headers, body)
        await self._active.acquire()
        try:
            response = await self._exchange(method, data)
        except BaseException:
            self._active.release()
            raise
        response.holds_turn = True
        return response

    async def _exchange(self, method: str, data: bytes) -> UpstreamResponse:
        for attempt in (0, 1):
            conn = self._take_idle()
            if conn is None and self._refilling is not None:
                await asyncio.wait([self._refilling])  # a replacement is being opened: take that one
                conn = self._take_idle()
            reused = conn is not None
            if conn is None:
                conn = await self.connect()
            response = UpstreamResponse(self, conn, head_only=method == "HEAD")
            try:
                conn.start(response, data)
                await response.wait_head()
                return response
            except UpstreamError:
                response.close()
                if reused and not conn.received and attempt == 0:
                    continue
                raise
            except BaseException:  # cancelled: the connection is in an unknown state
                response.close()
                raise
        raise AssertionError("unreachable")

    def _encode(self, method: str, target: str, headers: Iterable[tuple[str, str]], body: bytes) -> bytes:
        if not TOKEN_RE.fullmatch(method.encode("ascii", "replace")):
            raise ValueError(f"bad method {method!r}")
        if not target.startswith("/") or any(c in target for c in " \r\n\t"):
            raise ValueError(f"bad request target {target!r}")
        lines = [b"%s %s HTTP/1.1" % (method.encode(), (self.prefix + target).encode("utf-8", "surrogateescape")),
                 b"Host: " + self.host_header]
        for name, value in headers:
            raw = value.encode("utf-8", "surrogateescape")
            if b"\r" in raw or b"\n" in raw or not TOKEN_RE.fullmatch(name.encode("ascii", "replace")):
                raise ValueError(f"bad header {name!r}")
            lines.append(name.encode() + b": " + raw)
        if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            lines.append(b"Content-Length: %d" % len(body))
        return b"\r\n".join(lines) + b"\r\n\r\n" + body

    def _take_idle(self) -> Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: least likely to have been dropped
            conn.pool = None
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    async def connect(self) -> Connection:
        """A new connection, outside the pool (the pool's, or the witness's own)."""
        if self._closed:
            raise UpstreamError("client closed")
        loop = asyncio.get_running_loop()
        context = ssl.create_default_context() if self.ssl else None
        opening = loop.create_unix_connection(Connection, self.unix_socket) if self.unix_socket is not None \
            else loop.create_connection(Connection, self.host, self.port, ssl=context)
        _, conn = await asyncio.wait_for(opening, self.connect_timeout)
        return conn

    def _ended(self, conn: Connection) -> None:
        if time.monotonic() - conn.idle_since <= REFILL_S:
            self.closes_streams |= conn.after_chunked
            self._open_spare()

    def _keep_spare(self) -> None:
        """A chunked answer's head or body came. Once the server was seen to close the connection
        after one (llama-server's stream provider reports its end as a failure), the next is kept
        ready as it computes: opened as a stream begins, again once the idle one passes
        ``SPARE_FRESH`` of the keep-alive. Repeats sent the moment their answer ended waited 1.2-1.7
        ms (2 of 6) for one opened at the close, 0.3-0.6 ms (5 of 6) at the answer's end."""
        if self.closes_streams:
            self._open_spare(self.keepalive_s * SPARE_FRESH)

    def _open_spare(self, fresh_s: float | None = None) -> None:
        """One connection opened for the pool, unless one idle is younger than ``fresh_s`` (the
        keep-alive by default) or one is being opened."""
        now, fresh_s = time.monotonic(), self.keepalive_s if fresh_s is None else fresh_s
        if not (self._closed or self._refilling
                or any(not c.closed and now - c.idle_since < fresh_s for c in self._idle)):
            self._refilling = asyncio.get_running_loop().create_task(self._refill())

    async def _refill(self) -> None:
        try:
            self.put_back(await self.connect())
        except (OSError, TimeoutError, UpstreamError):
            pass  # the next request connects itself, and reports what fails
        finally:
            self._refilling = None

    async def health_on(self, conn: Connection, timeout: float) -> bool:
        """``GET /health`` on ``conn``: answered within ``timeout`` and kept open (closed if not)."""
        response = UpstreamResponse(self, conn, head_only=False)
        try:
            conn.start(response, self._encode("GET", "/health", (), b""))
            async with asyncio.timeout(timeout):
                await response.wait_head()
                await response.read()
        except (UpstreamError, TimeoutError):
            conn.close()
            return False
        except BaseException:  # cancelled mid-exchange: the connection is in an unknown state
            conn.close()
            raise
        finally:
            conn.response = None
        if not response.keep_alive:
            conn.close()
        return response.status == 200 and not conn.closed

    def put_back(self, conn: Connection) -> None:
        """Keep ``conn`` for the next request; a closed one is dropped (and replaced: ``_ended``)."""
        conn.idle_since = time.monotonic()
        for old in [c for c in self._idle if c.closed or conn.idle_since - c.idle_since >= self.keepalive_s]:
            self._idle.remove(old)  # closed by the server or idled out: not counted against MAX_IDLE
            old.pool = None
            old.close()
        if self._closed or conn.closed or len(self._idle) >= MAX_IDLE:
            conn.close()
            self._ended(conn)
            return
        conn.pool = self
        self._idle.append(conn)

    def close(self) -> None:
        self._closed = True
        if self._refilling is not None:
            self._refilling.cancel()
        while self._idle:
            self._idle.pop().close()


class Connection(asyncio.Protocol):
    """One connection (TCP, or a Unix socket's); the response being read gets its bytes."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.received = False  # any byte of the current answer
        self.idle_since = 0.0
        self.pool: Upstream | None = None  # while idle in a pool: told when the server closes it
        self.after_chunked = False  # its last answer was chunked

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family != socket.AF_UNIX:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def start(self, response: UpstreamResponse, data: bytes) -> None:
        if self.closed or self.transport is None:
            raise UpstreamError("connection closed")
        self.response = response
        self.received = False
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self.response is None:  # bytes nobody asked for: the connection is not reusable
            self.close()
            return
        self.response.feed(data)

    def eof_received(self) -> bool | None:
        return False  # close the transport: HTTP/1.1 has no half-closed connections

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None:
            self.response.lost(exc)
        elif self.pool is not None:
            self.pool._ended(self)

    def pause(self, paused: bool) -> None:
        if self.transport is not None and not self.closed:
            (self.transport.pause_reading if paused else self.transport.resume_reading)()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


# Body states
_HEAD, _LENGTH, _SIZE, _DATA, _DATA_END, _TRAILERS, _UNTIL_CLOSE, _DONE = range(8)
_FRAMING_STATE = {"none": _DONE, "length": _LENGTH, "chunked": _SIZE, "close": _UNTIL_CLOSE}  # ``Head.framing``


def _find(buf: bytearray, sep: bytes, limit: int, what: str) -> int:
    """Where ``sep`` starts in ``buf``; -1 while more bytes may still bring it."""
    end = buf.find(sep)
    if end > limit or (end < 0 and len(buf) > limit):
        raise UpstreamError(f"{what} too large")
    return end


class UpstreamResponse:
    """One answer: its head once :meth:`Upstream.request` returns, its body by :meth:`read` or
    :meth:`iter_any`. :meth:`release` when done (the connection is kept only after a whole answer)."""

    def __init__(self, upstream: Upstream, conn: Connection, *, head_only: bool) -> None:
        self._upstream = upstream
        self._conn: Connection | None = conn
        self._head_only = head_only
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.content_length: int | None = None
        self.keep_alive = True
        self.chunked = False
        self._state = _HEAD
        self._buf = bytearray()
        self._left = 0  # bytes of the current chunk or of the Content-Length body
        self._pieces: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.holds_turn = False  # one of the client's max_active turns, given back with the connection

    @property
    def complete(self) -> bool:
        return self._state == _DONE

    # -- fed by the connection ------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        if self._error is not None or self._state == _DONE:
            if self._state == _DONE and self._conn is not None:
                self._conn.close()  # more than the answer: never reuse this connection
            return
        self._buf += data
        try:
            self._parse()
        except UpstreamError as exc:
            self._fail(exc)
            if self._conn is not None:
                self._conn.close()
            return
        if self.chunked:
            self._upstream._keep_spare()
        self._wake()

    def lost(self, exc: Exception | None) -> None:
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
            self.keep_alive = False
        elif self._state != _DONE and self._error is None:
            why = f": {exc}" if exc else ""
            self._fail(UpstreamError(f"llama-server closed the connection mid-answer{why}"
                                     if self._state != _HEAD or self._buf else f"llama-server closed the connection{why}"))
        self._wake()

    def _fail(self, exc: UpstreamError) -> None:
        self._error = exc
        self.keep_alive = False

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _parse(self) -> None:
        buf = self._buf
        while buf:
            state = self._state
            if state == _HEAD:
                end = _find(buf, b"\r\n\r\n", MAX_HEAD, "answer head")
                if end < 0:
                    return
                head = bytes(buf[:end])
                del buf[: end + 4]
                self._parse_head(head)
            elif state == _LENGTH or state == _DATA:
                take = min(self._left, len(buf))
                self._emit(bytes(buf[:take]))
                del buf[:take]
                self._left -= take
                if self._left == 0:
                    self._state = _DONE if state == _LENGTH else _DATA_END
            elif state == _SIZE:
                end = _find(buf, b"\r\n", MAX_CHUNK_LINE, "chunk-size line")
                if end < 0:
                    return
                line = bytes(buf[:end]).split(b";", 1)[0].strip(b" \t")
                del buf[: end + 2]
                if not _CHUNK_SIZE_RE.fullmatch(line):
                    raise UpstreamError(f"bad chunk size {line[:40]!r}")
                self._left = int(line, 16)
                self._state = _DATA if self._left else _TRAILERS
            elif state == _DATA_END:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise UpstreamError("chunk not followed by CRLF")
                del buf[:2]
                self._state = _SIZE
            elif state == _TRAILERS:
                end = _find(buf, b"\r\n", MAX_HEAD, "trailer line")
                if end < 0:
                    return
                del buf[: end + 2]
                if end == 0:
                    self._state = _DONE
            elif state == _UNTIL_CLOSE:
                self._emit(bytes(buf))
                buf.clear()
            else:  # _DONE with bytes left over
                raise UpstreamError("llama-server sent more than its answer")

    def _parse_head(self, head: bytes) -> None:
        found = parse_head(head, head_only=self._head_only)
        if found is None:
            return  # an interim answer: the real one follows
        self.status, self.reason, self.headers = found.status, found.reason, found.headers
        self.keep_alive = found.keep_alive
        self._left = found.length or 0
        self.content_length = found.length if found.framing in ("none", "length") else None
        self.chunked = found.framing == "chunked"
        self._state = _FRAMING_STATE[found.framing]

    def _emit(self, piece: bytes) -> None:
        if not piece:
            return
        self._pieces.append(piece)
        self._buffered += len(piece)
        if self._buffered > PAUSE_AT and not self._paused and self._conn is not None:
            self._paused = True
            self._conn.pause(True)

    # -- read by the relay ----------------------------------------------------------------------

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def wait_head(self) -> None:
        while self._state == _HEAD and self._error is None:
            await self._wait()
        if self._state == _HEAD:
            assert self._error is not None
            raise self._error

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive; raises :class:`UpstreamError` if it is cut short."""
        while True:
            if self._pieces:
                piece = self._pieces.popleft()
                self._buffered -= len(piece)
                if self._paused and self._buffered <= PAUSE_AT // 2 and self._conn is not None:
                    self._paused = False
                    self._conn.pause(False)
                yield piece
            elif self._state == _DONE:
                return
            elif self._error is not None:
                raise self._error
            else:
                await self._wait()

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.iter_any()])

    def _end_turn(self) -> None:
        if self.holds_turn:
            self.holds_turn = False
            self._upstream._active.release()

    def release(self) -> None:
        """Give the connection back: kept for the next request after a whole answer, else closed."""
        self._end_turn()
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.response = None
        whole = self._state == _DONE and self.keep_alive and self._error is None and not self._buf
        conn.after_chunked = whole and self.chunked  # a close by the server now teaches ``closes_streams``
        if not whole or conn.after_chunked and self._upstream.closes_streams:  # about to be closed: replaced
            conn.close()
        self._upstream.put_back(conn)  # kept, or (closed) dropped and replaced

    def close(self) -> None:
        """Drop the connection (llama-server then stops generating this answer)."""
        self._end_turn()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.response = None
            conn.close()
