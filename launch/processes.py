"""The processes: started, waited for until they serve, stopped in order.

Every server listens on a free loopback port: nothing here touches a server that happens to listen
on 6379 or 8080. A process that exits, or is not ready in time, raises with the tail of its log
(and is stopped): nothing here skips.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from launch.binaries import free_port, llama_server_binary, valkey_binary

POLL_S = 0.05  # between readiness checks
LOG_TAIL_CHARS = 2000  # of a failed process's log, in the exception


def http_ok(url: str) -> Callable[[], bool]:
    """A readiness check: ``url`` answers 200."""

    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    return check


def http_ok_on(unix_socket: Path, target: str) -> Callable[[], bool]:
    """A readiness check: ``GET target`` answers 200 on the Unix socket at ``unix_socket``."""

    def check() -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(1)
                sock.connect(str(unix_socket))
                sock.sendall(b"GET %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n" % target.encode())
                return sock.recv(64).startswith(b"HTTP/1.1 200")
        except OSError:
            return False

    return check


def accepts(port: int) -> Callable[[], bool]:
    """A readiness check: something accepts TCP connections on 127.0.0.1:``port``."""

    def check() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            return False

    return check


def wait_ready(ready: Callable[[], bool], timeout: float, what: str,
               proc: subprocess.Popen[bytes] | None = None, log: Path | None = None) -> None:
    """Poll ``ready()`` until it holds; raise if ``proc`` exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}{_tail(log)}")
        if ready():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:.0f} s{_tail(log)}")
        time.sleep(POLL_S)


def wait_port(port: int, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Wait until 127.0.0.1:``port`` accepts connections; raise if ``proc`` exits first."""
    wait_ready(accepts(port), timeout, f"the process for port {port}", proc)


def _tail(log: Path | None) -> str:
    if log is None or not log.exists():
        return ""
    return "\n" + log.read_text(errors="replace")[-LOG_TAIL_CHARS:]


@dataclass
class Proc:
    """A child process, its output appended to ``log`` (discarded without one).

    It stays in the parent's session. In a session of its own (to keep a terminal's Ctrl-C from
    it), a llama-server answering two slots at once stalled mid-prompt for minutes on these 2-core
    VMs while the same server in the parent's session answered in 9 s (likely the kernel's
    per-session scheduling groups against ggml's spinning worker threads).
    """

    name: str
    cmd: list[str]
    log: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self, ready: Callable[[], bool], timeout: float) -> None:
        """Start and wait until ``ready()``; a process that exits or times out first raises (stopped)."""
        with contextlib.ExitStack() as stack:
            out = stack.enter_context(open(self.log, "ab")) if self.log is not None else subprocess.DEVNULL
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(ready, timeout, self.name, self.proc, self.log)
        except BaseException:
            self.stop(grace=0)
            raise

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds (at once with ``grace=0``)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        if grace > 0:
            proc.terminate()
            try:
                proc.wait(grace)
                return
            except subprocess.TimeoutExpired:
                pass
        proc.kill()
        proc.wait(10)


@dataclass
class ValkeyServer:
    """A Valkey (or Redis) server on loopback, without persistence.

    ``stop`` kills it: it holds nothing worth a clean shutdown, and a test of an outage wants it
    gone at once.
    """

    port: int
    dir: Path
    args: list[str] = field(default_factory=list)
    process: Proc | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> None:
        self.process = Proc(f"valkey-server :{self.port}", [
            valkey_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
            "--save", "", "--appendonly", "no", *self.args])
        self.process.start(accepts(self.port), timeout)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(grace=0)
        self.process = None

    def restart(self) -> None:
        """The same port, empty."""
        self.stop()
        self.start()


@contextlib.contextmanager
def valkey_server(*args: str) -> Iterator[ValkeyServer]:
    """A Valkey on a free port in a temporary directory, with extra ``args``; stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="kvtier-valkey-") as d:
        srv = ValkeyServer(free_port(), Path(d), list(args))
        srv.start()
        try:
            yield srv
        finally:
            srv.stop()


@contextlib.contextmanager
def valkey() -> Iterator[str]:
    """An embedded Valkey for the demo and the benchmarks; yields its URL."""
    with valkey_server() as srv:
        yield srv.url


@dataclass
class LlamaServer:
    """llama-server on loopback, saving slots to ``slot_dir``; its log beside ``slot_dir`` unless given."""

    model: str
    args: list[str]
    slot_dir: Path
    port: int = field(default_factory=free_port)
    name: str = "llama-server"
    log: Path | None = None
    process: Proc | None = None
    unix_socket: Path | None = None  # listen there only (``--host PATH.sock``), not on ``port``

    @property
    def url(self) -> str:
        """Its URL on loopback; with ``unix_socket``, the one a client names (Host) but connects elsewhere."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> None:
        self.slot_dir.mkdir(parents=True, exist_ok=True)
        log = self.log or self.slot_dir.parent / f"llama-server-{self.port}.log"
        where = ["--host", str(self.unix_socket)] if self.unix_socket is not None \
            else ["--host", "127.0.0.1", "--port", str(self.port)]
        self.process = Proc(self.name, [
            llama_server_binary(), "-m", self.model, *where,
            "--slot-save-path", f"{self.slot_dir}/", "--no-webui", *self.args], log)
        ready = http_ok_on(self.unix_socket, "/health") if self.unix_socket is not None else http_ok(self.url + "/health")
        self.process.start(ready, timeout)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


@dataclass
class Node:
    """One llama-server and, optionally, its ``kvtier serve`` sidecar (one Pod), logs under ``root``."""

    name: str
    root: Path
    model: str
    llama_args: list[str]
    redis_url: str | None
    chunk_tokens: int
    llama_port: int = field(default_factory=free_port)
    sidecar_port: int = field(default_factory=free_port)
    sidecar: Proc | None = None
    extra_sidecar_args: list[str] = field(default_factory=list)
    advertise: bool = False  # the sidecar publishes its URL in the fleet view (--advertise-url)
    llama: LlamaServer = field(init=False)

    def __post_init__(self) -> None:
        self.llama = LlamaServer(self.model, self.llama_args, self.slot_dir, self.llama_port,
                                 f"llama-server {self.name}", self.root / f"{self.name}-llama.log")

    @property
    def slot_dir(self) -> Path:
        return self.root / f"{self.name}-slots"

    @property
    def llama_url(self) -> str:
        return self.llama.url

    @property
    def sidecar_url(self) -> str:
        return f"http://127.0.0.1:{self.sidecar_port}"

    def start(self, with_sidecar: bool) -> None:
        self.llama.start()
        if with_sidecar:
            # This interpreter's kvtier, so a checkout runs its own code.
            cmd = [sys.executable, "-m", "sidecar.cli", "serve", "--listen", f"127.0.0.1:{self.sidecar_port}",
                   "--llama-url", self.llama_url, "--slot-dir", str(self.slot_dir), "--node-id", self.name,
                   "--chunk-tokens", str(self.chunk_tokens), *self.extra_sidecar_args]
            if self.redis_url:
                cmd += ["--redis-url", self.redis_url]
            if self.advertise:
                cmd += ["--advertise-url", self.sidecar_url]
            self.sidecar = Proc(f"kvtier {self.name}", cmd, self.root / f"{self.name}-kvtier.log")
            self.sidecar.start(http_ok(self.sidecar_url + "/readyz"), 60)

    def stop(self) -> None:
        """The sidecar first (its last saves need llama-server), then llama-server."""
        if self.sidecar is not None:
            self.sidecar.stop()
        self.sidecar = None
        self.llama.stop()

    def restart(self, with_sidecar: bool) -> None:
        self.stop()
        self.start(with_sidecar)
