"""Redis clients built from one options object: ``ClientOptions`` holds the URL's target and the
socket, retry and pool settings, checked once; one factory per mode (one server, a Unix socket,
Sentinel, Cluster) builds the redis-py asyncio client from it.

``RedisConnection`` puts its breaker in front of what these build; nothing here sends a command.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialWithJitterBackoff

from .errors import ConfigError
from .redis_urls import Mode, RedisTarget, parse_redis_url

# Defaults, with units. Timeouts bound every socket operation; the worst case of one call is about
# (retries + 1) * timeout + backoff, after which the breaker takes over.
DEFAULT_SOCKET_TIMEOUT = 2.0  # s, one read or write on an open connection
DEFAULT_CONNECT_TIMEOUT = 1.0  # s, TCP/TLS connect
DEFAULT_RETRIES = 2  # retries after the first attempt, connection errors and timeouts only
DEFAULT_BACKOFF_BASE = 0.02  # s, first retry delay (exponential with full jitter)
DEFAULT_BACKOFF_CAP = 0.5  # s, longest retry delay
DEFAULT_MAX_CONNECTIONS = 64  # per server (per node in cluster mode)
DEFAULT_READ_SIZE = 1 << 20  # bytes per socket read: large blobs parse in far fewer hiredis calls

RedisClient = aioredis.Redis | RedisCluster


def positive_seconds(name: str, value: object, *, allow_none: bool = False) -> float | None:
    """``value`` as positive seconds (None passes when ``allow_none``).

    Raises:
        ConfigError: not a finite positive number.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"redis {name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _seconds(name: str, value: object) -> float:
    seconds = positive_seconds(name, value)
    assert seconds is not None
    return seconds


def _count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"redis {name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How to reach one Redis deployment and how its client behaves; secrets are kept out of ``repr``.

    Build it with ``from_url``, which checks every setting.
    """

    target: RedisTarget
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    socket_timeout: float = DEFAULT_SOCKET_TIMEOUT
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    retries: int = DEFAULT_RETRIES
    backoff_base: float = DEFAULT_BACKOFF_BASE
    backoff_cap: float = DEFAULT_BACKOFF_CAP
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    socket_read_size: int = DEFAULT_READ_SIZE

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        username: str | None = None,
        password: str | None = None,
        socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        backoff_base: float = DEFAULT_BACKOFF_BASE,
        backoff_cap: float = DEFAULT_BACKOFF_CAP,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        socket_read_size: int = DEFAULT_READ_SIZE,
    ) -> ClientOptions:
        """The options of ``url`` (see ``tiers.redis_urls``); credentials given here override the URL's.

        Raises:
            ConfigError: a bad URL or setting.
        """
        target = parse_redis_url(url)
        timeout, connect = _seconds("socket_timeout", socket_timeout), _seconds("connect_timeout", connect_timeout)
        base, cap = _seconds("backoff_base", backoff_base), _seconds("backoff_cap", backoff_cap)
        if cap < base:
            raise ConfigError("redis backoff_cap must be >= backoff_base")
        return cls(
            target,
            username if username is not None else target.username,
            password if password is not None else target.password,
            timeout, connect, _count("retries", retries, 0), base, cap,
            _count("max_connections", max_connections, 1), _count("socket_read_size", socket_read_size, 4096),
        )

    def connection_kwargs(self) -> dict[str, Any]:
        """redis-py keyword arguments for a connection to a data node (not to a Sentinel)."""
        return dict(
            username=self.username, password=self.password, socket_timeout=self.socket_timeout,
            socket_connect_timeout=self.connect_timeout,
            retry=Retry(ExponentialWithJitterBackoff(cap=self.backoff_cap, base=self.backoff_base), self.retries),
            socket_read_size=self.socket_read_size, **self.target.ssl_kwargs(),
        )


@dataclass(frozen=True, slots=True)
class Clients:
    """What a factory built: the client every call goes through, the keyword arguments of its
    connections (a subscriber's client of one cluster node is built with the same), and the
    Sentinel manager whose connections close with it."""

    client: RedisClient
    connection_kwargs: dict[str, Any]
    sentinel: Sentinel | None = None


def build_clients(options: ClientOptions) -> Clients:
    """The client of ``options.target``'s mode. Nothing is sent: redis-py connects on first use."""
    return _FACTORIES[options.target.mode](options)


def _standalone(o: ClientOptions) -> Clients:
    kwargs = o.connection_kwargs()
    host, port = o.target.hosts[0]
    return Clients(aioredis.Redis(host=host, port=port, db=o.target.db, max_connections=o.max_connections,
                                  **kwargs), kwargs)


def _unix(o: ClientOptions) -> Clients:
    kwargs = {k: v for k, v in o.connection_kwargs().items() if not k.startswith("ssl")}
    return Clients(aioredis.Redis(unix_socket_path=o.target.unix_path, db=o.target.db,
                                  max_connections=o.max_connections, **kwargs), kwargs)


def _sentinel(o: ClientOptions) -> Clients:
    t, kwargs = o.target, o.connection_kwargs()
    # Sentinels get no credentials unless sentinel_password is given (redis-py's convention:
    # Sentinels often run without auth, and AUTH against one without a password fails).
    sentinel_kwargs: dict[str, Any] = dict(socket_timeout=o.socket_timeout, socket_connect_timeout=o.connect_timeout,
                                           **t.ssl_kwargs())
    if t.sentinel_password is not None:
        sentinel_kwargs.update(username=o.username, password=t.sentinel_password)
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]  # unannotated before redis-py 8.2
        list(t.hosts), sentinel_kwargs=sentinel_kwargs, **kwargs)
    assert t.service_name is not None
    return Clients(sentinel.master_for(t.service_name, db=t.db, max_connections=o.max_connections), kwargs, sentinel)


def _cluster(o: ClientOptions) -> Clients:
    kwargs = o.connection_kwargs()
    nodes = [ClusterNode(h, p) for h, p in o.target.hosts]
    return Clients(RedisCluster(startup_nodes=nodes, max_connections=o.max_connections, **kwargs), kwargs)


_FACTORIES: dict[Mode, Callable[[ClientOptions], Clients]] = {
    "standalone": _standalone,
    "unix": _unix,
    "sentinel": _sentinel,
    "cluster": _cluster,
}
