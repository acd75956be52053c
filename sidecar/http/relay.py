"""The one relay loop: an answer streamed back to the client as it arrives.

Used for llama-server's answers (through ``Upstream``) and for a peer's (through aiohttp's client,
wrapped as ``PeerAnswer``). SSE is never buffered. A client that goes away closes the answer's
connection, which makes the server behind it stop generating; an answer cut short by that server
closes the client's connection too (a clean end would pass a truncated answer off as whole).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, MultiMapping

from integrations.llama_server import stream_finished

from ..logs import request_id
from .headers import REQUEST_ID, end_to_end

TAIL_BYTES = 64 * 1024  # enough of a stream's end to find its final timings
MAX_CAPTURE = 16 << 20  # non-streaming answers are parsed for timings up to this size
_NO_HEADERS: Mapping[str, str] = {}


class Answer(Protocol):
    """An answer whose head is in and whose body is still to read."""

    @property
    def status(self) -> int: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def headers(self) -> MultiMapping[str]: ...
    @property
    def content_length(self) -> int | None: ...
    def iter_any(self) -> AsyncIterator[bytes]: ...
    def close(self) -> None: ...  # drop the connection: the server stops generating
    def release(self) -> None: ...  # done with it: the connection is kept only after a whole answer


class PeerAnswer:
    """A peer's answer (aiohttp's client) as an ``Answer``."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.status = response.status
        self.reason = response.reason
        self.headers: MultiMapping[str] = response.headers
        self.content_length = response.content_length

    def iter_any(self) -> AsyncIterator[bytes]:
        return self.response.content.iter_any()

    def close(self) -> None:
        self.response.close()

    def release(self) -> None:
        self.response.release()


@dataclass(slots=True)
class Relay:
    """What a relay got from upstream; readable even when the client went away mid-answer."""

    status: int = 0
    upstream_complete: bool = False  # the server sent its whole answer
    stream: bool = False
    client_left: bool = False  # the client went away while the server answered
    tail: bytearray = field(default_factory=bytearray)

    @property
    def ok(self) -> bool:
        """llama-server finished the answer: it sent it whole, or (a client that left at once, as
        the OpenAI client does after ``data: [DONE]``) its last event reached kvtier."""
        finished = self.upstream_complete or (self.stream and stream_finished(bytes(self.tail)))
        return finished and 200 <= self.status < 300


def is_event_stream(headers: MultiMapping[str]) -> bool:
    return headers.get("Content-Type", "").startswith("text/event-stream")


async def relay(request: web.Request, answer: Answer, out: Relay, *, headers: Mapping[str, str] = _NO_HEADERS,
                capture: bool = False, whole_max: int | None = None, keep_length: bool = False) -> web.StreamResponse:
    """Relay ``answer`` to the client of ``request``, recording the outcome in ``out``.

    Args:
        headers: added to the answer's own (its hop-by-hop ones left out).
        capture: keep the answer in ``out.tail`` (its last ``TAIL_BYTES`` for a stream).
        whole_max: an answer of known length up to this many bytes, not a stream, is read whole
            and sent in one write with its ``Content-Length`` (None: always streamed).
        keep_length: a streamed answer of known length keeps its ``Content-Length`` (else chunked).

    Raises:
        asyncio.CancelledError: the client went away (``out.client_left``; the answer's
            connection is closed).
        Whatever reading ``answer`` raised when it broke off (its connection is closed).
    """
    out.status = answer.status
    try:
        length = answer.content_length
        if whole_max is not None and length is not None and length <= whole_max \
                and not is_event_stream(answer.headers):
            return await _whole(answer, out, headers, capture)
        response = web.StreamResponse(status=answer.status, reason=answer.reason)
        response.headers.extend(end_to_end(answer.headers.items()))
        response.headers.update(headers)
        if keep_length and length is not None:
            response.content_length = length
        if request_id.get():  # prepared here, so the middleware cannot add it
            response.headers[REQUEST_ID] = request_id.get()
        await response.prepare(request)
        await _stream(answer, response, out, capture)
    except (ConnectionResetError, asyncio.CancelledError) as exc:
        # The client went away: closing the answer's connection makes the server stop generating.
        out.client_left = True
        answer.close()
        if isinstance(exc, asyncio.CancelledError):
            raise
        raise asyncio.CancelledError from None  # nothing to answer: no error, no traceback
    except BaseException:
        answer.close()  # cut short by the server (or kvtier failed): never kept for another request
        raise
    finally:
        answer.release()
    return response


async def _whole(answer: Answer, out: Relay, headers: Mapping[str, str], capture: bool) -> web.Response:
    # A whole answer of known size (llama-server computes it before sending): relayed in one write
    # with its Content-Length rather than in chunks.
    body = b"".join([piece async for piece in answer.iter_any()])
    out.upstream_complete = True
    if capture:
        out.tail += body
    whole = web.Response(status=answer.status, reason=answer.reason, body=body,
                         headers=CIMultiDict(end_to_end(answer.headers.items())))
    whole.headers.update(headers)
    # Sent by aiohttp once the handler returns: after the caller has registered the slot save
    # (which itself waits ``save_pause``), so that a client that has its answer never sees the
    # sidecar idle while that save is still to come.
    return whole


async def _stream(answer: Answer, response: web.StreamResponse, out: Relay, capture: bool) -> None:
    out.stream = is_event_stream(answer.headers)
    limit = TAIL_BYTES if out.stream else MAX_CAPTURE
    async for piece in answer.iter_any():
        if capture:  # before the write: a client gone by then does not hide what the server sent
            out.tail += piece
            if len(out.tail) > limit:
                del out.tail[: len(out.tail) - TAIL_BYTES]
        await response.write(piece)
    out.upstream_complete = True
    await response.write_eof()
