"""Logging of ``kvtier serve``: text or JSON lines, each stamped with the request it was logged for."""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
from typing import TextIO

from aiohttp.http_exceptions import HttpProcessingError

# Set by the front middleware for the length of a request; tasks the request starts inherit it.
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


class RequestIdFilter(logging.Filter):
    """Adds the current request id (empty outside a request) to every record it sees.

    Installed on the handler, not a logger: a logger's filters see only the records logged on that
    very logger, a handler's see those of every logger below the root.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class MalformedRequestFilter(logging.Filter):
    """Turns aiohttp's report of a request it could not parse into one INFO line.

    aiohttp answers a bad request line, bad headers or bad chunked framing with 400 itself and
    logs it as an ERROR with the parser's traceback: noise any client can write into the log at
    will, and nothing in kvtier to fix. Installed on the logger given to aiohttp's request
    handler (``app.SERVER_OPTIONS``), which also reports real errors: those keep their level and
    traceback.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.levelno, record.levelname = logging.INFO, "INFO"  # the client's mistake, not kvtier's
            record.msg, record.args = "malformed HTTP request from %s answered %s: %s", (
                (record.args or ("?",))[0] if isinstance(record.args, tuple) else "?", exc.code,
                _one_line(exc.message))
            record.exc_info = record.exc_text = None
        return True


def _one_line(message: str) -> str:
    # aiohttp's parser messages quote the offending bytes over several lines (a caret under them).
    return " ".join(message.split())[:200]


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts``, ``level``, ``logger``, ``msg``, and ``request_id``, ``exc`` when set."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        rid = getattr(record, "request_id", "")
        if rid:
            out["request_id"] = rid
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(fmt: str = "text", level: str | None = None, stream: TextIO | None = None) -> logging.Handler:
    """Send every log record to ``stream`` (stderr) as ``text`` or ``json``; returns the handler.

    The level is ``level``, else ``KVTIER_LOG_LEVEL``, else INFO.
    """
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level or os.environ.get("KVTIER_LOG_LEVEL", "INFO"))
    return handler
