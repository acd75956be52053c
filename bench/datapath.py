"""``python -m bench datapath``: issue #28's data path at real models' KV sizes, floors and kvtier
side by side in one run.

    python -m bench datapath                 # SmolLM2 4k, 8B 4k and 8k, 70B 2k; 3 reps (~1.5 h on 2 cores)
    python -m bench datapath --quick         # 8B 4,000 tokens, 1 rep
    python -m bench datapath --sizes 2000,70b:1000 --reps 2 --b-tokens 300 --json /tmp/dp.json

``--sizes`` lists runs as ``[SHAPE:]TOKENS`` (the shape is ``8b`` unless named):
- ``8b``: random weights (``tests/ggufgen.py``) with Llama-3-8B's KV shape, 32 layers, 8 KV heads of
  128, f16: 128 KiB per token (1 GiB per 8k-token slot);
- ``70b``: the same with 80 layers, a 70B's 320 KiB per token;
- ``smollm2``: SmolLM2-135M itself, 22.5 KiB per token.
The random models are generated once into ``$KVTIER_CACHE/models``. Every llama-server runs
``-np 2 -t THREADS --cache-ram 0``, slots on /dev/shm; kvtier runs two nodes on one Valkey. Rows per
run, medians over the reps:

- floors: llama-server's own save of the slot (``save_ms``) and restore of that file
  (``restore_ms``); redis-py asyncio SET then GET of those bytes in 256-token values (32 MiB) over
  1 and 4 connections; the prompt's prefill. Save steps offline: kvtier's parse, split and encode
  of the file, in this process.
- kvtier save: a /completion (``n_predict`` 4) through node A's sidecar, from the answer's end
  until Redis holds its chunks and tail: the sidecar's ``kvtier_save_readable_seconds`` (timed by
  the sidecar from the answer's end to the write-behind barrier: exactly that interval), checked by
  the client polling Redis for the keys every 20 ms; ``save_seconds``: until the local tiers hold it.
- kvtier restore: the prompt + 16 new tokens on node B (fresh: from Redis), and on node A once
  other prompts took both its slots (its RAM tier): ``kvtier_restore_seconds`` by phase, the TTFT,
  llama-server's ``prompt_n`` (only the new tokens computed: the restore was used).
- stall: user B streams ``--b-tokens`` tokens on one slot from the first token of user A's answer
  on the other; after A's answer ends, no save, llama-server's own save of A's slot, or kvtier's save
  (through the sidecar, as B). B's longest and median gap between tokens after A's end. Then, in
  kvtier's rep, A's conversation once more with llama-server's own save, sent past the sidecar
  (``sidecars running``): llama-server writes a slot more slowly when the machine's memory is in use
  (both sidecars' RAM tiers, Valkey), so kvtier's gap is rated per rep against both.
- CPU: the sidecar's utime + stime and minor faults (``/proc/PID/stat``) from the answer's end until
  the save is done, per GB saved; from the request to its answer, per GB restored.

Writes ``bench/results/datapath.json`` (every rep, with the load average seen).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import aiohttp

from launch import Node, smollm2_path

from .common import (
    RESULTS_DIR,
    Cluster,
    Samples,
    client_session,
    cluster,
    complete,
    console,
    delta,
    exact_tokens,
    machine,
    metric,
    post_json,
    print_table,
    redis_client,
    redis_flush,
    redis_or_given,
    scrape,
    versions,
    wait_idle,
    write_json,
)

# The generated models' shapes: Llama-3-8B's KV is 32 layers x (K + V) x 8 KV heads x 128 x 2 bytes
# (f16) = 128 KiB per token; a 70B's is the same with 80 layers. None: SmolLM2-135M itself.
SHAPES: dict[str, dict[str, int] | None] = {
    "8b": {"n_layer": 32, "n_embd": 256, "n_head": 8, "n_head_kv": 8, "head_dim": 128, "n_ff": 512},
    "70b": {"n_layer": 80, "n_embd": 256, "n_head": 8, "n_head_kv": 8, "head_dim": 128, "n_ff": 512},
    "smollm2": None,
}
SMOLLM2_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2  # 30 layers x (K + V) x 3 KV heads x 64, f16
CHUNK_TOKENS = 256  # kvtier's chunk, and the raw Redis floor's piece (32 MiB)
NEW_TOKENS = 16  # appended to a saved prompt for a restore
OTHER_TOKENS = 512  # the prompts that overwrite a node's slots before the same-node restore
A_ANSWER = 32  # tokens of user A's answer in the stall test (B starts at its first)
SLOT_MARGIN = 320  # tokens per slot beyond the prompt (new tokens, answers)
PHASES = ("fetch", "assemble", "write", "queue", "llama")
POLL_S = 0.02
MIB = 1 << 20


def kv_per_token(shape: str) -> int:
    """Bytes of K and V per token (f16) of a ``SHAPES`` entry."""
    dims = SHAPES[shape]
    if dims is None:
        return SMOLLM2_KV_BYTES_PER_TOKEN
    return 2 * dims["n_layer"] * dims["n_head_kv"] * dims["head_dim"] * 2


def model_name(shape: str) -> str:
    dims = SHAPES[shape]
    if dims is None:
        return Path(smollm2_path()).name
    return "kvtier-random-l{n_layer}-e{n_embd}-h{n_head}-kv{n_head_kv}x{head_dim}-ff{n_ff}.gguf".format(**dims)


def model_path(shape: str) -> str:
    """The model of a ``SHAPES`` entry; a random one is generated once into the kvtier cache."""
    dims = SHAPES[shape]
    if dims is None:
        return smollm2_path()
    cache = Path(os.environ.get("KVTIER_CACHE", Path.home() / ".cache" / "kvtier")) / "models"
    path = cache / model_name(shape)
    if not path.exists():
        from tests.ggufgen import ModelShape, write_random_llama

        cache.mkdir(parents=True, exist_ok=True)
        console.print(f"datapath: generating {path.name}")
        tmp = path.with_suffix(".partial")
        write_random_llama(tmp, smollm2_path(), ModelShape(**dims))
        tmp.rename(path)
    return str(path)


def parse_runs(spec: str) -> list[tuple[str, int]]:
    """``--sizes``: ``[SHAPE:]TOKENS`` entries, comma-separated, as (shape, tokens)."""
    runs = []
    for entry in (x.strip() for x in spec.split(",") if x.strip()):
        shape, _, tokens = entry.rpartition(":")
        shape = shape or "8b"
        if shape not in SHAPES:
            raise SystemExit(f"--sizes: unknown shape {shape!r} (one of {', '.join(SHAPES)})")
        runs.append((shape, int(tokens)))
    return runs


def llama_args(n_tokens: int, threads: int) -> list[str]:
    return ["-c", str(2 * (n_tokens + SLOT_MARGIN)), "-np", "2", "-t", str(threads), "--cache-ram", "0"]


@dataclass(frozen=True, slots=True)
class ProcTimes:
    """A process's CPU seconds (all its threads) and minor page faults (``/proc/PID/stat``)."""

    user: float
    sys: float
    faults: int

    @classmethod
    def of(cls, pid: int) -> ProcTimes:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # fields from the 3rd on
        tick = os.sysconf("SC_CLK_TCK")
        return cls(int(f[11]) / tick, int(f[12]) / tick, int(f[7]))  # utime, stime, minflt

    def since(self, before: ProcTimes, nbytes: int) -> dict[str, Any]:
        """CPU and faults since ``before``, per GB of ``nbytes``; ``fault_passes``: the faulted 4 KiB
        pages over ``nbytes`` (how many times that much fresh memory was touched)."""
        user, sys_, faults = self.user - before.user, self.sys - before.sys, self.faults - before.faults
        return {"cpu_s": round(user + sys_, 2), "user_s": round(user, 2), "sys_s": round(sys_, 2), "minflt": faults,
                "cpu_s_per_gb": round((user + sys_) / (nbytes / 1e9), 2) if nbytes else None,
                "fault_passes": round(faults * 4096 / nbytes, 2) if nbytes else None}


def sidecar_pid(node: Node) -> int:
    assert node.sidecar is not None and node.sidecar.proc is not None
    return node.sidecar.proc.pid


def peak_rss_mib(pid: int) -> float | None:
    """The most resident memory process ``pid`` has held so far (``VmHWM``), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


class RssPeaks:
    """The most private (``RssAnon``) and mapped-file (``RssFile`` + ``RssShmem``) memory each of
    some processes held, sampled every ``every`` seconds in a thread while in the ``with`` block.

    ``VmHWM`` counts both: a save maps the slot file llama-server wrote (tmpfs pages that exist
    whether or not kvtier maps them), so its peak says little of the memory kvtier itself adds.
    """

    def __init__(self, pids: dict[str, int], every: float = 0.01):
        self.pids, self.every = pids, every
        self.anon = dict.fromkeys(pids, 0.0)
        self.mapped = dict.fromkeys(pids, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            for name, pid in self.pids.items():
                kib = {}
                with contextlib.suppress(OSError):
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                            kib[line.split(":")[0]] = int(line.split()[1])
                self.anon[name] = max(self.anon[name], kib.get("RssAnon", 0) / 1024)
                self.mapped[name] = max(self.mapped[name], (kib.get("RssFile", 0) + kib.get("RssShmem", 0)) / 1024)
            if self._stop.wait(self.every):
                return

    def row(self) -> dict[str, dict[str, float]]:
        return {"anon": {k: round(v, 1) for k, v in self.anon.items()},
                "mapped": {k: round(v, 1) for k, v in self.mapped.items()}}


def gbps(nbytes: float, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else None


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- streams with the time of each token ----------------------------------------------------------


@dataclass
class Stream:
    """A streamed native completion: when each token event arrived (perf_counter), its timings and
    the slot llama-server computed it in."""

    times: list[float] = field(default_factory=list)
    timings: dict[str, Any] = field(default_factory=dict)
    end: float = 0.0
    slot: int | None = None


async def timed_stream(s: aiohttp.ClientSession, url: str, body: dict[str, Any],
                       first: asyncio.Event | None = None) -> Stream:
    """Stream ``body``; ``first`` is set once its prompt is computed (its first token is then sampled).

    That moment comes from llama-server's progress events, not from the first token's: llama-server
    holds a token back while the text so far ends in an unfinished UTF-8 character, and a generated
    model's greedy answer can repeat such a token to its end (8B shape, 4,000 tokens, seed 200: no
    token event before the last), which would start the other user only at A's end.
    """
    out = Stream()
    progress = {"return_progress": True} if first is not None else {}
    async with s.post(url + "/completion", json={**body, "stream": True, **progress}) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
        buf = b""
        async for piece in r.content.iter_any():
            now = time.perf_counter()
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if not event.startswith(b"data: ") or event.strip() == b"data: [DONE]":
                    continue
                data = json.loads(event[6:])
                done = prompt_computed(data)
                if done is not None:  # a progress event (asked for only with ``first``)
                    if done and first is not None:
                        first.set()
                    continue
                if not data.get("stop"):
                    out.times.append(now)
                    if first is not None:
                        first.set()
                out.timings = data.get("timings") or out.timings
                out.slot = data.get("id_slot", out.slot)
    out.end = time.perf_counter()
    return out


def prompt_computed(event: dict[str, Any]) -> bool | None:
    """For a progress event (``return_progress``): whether the whole prompt is computed; None for
    any other event."""
    progress = event.get("prompt_progress")
    if not isinstance(progress, dict):
        return None
    return bool(progress.get("total")) and progress.get("processed") == progress.get("total")


def body(prompt: list[int], n_predict: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "cache_prompt": True, **extra}


async def stall_round(s: aiohttp.ClientSession, a_url: str, a_body: dict[str, Any], b_url: str,
                      b_body: dict[str, Any], save: Callable[[Stream], Awaitable[dict[str, Any]]] | None
                      ) -> dict[str, Any]:
    """A answers; B starts at A's first token; once A's answer ends ``save`` runs (given A's stream).
    B's gaps after A's end."""
    first = asyncio.Event()
    a_task = asyncio.create_task(timed_stream(s, a_url, a_body, first))
    waiter = asyncio.create_task(first.wait())
    await asyncio.wait({a_task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    b_task = asyncio.create_task(timed_stream(s, b_url, b_body))
    a = await a_task
    saved = await save(a) if save is not None else {}
    b = await b_task
    # Gaps ending after A's answer ended (the one spanning its end included).
    after = max(1, next((i for i, t in enumerate(b.times) if t > a.end), len(b.times)))
    gaps = [1e3 * (b.times[i] - b.times[i - 1]) for i in range(after, len(b.times))]
    during = [g for i, g in zip(range(after, len(b.times)), gaps, strict=True)
              if b.times[i] <= a.end + saved.get("save_s", 0.0)]  # gaps ending while the save ran
    b_after_s = (b.times[-1] - a.end) if b.times else 0.0
    out = {"a_prompt_ms": a.timings.get("prompt_ms", 0.0), "b_tokens_after": len(gaps),
           "max_gap_ms": round(max(gaps, default=0.0), 1),
           "p50_gap_ms": round(statistics.median(gaps), 2) if gaps else 0.0,
           "b_after_s": round(b_after_s, 2), "b_tps": round(len(gaps) / b_after_s, 1) if b_after_s > 0 else None,
           "b_tokens_during_save": len(during), **saved,
           "b_times_ms": [round(1e3 * (t - a.end), 1) for t in b.times]}  # B's token arrivals, from A's end
    if saved.get("save_s"):  # B's tokens per second while the save ran (events relayed in bursts have no gaps)
        out["b_tps_during_save"] = round(len(during) / saved["save_s"], 1)
    out["covered"] = "save_s" not in out or out["b_after_s"] > out["save_s"]
    return out


# -- floors ---------------------------------------------------------------------------------------


async def redis_floor(url: str, data: memoryview, conns: int, piece: int) -> dict[str, Any]:
    """SET then GET of ``data`` in ``piece``-byte values over ``conns`` parallel connections."""
    pieces = [data[i: i + piece] for i in range(0, len(data), piece)]
    keys = [f"datapath-floor:{i}".encode() for i in range(len(pieces))]
    clients = [redis_client(url) for _ in range(conns)]
    try:
        await asyncio.gather(*(c.ping() for c in clients))

        async def run(op: Callable[[Any, int], Awaitable[Any]]) -> float:
            async def share(k: int) -> None:
                for i in range(k, len(pieces), conns):
                    await op(clients[k], i)

            t0 = time.perf_counter()
            await asyncio.gather(*(share(k) for k in range(conns)))
            return time.perf_counter() - t0

        got: list[int] = []
        set_s = await run(lambda c, i: c.set(keys[i], pieces[i]))

        async def get(c: Any, i: int) -> None:
            got.append(len(await c.get(keys[i]) or b""))

        get_s = await run(get)
        assert sum(got) == len(data), "Redis returned other bytes than were set"
        await clients[0].unlink(*keys)
    finally:
        for c in clients:
            await c.aclose()
    return {"conns": conns, "set_ms": round(1e3 * set_s, 1), "get_ms": round(1e3 * get_s, 1),
            "set_gbps": gbps(len(data), set_s), "get_gbps": gbps(len(data), get_s)}


def save_steps(data: bytes) -> dict[str, float]:
    """kvtier's save steps on a saved file, in this process: parse, split into chunks, encode each."""
    from integrations.chunksplit import split_state
    from integrations.stateparse import parse_state
    from tiers.codec import BlobCodec

    t0 = time.perf_counter()
    state = parse_state(data)
    t1 = time.perf_counter()
    split = split_state(state, CHUNK_TOKENS, tail=True)
    t2 = time.perf_counter()
    codec = BlobCodec("adaptive")
    encoded = sum(len(codec.encode(c, chunk_hash=bytes(16), namespace_id=bytes(8), n_tokens=CHUNK_TOKENS))
                  for c in split.chunks)
    t3 = time.perf_counter()
    return {"parse_ms": round(1e3 * (t1 - t0), 1), "split_ms": round(1e3 * (t2 - t1), 1),
            "encode_ms": round(1e3 * (t3 - t2), 1), "encoded_bytes": encoded}


async def llama_floor(s: aiohttp.ClientSession, node: Node, redis_url: str, conns: list[int]) -> dict[str, Any]:
    """llama-server's own save of slot 0 and restore of that file; then Redis and the save steps on its bytes."""
    name = "datapath-floor.bin"
    path = node.slot_dir / name
    try:
        saved, _ = await post_json(s, f"{node.llama_url}/slots/0?action=save", {"filename": name})
        restored, _ = await post_json(s, f"{node.llama_url}/slots/0?action=restore", {"filename": name})
        t0 = time.perf_counter()
        data = path.read_bytes()
        read_ms = 1e3 * (time.perf_counter() - t0)
    finally:
        path.unlink(missing_ok=True)
    save_ms, restore_ms = float(saved["timings"]["save_ms"]), float(restored["timings"]["restore_ms"])
    piece = max(1, len(data) * CHUNK_TOKENS // max(1, int(saved["n_saved"])))  # kvtier's chunk, about
    out: dict[str, Any] = {
        "n_saved": int(saved["n_saved"]), "file_bytes": len(data), "save_ms": save_ms, "restore_ms": restore_ms,
        "save_gbps": gbps(len(data), save_ms / 1e3), "restore_gbps": gbps(len(data), restore_ms / 1e3),
        "piece_bytes": piece,
        "redis": [await redis_floor(redis_url, memoryview(data), c, piece) for c in conns]}
    out["steps"] = {"read_ms": round(read_ms, 1), **save_steps(data)}
    return out


async def next_turn(s: aiohttp.ClientSession, url: str, prompt: list[int], extra: list[int],
                    after_s: float) -> dict[str, Any]:
    """A conversation's next turn (``prompt`` + ``extra``), sent ``after_s`` after ``prompt``'s answer
    ended: through kvtier, while that answer's save is in flight. Its TTFT and tokens computed."""
    await complete(s, url, prompt, 4)
    await asyncio.sleep(after_s)
    reply = await complete(s, url, prompt + extra, 4)
    return {"ttft_ms": reply.ttft_ms, "prompt_n": reply.recomputed_tokens, "load_avg": load_avg()}


def llama_save(s: aiohttp.ClientSession, node: Node) -> Callable[[Stream], Awaitable[dict[str, Any]]]:
    """llama-server's own save of the slot A answered in (its file removed at once)."""
    async def save(a: Stream) -> dict[str, Any]:
        name = "datapath-stall.bin"
        t0 = time.perf_counter()
        saved, _ = await post_json(s, f"{node.llama_url}/slots/{a.slot or 0}?action=save", {"filename": name})
        (node.slot_dir / name).unlink(missing_ok=True)
        return {"save_s": round(time.perf_counter() - t0, 3), "save_ms": float(saved["timings"]["save_ms"])}
    return save


async def alone_rep(s: aiohttp.ClientSession, node: Node, redis_url: str, n: int, r: int,
                    a: argparse.Namespace) -> dict[str, Any]:
    """Stall without a save, the floors, then stall with llama-server's own save (one llama-server)."""
    url = node.llama_url
    prompt = await exact_tokens(s, url, n, seed=r)
    extra = await exact_tokens(s, url, NEW_TOKENS, seed=950 + r)
    b_body = body(await exact_tokens(s, url, 64, seed=900 + r), a.b_tokens, id_slot=1, ignore_eos=True)
    out: dict[str, Any] = {"rep": r, "load_avg": load_avg()}
    out["stall_none"] = await stall_round(s, url, body(prompt, A_ANSWER, id_slot=0), url, b_body, None)
    out["recompute_ms"] = out["stall_none"]["a_prompt_ms"]
    out["floor"] = await llama_floor(s, node, redis_url, a.conns)

    out["stall_llama"] = await stall_round(s, url, body(prompt + extra, A_ANSWER, id_slot=0), url, b_body,
                                           llama_save(s, node))
    out["next_turn"] = await next_turn(s, url, await exact_tokens(s, url, n, seed=300 + r), extra, a.next_after_ms / 1e3)
    return out


# -- kvtier ---------------------------------------------------------------------------------------


async def key_counts(url: str) -> tuple[int, int]:
    """kvtier's chunk keys (``:c:``) and automatic tail keys (``:a:``) in Redis."""
    client = redis_client(url)
    try:
        keys = [k async for k in client.scan_iter(match="kvtier:*:[ca]:*", count=1000)]
    finally:
        await client.aclose()
    chunks = sum(1 for k in keys if b":c:" in k)
    return chunks, len(keys) - chunks


async def redis_holds(url: str, chunks: int, tails: int, since: float, timeout: float = 300) -> float:
    """Seconds from ``since`` until Redis holds ``chunks`` chunk keys and ``tails`` tail keys (polled)."""
    while time.perf_counter() - since < timeout:
        c, t = await key_counts(url)
        if c >= chunks and t >= tails:
            return time.perf_counter() - since
        await asyncio.sleep(POLL_S)
    raise TimeoutError(f"Redis did not hold {chunks} chunks in {timeout:.0f} s")


async def kvtier_save(s: aiohttp.ClientSession, cl: Cluster, redis_url: str, prompt: list[int],
                      per_token: int) -> dict[str, Any]:
    """A completion through node A's sidecar; from its end until Redis holds the chunks and the tail."""
    node, urls = cl.nodes[0], [n.sidecar_url for n in cl.nodes]
    base = await key_counts(redis_url)
    m0 = await scrape(s, node.sidecar_url)
    reply = await complete(s, node.sidecar_url, prompt, 4)
    t_end, c0 = time.perf_counter(), ProcTimes.of(sidecar_pid(node))
    client_s = await redis_holds(redis_url, base[0] + (len(prompt) + 3) // CHUNK_TOKENS, base[1] + 1, t_end)
    await wait_idle(s, urls)
    c1 = ProcTimes.of(sidecar_pid(node))
    m1 = await scrape(s, node.sidecar_url)
    readable = delta(m1, m0, "kvtier_save_readable_seconds_sum")
    kv = len(prompt) * per_token
    return {"readable_ms": round(1e3 * readable, 1), "client_ms": round(1e3 * client_s, 1),
            "save_seconds_ms": round(1e3 * delta(m1, m0, "kvtier_save_seconds_sum"), 1),
            "saves": delta(m1, m0, "kvtier_save_readable_seconds_count"), "gbps": gbps(kv, readable),
            "client_gbps": gbps(kv, client_s), **c1.since(c0, kv),
            "redis_bytes": delta(m1, m0, "kvtier_tier_bytes_written_total", tier="redis"),
            "prompt_n": reply.recomputed_tokens, "load_avg": load_avg()}


async def kvtier_restore(s: aiohttp.ClientSession, cl: Cluster, node: Node, prompt: list[int],
                         per_token: int) -> dict[str, Any]:
    """The prompt through ``node``'s sidecar: its restore's time by phase, TTFT, prompt_n, CPU."""
    m0 = await scrape(s, node.sidecar_url)
    c0 = ProcTimes.of(sidecar_pid(node))
    reply = await complete(s, node.sidecar_url, prompt, 4)
    c1 = ProcTimes.of(sidecar_pid(node))
    m1 = await scrape(s, node.sidecar_url)
    await wait_idle(s, [n.sidecar_url for n in cl.nodes])
    restore_s = delta(m1, m0, "kvtier_restore_seconds_sum")
    kv = reply.restored_tokens * per_token
    return {"restore_ms": round(1e3 * restore_s, 1), "gbps": gbps(kv, restore_s),
            "phases_ms": {p: round(1e3 * delta(m1, m0, "kvtier_restore_phase_seconds_sum", phase=p), 1)
                          for p in PHASES},
            "ttft_ms": reply.ttft_ms, "prompt_n": reply.recomputed_tokens, "restored_tokens": reply.restored_tokens,
            "overhead_ms": round(1e3 * delta(m1, m0, "kvtier_overhead_seconds_sum"), 1),  # before forwarding
            "save_wait_ms": round(1e3 * delta(m1, m0, "kvtier_save_wait_seconds_sum"), 1),
            "llama_prompt_ms": reply.prompt_ms,
            "tier": reply.restore_tier, **c1.since(c0, kv), "load_avg": load_avg()}


async def kvtier_stall(s: aiohttp.ClientSession, cl: Cluster, redis_url: str, prompt: list[int],
                       b_prompt: list[int], b_tokens: int) -> dict[str, Any]:
    """The stall round through node A's sidecar; the save ends when Redis holds it (polled)."""
    node = cl.nodes[0]
    base = await key_counts(redis_url)
    m0 = await scrape(s, node.sidecar_url)

    async def kvtier_saves(_: Stream) -> dict[str, Any]:
        t_end = time.perf_counter()
        client_s = await redis_holds(redis_url, base[0] + (len(prompt) + A_ANSWER - 1) // CHUNK_TOKENS, base[1] + 1, t_end)
        m1 = await scrape(s, node.sidecar_url)  # now: B's own save, after its answer, would count too
        return {"save_s": round(client_s, 3),
                "readable_ms": round(1e3 * delta(m1, m0, "kvtier_save_readable_seconds_sum"), 1),
                "loop_lag": loop_lag(m1, m0)}

    out = await stall_round(s, node.sidecar_url, body(prompt, A_ANSWER), node.sidecar_url,
                            body(b_prompt, b_tokens, ignore_eos=True), kvtier_saves)
    await wait_idle(s, [n.sidecar_url for n in cl.nodes])
    return out


def loop_lag(after: Samples, before: Samples) -> dict[str, float]:
    """The sidecar's event loop lag between two scrapes (``kvtier_event_loop_lag_seconds``): its
    samples, how many were 0.05 and 0.1 s late or more, and the bound of the latest bucket one fell in."""
    name = "kvtier_event_loop_lag_seconds_bucket"
    les = [k.split('le="')[1].rstrip('"}') for k in after if k.startswith(name + "{")]
    counts = {le: delta(after, before, name, le=le) for le in les}
    total = counts.get("+Inf", 0.0)
    covering = [float(le) for le, n in counts.items() if n >= total]
    return {"samples": total, "over_0.05s": total - counts.get("0.05", 0.0),
            "over_0.1s": total - counts.get("0.1", 0.0), "max_le_s": min(covering, default=float("inf"))}


async def kvtier_rep(s: aiohttp.ClientSession, cl: Cluster, redis_url: str, n: int, r: int,
                     a: argparse.Namespace, per_token: int) -> dict[str, Any]:
    """Save on node A, restore on node B (Redis), then on A after its slots were overwritten (its
    saved file); a next turn while the save is in flight; stall."""
    node_a, node_b = cl.nodes
    # An empty Redis (its memory), but not a purge: that would also remove the restore files each
    # node keeps for its next restore, which a node that has restored before has.
    await redis_flush(redis_url)
    with RssPeaks({"a": sidecar_pid(node_a), "b": sidecar_pid(node_b)}) as peaks:
        out = await _kvtier_rep(s, cl, redis_url, n, r, a, per_token)
    out["peak_rss_sampled_mib"] = peaks.row()
    # Each sidecar's peak so far: its saves (A) and restores (B, then A), this size's reps up to now.
    out["peak_rss_mib"] = {"a": peak_rss_mib(sidecar_pid(node_a)), "b": peak_rss_mib(sidecar_pid(node_b))}
    out["heap_mib"] = {name: await heap_mib(s, node.sidecar_url) for name, node in (("a", node_a), ("b", node_b))}
    return out


async def heap_mib(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """A sidecar's RAM tier and malloc heap now (``kvtier_heap_bytes``), MiB: free bytes not at
    the heap's top are holes between blocks in use, in its RSS whether or not a buffer fits them."""
    m = await scrape(s, url)
    out = {state: metric(m, "kvtier_heap_bytes", state=state) / MIB for state in ("in_use", "free", "free_at_top")}
    return {"ram_tier": metric(m, "kvtier_tier_bytes_used", tier="memory") / MIB} | out


async def _kvtier_rep(s: aiohttp.ClientSession, cl: Cluster, redis_url: str, n: int, r: int,
                      a: argparse.Namespace, per_token: int) -> dict[str, Any]:
    node_a, node_b = cl.nodes
    urls = [x.sidecar_url for x in cl.nodes]
    tok = node_a.llama_url
    prompt = await exact_tokens(s, tok, n, seed=100 + r)
    out: dict[str, Any] = {"rep": r, "save": await kvtier_save(s, cl, redis_url, prompt, per_token)}
    other_end = await exact_tokens(s, tok, NEW_TOKENS, seed=960 + r)
    out["restore_other"] = await kvtier_restore(s, cl, node_b, prompt + other_end, per_token)
    for k in range(2):  # both of A's slots now hold other prompts (least recently used first)
        await complete(s, node_a.sidecar_url, await exact_tokens(s, tok, OTHER_TOKENS, seed=700 + 10 * r + k), 4)
    await wait_idle(s, urls)
    same_end = await exact_tokens(s, tok, NEW_TOKENS, seed=970 + r)  # not B's: its tail is in Redis only
    out["restore_same"] = await kvtier_restore(s, cl, node_a, prompt + same_end, per_token)
    m0 = await scrape(s, node_a.sidecar_url)
    out["next_turn"] = await next_turn(s, node_a.sidecar_url, await exact_tokens(s, tok, n, seed=300 + r),
                                       await exact_tokens(s, tok, NEW_TOKENS, seed=950 + r), a.next_after_ms / 1e3)
    out["next_turn"]["saves_skipped"] = delta(await scrape(s, node_a.sidecar_url), m0, "kvtier_saves_skipped_total")
    await wait_idle(s, urls)
    stall_prompt = await exact_tokens(s, tok, n, seed=200 + r)
    b_prompt = await exact_tokens(s, tok, 64, seed=900 + r)
    out["stall_kvtier"] = await kvtier_stall(s, cl, redis_url, stall_prompt, b_prompt, a.b_tokens)
    # llama-server's own save of the same slot, sent past the sidecar, with both sidecars and Valkey
    # holding what this rep left them: how long llama-server takes to write a slot depends on the
    # memory the machine has in use, and the alone rows were measured without kvtier's.
    extra = await exact_tokens(s, tok, NEW_TOKENS, seed=980 + r)
    out["stall_llama_beside"] = await stall_round(
        s, node_a.llama_url, body(stall_prompt + extra, A_ANSWER), node_a.llama_url,
        body(b_prompt, a.b_tokens, ignore_eos=True), llama_save(s, node_a))
    await wait_idle(s, urls)
    return out


# -- run and report -------------------------------------------------------------------------------


async def run_size(a: argparse.Namespace, shape: str, n: int, redis_url: str) -> dict[str, Any]:
    per_token, model = kv_per_token(shape), model_path(shape)
    out: dict[str, Any] = {"shape": shape, "model": model_name(shape), "kv_per_token": per_token,
                           "n_tokens": n, "kv_bytes": n * per_token}
    await redis_flush(redis_url)
    with cluster(1, llama_args(n, a.threads), sidecar=False, redis_url=None, model=model) as cl:
        async with client_session() as s:
            out["alone"] = []
            for r in range(a.reps):
                console.print(f"datapath: {shape}, {n} tokens, llama-server alone, rep {r + 1}/{a.reps}")
                out["alone"].append(await alone_rep(s, cl.nodes[0], redis_url, n, r, a))
    await redis_flush(redis_url)
    # Each node prices a recompute at the prefill rate measured above at this size, as a serving
    # node learns it from its prompts. These generated models' prefill is attention-bound, so a
    # short prompt's rate is many times a long one's (70B: the 32-token warm-up taught node B
    # a rate that made a 2,000-token recompute look faster than a restore, twice).
    tps = n / (statistics.median(x["recompute_ms"] for x in out["alone"]) / 1000)
    with cluster(2, llama_args(n, a.threads), sidecar=True, redis_url=redis_url, model=model,
                 sidecar_args=("--prefill-tps-prior", f"{tps:.1f}")) as cl:
        async with client_session() as s:
            for node in cl.nodes:  # a sidecar's first request probes llama-server: not in a measured one
                # (under 32 tokens computed: too few to learn a prefill rate from, which keeps the prior)
                await complete(s, node.sidecar_url, await exact_tokens(s, node.llama_url, 16, seed=999), 2)
            await wait_idle(s, [node.sidecar_url for node in cl.nodes])
            out["kvtier"] = []
            try:
                for r in range(a.reps):
                    console.print(f"datapath: {shape}, {n} tokens, kvtier, rep {r + 1}/{a.reps}")
                    out["kvtier"].append(await kvtier_rep(s, cl, redis_url, n, r, a, per_token))
            except Exception:
                await show_state(s, cl)  # the logs go with the cluster's directory
                raise
    return out


async def show_state(s: aiohttp.ClientSession, cl: Cluster) -> None:
    """Each sidecar's pending saves, write queue and the end of its log, on the console."""
    for node in cl.nodes:
        with contextlib.suppress(Exception):
            m = await scrape(s, node.sidecar_url)
            console.print(f"{node.name}: pending saves {metric(m, 'kvtier_pending_saves')}, write queue "
                          f"{metric(m, 'kvtier_write_queue_depth')}, Redis circuit {metric(m, 'kvtier_redis_circuit_open')}")
        log = node.root / f"{node.name}-kvtier.log"
        if log.exists():
            console.print(f"--- {log.name}, its end:\n" + log.read_text(errors="replace")[-4000:], markup=False)


def med(rows: list[dict[str, Any]], *path: str) -> float | None:
    values = []
    for row in rows:
        v: Any = row
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        if isinstance(v, (int, float)):
            values.append(float(v))
    return round(statistics.median(values), 3) if values else None


def num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def pct(floor_ms: float | None, ms: float | None) -> float | None:
    return round(100 * floor_ms / ms, 1) if floor_ms and ms else None


def run_label(res: dict[str, Any]) -> str:
    """A run's name in the table: its KV shape and prompt size (runs before shapes were 8B)."""
    return f"{res.get('shape', '8b')} {res['n_tokens']:,}"


def size_rows(res: dict[str, Any], conns: list[int]) -> list[list[Any]]:
    """The table's rows of one prompt size (medians over the reps)."""
    al, kv = res["alone"], res["kvtier"]
    run = run_label(res)
    fl = [x["floor"] for x in al]
    restore_floor = med(fl, "restore_ms")
    # The floors the issue names, per rep: llama-server's own save and the fastest raw SET of the
    # same bytes (a save to Redis); the fastest raw GET and llama-server's own load (a restore from
    # Redis). A restore from the node's own tiers has llama-server's load alone.
    both = [{"save": x["save_ms"] + min(r["set_ms"] for r in x["redis"]),
             "restore": x["restore_ms"] + min(r["get_ms"] for r in x["redis"])} for x in fl]
    save_floor, redis_floor = med(both, "save"), med(both, "restore")
    rows: list[list[Any]] = [
        [run, "floor: llama-server save (slot -> file)", med(fl, "save_ms"), med(fl, "save_gbps"), None, ""],
        [run, "floor: llama-server restore (file -> slot)", restore_floor, med(fl, "restore_gbps"), None, ""]]
    for i, c in enumerate(conns):
        redis = [x["redis"][i] for x in fl]
        rows += [[run, f"floor: Redis SET, {c} conn", med(redis, "set_ms"), med(redis, "set_gbps"), None,
                  f"{med(fl, 'piece_bytes') or 32 * MIB:,.0f}-byte values"],
                 [run, f"floor: Redis GET, {c} conn", med(redis, "get_ms"), med(redis, "get_gbps"), None, ""]]
    rows += [[run, "floor: to Redis (llama-server save + fastest SET)", save_floor, None, None, "the save's floor"],
             [run, "floor: from Redis (fastest GET + llama-server restore)", redis_floor, None, None,
              "the other node's restore's floor; the same node's is llama-server's restore"]]
    steps = [x["steps"] for x in fl]
    rows.append([run, "save steps offline (bench process)", None, None, None,
                 " / ".join(f"{k[:-3]} {num(med(steps, k))}" for k in ("read_ms", "parse_ms", "split_ms", "encode_ms"))
                 + " ms"])
    rows.append([run, "recompute (prefill)", med(al, "recompute_ms"), None, None, ""])
    sv = [x["save"] for x in kv]
    rows += [[run, "kvtier save: answer end -> Redis holds", med(sv, "readable_ms"), med(sv, "gbps"),
              pct(save_floor, med(sv, "readable_ms")), "sidecar's save_readable_seconds"],
             [run, "  the same, client polling Redis", med(sv, "client_ms"), med(sv, "client_gbps"),
              pct(save_floor, med(sv, "client_ms")), ""],
             [run, "  until the local tiers hold it", med(sv, "save_seconds_ms"), None, None, "save_seconds"]]
    for key, label in (("restore_other", "other node"), ("restore_same", "same node")):
        rs = [x[key] for x in kv]
        tiers = ",".join(sorted({x["tier"] for x in rs}))
        rows.append([run, f"kvtier restore, {label} ({tiers})", med(rs, "restore_ms"), med(rs, "gbps"),
                     pct(redis_floor if key == "restore_other" else restore_floor, med(rs, "restore_ms")),
                     (f"TTFT {num(med(rs, 'ttft_ms'))} ms, computed {num(med(rs, 'prompt_n'))}, "
                      f"restored {num(med(rs, 'restored_tokens'))}")])
        rows.append([run, "  fetch / assemble / write / queue / llama-server", None, None, None,
                     " / ".join(num(med(rs, "phases_ms", p)) for p in PHASES)
                     + f" ms; all before forwarding {num(med(rs, 'overhead_ms'))} ms"])
    for key, label, src in (("stall_none", "no save", al), ("stall_llama", "llama-server save", al),
                            ("stall_llama_beside", "llama-server save, sidecars running", kv),
                            ("stall_kvtier", "kvtier save", kv)):
        rounds = [x[key] for x in src if key in x]
        st = [x for x in rounds if key in ("stall_none", "stall_kvtier") or measured_save(x)]
        if not st:  # runs before the round existed, or B never streamed through the save
            continue
        detail = f"p50 gap {med(st, 'p50_gap_ms')} ms, B {med(st, 'b_tps')} tok/s"
        if len(st) < len(rounds):
            detail += f"; {len(rounds) - len(st)} of {len(rounds)} reps left out (B started after the save)"
        if key != "stall_none":
            covered = sum(x["covered"] for x in st)
            detail += (f"; save {num(1e3 * (med(st, 'save_s') or 0))} ms, B in it {med(st, 'b_tps_during_save')} "
                       f"tok/s, covered {covered}/{len(st)}")
        if key == "stall_kvtier" and all("loop_lag" in x for x in st):
            detail += ("; sidecar loop lag >= 0.1 s: " + " / ".join(str(int(x["loop_lag"]["over_0.1s"])) for x in st)
                       + " samples, max <= " + " / ".join(f"{x['loop_lag']['max_le_s']:g}" for x in st) + " s")
        if key == "stall_kvtier":
            detail += "; per rep, against llama-server's save alone / beside: " + gap_ratios(al, kv)
        rows.append([run, f"user B's longest gap: {label}", med(st, "max_gap_ms"), None, None, detail])
    return rows + next_turn_rows(run, al, kv) + cpu_rows(run, al, kv, res.get("kv_per_token", 128 << 10))


def measured_save(round_: dict[str, Any]) -> bool:
    """Whether B streamed through a save that began as A's answer ended (llama-server's own):
    its first token came before A's end. Sent at A's first token, B has sometimes started only
    after A's end (first reps at 8B): its gaps then tell nothing of that save."""
    times = round_.get("b_times_ms")
    return times is None or (bool(times) and times[0] < 0)  # runs before B's times were kept: as measured


def gap_ratios(al: list[dict[str, Any]], kv: list[dict[str, Any]]) -> str:
    """kvtier's longest gap over llama-server's own save's, per rep: measured alone, and beside
    the sidecars in kvtier's round (``-`` where a run has no such round, or B started after that
    save)."""
    def ratio(k: dict[str, Any], ref: dict[str, Any] | None) -> str:
        if not ref or not ref.get("max_gap_ms") or not measured_save(ref):
            return "-"
        return f"{k['max_gap_ms'] / ref['max_gap_ms']:.2f}x"
    return ", ".join(f"{ratio(k['stall_kvtier'], a['stall_llama'])} / {ratio(k['stall_kvtier'], k.get('stall_llama_beside'))}"
                     for a, k in zip(al, kv, strict=False))


def next_turn_rows(run: str, al: list[dict[str, Any]], kv: list[dict[str, Any]]) -> list[list[Any]]:
    """The next turn's TTFT alone (nothing saved) and through kvtier (its save in flight)."""
    alone, kvtier = [x["next_turn"] for x in al if "next_turn" in x], [x["next_turn"] for x in kv if "next_turn" in x]
    if not alone or not kvtier:
        return []
    a_ms, k_ms = med(alone, "ttft_ms"), med(kvtier, "ttft_ms")
    ratio = round(k_ms / a_ms, 2) if a_ms and k_ms else None
    skipped = sum(x.get("saves_skipped", 0) for x in kvtier)
    return [[run, "next turn TTFT: llama-server alone (no save)", a_ms, None, None,
             f"computed {num(med(alone, 'prompt_n'))}"],
            [run, "next turn TTFT: kvtier, the answer's save in flight", k_ms, None, None,
             f"{ratio}x alone; computed {num(med(kvtier, 'prompt_n'))}; saves skipped {skipped:.0f}/{len(kvtier)}"]]


def cpu_rows(run: str, al: list[dict[str, Any]], kv: list[dict[str, Any]], per_token: int) -> list[list[Any]]:
    """The sidecar's CPU per GB (user / system seconds, minor faults), and the load average seen."""
    rows = []
    for key, label in (("save", "saved"), ("restore_other", "restored (other node)"),
                       ("restore_same", "restored (same node)")):
        xs = [x[key] for x in kv]
        rows.append([run, f"kvtier CPU s per GB {label}", med(xs, "cpu_s_per_gb"), None, None,
                     f"user {med(xs, 'user_s')} + sys {med(xs, 'sys_s')} s; fresh pages {med(xs, 'fault_passes')}x"])
    budget = (2 << 30) + 4 * CHUNK_TOKENS * per_token  # the default --cache-size, and 4 chunks
    peaks = [x["peak_rss_mib"] for x in kv if "peak_rss_mib" in x]
    if peaks:
        rows.append([run, "sidecar peak RSS, MiB (node A saves / node B restores)", None, None, None,
                     (f"{max(p['a'] or 0 for p in peaks):,.0f} / {max(p['b'] or 0 for p in peaks):,.0f}; "
                      f"RAM tier budget + 4 chunks: {budget / MIB:,.0f}")])
    sampled = [x["peak_rss_sampled_mib"] for x in kv if "peak_rss_sampled_mib" in x]
    if sampled:
        rows.append([run, "  of it private (RssAnon) / mapped files (slot files on tmpfs), MiB", None, None, None,
                     " / ".join(f"{max(p['anon'][k] for p in sampled):,.0f}" for k in ("a", "b")) + " private; "
                     + " / ".join(f"{max(p['mapped'][k] for p in sampled):,.0f}" for k in ("a", "b")) + " mapped"])
    for x in kv:
        if "heap_mib" in x:
            h = x["heap_mib"]["a"]
            rows.append([run, f"  node A after rep {x['rep'] + 1}: RAM tier / heap in use / heap free (at its top), MiB",
                         None, None, None, (f"{h['ram_tier']:,.0f} / {h['in_use']:,.0f} / {h['free']:,.0f} "
                                                 f"({h['free_at_top']:,.0f})")])
    loads = [x["load_avg"][0] for x in al] + [x[k]["load_avg"][0] for x in kv for k in ("save", "restore_other")]
    rows.append([run, "load average (1 min) seen", None, None, None, f"{min(loads)} to {max(loads)}"])
    return rows


HEADERS = ["KV shape, tokens", "measure", "ms (p50)", "GB/s (p50)", "% of floor", "detail"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench datapath", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="smollm2:4000,8b:4000,8b:8000,70b:2000",
                   help="runs as [SHAPE:]TOKENS, comma-separated; SHAPE one of " + ", ".join(SHAPES) + " (8b if left out)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="8b, 4,000 tokens, 1 rep")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--b-tokens", type=int, default=800, help="tokens user B streams in the stall test")
    p.add_argument("--conns", default="1,4", help="parallel Redis connections of the raw floor")
    p.add_argument("--next-after-ms", type=float, default=60.0,
                   help="a next turn is sent this long after its answer ends (kvtier's save then in flight)")
    p.add_argument("--redis-url", help="use this Redis instead of an embedded Valkey (it gets FLUSHALLed!)")
    p.add_argument("--json", default=str(RESULTS_DIR / "datapath.json"))
    a = p.parse_args(argv)
    runs = [("8b", 4000)] if a.quick else parse_runs(a.sizes)
    a.reps = 1 if a.quick else a.reps
    a.conns = [int(x) for x in a.conns.split(",") if x]
    started, before = time.time(), machine()
    results = []
    with redis_or_given(a.redis_url) as redis_url:
        for shape, n in runs:
            results.append(asyncio.run(run_size(a, shape, n, redis_url)))
            write_json(a.json, {"benchmark": "datapath", "partial": True, "results": results})  # a crash keeps these
        vers = versions(redis_url)
    rows = [row for res in results for row in size_rows(res, a.conns)]
    after = machine()
    shapes = ", ".join(f"{shape} {kv_per_token(shape) / 1024:,.1f} KiB/token" for shape in dict.fromkeys(s for s, _ in runs))
    print_table(f"KV data path ({shapes}), medians of {a.reps} rep(s); "
                f"load avg {before['load_avg']} -> {after['load_avg']}", HEADERS, rows)
    write_json(a.json, {"benchmark": "datapath", "command": "python -m bench datapath " + " ".join(argv or []),
                        "settings": {k: v for k, v in vars(a).items() if k != "json"},
                        "shapes": {shape: SHAPES[shape] for shape, _ in runs}, "machine": before,
                        "load_avg_end": after["load_avg"], "versions": vers,
                        "minutes": round((time.time() - started) / 60, 1), "results": results,
                        "table": [dict(zip(HEADERS, r, strict=True)) for r in rows]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
