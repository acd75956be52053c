"""llama-server changing under a running sidecar, and turns that follow each other at once.

- A llama-server restarted under its sidecar (an OOM kill, a failed liveness probe): the next
  turn must know before it is forwarded, and restore from the tiers as on a fresh node.
- The next turn sent as soon as the last answer ended, to the same node: it keeps its own slot
  (waiting for that slot's save) instead of taking another one and recomputing.
- A model swapped behind the same URL, to another file or to other bytes at the same path, with
  the same KV layout: nothing of the old model is restored into the new one, and nothing the new
  one computes is stored under the old model's namespace.

Real llama-servers, a real Valkey, SmolLM2 and two generated models of one shape.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import redis

from sidecar import aftercare as aftercare_module
from sidecar.config import Settings
from tests.ggufgen import ModelShape, write_random_llama
from tests.servers import LlamaServer, RedisProc, llama_server, smollm2_path
from tests.sidecars import Sidecar, post, run_sidecar

pytestmark = pytest.mark.llama

CHUNK = 64
DOC = " ".join(f"Record {i}: the {['amber', 'teal', 'grey', 'plum'][i % 4]} jar on shelf {i} holds {i * 3} beads."
               for i in range(40))
SHAPE = ModelShape(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512)


def settings_for(llama: LlamaServer, redis_url: str) -> Settings:
    return Settings(llama_url=llama.url, slot_dir=str(llama.slot_dir), redis_url=redis_url, node_id="node",
                    chunk_tokens=CHUNK, cache_size=512 << 20, prefill_tps_prior=100.0)


def chat(history: list[dict[str, str]], question: str) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": "Answer from these records. " + DOC}, *history,
                         {"role": "user", "content": question}], "max_tokens": 8, "temperature": 0}


async def settle(sc: Sidecar) -> None:
    await sc.engine.drain(30)
    assert await sc.store.flush(30)


@pytest_asyncio.fixture(scope="module")
async def node(redis_srv: RedisProc, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[
        tuple[LlamaServer, Sidecar]]:
    with llama_server(tmp_path_factory.mktemp("restarts"), "-np", "2") as llama:
        async with run_sidecar(settings_for(llama, redis_srv.url)) as sc:
            yield llama, sc


async def test_a_restart_is_known_before_the_next_turn(node: tuple[LlamaServer, Sidecar]) -> None:
    llama, sc = node
    first = await post(sc.url + "/v1/chat/completions", chat([], "What does shelf 3 hold?"))
    assert first.status == 200
    await settle(sc)
    history = [{"role": "user", "content": "What does shelf 3 hold?"},
               {"role": "assistant", "content": first.content}]
    llama.restart()  # the sidecar keeps running; nothing waits for its health watcher
    second = await post(sc.url + "/v1/chat/completions", chat(history, "And shelf 7?"))
    assert second.status == 200
    # Restored from the tiers (the slot is empty now), not sent to a slot that no longer holds it.
    assert second.restored > 0 and second.prompt_n < 2 * CHUNK, second.headers
    assert first.prompt_n > 5 * CHUNK  # what a recompute would have cost


async def test_an_idle_sidecar_stays_sure_of_its_llama_server(node: tuple[LlamaServer, Sidecar]) -> None:
    """llama-server closes a connection idle for 5 s. The witness kvtier keeps open for itself
    outlives that, so a request after a pause (a tool call, a user reading) is not held up by a
    check of llama-server's identity first; and a restart still breaks it at once."""
    llama, sc = node
    assert (await post(sc.url + "/v1/chat/completions", chat([], "What does shelf 5 hold?"))).status == 200
    await settle(sc)
    await asyncio.sleep(7)  # past llama-server's idle timeout, and kvtier's own for relayed connections
    watcher = sc.engine.watcher
    checks = sc.metric("kvtier_server_checks_seconds_count")
    for _ in range(10):  # across a health check or two: none lost the witness
        assert watcher.confirmed
        await asyncio.sleep(0.25)
    assert (await post(sc.url + "/v1/chat/completions", chat([], "What does shelf 6 hold?"))).status == 200
    assert sc.metric("kvtier_server_checks_seconds_count") == checks
    await settle(sc)
    llama.restart()
    await asyncio.sleep(0.2)  # the loop, blocked by the restart, takes in the closed connection
    assert not watcher.confirmed


async def test_only_requests_count_as_waiting_for_an_identity_check(redis_srv: RedisProc, tmp_path: Path) -> None:
    # The sidecar's own background work (the model record, following purges) waits for
    # llama-server at start-up too; kvtier_server_checks_seconds is what requests waited (bench
    # neverworse read 15 s of start-up as requests' waits).
    with llama_server(tmp_path, "-np", "1") as llama:
        async with run_sidecar(settings_for(llama, redis_srv.url)) as sc:
            await asyncio.sleep(0.5)  # the background tasks are past their first check
            assert sc.engine.watcher.confirmed
            assert sc.metric("kvtier_server_checks_seconds_count") == 0
            assert (await post(sc.url + "/v1/chat/completions", chat([], "What does shelf 2 hold?"))).status == 200
            assert sc.metric("kvtier_server_checks_seconds_count") == 0  # confirmed: nothing waited


async def test_the_next_turn_at_once_keeps_its_own_slot(node: tuple[LlamaServer, Sidecar]) -> None:
    _, sc = node
    await settle(sc)
    history: list[dict[str, str]] = []
    slots, computed = [], []
    for question in ("What does shelf 11 hold?", "And shelf 12?", "And shelf 13?"):
        ans = await post(sc.url + "/v1/chat/completions", chat(history, question))  # no pause, no settle
        assert ans.status == 200
        slots.append(ans.headers["X-KVTier-Slot"])
        computed.append(ans.prompt_n)
        history += [{"role": "user", "content": question}, {"role": "assistant", "content": ans.content}]
    assert slots[1] == slots[0] and slots[2] == slots[0], slots
    assert max(computed[1:]) < CHUNK, computed  # only the new turn, not the history
    await settle(sc)


async def test_a_turn_planned_before_a_restart_does_not_judge_the_new_server(
        node: tuple[LlamaServer, Sidecar], monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn answered by the old server whose save comes after a restart: kvtier must not compare
    its prompt with what the new server's slot holds (they differ, and in-process chat rendering
    would be turned off for good); the save is skipped instead."""
    llama, sc = node
    assert await sc.engine.ensure_ready()
    await settle(sc)
    monkeypatch.setattr(aftercare_module, "SAVE_DELAY_S", 6.0)  # room for a restart before the save
    assert sc.metric("kvtier_prompt_in_process", step="render") == 1
    mismatches = sc.metric("kvtier_prompt_mismatches_total", step="render")
    skipped = sc.metric("kvtier_cache_errors_total", stage="server_changed")
    ans = await post(sc.url + "/v1/chat/completions", {**chat([], "What does shelf 5 hold?"), "id_slot": 1})
    assert ans.status == 200 and ans.headers["X-KVTier-Slot"] == "1"
    llama.restart()
    # The new server's slot 1 gets another conversation before the old turn's save looks at it.
    other = {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 2, "id_slot": 1}
    assert (await post(llama.url + "/v1/chat/completions", other)).status == 200
    await settle(sc)
    assert sc.metric("kvtier_cache_errors_total", stage="server_changed") == skipped + 1
    assert sc.metric("kvtier_prompt_mismatches_total", step="render") == mismatches
    assert sc.metric("kvtier_prompt_in_process", step="render") == 1


async def test_requests_that_queue_behind_one_identity_check_take_its_answer(
        node: tuple[LlamaServer, Sidecar], monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests that arrive together while llama-server is not confirmed (after 5 s idle, at
    start-up) check its identity once, not once each in turn: each check is two calls to
    llama-server, and requests let through one by one miss the batch the first one started."""
    _, sc = node
    watcher = sc.engine.watcher
    assert await sc.engine.ensure_ready()
    calls = 0
    slots = watcher.client.slots

    async def counted() -> list[dict[str, object]]:
        nonlocal calls
        calls += 1
        return await slots()

    monkeypatch.setattr(watcher.client, "slots", counted)
    watcher.doubt()
    assert all(await asyncio.gather(*(sc.engine.ensure_ready() for _ in range(6))))
    # The first begins a check at once; those that asked after it had begun (it may have asked
    # llama-server before they did) take the next one's answer: two checks, not six.
    assert calls <= 2
    # A doubt after those checks is not answered by them: the next request checks again.
    before = calls
    watcher.doubt()
    assert await sc.engine.ensure_ready()
    assert calls == before + 1


# -- a model swapped behind the same URL ----------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    tmp = tmp_path_factory.mktemp("models")
    return (str(write_random_llama(tmp / "r1.gguf", smollm2_path(), SHAPE, seed=1)),
            str(write_random_llama(tmp / "r2.gguf", smollm2_path(), SHAPE, seed=2)))


def chunk_keys(r: redis.Redis, namespace_id: str) -> set[bytes]:
    return set(r.keys(f"kvtier:{namespace_id}:c:*"))


async def test_a_swapped_model_never_gets_the_old_ones_kv(redis_srv: RedisProc, models: tuple[str, str],
                                                          tmp_path: Path) -> None:
    r1, r2 = models
    path = tmp_path / "model.gguf"  # what llama-server loads; replaced in place further down
    shutil.copyfile(r1, path)
    prompt = {"prompt": DOC, "n_predict": 6, "temperature": 0}
    longer = {**prompt, "prompt": DOC + " Record 40: the teal jar on shelf 40 holds 120 beads."}
    with llama_server(tmp_path, "-np", "2", model=str(path)) as llama, \
            llama_server(tmp_path, model=r2) as direct_r2, redis.Redis(port=redis_srv.port) as r:
        async with run_sidecar(settings_for(llama, redis_srv.url)) as sc:
            assert (await post(sc.url + "/completion", prompt)).status == 200
            await settle(sc)
            assert sc.engine.target is not None
            old_ns = sc.engine.target.namespace.id
            old_keys = chunk_keys(r, old_ns)
            assert len(old_keys) >= 5
            expected = (await post(direct_r2.url + "/completion", longer)).content

            # Other bytes at the same path (a model update in place), under a running sidecar.
            llama.stop()
            shutil.copyfile(r2, path)
            os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 1_000_000_000))
            llama.start()
            ans = await post(sc.url + "/completion", longer)
            assert ans.status == 200 and ans.restored == 0, ans.headers
            assert ans.content == expected
            await settle(sc)
            assert sc.engine.target is not None and sc.engine.target.namespace.id != old_ns
            assert chunk_keys(r, old_ns) == old_keys  # nothing of R2 stored under R1's namespace
            new_ns = sc.engine.target.namespace.id

            assert chunk_keys(r, new_ns)

            # Another file behind the same URL: back to R1's bytes, which find R1's namespace again.
            llama.stop()
            llama.model = r1
            llama.start()
            ans = await post(sc.url + "/completion", longer)
            assert ans.status == 200 and sc.engine.target.namespace.id == old_ns
            assert ans.restored > 0 and ans.headers["X-KVTier-Restore-Tier"] in ("memory", "redis")
