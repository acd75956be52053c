"""kvtier and llama-server's own prompt cache (``--cache-ram``) on one node.

llama-server alone copies a slot's prompt into its host-memory cache when a completion overwrites
most of it, and loads it back for a prompt that continues it, in the same task. kvtier learns
whether a llama-server does that (three one-token completions when it first sees it), and leaves such
a prompt to it instead of restoring from its own tiers: a kvtier restore is a slot action that waits
in llama-server's queue. With the cache off, kvtier restores the prompt itself.

Real llama-servers (SmolLM2, one slot), a real Valkey.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.servers import RedisProc
from tests.sidecars import Sidecar, post
from tests.test_aborted_answers import SYSTEM, node
from tests.test_hardening_storage import completion as text

pytestmark = pytest.mark.llama

OTHER = " ".join(f"Verse {i}: the tide at cove {i} turns at {i % 12} o'clock." for i in range(30))


async def overwrite_then_return(sc: Sidecar) -> tuple[int, int, int]:
    """A prompt, an unrelated one in the same slot, then the first one's prefix with a new question:
    (tokens kvtier restored, tokens llama-server reused, tokens computed) of the last."""
    for prompt in (SYSTEM + "\nQuestion: shelf 7?\nAnswer:", OTHER):
        answer = await post(sc.url + "/completion", text(prompt, 2))
        assert answer.status == 200, answer.text
        assert await sc.engine.drain(30)
    back = await post(sc.url + "/completion", text(SYSTEM + "\nQuestion: shelf 9?\nAnswer:", 2))
    assert back.status == 200, back.text
    return back.restored, int(back.body["timings"]["cache_n"]), back.prompt_n


async def test_a_prompt_llama_server_caches_itself_is_left_to_it(redis_srv: RedisProc, tmp_path: Path) -> None:
    async with node(tmp_path, redis_srv.url, "on", ("-np", "1", "--cache-ram", "256")) as (_, sc):
        assert await sc.engine.ensure_ready()
        assert sc.engine.watcher.llama_cache.on  # found by its three probe completions
        restored, reused, computed = await overwrite_then_return(sc)
        assert restored == 0  # left to llama-server, which loaded it from its own cache
        assert reused > 500 and computed < 20, (reused, computed)
        assert sc.metric("kvtier_cost_decisions_total", decision="llama_cache") == 1
        assert sc.engine.watcher.llama_cache.on  # it served what the mirror promised


async def test_without_llama_servers_cache_kvtier_restores_the_prompt(redis_srv: RedisProc, tmp_path: Path) -> None:
    async with node(tmp_path, redis_srv.url, "off", ("-np", "1")) as (_, sc):  # the tests' --cache-ram 0
        assert await sc.engine.ensure_ready()
        assert not sc.engine.watcher.llama_cache.on
        restored, reused, _ = await overwrite_then_return(sc)
        assert restored > 500 and reused >= restored, (restored, reused)
        assert sc.metric("kvtier_cost_decisions_total", decision="llama_cache") == 0
