"""``python -m bench relays``: what each layer of a Python relay costs, with no llama-server behind it.

    python -m bench relays                        # 300 requests per path and gap, under a minute
    python -m bench relays --requests 1000 --gaps 0 20 200

``bench overhead`` measures the sidecar against two floors in front of real llama-servers, where
compute jitters by milliseconds. This one takes llama-server out: a stub server (``bench/barerelay.py
--stub``) answers every request at once with a JSON answer of a one-token completion's size, and
four relays sit in front of it, each its own process on uvloop:

    bytes    bytes in, bytes out: framing by ``Content-Length``, nothing parsed (the floor)
    asyncio  the sidecar's ``Upstream`` behind an ``asyncio.Protocol`` that frames requests and
             writes each answer in one buffer: kvtier's client without aiohttp's server
    aiohttp  aiohttp's server, ``Upstream`` and the sidecar's relay: kvtier's web layer alone
    aiohttp-unix  the same, connected to the stub on a Unix socket (as ``--llama-socket`` connects
             the sidecar to llama-server): what loopback TCP costs on the second hop

A client in this process sends ``POST /completion`` requests one at a time on one kept-alive
connection, to the stub directly and through each relay, in rotating order, and waits ``gap`` ms
before each (0: back to back, every path hot; 20 ms: as between the requests of ``bench overhead``,
where this host charges code for waking, ``wake_cost`` there). Reported per relay and gap: wall
time p50 and p90, what it adds to the direct request's p50, and the CPU its main thread spent per
request (Linux's schedstat; the median of the batches). The difference between two rows is what
that layer costs: what leaving aiohttp's server, or any Python relay, could save at best.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .barerelay import LAYERS, bare_relay
from .common import RESULTS_DIR, machine, percentile, print_table, summary, versions, write_json
from .overhead import main_thread_cpu_us, rotated

PATHS = ("direct", *LAYERS, "aiohttp-unix")
BATCH = 20  # requests per path in a row before the next path's turn
_LENGTH = re.compile(rb"(?i)\r\ncontent-length:\s*(\d+)")
REQUEST_BODY = b'{"prompt":"' + b"and the next question, please. " * 6 + b'","n_predict":1,"cache_prompt":true}'


class Client:
    """One kept-alive connection, one request at a time (a raw socket: nothing of the client's own
    library falls in the time measured)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.request = (b"POST /completion HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(REQUEST_BODY)) + REQUEST_BODY

    def ask(self) -> bytes:
        """Send the request; its whole answer (head and body)."""
        self.sock.sendall(self.request)
        buf = b""
        while True:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the relay closed the connection")
            buf += chunk
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                length = _LENGTH.search(buf[:end + 2])
                if length is None:
                    raise ConnectionError(f"an answer without Content-Length: {buf[:end]!r}")
                if len(buf) >= end + 4 + int(length.group(1)):
                    return buf

    def close(self) -> None:
        self.sock.close()


def batch(client: Client, pid: int | None, n: int, gap_s: float) -> tuple[list[float], float | None]:
    """``n`` requests, ``gap_s`` apart: their wall times (ms), and the CPU the relay's main thread
    spent on them, per request (us; None for the direct path)."""
    walls = []
    cpu0 = main_thread_cpu_us(pid)
    for _ in range(n):
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        answer = client.ask()
        walls.append((time.perf_counter() - t0) * 1000)
        if not answer.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"unexpected answer: {answer[:80]!r}")
    cpu1 = main_thread_cpu_us(pid)
    return walls, (cpu1 - cpu0) / n if cpu0 is not None and cpu1 is not None else None


def measure(requests: int, gaps_ms: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": requests, "batch": BATCH, "gaps": {}}
    with contextlib.ExitStack() as stack:
        unix_socket = str(Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-relays-"))) / "stub.sock")
        stub = stack.enter_context(bare_relay(None, unix_socket=unix_socket))
        ports: dict[str, tuple[int, int | None]] = {"direct": (int(stub.url.rsplit(":", 1)[1]), None)}
        for path in PATHS[1:]:
            layer, _, over = path.partition("-")
            relayed = stack.enter_context(bare_relay(stub.url, layer, unix_socket if over == "unix" else None))
            ports[path] = (int(relayed.url.rsplit(":", 1)[1]), relayed.pid)
        clients = {path: Client(port) for path, (port, _) in ports.items()}
        try:
            for client in clients.values():  # warm-up: connections open, code loaded
                for _ in range(BATCH):
                    client.ask()
            for gap in gaps_ms:
                out["gaps"][str(gap)] = _rounds(clients, ports, requests, gap / 1000)
        finally:
            for client in clients.values():
                client.close()
    return out


def _rounds(clients: dict[str, Client], ports: dict[str, tuple[int, int | None]], requests: int,
            gap_s: float) -> dict[str, Any]:
    walls: dict[str, list[float]] = {path: [] for path in PATHS}
    cpus: dict[str, list[float]] = {path: [] for path in PATHS}
    for i in range(max(1, requests // BATCH)):
        for path in rotated(PATHS, i):
            w, cpu = batch(clients[path], ports[path][1], BATCH, gap_s)
            walls[path] += w
            if cpu is not None:
                cpus[path].append(cpu)
    direct = percentile(walls["direct"], 50)
    return {path: {"wall_ms": summary(walls[path], 3),
                   "added_ms_p50": round(percentile(walls[path], 50) - direct, 3) if path != "direct" else None,
                   "cpu_us_per_request": round(statistics.median(cpus[path]), 1) if cpus[path] else None}
            for path in PATHS}


def rows(res: dict[str, Any]) -> list[list[Any]]:
    table = []
    for gap, paths in res["gaps"].items():
        for path in PATHS:
            r = paths[path]
            table.append([f"{path}, {gap} ms apart", r["wall_ms"]["p50"], r["wall_ms"]["p90"], r["added_ms_p50"],
                          r["cpu_us_per_request"]])
    return table


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench relays", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300, help="requests per path and gap")
    p.add_argument("--gaps", type=float, nargs="+", default=[0.0, 20.0],
                   help="ms waited before each request (one run per value)")
    p.add_argument("--json", default=str(RESULTS_DIR / "relays.json"))
    a = p.parse_args(argv)
    if a.requests < 1 or any(g < 0 for g in a.gaps):
        p.error("--requests must be at least 1 and --gaps at least 0")
    res = {"benchmark": "relays", "machine": machine(), "versions": versions(), **measure(a.requests, a.gaps)}
    print_table("A request through each relay, in front of a stub server (no llama-server)",
                ["path", "wall p50 ms", "wall p90 ms", "added to direct p50 ms", "relay CPU us per request"],
                rows(res))
    print(f"wrote {write_json(a.json, res)}")
    return 0
