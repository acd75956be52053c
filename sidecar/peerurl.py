"""Advertise URLs: what a URL peers reach a sidecar at may be, and the forward URL built from one.

A peer's URL comes from the fleet view in Redis, so it is checked where it is read, not only
where it is configured: scheme http or https, a host (a name, an IPv4 address or a bracketed IPv6
one), a port (explicit, else the scheme's), and nothing else: no user info, path, query or
fragment. The URL a request is forwarded to is then built from those parts and the request's
own path, never by joining strings: ``"http://host" + "@evil/..."`` cannot move the host.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

_DEFAULT_PORTS = {"http": 80, "https": 443}
_HOSTNAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}))*\.?")
MAX_URL_CHARS = 300  # an advertise URL is a scheme, a host and a port


@dataclass(frozen=True, slots=True)
class PeerUrl:
    """An advertise URL's parts, checked."""

    scheme: str  # http or https
    host: str  # a DNS name or an IP address (IPv6 without brackets)
    port: int

    def forward_url(self, raw_path: str) -> str:
        """The URL of ``raw_path`` (a request's path and query, as received) at this peer."""
        if not raw_path.startswith("/"):
            raise ValueError(f"not an absolute path: {raw_path!r}")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{raw_path}"


def parse_peer_url(url: str) -> PeerUrl:
    """The parts of an advertise URL.

    Raises:
        ValueError: what is wrong with it.
    """
    if len(url) > MAX_URL_CHARS or not url.isascii() or not url.isprintable() or " " in url:
        raise ValueError("expected a short URL of printable ASCII characters")
    parts = urlsplit(url)
    if parts.scheme not in _DEFAULT_PORTS:
        raise ValueError("the scheme must be http or https")
    if "@" in parts.netloc:
        raise ValueError("user info (user@) is not allowed")
    if parts.path not in ("", "/") or parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ValueError("a path, query or fragment is not allowed")
    host = parts.hostname or ""
    if parts.netloc.startswith("["):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"not an IPv6 address: {host!r}") from None
    elif not _HOSTNAME.fullmatch(host):
        raise ValueError("a host name or an IP address is required")
    try:
        port = parts.port
    except ValueError:
        raise ValueError("the port must be a number in 1..65535") from None
    if parts.netloc.endswith(":") or port == 0:
        raise ValueError("the port must be a number in 1..65535")
    return PeerUrl(parts.scheme, host, port if port is not None else _DEFAULT_PORTS[parts.scheme])


def peer_url_or_none(url: str) -> PeerUrl | None:
    """``parse_peer_url``, None for a URL it refuses (a hint read from Redis: never raises)."""
    try:
        return parse_peer_url(url)
    except ValueError:
        return None
