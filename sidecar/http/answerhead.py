"""The head of llama-server's answer, read by ``Upstream``: its status line, its headers, and how its
body is framed (RFC 9112: ``Content-Length``, chunked, or until the connection closes).

A head that is not valid HTTP/1.x (a status line of another protocol, a folded or nameless header,
two different lengths, a length past 15 digits) is an ``UpstreamError``, never a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from multidict import CIMultiDict

MAX_HEAD = 64 * 1024  # status line and headers
MAX_HEADERS = 128
STATUS_RE = re.compile(rb"HTTP/1\.([01]) (\d{3})(?: (.*))?")
TOKEN_RE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


class UpstreamError(Exception):
    """llama-server's answer could not be read: connection lost, or not valid HTTP/1.1."""


@dataclass
class Head:
    """An answer's head. ``framing``: ``"none"`` (no body: a HEAD, a 204, a 304, ``Content-Length: 0``),
    ``"length"`` (``length`` bytes), ``"chunked"``, or ``"close"`` (until the connection closes)."""

    status: int
    reason: str
    headers: CIMultiDict[str]
    keep_alive: bool
    framing: str
    length: int | None = None


def parse_head(head: bytes, *, head_only: bool) -> Head | None:
    """The head ``head`` (without its blank line) of the answer to a request (``head_only``: a HEAD);
    None for an interim (1xx) answer, which the real one follows."""
    lines = head.split(b"\r\n")
    match = STATUS_RE.fullmatch(lines[0])
    if match is None:
        raise UpstreamError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    if len(lines) - 1 > MAX_HEADERS:
        raise UpstreamError("too many headers in the answer")
    status = int(match.group(2))
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not TOKEN_RE.fullmatch(name):
            raise UpstreamError(f"bad header line {line[:80]!r}")
        headers.add(name.decode("ascii"), value.strip(b" \t").decode("utf-8", "surrogateescape"))
    if 100 <= status < 200:
        if status == 101:
            raise UpstreamError("llama-server switched protocols")
        return None
    reason = (match.group(3) or b"").decode("latin-1")
    connection = {t.strip().lower() for v in headers.getall("Connection", []) for t in v.split(",")}
    keep_alive = match.group(1) == b"1" and "close" not in connection
    if head_only or status in (204, 304):
        return Head(status, reason, headers, keep_alive, "none", 0)
    if "Transfer-Encoding" in headers:
        codings = [t.strip().lower() for v in headers.getall("Transfer-Encoding") for t in v.split(",")]
        if codings[-1] == "chunked":
            return Head(status, reason, headers, keep_alive, "chunked")
        return Head(status, reason, headers, False, "close")
    lengths = {v.strip() for v in headers.getall("Content-Length", [])}
    if not lengths:
        return Head(status, reason, headers, False, "close")
    length = lengths.pop()
    if lengths or not length.isdigit() or not length.isascii() or len(length) > 15:
        raise UpstreamError("bad Content-Length in the answer")
    return Head(status, reason, headers, keep_alive, "length" if int(length) else "none", int(length))
