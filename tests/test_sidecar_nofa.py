"""Automatic mode in front of llama-servers without flash attention (``-fa off``).

Such a server stores V transposed (one row per element, all cells along it), so a restore cannot
be a list of slices of the chunks: kvtier builds each layer's V block. A hop between two such
nodes must still give one node's greedy tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.servers import LlamaServer, RedisProc, llama_server
from tests.sidecars import Sidecar, post, run_sidecar
from tests.test_sidecar import CHUNK, DOC, EXACT, settings_for, settle

pytestmark = pytest.mark.llama

NO_FLASH_ATTENTION = ("-fa", "off", *EXACT)


@pytest_asyncio.fixture(scope="module")
async def nodes(redis_srv: RedisProc,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Sidecar, Sidecar, LlamaServer]]:
    tmp = tmp_path_factory.mktemp("nofa")
    with llama_server(tmp, *NO_FLASH_ATTENTION) as la, llama_server(tmp, *NO_FLASH_ATTENTION) as lb, \
            llama_server(tmp, *NO_FLASH_ATTENTION) as direct:
        async with run_sidecar(settings_for(la, redis_srv.url, "node-a")) as a, \
                run_sidecar(settings_for(lb, redis_srv.url, "node-b")) as b:
            yield a, b, direct


async def test_a_hop_between_servers_without_flash_attention_matches_one_node(
        nodes: tuple[Sidecar, Sidecar, LlamaServer]) -> None:
    a, b, direct = nodes
    first = {"prompt": f"Inventory. {DOC[:800]}\nQuestion: how many marbles does box 4 hold?\nAnswer:",
             "n_predict": 8, "temperature": 0}
    ans = await post(a.url + "/completion", first)
    assert ans.status == 200 and ans.content == (await post(direct.url + "/completion", first)).content
    await settle(a)
    assert a.engine.target is not None and a.engine.target.v_trans  # what the server's saved state says
    # The next turn on B, which never saw the conversation: A's chunks and tail come from Redis.
    second = {**first, "prompt": first["prompt"] + ans.content + "\nQuestion: and box 6?\nAnswer:"}
    expected = await post(direct.url + "/completion", second)
    hop = await post(b.url + "/completion", second)
    assert hop.status == 200 and hop.content == expected.content, (hop.text, expected.text)
    assert hop.headers["X-KVTier-Restore-Tier"] == "redis" and hop.restored > 2 * CHUNK, hop.headers
    assert hop.prompt_n <= int(hop.headers["X-KVTier-Prompt-Tokens"]) - hop.restored + 1
    assert b.engine.target is not None and b.engine.target.v_trans
    assert b.metric("kvtier_restore_not_reused_total") == 0
