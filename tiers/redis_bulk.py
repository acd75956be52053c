"""BulkLane: chunk values to and from one Redis or Valkey server over blocking sockets in worker threads.

Why it exists: redis-py's asyncio client moves a large value at 0.2-0.9 GB/s on the machines kvtier
is measured on. Its transport copies whatever the socket does not take at once into a bytearray,
and its reader copies every value through the stream buffer, all on the event loop that relays
other users' tokens. A blocking socket in a worker thread sends a value straight from the caller's
buffer (``sendall``) and reads one straight into a buffer of its size (``recv_into``), with the GIL
released while the kernel copies: measured on one loopback Valkey with 32 MiB values (an 8B
model's 256-token chunk), 1.4 GB/s SET and 3.6-5 GB/s GET against 0.2-0.4 and 0.9-1.1 through
redis-py.

Only value commands go here (``SET``, ``GET``/``GETEX``, ``PTTL``): everything else (``EXISTS``,
``DEL``, manifests, events) stays on redis-py and its pool. A lane serves one server (``redis://``,
``rediss://``, ``unix://``); Sentinel and Cluster deployments keep redis-py for values too, since
their routing lives in redis-py's clients. Calls are made under the connection's breaker by
``RedisTier``; a failed socket is closed, never reused.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import redis.exceptions as rex

from .redis_clients import ClientOptions
from .threads import background_executor, in_pool

# Defaults, with units.
DEFAULT_BULK_CONNECTIONS = 2  # sockets (and threads) per server: GET ran at 3.6 GB/s on 1, 5 on 2, 3.2 on 4
WINDOW = 4  # commands sent ahead of their replies on one socket (bounds what the server buffers)
READ_SIZE = 64 << 10  # bytes per read of reply lines (values are read into their own buffers)
MAX_VALUE_BYTES = 4 << 30  # a longer bulk reply is a damaged or hostile server, not a chunk
CLIENT_NAME = b"kvtier-bulk"  # how an operator tells the lane's sockets apart in CLIENT LIST

Buffer = bytes | bytearray | memoryview
Command = tuple[Buffer, ...]


class _Socket:
    """One connection: sends commands as RESP, reads RESP2 replies; values into buffers of their own."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()

    def send(self, command: Command) -> None:
        parts = [b"*%d\r\n" % len(command)]
        for arg in command:
            n = memoryview(arg).nbytes
            if n > READ_SIZE:  # sent from the caller's buffer, not copied into a header
                self.sock.sendall(b"".join(parts) + b"$%d\r\n" % n)
                self.sock.sendall(arg)
                parts = [b"\r\n"]
            else:
                parts += [b"$%d\r\n" % n, bytes(arg), b"\r\n"]
        self.sock.sendall(b"".join(parts))

    def _fill(self) -> None:
        data = self.sock.recv(READ_SIZE)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buf += data

    def _line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > READ_SIZE:
                raise ConnectionError("a reply line longer than any Redis sends")
            self._fill()
        line = bytes(self.buf[:end])
        del self.buf[: end + 2]
        return line

    def reply(self) -> Any:
        """The next reply: bytes for a status, int, a read-only view of a value of its own, None,
        or a ``ResponseError`` for an error reply (returned, as redis-py's pipelines do)."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return rex.ResponseError(rest.decode("utf-8", "replace"))
        try:
            n = int(rest)
        except ValueError:
            raise ConnectionError(f"not a RESP reply: {line[:40]!r}") from None
        if kind == b":":
            return n
        if kind != b"$":
            raise ConnectionError(f"an unexpected RESP reply: {line[:40]!r}")
        if n < 0:
            return None
        if n > MAX_VALUE_BYTES:
            raise ConnectionError(f"a value of {n} bytes announced: refused")
        return self._value(n)

    def _value(self, n: int) -> memoryview:
        # Exactly n bytes of its own, uninitialised (every byte is read into it): a reader may keep
        # it whole, and nothing else lives in it.
        out = np.empty(n, np.uint8).data
        got = min(len(self.buf), n)
        out[:got] = self.buf[:got]
        del self.buf[:got]
        while got < n:
            k = self.sock.recv_into(out[got:], n - got)
            if k == 0:
                raise ConnectionError("the server closed the connection mid-value")
            got += k
        while len(self.buf) < 2:
            self._fill()
        if self.buf[:2] != b"\r\n":
            raise ConnectionError("a value not followed by CRLF")
        del self.buf[:2]
        return out.toreadonly()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class BulkLane:
    """Value commands to one server over blocking sockets, each used by one worker thread at a time;
    a call's commands are cut into ``connections`` contiguous runs, each run pipelined ``WINDOW``
    commands ahead of its replies. Reads and writes have threads of their own: a restore on the
    request path never queues behind a background write of hundreds of megabytes.

    Args:
        options: the server (one host or a Unix socket), credentials, TLS and timeouts.
        connections: sockets and worker threads.

    Raises:
        ValueError: a Sentinel or Cluster target (no single server), or fewer than one connection.
    """

    def __init__(self, options: ClientOptions, *, connections: int = DEFAULT_BULK_CONNECTIONS):
        if options.target.mode not in ("standalone", "unix"):
            raise ValueError(f"a bulk lane serves one server, not a {options.target.mode} deployment")
        if connections < 1:
            raise ValueError("a bulk lane needs at least one connection")
        self.options = options
        self.connections = connections
        self._pools = {"read": ThreadPoolExecutor(connections, thread_name_prefix="kvtier-bulk-read"),
                       "write": background_executor(connections, "kvtier-bulk-write")}  # writes are saves
        self._idle: list[_Socket] = []
        self._lock = threading.Lock()
        self._tls = _tls_context(options) if options.target.tls else None
        self._closed = False

    @staticmethod
    def available(options: ClientOptions) -> bool:
        """True when ``options`` names one server a lane can serve."""
        return options.target.mode in ("standalone", "unix")

    async def execute(self, commands: Sequence[Command], *, step: int = 1, sizes: Sequence[int] | None = None,
                      writes: bool = False) -> list[Any]:
        """Run ``commands`` and return their replies in order (error replies as exceptions).

        ``step``: commands that must run in order on one socket come in runs of this many (a
        ``PTTL`` before the ``GETEX`` that refreshes it). ``sizes``: bytes each run sends, to
        balance the sockets (equal when not given). ``writes``: run on the write threads.

        Raises:
            OSError / ConnectionError: a socket failed or the server sent no RESP (that socket is closed).
        """
        if self._closed:
            raise ConnectionError("the bulk lane is closed")
        runs = [list(commands[i: i + step]) for i in range(0, len(commands), step)]
        groups = _balanced(sizes or [1] * len(runs), self.connections)
        pool = self._pools["write" if writes else "read"]
        parts = await asyncio.gather(*(
            in_pool(pool, self._run, [c for i in group for c in runs[i]]) for group in groups))
        return [reply for part in parts for reply in part]

    def _run(self, commands: list[Command]) -> list[Any]:
        # Every command here may run twice (SET, GET, GETEX, PTTL): a socket that fails, say one
        # left idle while the server restarted, is replaced and the run sent again, up to the
        # options' retries (as redis-py retries its own connection errors).
        for attempt in range(self.options.retries + 1):
            try:
                return self._run_once(commands)
            except (OSError, rex.ConnectionError):
                self._drop_idle()  # a server that went away took every idle socket with it
                if attempt == self.options.retries or self._closed:
                    raise
        raise AssertionError("unreachable")

    def _run_once(self, commands: list[Command]) -> list[Any]:
        conn = self._take()
        try:
            replies: list[Any] = []
            sent = 0
            while len(replies) < len(commands):
                while sent < len(commands) and sent - len(replies) < WINDOW:
                    conn.send(commands[sent])
                    sent += 1
                replies.append(conn.reply())
        except BaseException:
            conn.close()
            raise
        self._give_back(conn)
        return replies

    def _take(self) -> _Socket:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _give_back(self, conn: _Socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def _connect(self) -> _Socket:
        o, t = self.options, self.options.target
        if t.mode == "unix":
            assert t.unix_path is not None
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(o.connect_timeout)
            try:
                sock.connect(t.unix_path)
            except OSError:
                sock.close()
                raise
        else:
            host, port = t.hosts[0]
            sock = socket.create_connection((host, port), timeout=o.connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=host)
        sock.settimeout(o.socket_timeout)
        conn = _Socket(sock)
        try:
            if o.password is not None:
                user = (o.username.encode(),) if o.username else ()
                _expect_ok(conn, (b"AUTH", *user, o.password.encode()), "AUTH")
            if t.db:
                _expect_ok(conn, (b"SELECT", str(t.db).encode()), "SELECT")
            _expect_ok(conn, (b"CLIENT", b"SETNAME", CLIENT_NAME), "CLIENT SETNAME")  # for CLIENT LIST
        except BaseException:
            conn.close()
            raise
        return conn

    def close(self) -> None:
        """Close the idle sockets and stop the threads (those in use close when their call ends)."""
        with self._lock:
            self._closed = True
        self._drop_idle()
        for pool in self._pools.values():
            pool.shutdown(wait=False)


def _expect_ok(conn: _Socket, command: Command, what: str) -> None:
    conn.send(command)
    reply = conn.reply()
    if isinstance(reply, Exception):
        raise rex.AuthenticationError(f"{what} refused: {reply}") if what == "AUTH" else reply
    if reply != b"OK":
        raise ConnectionError(f"{what} answered {reply!r}")


def _balanced(sizes: Sequence[int], n: int) -> list[list[int]]:
    """Cut indexes ``0..len(sizes)-1`` into at most ``n`` contiguous, non-empty groups of about
    equal total size."""
    total = sum(sizes)
    groups: list[list[int]] = [[]]
    acc = 0
    for i, size in enumerate(sizes):
        if groups[-1] and len(groups) < n and acc >= total * len(groups) / n:
            groups.append([])
        groups[-1].append(i)
        acc += size
    return [g for g in groups if g]


def _tls_context(options: ClientOptions) -> ssl.SSLContext:
    """The TLS context of the URL's options (as redis-py builds its own from the same ones)."""
    opts = dict(options.target.tls_options)
    ctx = ssl.create_default_context(cafile=opts.get("ssl_ca_certs"))
    reqs = opts.get("ssl_cert_reqs", "required").lower()
    check = opts.get("ssl_check_hostname", "true").lower() == "true"  # redis-py's default too
    ctx.check_hostname = check and reqs != "none"
    ctx.verify_mode = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL}.get(reqs, ssl.CERT_REQUIRED)
    if opts.get("ssl_certfile"):
        ctx.load_cert_chain(opts["ssl_certfile"], opts.get("ssl_keyfile"))
    return ctx
