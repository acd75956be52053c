"""An answer aborted mid-stream keeps its prompt: a user pressing stop, an agent cancelling.

The client closes the stream after a few tokens and sends the same long prefix again with a new
ending. llama-server alone keeps the slot's KV and reuses the prefix; kvtier must not forget that
slot (it would send the re-prompt to another one and recompute), and stores what the slot holds, so
that the re-prompt reuses the prefix on another node too.

Real llama-servers (SmolLM2, two slots each), a real Valkey.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar import aftercare
from sidecar.config import Settings
from tests.servers import LlamaServer, RedisProc, llama_server
from tests.sidecars import Sidecar, post, run_sidecar

pytestmark = pytest.mark.llama

SYSTEM = "Answer from these records. " + " ".join(
    f"Record {i}: the {['amber', 'teal', 'grey', 'plum'][i % 4]} jar on shelf {i} holds {i * 3} beads."
    for i in range(40))


def chat(question: str, max_tokens: int) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0}


@contextlib.asynccontextmanager
async def node(tmp: Path, redis_url: str, name: str,
               llama_args: tuple[str, ...] = ("-np", "2")) -> AsyncIterator[tuple[LlamaServer, Sidecar]]:
    with llama_server(tmp / name, *llama_args) as llama:
        settings = Settings(llama_url=llama.url, slot_dir=str(llama.slot_dir), redis_url=redis_url, node_id=name,
                            chunk_tokens=64, cache_size=256 << 20, prefill_tps_prior=100.0)
        async with run_sidecar(settings) as sc:
            yield llama, sc


async def stream_then_leave(url: str, body: dict[str, Any], events: int) -> None:
    """Stream ``body`` and drop the connection after ``events`` SSE events."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        r = await s.post(url, json={**body, "stream": True})
        assert r.status == 200
        seen = 0
        async for line in r.content:
            if line.startswith(b"data: ") and b"[DONE]" not in line:
                seen += 1
                if seen >= events:
                    break
        assert seen >= events
        r.close()


async def prefix_tokens(llama: LlamaServer) -> int:
    """Tokens the two prompts below share: the rendered system message and the user's turn start."""
    async with aiohttp.ClientSession() as s:
        async with s.post(llama.url + "/apply-template", json=chat("Q", 1)) as r:
            text = (await r.json())["prompt"]
        async with s.post(llama.url + "/tokenize", json={"content": text[:text.index("Q")]}) as r:
            return len((await r.json())["tokens"])


async def test_an_aborted_answer_keeps_its_prefix_here_and_on_another_node(
        redis_srv: RedisProc, tmp_path: Path) -> None:
    async with node(tmp_path, redis_srv.url, "a") as (llama_a, a), node(tmp_path, redis_srv.url, "b") as (_, b):
        shared = await prefix_tokens(llama_a)
        assert shared > 600
        # Another conversation (nothing in common) used the other slot first: without kvtier's record
        # of the aborted slot, the re-prompt would take that least recently used slot and recompute.
        other = {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 2}
        assert (await post(a.url + "/v1/chat/completions", other)).status == 200
        await stream_then_leave(a.url + "/v1/chat/completions", chat("Tell a long story about the jars.", 300), 16)
        await a.engine.drain(30)
        assert await a.store.flush(30)
        assert a.metric("kvtier_cache_errors_total", stage="save") == 0

        here = await post(a.url + "/v1/chat/completions", chat("What does shelf 7 hold?", 8))
        assert here.status == 200
        assert here.body["timings"]["cache_n"] >= 0.95 * shared, (here.body["timings"], shared)

        there = await post(b.url + "/v1/chat/completions", chat("What does shelf 9 hold?", 8))
        assert there.status == 200
        assert there.restored >= 0.95 * shared, (there.headers, shared)  # chunks, then a prefix reference
        assert there.body["timings"]["cache_n"] >= 0.95 * shared, (there.body["timings"], shared)


async def test_a_reprompt_sent_the_moment_the_client_left_finds_the_aborted_slot(
        redis_srv: RedisProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The re-prompt arrives while kvtier still saves the aborted slot: it waits for that slot (the
    slot holds the prompt, as on llama-server alone) instead of taking a colder one and
    recomputing; and the save it waited for is stored, so another node restores the prefix too.
    The save starts late here (as on a loaded host), so the re-prompt surely finds it running."""
    monkeypatch.setattr(aftercare, "SAVE_DELAY_S", 1.5)

    def text(question: str, n: int) -> dict[str, Any]:
        return {"prompt": f"{SYSTEM}\nQuestion: {question}\nAnswer:", "n_predict": n, "temperature": 0}

    async with node(tmp_path, redis_srv.url, "a") as (llama_a, a), node(tmp_path, redis_srv.url, "b") as (_, b):
        async with aiohttp.ClientSession() as s, s.post(llama_a.url + "/tokenize", json={"content": SYSTEM}) as r:
            shared = len((await r.json())["tokens"])
        assert (await post(a.url + "/completion", {"prompt": "Name three rivers.", "n_predict": 2})).status == 200
        await stream_then_leave(a.url + "/completion", text("Tell a long story about the jars.", 300), 16)

        here = await post(a.url + "/completion", text("What does shelf 7 hold?", 8))  # no pause
        assert here.status == 200
        assert here.body["timings"]["cache_n"] >= 0.95 * shared, (here.body["timings"], shared)

        await a.engine.drain(30)
        assert await a.store.flush(30)
        there = await post(b.url + "/completion", text("What does shelf 9 hold?", 8))
        assert there.status == 200
        assert there.body["timings"]["cache_n"] >= 0.95 * shared, (there.body["timings"], shared)
