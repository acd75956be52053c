"""Redis connection URLs: parsing into a ``RedisTarget`` and redaction for logs.

Accepted forms (``[user:pass@]`` is optional everywhere; percent-encode ``@ : /`` in passwords)::

    redis://[user:pass@]host[:6379][/db]                        one server
    rediss://...                                                the same over TLS
    unix://[user:pass@]/path/to/redis.sock[?db=N]               a Unix socket
    redis+sentinel://[user:pass@]h1:26379,h2:26379/master[/db]  Sentinel (rediss+sentinel: TLS)
    redis+cluster://[user:pass@]h1:6379[,h2:6379]               Redis Cluster (rediss+cluster: TLS)

Query options: ``db`` (unix only), ``ssl_cert_reqs`` (none|optional|required), ``ssl_ca_certs``,
``ssl_certfile``, ``ssl_keyfile``, ``ssl_check_hostname`` (true|false), ``sentinel_password`` (when
the Sentinels use another password than the data nodes). Anything else is a ``ConfigError``, so a
typo is caught at start-up rather than silently ignored.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import parse_qsl, unquote, unquote_plus, urlsplit

from .errors import ConfigError

Mode = Literal["standalone", "sentinel", "cluster", "unix"]

_SCHEMES: dict[str, tuple[Mode, bool, int]] = {
    # scheme: (mode, tls, default port)
    "redis": ("standalone", False, 6379),
    "rediss": ("standalone", True, 6379),
    "unix": ("unix", False, 0),
    "redis+sentinel": ("sentinel", False, 26379),
    "rediss+sentinel": ("sentinel", True, 26379),
    "redis+cluster": ("cluster", False, 6379),
    "rediss+cluster": ("cluster", True, 6379),
}
_TLS_OPTIONS = {"ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname"}
_OPTIONS = {"db", "sentinel_password"} | _TLS_OPTIONS
_HOST_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_SERVICE_RE = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where and how to connect; secrets are kept out of ``repr``."""

    mode: Mode
    hosts: tuple[tuple[str, int], ...] = ()  # server, Sentinels or cluster seed nodes
    unix_path: str | None = None
    db: int = 0
    tls: bool = False
    service_name: str | None = None  # the Sentinel master name
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)
    tls_options: tuple[tuple[str, str], ...] = ()

    def ssl_kwargs(self) -> dict[str, object]:
        """redis-py connection keyword arguments for TLS (empty when TLS is off)."""
        if not self.tls:
            return {}
        kwargs: dict[str, object] = {"ssl": True}
        for k, v in self.tls_options:
            kwargs[k] = v.lower() == "true" if k == "ssl_check_hostname" else v
        return kwargs


def scheme_names() -> list[str]:
    return sorted(_SCHEMES)


def parse_redis_url(url: str) -> RedisTarget:
    """Parse and validate a Redis URL.

    Raises:
        ConfigError: unknown scheme, missing host or master name, bad port or db, unknown option.
            The message quotes the URL with its password redacted.
    """
    parts = _split(url)
    return _TARGET_BUILDERS[parts.mode](parts)


@dataclass(frozen=True, slots=True)
class _UrlParts:
    """The pieces every form of URL has, checked: what is left is for the mode to read."""

    scheme: str  # lower case
    mode: Mode
    tls: bool
    default_port: int
    hostinfo: str  # what follows the userinfo: host[:port][,host[:port]...]
    path: str
    username: str | None
    password: str | None = field(repr=False)
    options: dict[str, str]  # the query, known options only
    shown: str  # the URL as error messages quote it: redacted

    @property
    def tls_options(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((k, v) for k, v in self.options.items() if k in _TLS_OPTIONS))


def _split(url: str) -> _UrlParts:
    """The scheme, credentials, hosts, path and options of ``url``, checked as far as every mode
    shares them."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("redis url must be a non-empty string such as redis://host:6379/0")
    shown = redacted_url(url)
    scheme = _scheme(url, shown)
    mode, tls, default_port = _SCHEMES[scheme]
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ConfigError(f"malformed redis url {shown!r}: {exc}") from None
    if parts.fragment:
        raise ConfigError(f"redis url {shown!r} must not have a #fragment")
    if "@" in url.partition("://")[2].removeprefix(parts.netloc):
        # A password with an unencoded / ? # or @ leaves an '@' behind the host, and pieces of the
        # password would be quoted as a host, port, db or option below.
        raise ConfigError(f"malformed redis url {shown!r}: an '@' after the host; percent-encode "
                          "/ ? # @ in the user name and password (and @ as %40 elsewhere)")
    userinfo, at, hostinfo = parts.netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None  # as redis-py: redis://:secret@host for a password
    options = _checked_options(parts.query, mode, tls, shown)
    return _UrlParts(scheme, mode, tls, default_port, hostinfo, parts.path, username, password, options, shown)


def _scheme(url: str, shown: str) -> str:
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise ConfigError(f"redis url {shown!r} has no scheme; expected one of {', '.join(scheme_names())}")
    scheme = scheme.lower()
    if scheme not in _SCHEMES:
        raise ConfigError(f"unknown redis url scheme {scheme!r} in {shown!r}; expected one of {', '.join(scheme_names())}")
    return scheme


def _checked_options(query: str, mode: Mode, tls: bool, shown: str) -> dict[str, str]:
    """The query's options, refused when unknown or meant for another mode."""
    options = _parse_query(query, shown)
    unknown = set(options) - _OPTIONS
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(sorted(unknown))} in redis url {shown!r}")
    if not tls and set(options) & _TLS_OPTIONS:
        raise ConfigError(f"TLS options given for a non-TLS url {shown!r}; use a rediss:// scheme")
    if options.get("ssl_cert_reqs", "required").lower() not in ("none", "optional", "required"):
        raise ConfigError(f"ssl_cert_reqs must be none, optional or required in {shown!r}")
    if "sentinel_password" in options and mode != "sentinel":
        raise ConfigError(f"sentinel_password only applies to redis+sentinel urls, not {shown!r}")
    return options


def _unix_target(p: _UrlParts) -> RedisTarget:
    if p.hostinfo:
        raise ConfigError(f"unix url {p.shown!r} must not name a host; write unix:///path/to/redis.sock")
    if not p.path or p.path == "/":
        raise ConfigError(f"unix url {p.shown!r} has no socket path")
    db = _parse_db(p.options.get("db", "0"), p.shown)
    return RedisTarget("unix", unix_path=unquote(p.path), db=db, username=p.username, password=p.password)


def _hosts_and_path(p: _UrlParts) -> tuple[tuple[tuple[str, int], ...], list[str]]:
    """A network URL's hosts, and its path's segments (the db, or the master name and db)."""
    if "db" in p.options:
        raise ConfigError(f"put the db in the path (redis://host/1), not in the query, in {p.shown!r}")
    hosts = _parse_hosts(p.hostinfo, p.default_port, p.shown)
    return hosts, [s for s in p.path.split("/") if s] if p.path else []


def _standalone_target(p: _UrlParts) -> RedisTarget:
    hosts, segments = _hosts_and_path(p)
    if len(hosts) != 1:
        raise ConfigError(f"{p.scheme}:// takes one host, got {len(hosts)} in {p.shown!r}; "
                          "use redis+cluster:// or redis+sentinel:// for several")
    if len(segments) > 1:
        raise ConfigError(f"unexpected path in redis url {p.shown!r}; expected /db")
    db = _parse_db(segments[0], p.shown) if segments else 0
    return RedisTarget("standalone", hosts, db=db, tls=p.tls, username=p.username, password=p.password,
                       tls_options=p.tls_options)


def _sentinel_target(p: _UrlParts) -> RedisTarget:
    hosts, segments = _hosts_and_path(p)
    if not segments:
        raise ConfigError(f"sentinel url {p.shown!r} lacks the master name: redis+sentinel://h1:26379/mymaster")
    if len(segments) > 2:
        raise ConfigError(f"unexpected path in sentinel url {p.shown!r}; expected /master[/db]")
    service = unquote(segments[0])
    if not _SERVICE_RE.match(service):
        raise ConfigError(f"bad sentinel master name {service!r} in {p.shown!r}")
    db = _parse_db(segments[1], p.shown) if len(segments) == 2 else 0
    return RedisTarget("sentinel", hosts, db=db, tls=p.tls, service_name=service, username=p.username,
                       password=p.password, sentinel_password=p.options.get("sentinel_password"),
                       tls_options=p.tls_options)


def _cluster_target(p: _UrlParts) -> RedisTarget:
    hosts, segments = _hosts_and_path(p)
    if segments and segments != ["0"]:
        raise ConfigError(f"Redis Cluster has only db 0; unexpected path in {p.shown!r}")
    return RedisTarget("cluster", hosts, tls=p.tls, username=p.username, password=p.password,
                       tls_options=p.tls_options)


_TARGET_BUILDERS: dict[Mode, Callable[[_UrlParts], RedisTarget]] = {
    "standalone": _standalone_target,
    "sentinel": _sentinel_target,
    "cluster": _cluster_target,
    "unix": _unix_target,
}


def _parse_query(query: str, shown: str) -> dict[str, str]:
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ConfigError(f"malformed query string in redis url {shown!r}") from None
    options: dict[str, str] = {}
    for k, v in pairs:
        if k in options:
            raise ConfigError(f"option {k!r} given twice in redis url {shown!r}")
        options[k] = v
    return options


def _parse_db(text: str, shown: str) -> int:
    if not text.isdigit() or int(text) > 10_000:
        raise ConfigError(f"bad db number {text!r} in redis url {shown!r}")
    return int(text)


def _parse_hosts(hostinfo: str, default_port: int, shown: str) -> tuple[tuple[str, int], ...]:
    if not hostinfo:
        raise ConfigError(f"redis url {shown!r} has no host")
    hosts: list[tuple[str, int]] = []
    for item in hostinfo.split(","):
        if not item:
            raise ConfigError(f"empty host in redis url {shown!r}")
        if item.startswith("["):  # [IPv6]:port
            host, bracket, port_text = item[1:].partition("]")
            if not bracket or (port_text and not port_text.startswith(":")):
                raise ConfigError(f"malformed IPv6 host {item!r} in redis url {shown!r}")
            port_text = port_text[1:]
        else:
            host, _, port_text = item.partition(":")
            if not _HOST_RE.match(host):
                raise ConfigError(f"malformed host {host!r} in redis url {shown!r}")
        if port_text:
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise ConfigError(f"bad port {port_text!r} in redis url {shown!r}")
            port = int(port_text)
        else:
            port = default_port
        hosts.append((host, port))
    return tuple(hosts)


# Query parameters whose values are hidden in logs: password, sentinel_password, passwd, token, ...
_SECRET_PARAM_RE = re.compile(r"pass|pwd|secret|token|auth", re.IGNORECASE)
_PARAM_RE = re.compile(r"(?P<sep>^|[?&;])(?P<name>[^?&;=#]*)=(?P<value>[^&;#]*)")


def redacted_url(url: str) -> str:
    """The URL with every secret replaced by ``***``; safe to log.

    Hidden: the password of the userinfo (``redis://user:***@host``) and the value of every query
    parameter named like a secret (``password``, ``sentinel_password``, ``token``, ...; names are
    compared percent-decoded). A malformed URL is redacted too, erring towards hiding more: the
    userinfo ends at the URL's last ``@``, so a password holding an unencoded ``/ ? # @`` stays
    hidden, and a fragment is hidden whole.
    """
    if not isinstance(url, str):
        return "<not a url>"
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    userinfo, at, rest = rest.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        # A user that holds a URL delimiter is part of a malformed URL: hidden with the rest.
        userinfo = f"{user}:***@" if colon and not any(c in user for c in "/?#") else "***@"
    rest, hash_, fragment = rest.partition("#")
    # Parameters are found by their separators anywhere after the userinfo, not only after a '?':
    # the userinfo may have taken that '?' when a query value held an '@'.
    rest = _PARAM_RE.sub(_hidden_param, rest)
    return f"{scheme}{sep}{userinfo}{rest}{hash_}{'***' if fragment else ''}"


def _hidden_param(match: re.Match[str]) -> str:
    if match["value"] and _SECRET_PARAM_RE.search(unquote_plus(match["name"])):
        return f"{match['sep']}{match['name']}=***"
    return match[0]
