"""Tenants against a real sidecar, llama-server and Valkey (docs/security.md, *Tenants* and *Side
channels*): what one tenant can learn of, or do to, another's prompts and sessions."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import redis

from integrations.pendingflow import pending_marks
from sidecar.config import Settings
from sidecar.slotsview import SHOWN_FIELDS
from tests.servers import LlamaServer, RedisProc, llama_server
from tests.sidecars import Node, post, run_sidecar
from tiers.pending import PendingMark

pytestmark = pytest.mark.llama

TOKEN = "tenants-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
CHUNK = 64
# About 300 tokens: several chunks, a second or two to compute on 2 cores.
DOC = " ".join(f"Ledger {i}: vault {i * 7919 % 1000} holds {i * 13} bars of {['gold', 'silver'][i % 2]}."
               for i in range(25))



def settings_for(llama: LlamaServer, redis_url: str, **kw: Any) -> Settings:
    return replace(Settings(llama_url=llama.url, slot_dir=str(llama.slot_dir), redis_url=redis_url, node_id="ten",
                            chunk_tokens=CHUNK, cache_size=256 << 20, auth_token=TOKEN), **kw)


@pytest_asyncio.fixture(scope="module")
async def node(redis_srv: RedisProc, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Node]:
    tmp: Path = tmp_path_factory.mktemp("tenants")
    with llama_server(tmp, "-np", "2") as llama:  # 2 slots of 2,048 tokens
        async with run_sidecar(settings_for(llama, redis_srv.url)) as sc:
            assert await sc.engine.ensure_ready()
            yield Node(sc, llama, redis_srv)


def mann_whitney_z(xs: list[float], ys: list[float]) -> float:
    """The Mann-Whitney U statistic of ``xs`` against ``ys`` as a normal z score (no ties correction):
    |z| < 2 is what two samples of one distribution give 95% of the time."""
    u = sum(1.0 if x > y else 0.5 if x == y else 0.0 for x in xs for y in ys)
    n1, n2 = len(xs), len(ys)
    return (u - n1 * n2 / 2) / (n1 * n2 * (n1 + n2 + 1) / 12) ** 0.5


# -- 4: the in-process tokenizer's memo is per tenant -------------------------------------------------------


def _random_text(rng: random.Random, chars: int) -> str:
    words = []
    while sum(map(len, words)) + len(words) < chars:
        words.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))))
    return " ".join(words)[:chars]


async def test_a_tenant_cannot_time_its_guess_of_another_tenants_prompt(node: Node) -> None:
    """Tenant A sends 40 system prompts of 10,000 characters (more tokens than a slot holds, so
    llama-server refuses them at once and the time is the sidecar's). Tenant B then sends, in turn,
    32 of them exactly, 32 fresh texts of the same length, and 8 that share A's first 95%. Whatever
    B can observe (kvtier_prompt_seconds, the request's own latency) is the same for a right and a
    wrong guess, because B's tokenizing never reuses what was tokenized for A."""
    prompts = node.sc.engine.prompts
    assert prompts.render_here and prompts.tokenize_here and prompts.vocab is not None
    rng = random.Random(4)
    secrets = [_random_text(rng, 10_000) for _ in range(40)]
    url = node.sc.url + "/v1/chat/completions"

    def chat(system: str) -> dict[str, Any]:
        return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Summarize."}],
                "max_tokens": 1}

    for text in secrets:
        ans = await post(url, chat(text), headers={"X-KVTier-Salt": "tenant-a"})
        assert ans.status == 400 and "context" in ans.text, ans.text[:300]  # refused by llama-server, after kvtier

    async def guess(text: str) -> tuple[float, float, int]:
        """kvtier_prompt_seconds of the request, its latency, and the bytes the memo served it."""
        before_s = node.sc.metric("kvtier_prompt_seconds_sum", way="in_process")
        before = prompts.vocab.memo_stats()  # type: ignore[union-attr]
        t0 = time.perf_counter()
        ans = await post(url, chat(text), headers={"X-KVTier-Salt": "tenant-b"})
        took = time.perf_counter() - t0
        after = prompts.vocab.memo_stats()  # type: ignore[union-attr]
        assert ans.status == 400, ans.text[:300]
        reused = after.hit_bytes - before.hit_bytes + after.extended_bytes - before.extended_bytes
        return node.sc.metric("kvtier_prompt_seconds_sum", way="in_process") - before_s, took, reused

    await guess(_random_text(rng, 10_000))  # B's first request: its memo learns the template's short pieces
    right: list[tuple[float, float, int]] = []
    wrong: list[tuple[float, float, int]] = []
    for text in secrets[:32]:
        right.append(await guess(text))
        wrong.append(await guess(_random_text(rng, 10_000)))
    near = [await guess(text[:9_500] + _random_text(rng, 500)) for text in secrets[32:]]
    # The mechanism: nothing A's requests left in the memo serves B (only the short template pieces B sent itself).
    assert max(r[2] for r in right + wrong + near) < 100, [r[2] for r in right + near]
    ratios = {}
    for i, what in ((0, "kvtier_prompt_seconds"), (1, "latency")):
        r, w, n = ([x[i] for x in xs] for xs in (right, wrong, near))
        ratios[what] = (statistics.median(r) / statistics.median(w), statistics.median(n) / statistics.median(w))
        print(f"{what}: median right {statistics.median(r) * 1e3:.2f} ms, wrong {statistics.median(w) * 1e3:.2f} ms, "
              f"95% {statistics.median(n) * 1e3:.2f} ms, ratio {ratios[what][0]:.2f}, "
              f"Mann-Whitney z {mann_whitney_z(r, w):.2f}")
    # Generous (a busy 2-core machine): a memo hit costs a tenth of a miss or less.
    assert all(0.5 < ratio < 2 for pair in ratios.values() for ratio in pair), ratios


# -- 5: a gateway's header names the tenant, even empty -----------------------------------------------------


async def test_a_present_salt_header_names_the_tenant_whatever_the_body_says(node: Node) -> None:
    """Tenant a's prompt is hot in a slot and stored in the tiers. A request whose gateway named the
    unsalted tenant (an empty header) and whose body claims ``cache_salt: a`` is the unsalted tenant:
    it reuses and restores nothing of a's. Without the header, the body's salt is the tenant."""
    url = node.sc.url + "/completion"
    prompt = "Tenant a's ledger. " + DOC
    first = await post(url, {"prompt": prompt, "n_predict": 2, "temperature": 0}, headers={"X-KVTier-Salt": "a"})
    assert first.status == 200, first.text
    await node.sc.engine.drain(30)
    claim = {"prompt": prompt + " Which vault holds most?", "n_predict": 2, "temperature": 0, "cache_salt": "a"}
    ans = await post(url, claim, headers={"X-KVTier-Salt": ""})
    assert ans.status == 200, ans.text
    assert ans.body["timings"]["cache_n"] == 0 and ans.restored == 0, (ans.body["timings"], ans.headers)
    await node.sc.engine.drain(30)
    # No header: the body's cache_salt (a secret the client holds) is its tenant.
    own = await post(url, {**claim, "prompt": prompt + " And the least?"})
    assert own.status == 200 and own.body["timings"]["cache_n"] + own.restored >= CHUNK * 4, own.body["timings"]
    await node.sc.engine.drain(30)
    # A header given twice, or a salt that is not a string: a clear 400, never a guess.
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json={"prompt": "x", "n_predict": 1},
                          headers=[("X-KVTier-Salt", "b"), ("X-KVTier-Salt", "a")]) as r:
            assert r.status == 400 and "X-KVTier-Salt" in (await r.json())["error"]["message"]
        async with s.get(node.sc.url + "/v1/sessions", headers=[*BEARER.items(), ("X-KVTier-Salt", "b"),
                                                                ("X-KVTier-Salt", "a")]) as r:
            assert r.status == 400, await r.text()
    for salt in (7, ["a"], {"a": 1}, True):
        bad = await post(url, {"prompt": "x", "n_predict": 1, "cache_salt": salt})
        assert bad.status == 400 and "cache_salt" in bad.body["error"]["message"], (salt, bad.text)
    # llama-server's own prompt endpoints are refused to a request whose gateway named a tenant, even the unsalted one.
    infill = await post(node.sc.url + "/infill", {"input_prefix": prompt, "n_predict": 1},
                        headers={"X-KVTier-Salt": ""})
    assert infill.status == 403, infill.text


# -- 6: a completion that saves a session needs the token ---------------------------------------------------


async def test_a_completion_saving_a_session_needs_the_token(node: Node) -> None:
    """An operator's session (saved by a completion with the token) is not overwritten by a
    completion that names it without the token: 401, as ``PUT /v1/sessions`` answers."""
    url = node.sc.url + "/completion"
    saved = await post(url, {"prompt": "Operator's runbook. " + DOC, "n_predict": 2, "temperature": 0},
                       headers={**BEARER, "X-Session-Id": "ops-runbook"})
    assert saved.status == 200, saved.text
    await node.sc.engine.drain(30)

    async def n_tokens() -> int:
        async with aiohttp.ClientSession() as s, s.get(node.sc.url + "/v1/sessions/ops-runbook", headers=BEARER) as r:
            assert r.status == 200, await r.text()
            return int((await r.json())["n_tokens"])

    held = await n_tokens()
    assert held > CHUNK * 4
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        for path in ("/completion", "/v1/chat/completions"):
            body = {"prompt": "Overwritten.", "messages": [{"role": "user", "content": "Overwritten."}],
                    "n_predict": 2, "max_tokens": 2}
            ans = await post(node.sc.url + path, body, headers={**headers, "X-Session-Id": "ops-runbook"})
            assert ans.status == 401 and ans.body["error"]["code"] == 401, (path, headers, ans.text)
            assert "X-Session-Id" in ans.body["error"]["message"]
    await node.sc.engine.drain(30)
    assert await n_tokens() == held
    async with aiohttp.ClientSession() as s, s.put(node.sc.url + "/v1/sessions/ops-runbook", json={}) as r:
        assert r.status == 401  # the sessions API, for comparison
    plain = await post(url, {"prompt": "No session here.", "n_predict": 2})  # completions stay open (no --auth-all)
    assert plain.status == 200, plain.text


# -- 7: /slots shows nothing of the prompts; several completions per request are refused --------------------


async def test_slots_needs_the_token_and_shows_no_prompt(node: Node) -> None:
    ans = await post(node.sc.url + "/completion", {"prompt": "Tenant a's plan. " + DOC[:200], "n_predict": 2},
                     headers={"X-KVTier-Salt": "a"})
    assert ans.status == 200
    await node.sc.engine.drain(30)
    async with aiohttp.ClientSession() as s:
        for method in ("GET", "HEAD"):
            async with s.request(method, node.sc.url + "/slots", headers={"X-KVTier-Salt": "b"}) as r:
                assert r.status == 401, (method, r.status)
        async with s.get(node.sc.url + "/slots", headers=BEARER) as r:
            assert r.status == 200
            text = await r.text()
            slots = await r.json()
        async with s.get(node.sc.url + "//slots?fail_on_no_slot=1", headers=BEARER) as r:
            assert r.status == 200
            assert await r.json() == slots
        async with s.get(node.llama.url + "/slots") as r:  # what llama-server itself lists: the prompts' lengths
            assert "n_prompt_tokens" in await r.text()
    assert [s["id"] for s in slots] == [0, 1] and all(set(s) <= set(SHOWN_FIELDS) for s in slots), slots
    assert "n_prompt_tokens" not in text and "n_decoded" not in text


async def test_a_request_for_several_completions_cannot_take_another_tenants_slot(node: Node) -> None:
    """llama-server copies an ``n: 2`` request's prompt into another idle slot it picks itself:
    tenant a's. Refused (400); a list of prompts is pinned to the one slot kvtier took for b."""
    url = node.sc.url + "/completion"
    prompt = "Tenant a's hot notes. " + DOC
    first = await post(url, {"prompt": prompt, "n_predict": 2, "temperature": 0}, headers={"X-KVTier-Salt": "a"})
    assert first.status == 200, first.text
    await node.sc.engine.drain(30)
    b = {"X-KVTier-Salt": "b"}
    for path, body in (("/completion", {"prompt": "Hi", "n": 2}), ("/v1/completions", {"prompt": "Hi", "n_cmpl": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 2.0}),
                       ("/completion", {"prompt": "Hi", "n": 2, "cache_prompt": False})):
        ans = await post(node.sc.url + path, {**body, "max_tokens": 2}, headers=b)
        assert ans.status == 400 and ans.body["error"]["code"] == 400, (path, ans.text)
        await node.sc.engine.drain(30)
    several = await post(url, {"prompt": ["One, two.", "Three, four."], "n_predict": 2}, headers=b)
    assert several.status == 200 and len(several.body) == 2, several.text
    await node.sc.engine.drain(30)
    again = await post(url, {"prompt": prompt + " Which vault?", "n_predict": 2, "temperature": 0},
                       headers={"X-KVTier-Salt": "a"})
    assert again.status == 200 and again.headers["X-KVTier-Slot"] == first.headers["X-KVTier-Slot"]
    assert again.restored == 0  # its slot was still hot: nothing to restore
    assert again.body["timings"]["cache_n"] >= first.body["timings"]["prompt_n"] - 1, again.body["timings"]


# -- 13: a session request waits for saves in flight once, not twice ----------------------------------------


async def test_a_session_request_waits_for_a_planted_mark_at_most_once(node: Node) -> None:
    """A mark nobody clears stands on the request's prompt; the session it names has never been
    saved. The session's lookup and then the prefix's both saw the mark, and each waited the whole
    ``--save-wait``: 2 s for a 1 s bound. Now they share one bound."""
    async with run_sidecar(settings_for(node.llama, node.redis.url, save_wait=1.0, node_id="ten-wait",
                                        prefill_tps_prior=50.0)) as sc:
        assert await sc.engine.ensure_ready()
        body = {"messages": [{"role": "system", "content": "Waiting room. " + DOC},
                             {"role": "user", "content": "Which vault holds the most?"}], "max_tokens": 2}
        prompt = await sc.engine.prompts.prompt_for("chat", body)
        assert prompt is not None and prompt.tokens.size > 4 * CHUNK
        marks = [key for key, n in pending_marks(sc.engine.target.namespace, prompt.tokens) if n % CHUNK == 0]
        with redis.Redis(port=node.redis.port) as r:
            r.set(marks[-1], PendingMark(int(prompt.tokens.size), "nobody").encode())
            try:
                ans = await post(sc.url + "/v1/chat/completions", body,
                                 headers={**BEARER, "X-Session-Id": "never-saved-before"})
            finally:
                r.delete(marks[-1])
        assert ans.status == 200, ans.text
        waited = sc.metric("kvtier_save_wait_seconds_sum")
        overhead = sc.metric("kvtier_overhead_seconds_sum")
        print(f"waited {waited:.2f} s in {sc.metric('kvtier_save_wait_seconds_count'):.0f} wait(s); "
              f"sidecar time before forwarding {overhead:.2f} s")
        assert 0.9 <= waited < 1.3 and sc.metric("kvtier_save_wait_seconds_count") == 1
        assert overhead < 1.5
        await sc.engine.drain(30)
