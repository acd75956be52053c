"""A witness of llama-server's process: one connection to it, kept open.

A process that exits takes its sockets with it, and a port has one listener at a time: while a
connection opened to llama-server stays open, whoever answers there is the process it was opened
to. ``Witness`` keeps one such connection open for that alone (a ``GET /health`` every 2 s:
llama-server closes a connection idle for 5 s, and ``/health`` never waits behind a batch). Before
llama-server's cap of 100 requests per connection would close it, the watch passes to a new
connection: the new one is opened, then the old one answers once more, so both reached the same
process. Such a run of connections is one ``Chain``. It breaks only when its connection closes
under it or stops answering, which a restart always does.

The server watcher (``sidecar/watcher.py``) trusts a process it confirmed while a chain held, for
as long as that chain holds: a request then costs an attribute read, not two calls to llama-server.
A chain that began after the check started proves nothing about the process checked, so the
watcher only takes one that was open before.

Not for llama-server's ``--reuse-port``: with it, two processes may listen on the port at once.
"""

from __future__ import annotations

import asyncio
import contextlib

from .upstream import Connection, Upstream, UpstreamError

INTERVAL_S = 2.0  # between two checks of the connection (llama-server closes one idle for 5 s)
TIMEOUT_S = 5.0  # for its answer: one not answered by then breaks the chain
PASS_ON_AFTER = 50  # requests on one connection before the watch passes to a new one (cap: 100)


class Chain:
    """One unbroken run of witness connections; ``closed`` once it broke (the watcher's ``Witness``).
    Read live: the moment its connection is lost, not at the witness's next step."""

    __slots__ = ("_broken", "conn")

    def __init__(self, conn: Connection) -> None:
        self.conn = conn  # the connection that holds it now
        self._broken = False

    @property
    def closed(self) -> bool:
        return self._broken or self.conn.closed

    def break_off(self) -> None:
        self._broken = True


class Witness:
    """Keeps one ``Chain`` going to ``upstream`` (``keep_forever``); ``current`` reads it."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self._chain: Chain | None = None
        self._uses = 0  # requests on the chain's connection

    def current(self) -> Chain | None:
        """The chain that holds now; None before one is open and after one broke, until the next opens."""
        if self._chain is not None and self._chain.closed:
            self._break()
        return self._chain

    def _break(self) -> None:
        if self._chain is not None:
            self._chain.break_off()
        self._chain = None

    async def keep(self) -> None:
        """One step: open a chain if none holds; else check that its connection still answers,
        passing the watch to a new connection after ``PASS_ON_AFTER`` requests."""
        chain = self.current()
        if chain is None:
            self._chain, self._uses = Chain(await self.upstream.connect()), 0
            return
        conn = chain.conn
        successor = await self.upstream.connect() if self._uses >= PASS_ON_AFTER else None
        try:
            answered = await self.upstream.health_on(conn, TIMEOUT_S)
        except BaseException:
            if successor is not None:
                successor.close()
            raise
        self._uses += 1
        if not answered:
            conn.close()
            self._break()
            if successor is not None:
                successor.close()
        elif successor is not None:
            # The old one answered after the new one was open: both reached one process.
            chain.conn, self._uses = successor, 0
            conn.close()

    async def keep_forever(self, interval: float = INTERVAL_S) -> None:
        """``keep`` every ``interval`` seconds (llama-server not reachable: tried again next time)."""
        try:
            while True:
                with contextlib.suppress(OSError, TimeoutError, UpstreamError):
                    await self.keep()
                await asyncio.sleep(interval)
        finally:
            self.close()

    def close(self) -> None:
        if self._chain is not None:
            self._chain.conn.close()
        self._break()
