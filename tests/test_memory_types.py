"""Every memory type hops between nodes through kvtier: sliding-window, hybrid and recurrent models.

A conversation is answered on node A, then continued on node B and back on A, each node's
llama-server restarted just before its turn (a rolling update; the sidecars keep running). Each
hop must compute only the new turn's tokens, restoring the rest from the tiers, and answer with the
greedy tokens llama-server gives when it moves the conversation itself, by its own slot save and
restore (same flags, threads and batch sizes, the same restored/computed boundary).

- Gemma 3 270M (real weights, sliding window 512) on default flags and with ``--swa-full``: the
  state's first KV cache goes into prefix chunks, its window (two masked cells longer) with the
  tail, restored only whole.
- A generated lfm2 (hybrid: attention + short convolutions): the attention cache in chunks, the
  recurrent state with the tail.
- A generated mamba2 (recurrent memory alone): no chunk, one tail of every token whose rest is
  the recurrent state.

Real llama-servers, a real Valkey, in-process sidecars.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

import sidecar.http.witness as witness_module
from integrations.stateparse import parse_state
from integrations.swa import gguf_sliding_window, pad_swa_window
from sidecar.config import Settings
from tests.ggufgen import ModelShape, write_random_model
from tests.servers import LlamaServer, RedisProc, gemma3_path, llama_server, smollm2_path
from tests.sidecars import Sidecar, post, run_sidecar

pytestmark = pytest.mark.llama

CHUNK = 64
TOPICS = ("rivers", "mountains", "bridges", "libraries", "orchards", "harbors", "railways", "deserts")
QUESTIONS = ("Which note mentions bridges first? Answer briefly.", "And which mentions deserts first?",
             "And the last note about harbors?")


def notes(n: int) -> str:
    return " ".join(f"Note {i}: the {TOPICS[i % len(TOPICS)]} of region {i * 7 % 31} were surveyed in year "
                    f"{1800 + i * 3}, and the report lists {i * 13 % 97} sites worth a visit." for i in range(n))


@dataclass
class Hop:
    node: str
    prompt_n: int
    restored: int
    content: str


async def _node(stack: AsyncExitStack, tmp: Path, name: str, model: str, flags: tuple[str, ...],
                redis_url: str, **extra: Any) -> tuple[LlamaServer, Sidecar]:
    llama = stack.enter_context(llama_server(tmp / name, *flags, model=model))
    settings = Settings(llama_url=llama.url, slot_dir=str(llama.slot_dir), redis_url=redis_url, node_id=name,
                        chunk_tokens=CHUNK, cache_size=256 << 20, **extra)
    sc = await stack.enter_async_context(run_sidecar(settings))
    assert await sc.engine.ensure_ready()
    # These tests are of what a restore does, not of whether one is chosen: a generated model
    # computes 300 tokens in ~25 ms, which a learned rate can price below a restore's fixed cost
    # (it did on a CI run: the last hop recomputed all 336 tokens by the cost model's choice).
    sc.pin_prefill_rate(50.0)
    return llama, sc


async def _chat_hops(tmp: Path, model: str, flags: tuple[str, ...], redis_url: str) -> tuple[list[Hop], list[str]]:
    """The conversation over A, B, A through kvtier (each llama-server restarted before its
    turn), and llama-server's own answers when it moves the conversation (``_own_restores``)."""
    with redis.Redis.from_url(redis_url) as r:
        r.flushall()  # chunks another test computed with other flags differ in their last bits
    messages: list[dict[str, str]] = [{"role": "user", "content": notes(40) + "\n" + QUESTIONS[0]}]
    body: dict[str, Any] = {"max_tokens": 12, "temperature": 0}
    hops: list[Hop] = []
    async with AsyncExitStack() as stack:
        nodes = {name: await _node(stack, tmp, name, model, flags, redis_url) for name in ("a", "b")}
        for turn, name in enumerate(("a", "b", "a")):
            llama, sc = nodes[name]
            if turn:
                await nodes["a" if name == "b" else "b"][1].engine.drain(30)  # the last turn is saved
                assert await nodes["a" if name == "b" else "b"][1].store.flush(30)
                llama.restart()
                messages.append({"role": "user", "content": QUESTIONS[turn]})
            ans = await post(sc.url + "/v1/chat/completions", {**body, "messages": messages})
            assert ans.status == 200, ans.text[:300]
            hops.append(Hop(name, ans.prompt_n, ans.restored, ans.content))
            messages.append({"role": "assistant", "content": ans.content})
    reference = await _own_restores(tmp, model, flags, [
        {**body, "messages": messages[:1 + 2 * turn]} for turn in range(3)], "/v1/chat/completions")
    return hops, [str(r["choices"][0]["message"]["content"]) for r in reference]


async def _own_restores(tmp: Path, model: str, flags: tuple[str, ...], bodies: list[dict[str, Any]],
                        path: str) -> list[dict[str, Any]]:
    """llama-server alone moving the same conversation: each turn on a fresh server that restored
    the slot the last one saved (its own slot save and restore), the reference a hop through kvtier
    is compared with: the same restored cells and the same computed turn. (A server that kept its
    slot is no reference for a sliding window with --swa-full: it holds cells a saved window
    leaves out, and its greedy tokens differ from its own restore's, measured on Gemma 3.) On
    default flags a saved window is padded as kvtier pads it (without, llama-server recomputes
    everything: another split)."""
    answers: list[dict[str, Any]] = []
    state: bytes | None = None
    n_swa = gguf_sliding_window(model)
    for turn, body in enumerate(bodies):
        with llama_server(tmp / f"reference-{turn}", *flags, model=model) as ref:
            if state is not None:
                st = parse_state(state)
                if st.memory_kind == "kv_pair" and "--swa-full" not in flags:
                    state = bytes(pad_swa_window(st, n_swa))
                (ref.slot_dir / "r.bin").write_bytes(state)
                assert (await post(ref.url + "/slots/0?action=restore", {"filename": "r.bin"})).status == 200
            ans = await post(ref.url + path, {**body, "id_slot": 0, "cache_prompt": True})
            assert ans.status == 200 and (turn == 0 or ans.body["timings"]["cache_n"] > 0), ans.text[:300]
            answers.append(ans.body)
            assert (await post(ref.url + "/slots/0?action=save", {"filename": "s.bin"})).status == 200
            state = (ref.slot_dir / "s.bin").read_bytes()
    return answers


@pytest.mark.parametrize("flags", [(), ("--swa-full",)], ids=["default", "swa-full"])
async def test_a_sliding_window_chat_hops_nodes(redis_srv: RedisProc, tmp_path: Path, flags: tuple[str, ...]) -> None:
    hops, reference = await _chat_hops(tmp_path, gemma3_path(), flags, redis_srv.url)
    assert hops[0].prompt_n > 1000  # turn 1: the whole document, computed
    for hop in hops[1:]:
        assert hop.restored > 1000 and hop.prompt_n < CHUNK, hop  # only the new turn
    assert [h.content for h in hops] == reference


async def _token_hops(tmp: Path, model: str, redis_url: str,
                      headers: dict[str, str] | None = None) -> tuple[list[Hop], list[list[int]]]:
    """The same with token-id prompts (a generated model's template is no chat's)."""
    prompt = list(range(1000, 1300))
    body: dict[str, Any] = {"n_predict": 8, "temperature": 0, "return_tokens": True}
    hops: list[Hop] = []
    answers: list[list[int]] = []
    async with AsyncExitStack() as stack:
        nodes = {name: await _node(stack, tmp, name, model, ("-c", "2048"), redis_url) for name in ("a", "b")}
        for turn, name in enumerate(("a", "b", "a")):
            llama, sc = nodes[name]
            if turn:
                other = nodes["a" if name == "b" else "b"][1]
                await other.engine.drain(30)
                assert await other.store.flush(30)
                llama.restart()
                prompt += list(range(2000 + 10 * turn, 2010 + 10 * turn))
            ans = await post(sc.url + "/completion", {**body, "prompt": prompt}, headers=headers)
            assert ans.status == 200, ans.text[:300]
            hops.append(Hop(name, ans.prompt_n, ans.restored, ans.content))
            answers.append(ans.body["tokens"])
            prompt += ans.body["tokens"]
    seq, bodies = list(range(1000, 1300)), []
    for turn in range(3):
        if turn:
            seq += list(range(2000 + 10 * turn, 2010 + 10 * turn))
        bodies.append({**body, "prompt": list(seq)})
        seq += answers[turn]  # the hop's answer, so both continue the same sequence
    reference = [r["tokens"] for r in await _own_restores(tmp, model, ("-c", "2048"), bodies, "/completion")]
    return hops, [answers, reference]


RECURRENT = {"lfm2": ModelShape(attn_layers=(1, 3), conv_kernel=4),  # hybrid: layers 0, 2 short convolutions
             "mamba2": ModelShape(conv_kernel=4, ssm_state=16)}  # recurrent memory alone


@pytest.mark.parametrize("session", [None, "agent-1"], ids=["prefix", "session"])
@pytest.mark.parametrize("arch", list(RECURRENT))
async def test_a_model_with_recurrent_memory_hops_nodes(redis_srv: RedisProc, tmp_path: Path, arch: str,
                                                       session: str | None) -> None:
    """Hybrid (lfm2) and recurrent-only (mamba2) memory: automatic prefix restores, and with
    ``X-Session-Id`` the session saved after each turn."""
    model = str(write_random_model(tmp_path / f"{arch}.gguf", smollm2_path(), RECURRENT[arch], arch=arch, seed=11))
    with redis.Redis.from_url(redis_srv.url) as r:
        r.flushall()
    hops, (answers, reference) = await _token_hops(tmp_path, model, redis_srv.url,
                                                   {"X-Session-Id": session} if session else None)
    for hop in hops[1:]:
        assert hop.restored > 250 and hop.prompt_n <= 12, hop  # only the new tokens (and the last answer token)
    assert answers == reference


async def test_a_restart_before_any_task_is_not_vouched_for_by_a_witness_opened_after_it(
        redis_srv: RedisProc, tmp_path: Path) -> None:
    """A recurrent model's slots run no task while kvtier learns them, so no task id can show a
    restart. The witness connection kvtier keeps reopens to the new process within 2 s; a check
    then finds nothing that tells the processes apart, and must not take that new connection as
    its witness (the restart would never be noticed): the next request checks again."""
    model = str(write_random_model(tmp_path / "mamba2.gguf", smollm2_path(), RECURRENT["mamba2"], arch="mamba2",
                                   seed=11))
    async with AsyncExitStack() as stack:
        llama, sc = await _node(stack, tmp_path, "a", model, ("-c", "2048"), redis_srv.url)
        watcher = sc.engine.watcher
        table = watcher.slots
        assert table is not None and all(slot.task_id is None for slot in table.slots)
        await asyncio.to_thread(llama.restart)
        await asyncio.sleep(2 * witness_module.INTERVAL_S + 0.5)  # the witness reopened, to the new process
        assert not watcher.confirmed
        assert await sc.engine.ensure_ready()  # a check: the same model, and no task id to compare
        assert not watcher.confirmed


@pytest.mark.parametrize("prompt_end", [True, False], ids=["save-prompt-end", "without"])
async def test_a_next_prompt_that_drops_the_answer_restores_the_state_at_the_prompts_end(
        redis_srv: RedisProc, tmp_path: Path, prompt_end: bool) -> None:
    """A thinking model's template drops the last answer's reasoning from the next prompt, which
    then continues the prompt but not the answer. A hybrid state holds one position only, so the
    state after the answer serves no such prompt; with ``--save-prompt-end`` the state at the
    prompt's end (its last token left to the request) is stored too, and restores on another node."""
    model = str(write_random_model(tmp_path / "lfm2.gguf", smollm2_path(), RECURRENT["lfm2"], arch="lfm2", seed=11))
    with redis.Redis.from_url(redis_srv.url) as r:
        r.flushall()
    first = list(range(1000, 1300))
    second = [*first, *range(3000, 3010)]  # not the answer: as if the template had dropped it
    body: dict[str, Any] = {"n_predict": 8, "temperature": 0, "return_tokens": True}
    async with AsyncExitStack() as stack:
        nodes = {name: await _node(stack, tmp_path, name, model, ("-c", "2048"), redis_srv.url,
                                   save_prompt_end=prompt_end) for name in ("a", "b")}
        one = await post(nodes["a"][1].url + "/completion", {**body, "prompt": first})
        assert one.status == 200
        await nodes["a"][1].engine.drain(30)
        assert await nodes["a"][1].store.flush(30)
        two = await post(nodes["b"][1].url + "/completion", {**body, "prompt": second})
        assert two.status == 200
        await nodes["b"][1].engine.drain(30)  # its answer's timings are counted there
        stored = nodes["a"][1].metric("kvtier_prompt_end_saves_total", outcome="stored")
        computed = nodes["b"][1].metric("kvtier_tokens_recomputed_total")
    if not prompt_end:
        assert stored == 0 and two.restored == 0 and computed == two.prompt_n == len(second)
        return
    assert stored == 1
    # B restored all of the first prompt but its last token, and computed only the rest: in two
    # steps, as every prompt with --save-prompt-end (its own prompt's end is saved before its answer).
    assert two.restored == len(first) - 1 and computed == len(second) - len(first) + 1 and two.prompt_n == 1
    # llama-server alone, the same split: the first prompt but its last token computed, the slot
    # saved and restored on a fresh server, the second prompt but its last token, then all of it.
    with llama_server(tmp_path / "ref-a", "-c", "2048", model=model) as ref:
        pre = await post(ref.url + "/completion", {"prompt": first[:-1], "n_predict": 0, "id_slot": 0,
                                                   "cache_prompt": True})
        assert pre.status == 200
        assert (await post(ref.url + "/slots/0?action=save", {"filename": "s.bin"})).status == 200
        state = (ref.slot_dir / "s.bin").read_bytes()
    with llama_server(tmp_path / "ref-b", "-c", "2048", model=model) as ref:
        (ref.slot_dir / "r.bin").write_bytes(state)
        assert (await post(ref.url + "/slots/0?action=restore", {"filename": "r.bin"})).status == 200
        assert (await post(ref.url + "/completion", {"prompt": second[:-1], "n_predict": 0, "id_slot": 0,
                                                     "cache_prompt": True})).status == 200
        own = await post(ref.url + "/completion", {**body, "prompt": second, "id_slot": 0, "cache_prompt": True})
    assert own.status == 200 and own.body["timings"]["cache_n"] == len(second) - 1
    assert two.body["tokens"] == own.body["tokens"]
