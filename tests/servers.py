"""Real servers for tests: Valkey/Redis and llama-server on free loopback ports.

Tests start what they need and stop it; they never touch a server that happens to listen on 6379.
A server that cannot be started fails the test loudly: nothing here skips. The processes are the
ones the demo and the benchmarks start (``launch``); this module adds the tests' defaults and keeps
the names the tests use (``RedisProc``, ``redis_server``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from launch import LlamaServer, free_port, gemma3_path, smollm2_path, wait_port
from launch import ValkeyServer as RedisProc
from launch import valkey_binary as redis_server_binary
from launch import valkey_server as redis_server

__all__ = ["DEFAULT_LLAMA_ARGS", "LlamaServer", "RedisProc", "free_port", "gemma3_path", "llama_server",
           "redis_server", "redis_server_binary", "smollm2_path", "wait_port"]

# Small contexts and 2 threads keep tests fast on 2 cores; callers add what they test.
DEFAULT_LLAMA_ARGS: tuple[str, ...] = ("-c", "4096", "-np", "1", "-t", "2", "-b", "512", "-ub", "512",
                                       "--cache-ram", "0")


@contextlib.contextmanager
def llama_server(tmp: Path, *args: str, model: str | None = None,
                 defaults: Sequence[str] = DEFAULT_LLAMA_ARGS) -> Iterator[LlamaServer]:
    """A llama-server with the tests' defaults and ``args``, its slot dir under ``tmp``; stopped on exit."""
    srv = LlamaServer(model or smollm2_path(), [*defaults, *args], tmp / f"slots-{free_port()}")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
