"""Pre-warming: a node copies the chunks its peers announce, so a hop restores from its own RAM.

Real Valkey, two real llama-servers, sidecar A (plain) and sidecar C (``--prewarm``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import pytest
import pytest_asyncio

from sidecar.config import Settings
from tests.servers import LlamaServer, RedisProc, llama_server
from tests.sidecars import Sidecar, post, run_sidecar

pytestmark = pytest.mark.llama

CHUNK = 64
EXACT = ("-ub", "1")  # one token per micro-batch: a restored and a recomputed suffix give the same tokens
DOC = " ".join(f"Shelf {i} holds {i * 3} jars of {['jam', 'honey', 'pickles'][i % 3]}." for i in range(25))


@dataclass
class Pair:
    a: Sidecar
    c: Sidecar
    llama_c: LlamaServer


@pytest_asyncio.fixture(scope="module")
async def pair(redis_srv: RedisProc, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pair]:
    tmp = tmp_path_factory.mktemp("prewarm")
    with llama_server(tmp, *EXACT) as la, llama_server(tmp, *EXACT) as lc:
        common = {"redis_url": redis_srv.url, "chunk_tokens": CHUNK, "prefill_tps_prior": 100.0}
        async with run_sidecar(Settings(llama_url=la.url, slot_dir=str(la.slot_dir), node_id="a", **common)) as a, \
                run_sidecar(Settings(llama_url=lc.url, slot_dir=str(lc.slot_dir), node_id="c", prewarm=True,
                                     **common)) as c:
            assert await a.engine.ensure_ready() and await c.engine.ensure_ready()
            yield Pair(a, c, lc)


def turn(history: list[dict[str, str]], question: str) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": DOC}, *history, {"role": "user", "content": question}],
            "max_tokens": 8, "temperature": 0}


async def prewarmed(sc: Sidecar, at_least: float, timeout: float = 30.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        n = sc.metric("kvtier_prewarmed_chunks_total")
        if n >= at_least:
            return n
        await asyncio.sleep(0.1)
    return sc.metric("kvtier_prewarmed_chunks_total")


async def test_announced_chunks_are_copied_and_a_hop_restores_from_ram(pair: Pair) -> None:
    a, c = pair.a, pair.c
    first = await post(a.url + "/v1/chat/completions", turn([], "Which shelf holds honey?"))
    assert first.status == 200, first.text
    await a.engine.drain(30)
    assert await a.store.flush(30)
    written = int(first.headers["X-KVTier-Prompt-Tokens"]) // CHUNK  # whole chunks of the prompt, at least
    assert written >= 4
    # Announced only once Redis holds them, so C's copy finds every one.
    assert await prewarmed(c, written) >= written
    assert c.metric("kvtier_tier_errors_total", tier="redis") == 0
    history = [{"role": "user", "content": "Which shelf holds honey?"},
               {"role": "assistant", "content": first.content}]
    on_c = await post(c.url + "/v1/chat/completions", turn(history, "And pickles?"))
    on_a = await post(a.url + "/v1/chat/completions", turn(history, "And pickles?"))
    assert on_c.status == on_a.status == 200
    assert on_c.headers["X-KVTier-Restore-Tier"] == "memory"
    assert on_c.restored >= written * CHUNK
    assert on_c.prompt_n <= int(on_c.headers["X-KVTier-Prompt-Tokens"]) - on_c.restored + 1
    assert on_c.content == on_a.content
    await asyncio.gather(a.engine.drain(30), c.engine.drain(30))
    # The restored state's pages stay in the slot dir: as the slot's restore file, or, once the
    # slot's save after the answer was written over that file, as a spare for the next restore.
    slot_dir = pair.llama_c.slot_dir
    kept = [f.stat().st_size for pattern in (f"kvtier-restore-{on_c.headers['X-KVTier-Slot']}.bin",
                                             "kvtier-spare-*.bin") for f in slot_dir.glob(pattern)]
    assert kept and max(kept) > on_c.restored * 1000


async def test_restore_files_beyond_the_budget_are_removed(pair: Pair) -> None:
    for f in pair.llama_c.slot_dir.glob("kvtier-restore-*.bin"):
        f.unlink()
    async with run_sidecar(replace(pair.c.settings, keep_restore_files=0, prewarm=False, node_id="c2")) as c2:
        assert await c2.engine.ensure_ready()
        await post(c2.url + "/completion", {"prompt": "Unrelated.", "n_predict": 1})  # the slot holds other tokens
        await c2.engine.drain(30)
        history = [{"role": "user", "content": "Which shelf holds jam?"}, {"role": "assistant", "content": "Shelf 0."}]
        ans = await post(c2.url + "/v1/chat/completions", turn(history, "And honey?"))
        assert ans.status == 200 and ans.restored > 0
        assert list(pair.llama_c.slot_dir.glob("kvtier-restore-*.bin")) == []
        await c2.engine.drain(30)
