"""Prompt tokens computed in kvtier (chat rendering, tokenizing) against a real llama-server.

Every in-process result is compared with what llama-server's own /apply-template and /tokenize
give; the checks that turn a step off are driven by real mismatches: a vocabulary with one merge
removed, and a server that renders its template with other arguments.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from integrations.llama_server import LlamaServerError
from integrations.vocab import Vocab, common_prefix, word_boundary
from launch import smollm2_path
from sidecar.config import Settings
from sidecar.prompts import Prompt, PromptTokens
from tests.ggufgen import ModelShape, write_random_llama
from tests.servers import LlamaServer, llama_server
from tests.sidecars import Sidecar, post, run_sidecar

pytestmark = pytest.mark.llama

TEXTS = ["hello", " leading space", "a\r\nb\n\n\n c", "ünïcödé 🙂 日本語 𝔘", "<|im_start|>user\nhi<|im_end|>\n",
         "<|im_start|>", "1234567890 3.14159", "nul \x00 byte", "   ", "\t\ttabs\t", "x" * 3000, "The red box number 7 holds marbles.",
         "<|im_start|>user\n" + "The red box number 7 holds marbles. " * 600]  # the last, over 16K: tokenized in a thread
PLAIN_CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour.\n"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "ünï 🙂"}],
    [{"role": "user", "content": ""}],
]
SERVER_RENDERED_CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},  # content parts
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]},  # prefill
    {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]},
    {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "hi", "name": "bob"}]},
]
# enable_thinking as llama-server decides it for this template (off: it detects no reasoning
# support), house_style only when the server is started with it as a template argument.
TEMPLATE = (
    "{% if house_style is defined %}{{ house_style }}\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@dataclass
class Node:
    llama: LlamaServer
    sidecar: Sidecar


def settings_for(llama: LlamaServer, **extra: Any) -> Settings:
    return Settings(llama_url=llama.url, slot_dir=str(llama.slot_dir), chunk_tokens=64, **extra)


@pytest_asyncio.fixture(scope="module")
async def node(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Node]:
    with llama_server(tmp_path_factory.mktemp("prompts")) as ll:
        async with run_sidecar(settings_for(ll)) as sc:
            assert await sc.engine.ensure_ready()
            yield Node(ll, sc)


async def server_tokens(node: Node, kind: str, body: dict[str, Any]) -> np.ndarray:
    client = node.sidecar.engine.client
    text = await client.apply_template(body) if kind == "chat" else body["prompt"]
    return np.asarray(await client.tokenize(text), np.int32)


async def test_in_process_prompts_equal_llama_servers(node: Node) -> None:
    prompts = node.sidecar.engine.prompts
    assert prompts.render_here and prompts.tokenize_here
    for text in TEXTS:
        prompt = await prompts.prompt_for("completion", {"prompt": text})
        assert prompt is not None and prompt.tokenized_here and not prompt.rendered_here
        assert np.array_equal(prompt.tokens, await server_tokens(node, "completion", {"prompt": text})), text
    for messages in PLAIN_CHATS:
        body = {"messages": messages, "temperature": 0, "max_tokens": 4}
        prompt = await prompts.prompt_for("chat", body)
        assert prompt is not None and prompt.rendered_here and prompt.tokenized_here
        assert np.array_equal(prompt.tokens, await server_tokens(node, "chat", body)), messages
    for body in SERVER_RENDERED_CHATS:
        prompt = await prompts.prompt_for("chat", body)
        assert prompt is not None and not prompt.rendered_here, body
        assert np.array_equal(prompt.tokens, await server_tokens(node, "chat", body)), body
    ids = await prompts.prompt_for("completion", {"prompt": [1, 2, 3]})
    assert ids is not None and ids.tokens.tolist() == [1, 2, 3] and not ids.tokenized_here
    # A lone surrogate cannot be encoded here: llama-server is asked, and refuses it (the request
    # then passes through and gets the same refusal).
    with pytest.raises(LlamaServerError, match="surrogate"):
        await prompts.prompt_for("completion", json.loads('{"prompt": "a \\ud800 b"}'))


async def test_piece_cache_tokenizes_like_one_llama_cpp_call(node: Node) -> None:
    """Texts cut at special tokens and tokenized piece by piece (cached) equal one llama.cpp call
    on the whole text, and llama-server's /tokenize; the cache stays within its budget."""
    vocab = node.sidecar.engine.prompts.vocab
    assert vocab is not None
    rng = random.Random(7)
    parts = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<reponame>", "<|im_start|><|im_end|>", " ", "  ",
             "\n", "\n\n", "\t", "a", "the", " box", "ü", "🙂", "12", "<", "|", ">", "im_", "user\n"]
    texts = ["".join(rng.choice(parts) for _ in range(rng.randint(0, 40))) for _ in range(400)]
    for i, text in enumerate(texts):
        assert np.array_equal(vocab.tokenize(text), vocab.tokenize_whole(text)), text
        if i % 20 == 0:
            assert np.array_equal(vocab.tokenize(text), await node.sidecar.engine.client.tokenize(text)), text
    small = Vocab(vocab.path, cache_bytes=2000)
    try:
        for text in texts:
            assert np.array_equal(small.tokenize(text * 3), vocab.tokenize_whole(text * 3))
        assert 0 < small._cached_bytes <= 2000
    finally:
        small.close()
    # A closed vocabulary (kvtier shutting down) makes the prompt llama-server's to tokenize.
    prompts = PromptTokens(node.sidecar.engine.client, node.sidecar.engine.metrics)
    prompts.vocab = small
    prompt = await prompts.prompt_for("completion", {"prompt": "hello there"})
    assert prompt is not None and not prompt.tokenized_here
    assert np.array_equal(prompt.tokens, vocab.tokenize("hello there"))


async def test_growing_texts_are_tokenized_from_their_start(node: Node) -> None:
    """A text prompt that extends a remembered one reuses its tokens up to a word boundary; the
    result equals one llama.cpp call on the whole text and llama-server's /tokenize."""
    vocab = Vocab(node.sidecar.engine.prompts.vocab.path)  # type: ignore[union-attr]
    extended = []
    real_extend = vocab._extend

    def counting(scope: str, piece: bytes) -> np.ndarray | None:
        out = real_extend(scope, piece)
        extended.append(out is not None)
        return out

    vocab._extend = counting  # type: ignore[method-assign]
    rng = random.Random(11)
    words = ["the", "of", "Hello", "x", "42", "3.14", "é", "日本", "🙂", " ", "  ", "\n", "\n\n", "\t", ",", ".",
             "'s", "'ll", "--", "(", "don't", "I'm", "A", "<|im", "end|>"]
    try:
        for conversation in range(30):
            text = " ".join(rng.choice(words) for _ in range(200))
            for turn in range(6):
                text += rng.choice(["", " ", "\n", "  ", "<|im_end|>\n"]) + "".join(
                    rng.choice(words) + rng.choice([" ", "", "\n", "  "]) for _ in range(rng.randint(1, 30)))
                ours = vocab.tokenize(text)
                assert np.array_equal(ours, vocab.tokenize_whole(text)), text
                if turn == 5 and conversation % 5 == 0:
                    assert np.array_equal(ours, await node.sidecar.engine.client.tokenize(text)), text
        assert sum(extended) >= 30  # taken (43 times with this seed): not for new short pieces after a special token
        # Texts that share only their start (one system prompt, two users) share its tokens too.
        system = " ".join(rng.choice(words) for _ in range(300))
        extended.clear()
        for user in ("Alice asks: what is 2+2?", "Bob asks: why is the sky blue?", "Bob asks: why not?"):
            assert np.array_equal(vocab.tokenize(system + "\n" + user), vocab.tokenize_whole(system + "\n" + user))
        assert extended == [False, True, True]
    finally:
        vocab.close()
    # Pieces the cache lets go are no longer kept as starts either: memory stays within the budget.
    vocab = Vocab(node.sidecar.engine.prompts.vocab.path, cache_bytes=20_000)  # type: ignore[union-attr]
    try:
        for i in range(60):
            vocab.tokenize(f"Conversation {i}: " + " ".join(f"word{j} of {i}" for j in range(80)))
        starts = [(scope, p) for (scope, _), bases in vocab._bases.items() for p in bases]
        assert starts and all(key in vocab._pieces for key in starts) and sum(len(p) for _, p in starts) <= 20_000
    finally:
        vocab.close()
    assert word_boundary(b"abc def", 7) == 3 and word_boundary(b"abc  def", 8) == -1
    assert word_boundary(b"a. b1 c", 7) == 5 and word_boundary(b"x" * 3000 + b" y", 3000) == 3000
    assert word_boundary(b"abc def", 2) == -1 and word_boundary(b"", 0) == -1
    assert [common_prefix(a, b) for a, b in [(b"", b"x"), (b"abc", b"abd"), (b"ab", b"abc"), (b"x" * 999, b"x" * 999)]] \
        == [0, 2, 2, 999]


async def test_requests_use_in_process_prompts_and_their_checks_pass(node: Node) -> None:
    sc = node.sidecar
    before = sc.metric("kvtier_prompt_seconds_count", way="in_process")
    follow_ups = sc.metric("kvtier_follow_ups_total")
    history = [{"role": "system", "content": "You list colours."}]
    for question in ("Name a colour.", "And another one?"):
        ans = await post(sc.url + "/v1/chat/completions",
                         {"messages": [*history, {"role": "user", "content": question}], "max_tokens": 6,
                          "temperature": 0})
        assert ans.status == 200, ans.text
        history += [{"role": "user", "content": question}, {"role": "assistant", "content": ans.content}]
        await sc.engine.drain(30)
    ans = await post(sc.url + "/completion", {"prompt": "Colours: red, green,", "n_predict": 4, "temperature": 0})
    assert ans.status == 200
    await sc.engine.drain(30)
    # The second turn continues the conversation its slot holds: sent there without tokens.
    assert sc.metric("kvtier_prompt_seconds_count", way="in_process") == before + 2
    assert sc.metric("kvtier_follow_ups_total") == follow_ups + 1
    assert sc.metric("kvtier_prompt_mismatches_total", step="render") == 0
    assert sc.metric("kvtier_prompt_mismatches_total", step="tokenize") == 0
    assert sc.engine.prompts.render_here and sc.engine.prompts.tokenize_here
    assert sc.metric("kvtier_prompt_in_process", step="tokenize") == 1


async def test_hostile_prompts_get_a_clear_answer(node: Node) -> None:
    sc = node.sidecar
    for raw in (b'{"prompt": "a \\ud800 b", "n_predict": 2}', b'{"prompt": "\\u0000\\u0001", "n_predict": 2}',
                b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
                b'{"messages": [{"role": 7, "content": "hi"}], "max_tokens": 2}',
                b'{"messages": [{"role": "user", "content": "{{ raise_exception(\'x\') }}"}], "max_tokens": 2}'):
        path = "/v1/chat/completions" if b"messages" in raw else "/completion"
        direct = await post(node.llama.url + path, None, raw=raw)
        side = await post(sc.url + path, None, raw=raw)
        # A lone surrogate is JSON kvtier does not read: kvtier answers 400 itself, never passing the
        # body on around the tenant rules (llama-server says 500); the rest get llama-server's answer.
        want = 400 if b"\\ud800" in raw or b"\\udfff" in raw else direct.status
        assert side.status == want, (raw, side.text, direct.text)
        await sc.engine.drain(30)
    assert sc.engine.prompts.render_here and sc.engine.prompts.tokenize_here


async def test_a_vocabulary_that_disagrees_is_turned_off(node: Node, tmp_path: Path) -> None:
    """--model names a GGUF whose vocabulary lacks the merge that makes " marbles" one token: the
    start-up sample does not notice, the first request with " marbles" does, and kvtier asks
    llama-server from then on; every answer is the server's own."""
    def drop_marbles(key: str, value: Any) -> Any:
        if key == "tokenizer.ggml.merges":
            return [m for m in value if m.replace(b" ", b"") != "Ġmarbles".encode()]
        return value

    odd = write_random_llama(tmp_path / "odd-vocab.gguf", smollm2_path(), ModelShape(n_layer=1),
                             edit_tokenizer=drop_marbles)
    text = "The red box number 7 holds 49 marbles. The green box number 8 holds"
    direct = await post(node.llama.url + "/completion", {"prompt": text, "n_predict": 6, "temperature": 0,
                                                         "cache_prompt": False})
    async with run_sidecar(settings_for(node.llama, model=str(odd))) as sc:
        assert await sc.engine.ensure_ready()
        prompts = sc.engine.prompts
        assert prompts.tokenize_here  # the sample has no " marbles"
        first = await post(sc.url + "/completion", {"prompt": text, "n_predict": 6, "temperature": 0})
        assert first.status == 200 and first.content == direct.content
        await sc.engine.drain(30)
        assert not prompts.tokenize_here
        assert sc.metric("kvtier_prompt_mismatches_total", step="tokenize") == 1
        assert sc.metric("kvtier_prompt_in_process", step="tokenize") == 0
        second = await post(sc.url + "/completion", {"prompt": text + " 56 marbles.", "n_predict": 4,
                                                     "temperature": 0})
        assert second.status == 200
        assert sc.metric("kvtier_prompt_seconds_count", way="llama_server") == 1
        assert second.prompt_n < 10  # the slot's tokens were found again: the server's own tokens
        await sc.engine.drain(30)


async def test_a_template_rendered_with_other_arguments_is_left_to_llama_server(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp("template")
    template = tmp / "house.jinja"
    template.write_text(TEMPLATE)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    with llama_server(tmp, "--chat-template-file", str(template)) as same:
        async with run_sidecar(settings_for(same)) as sc:
            assert await sc.engine.ensure_ready()
            assert sc.engine.prompts.render_here  # this template renders the same here
            prompt = await sc.engine.prompts.prompt_for("chat", body)
            assert prompt is not None and prompt.rendered_here
            assert np.array_equal(prompt.tokens, await sc.engine.client.tokenize(
                await sc.engine.client.apply_template(body)))
    # A template argument given to llama-server alone: kvtier's rendering would lack it; the
    # start-up check notices and leaves rendering to llama-server.
    with llama_server(tmp, "--chat-template-file", str(template),
                      "--chat-template-kwargs", '{"house_style": "Answer in French."}') as other:
        async with run_sidecar(settings_for(other)) as sc:
            assert await sc.engine.ensure_ready()
            assert not sc.engine.prompts.render_here and sc.engine.prompts.tokenize_here
            assert sc.metric("kvtier_prompt_mismatches_total", step="render") == 1
            ans = await post(sc.url + "/v1/chat/completions", body)
            assert ans.status == 200
            rendered = await sc.engine.client.apply_template(body)
            assert rendered.startswith("Answer in French.") and int(ans.headers["X-KVTier-Prompt-Tokens"]) == len(
                await sc.engine.client.tokenize(rendered))
            await sc.engine.drain(30)


async def test_local_tokenizer_off_asks_llama_server(node: Node) -> None:
    async with run_sidecar(settings_for(node.llama, local_tokenizer="off")) as sc:
        assert await sc.engine.ensure_ready()
        assert not sc.engine.prompts.render_here and not sc.engine.prompts.tokenize_here
        ans = await post(sc.url + "/completion", {"prompt": "Colours: red,", "n_predict": 2, "temperature": 0})
        assert ans.status == 200
        assert sc.metric("kvtier_prompt_seconds_count", way="llama_server") == 1
        await sc.engine.drain(30)


def test_check_turns_off_rendering_before_tokenizing() -> None:
    """Pure logic: which step a mismatch turns off, and that matching tokens turn nothing off."""
    from sidecar.metrics import Metrics
    from sidecar.prompts import ChatTemplate

    class Off:  # stands for a loaded vocabulary; only its identity matters here
        def close(self) -> None:
            pass

    metrics = Metrics()
    prompts = PromptTokens(None, metrics)  # type: ignore[arg-type]
    prompts.template = ChatTemplate("{{ messages[0]['content'] }}", "", "", False)
    prompts.vocab = Off()  # type: ignore[assignment]
    saved = np.array([1, 2, 3, 4], np.int32)
    prompts.check(Prompt(np.array([1, 2, 3], np.int32), True, True), saved)  # a prefix: fine
    prompts.check(Prompt(np.array([1, 2, 3, 4, 5], np.int32), True, True), saved)  # longer, same start: fine
    assert prompts.render_here and prompts.tokenize_here
    prompts.check(Prompt(np.array([1, 9], np.int32), True, True), saved)
    assert not prompts.render_here and prompts.tokenize_here
    prompts.check(Prompt(np.array([1, 9], np.int32), False, True), saved)
    assert not prompts.tokenize_here
    prompts.check(Prompt(np.array([7], np.int32)), saved)  # token ids from the client: nothing to check
    assert metrics.registry.get_sample_value("kvtier_prompt_mismatches_total", {"step": "render"}) == 1
    assert metrics.registry.get_sample_value("kvtier_prompt_mismatches_total", {"step": "tokenize"}) == 1
    prompts.close()
