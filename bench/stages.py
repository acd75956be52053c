"""Where a sidecar's time goes in one completion: timestamps at the request path's stages.

``python -m bench overhead --stages`` starts its sidecar with this hook (a ``sitecustomize`` on
``PYTHONPATH``, see ``hook_env``): it wraps the stage functions of ``sidecar/completion.py``,
``Upstream``'s connection and aiohttp's request handler, and appends one JSON line per completion
to a file: milliseconds since the request's bytes reached the sidecar, per stamp. Each wrapper
costs a few microseconds, so a run with the hook measures the stages, not the overhead itself.

Stamps (a follow-up has no ``prompt`` or ``prepare``): ``handler`` (aiohttp handed the request
over), ``parse``, ``follow_up``, ``prompt``, ``prepare``, ``sent`` (the request written to
llama-server), ``head`` (llama-server's first bytes back), ``read`` (those bytes parsed by
``Upstream``), ``body`` (the answer's last bytes parsed: ``read`` when it came in one piece; the
time between the two is llama-server's, which a client straight to it waits for too), ``answer``
(relayed into a response), ``save`` (handed to the aftercare), ``written`` (aiohttp wrote the answer).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HOOK_ENV = "KVTIER_BENCH_STAGES"  # the file the hook appends to
STAGES = [  # (label, from stamp, to stamp); "in" is the request's bytes reaching the sidecar
    ("aiohttp: bytes in -> handler", "in", "handler"),
    ("parse (body, shape, JSON, ready)", "handler", "parse"),
    ("who asks, follow-up check", "parse", "follow_up"),
    ("prompt tokens", "follow_up", "prompt"),
    ("route, slot, restore decision", "prompt", "prepare"),
    ("request written to llama-server", "prepare|follow_up", "sent"),
    ("answer's first bytes read (Upstream)", "head", "read"),
    ("waiting for the answer's rest", "read", "body"),
    ("answer's last bytes in -> relayed", "body", "answer"),
    ("save handed on", "answer", "save"),
    ("aiohttp: answer written", "save", "written"),
    ("before forwarding (total)", "in", "sent"),
    ("after the answer (total)", "head", "written"),
]


def hook_env(out: Path) -> dict[str, str]:
    """Environment for a sidecar process that records its stages to ``out`` (the hook is written
    beside it, and goes with its folder)."""
    hook = out.parent / "stages-hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(
        "import os, sys\nsys.path.insert(0, os.getcwd())\nfrom bench.stages import install\ninstall()\n")
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, HOOK_ENV: str(out)}


def install() -> None:
    """Wrap the stages (in the sidecar's process, from ``sitecustomize``)."""
    out = os.environ.get(HOOK_ENV)
    if not out:
        return
    try:
        _install(out)
    except Exception as exc:  # a renamed stage: the sidecar runs unwrapped
        print(f"bench.stages: not installed ({exc!r})", file=sys.stderr)


def _install(out: str) -> None:
    from sidecar import completion
    from sidecar.http import upstream

    now = time.perf_counter_ns
    stamps: dict[str, int] = {}

    def stamp(name: str) -> None:
        stamps.setdefault(name, now())

    def after(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def sync(*args: Any, **kwargs: Any) -> Any:
            try:
                return call(*args, **kwargs)
            finally:
                stamp(name)
        return sync

    def after_async(name: str, call: Callable[..., Any], first: str | None = None) -> Callable[..., Any]:
        @functools.wraps(call)
        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            if first:
                stamp(first)
            try:
                return await call(*args, **kwargs)
            finally:
                stamp(name)
        return wrapped

    completion.parse = after_async("parse", completion.parse, first="handler")  # type: ignore[assignment]
    completion.follow_up = after_async("follow_up", completion.follow_up)  # type: ignore[assignment]
    completion.prompt_of = after_async("prompt", completion.prompt_of)  # type: ignore[assignment]
    completion.prepare = after_async("prepare", completion.prepare)  # type: ignore[assignment]
    completion.answer = after_async("answer", completion.answer)  # type: ignore[assignment]
    completion.save = after("save", completion.save)  # type: ignore[assignment]

    conn = upstream.Connection
    start, received = conn.start, conn.data_received

    def sent(self: Any, response: Any, data: bytes) -> None:
        start(self, response, data)
        stamp("sent")

    def head(self: Any, data: bytes) -> None:
        stamp("head")
        received(self, data)
        stamp("read")
        if self.response is not None and self.response.complete:
            stamp("body")

    conn.start, conn.data_received = sent, head  # type: ignore[method-assign]

    _hook_server(stamps, stamp, out)


def _hook_server(stamps: dict[str, int], stamp: Callable[[str], None], out: str) -> None:
    """aiohttp's request handler: a POST's bytes arriving start a record, its answer written ends it."""
    from aiohttp import web_protocol

    handler = web_protocol.RequestHandler
    data_received, finish_response = handler.data_received, handler.finish_response

    def arrived(self: Any, data: bytes) -> None:
        if data.startswith(b"POST "):
            stamps.clear()
            stamp("in")
        data_received(self, data)

    async def finished(self: Any, request: Any, response: Any, start_time: Any) -> Any:
        try:
            return await finish_response(self, request, response, start_time)
        finally:
            if "in" in stamps and "parse" in stamps:
                stamp("written")
                t0 = stamps["in"]
                _append(out, {"path": request.path, **{k: round((v - t0) / 1e6, 4) for k, v in stamps.items()}})
            stamps.clear()

    handler.data_received, handler.finish_response = arrived, finished  # type: ignore[method-assign]


def _append(out: str, record: dict[str, Any]) -> None:
    # A line to a local file, after the answer went out: too short to hand to a thread.
    with open(out, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def read(out: Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def medians(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each stage's median milliseconds over ``records`` (None where no record has both stamps)."""
    out: dict[str, float | None] = {}
    for label, frm, to in STAGES:
        spans = []
        for r in records:
            start = next((r[k] for k in frm.split("|") if k in r), None)
            if start is not None and to in r:
                spans.append(r[to] - start)
        out[label] = round(statistics.median(spans), 3) if spans else None
    return out
