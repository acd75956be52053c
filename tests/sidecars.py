"""In-process sidecars for tests: ``create_app`` served on a free loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from aiohttp import web

from sidecar.app import create_app
from sidecar.appkeys import ENGINE, METRICS, STORE
from sidecar.config import Settings
from sidecar.costmodel import Ewma
from tests.servers import LlamaServer, RedisProc, free_port


@dataclass
class Sidecar:
    url: str
    app: web.Application
    settings: Settings

    @property
    def engine(self):  # type: ignore[no-untyped-def]
        return self.app[ENGINE]

    @property
    def store(self):  # type: ignore[no-untyped-def]
        return self.app[STORE]

    def metric(self, name: str, **labels: str) -> float:
        value = self.app[METRICS].registry.get_sample_value(name, labels or None)
        return float(value or 0.0)

    def pin_prefill_rate(self, tokens_per_s: float) -> None:
        """Have the cost model price every recompute at ``tokens_per_s``, whatever prefills it sees.

        For tests of what a restore does, not of whether one is chosen: on a shared CI machine the
        learned prefill rate beside a slow restore can price a small restore out, by the clock.
        """
        cost = self.engine.cost
        cost.prefill_tps = _Pinned(tokens_per_s)
        cost.prefill_shared = [_Pinned(tokens_per_s) for _ in cost.prefill_shared]
        cost.prefill_by_length = [[_Pinned(tokens_per_s) for _ in row] for row in cost.prefill_by_length]

    def pin_slot_write(self, seconds_per_byte: float) -> None:
        """Have the cost model expect llama-server to write a slot's file at this rate (a large
        model's slot on a small test model)."""
        self.engine.cost.slot_write_s_per_byte = _Pinned(seconds_per_byte)

    def decisions(self) -> dict[str, float]:
        """The cost model's decisions so far, by outcome (for an assertion's message)."""
        return {d: self.metric("kvtier_cost_decisions_total", decision=d) for d in ("restore", "recompute", "spared")}


class _Pinned(Ewma):
    """A rate that learns nothing."""

    def __init__(self, value: float):
        super().__init__(value)
        self.samples = 1

    def update(self, sample: float) -> None:
        pass


# How long a new sidecar may take to learn its llama-server before the test goes on anyway.
READY_WAIT_S = 120.0


@contextlib.asynccontextmanager
async def run_sidecar(settings: Settings, *, advertise: bool = False) -> AsyncIterator[Sidecar]:
    """``advertise``: its own URL as ``advertise_url`` (peers forward to it).

    Yields once the sidecar has learned its llama-server (or failed to): its probe sends a few
    dozen tokens, and two sidecars probing at once would have two ``-t 2`` llama-servers computing
    on the test machine's 2 cores. ggml's threads spin at every barrier, so four of them on two
    cores run a ``-ub 1`` prompt at ~3 s per token instead of ~20 ms: a later request times out.
    """
    port = free_port()
    settings = replace(settings, listen=f"127.0.0.1:{port}")
    if advertise:
        settings = replace(settings, advertise_url=f"http://127.0.0.1:{port}")
    app = create_app(settings)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        # Not ready (no llama-server, a test's broken one) is the test's own business: it goes on.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(app[ENGINE].watcher.ensure_ready(), READY_WAIT_S)  # no request's wait
        yield Sidecar(f"http://127.0.0.1:{port}", app, settings)
    finally:
        try:
            await asyncio.wait_for(runner.cleanup(), 90)
        except TimeoutError:
            for task in asyncio.all_tasks():
                task.print_stack(file=sys.stderr)
            raise


@dataclass
class Answer:
    status: int
    body: Any
    headers: dict[str, str]
    text: str

    @property
    def restored(self) -> int:
        return int(self.headers.get("X-KVTier-Restored-Tokens", "0"))

    @property
    def prompt_n(self) -> int:
        return int(self.body["timings"]["prompt_n"])

    @property
    def content(self) -> str:
        if "choices" in self.body:
            return str(self.body["choices"][0]["message"]["content"])
        return str(self.body["content"])


async def post(url: str, body: Any, *, raw: bytes | None = None, headers: dict[str, str] | None = None,
               method: str = "POST") -> Answer:
    async with aiohttp.ClientSession() as s:
        data = raw if raw is not None else json.dumps(body).encode()
        async with s.request(method, url, data=data,
                             headers={"Content-Type": "application/json", **(headers or {})}) as r:
            text = await r.text()
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError:
                parsed = None
            return Answer(r.status, parsed, dict(r.headers), text)


async def post_stream(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, list[Any], dict[str, str]]:
    """POST with ``stream: true``; returns the parsed SSE events (``[DONE]`` as the string)."""
    events: list[Any] = []
    async with aiohttp.ClientSession() as s, s.post(url, json={**body, "stream": True}, headers=headers) as r:
        buf = b""
        async for piece in r.content.iter_any():
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.decode().splitlines():
                    if line.startswith("data: "):
                        data = line[6:]
                        events.append(data if data == "[DONE]" else json.loads(data))
        return r.status, events, dict(r.headers)


def stream_text(events: list[Any]) -> str:
    out = []
    for e in events:
        if isinstance(e, dict):
            if "choices" in e:
                out.append(e["choices"][0].get("delta", {}).get("content") or "")
            else:
                out.append(e.get("content", ""))
    return "".join(out)


@dataclass
class Node:
    """One llama-server with its in-process sidecar, and the Valkey they use."""

    sc: Sidecar
    llama: LlamaServer
    redis: RedisProc


def peak_rss_reset() -> None:
    """Reset this process's peak resident set size (VmHWM)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    """This process's peak resident set size since the last reset, in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
