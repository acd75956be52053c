"""Real servers for tests: Valkey/Redis and llama-server on free loopback ports.

Tests start what they need and stop it; they never touch a server that happens to listen on 6379.
A server that cannot be started fails the test loudly: nothing here skips.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sidecar.procs import free_port, llama_server_binary, smollm2_path
from sidecar.procs import valkey_binary as redis_server_binary


def wait_port(port: int, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


# -- Redis / Valkey -------------------------------------------------------------------------------


@dataclass
class RedisProc:
    port: int
    dir: Path
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--save", "", "--appendonly", "no", *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_port(self.port, 15, self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@contextlib.contextmanager
def redis_server(*extra_args: str) -> Iterator[RedisProc]:
    with tempfile.TemporaryDirectory(prefix="kvtier-redis-") as d:
        srv = RedisProc(free_port(), Path(d), list(extra_args))
        srv.start()
        try:
            yield srv
        finally:
            srv.stop()


# -- llama-server ---------------------------------------------------------------------------------


@dataclass
class LlamaServer:
    model: str
    args: list[str]
    slot_dir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> None:
        self.slot_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.slot_dir.parent / f"llama-server-{self.port}.log"
        log = open(self.log_path, "ab")
        cmd = [llama_server_binary(), "-m", self.model, "--host", "127.0.0.1", "--port", str(self.port),
               "--slot-save-path", str(self.slot_dir) + "/", "--no-webui", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"llama-server not healthy after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


# Small contexts and 2 threads keep tests fast on 2 cores; callers add what they test.
DEFAULT_LLAMA_ARGS: tuple[str, ...] = ("-c", "4096", "-np", "1", "-t", "2", "-b", "512", "-ub", "512",
                                       "--cache-ram", "0")


@contextlib.contextmanager
def llama_server(tmp: Path, *args: str, model: str | None = None,
                 defaults: Sequence[str] = DEFAULT_LLAMA_ARGS) -> Iterator[LlamaServer]:
    srv = LlamaServer(model or smollm2_path(), [*defaults, *args], tmp / f"slots-{free_port()}")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
