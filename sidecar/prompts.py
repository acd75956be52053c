"""The prompt tokens llama-server will see, computed in-process where that is exact.

Three ways, cheapest first:

- token ids in the request are used as they are;
- in-process: a chat is rendered with Jinja2 from the template llama-server reports (``/props``)
  and text is tokenized with the model's own vocabulary (``integrations.vocab``: the same
  llama.cpp, loaded without weights), with no HTTP round trip;
- asked: llama-server's ``/apply-template`` and ``/tokenize`` (about 2 ms each on a small CPU,
  which is most of what the sidecar adds to a request that needs no restore).

The in-process steps are checked, never trusted: at start-up against llama-server on a sample,
and after every request against the tokens llama-server saved in the slot. A mismatch turns the
step off until restart (rendering first, then tokenizing), is logged and is counted
(``kvtier_prompt_mismatches``). A wrong token list costs reuse, never correctness: kvtier only
restores states of real tokens, and llama-server compares the slot's tokens with the prompt itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np

from integrations.llama_server import LlamaServerClient, LlamaServerError
from integrations.vocab import Vocab, VocabUnavailable
from tiers.keys import as_token_array

from .metrics import Metrics

log = logging.getLogger("kvtier.prompts")

# Request keys that change what llama-server renders (tools, schemas, continuation, reasoning,
# template arguments): such chats are rendered by llama-server itself.
SERVER_RENDERED = frozenset({
    "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "response_format", "json_schema",
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "reasoning_format",
    "reasoning_effort",
})
ROLES = frozenset({"system", "user", "assistant"})
# Longer texts are tokenized off the event loop: ~16K characters of new text take ~6 ms here.
THREAD_TOKENIZE_CHARS = 16 << 10
SAMPLE_TEXT = ("kvtier's check: Hello, World!  3.14159 == 22/7?\n\n\tünïcödé, 日本語, emoji 🙂 "
               "<|im_start|>user\n<s>[INST] </s> <|endoftext|>  trailing  ")
# A long plain text and a continuation of it: the second is tokenized from the first's tokens.
SAMPLE_BASE = "".join(f"Item {i}: the value is {i * 37 % 101}, ok?  Next\n" for i in range(24)) + "Last words"
SAMPLE_EXTENDED = SAMPLE_BASE + " here, and more:\tdone. Über café 🙂 x"
SAMPLE_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime.\nJust one."},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "Another, please:  ünïcödé 🙂"},
]


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt tokens and which of them kvtier computed itself."""

    tokens: np.ndarray
    rendered_here: bool = False
    tokenized_here: bool = False


class ChatTemplate:
    """A chat template rendered as llama-server renders a plain chat (content-only messages)."""

    def __init__(self, source: str, bos_token: str, eos_token: str, add_bos: bool):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # Hugging Face's settings for chat templates, which llama.cpp's Jinja engine follows.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ValueError(f"chat template does not compile here: {exc}") from None
        self.bos_token, self.eos_token, self.add_bos = bos_token, eos_token, add_bos
        # llama-server sets it per template (on where it detects reasoning support); /props does
        # not say, so the start-up check tries both values.
        self.enable_thinking = False

    def render(self, messages: list[dict[str, str]]) -> str:
        text = self._template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                     eos_token=self.eos_token, enable_thinking=self.enable_thinking)
        # llama-server drops a BOS the template wrote when the tokenizer adds one itself.
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def plain_chat(body: Mapping[str, Any]) -> list[dict[str, str]] | None:
    """The messages of a chat kvtier may render itself: roles and string contents only, no
    rendering options, and not ending with an assistant message (llama-server continues that one)."""
    if SERVER_RENDERED & body.keys():
        return None
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    for m in messages:
        if (not isinstance(m, dict) or m.keys() - {"role", "content"} or m.get("role") not in ROLES
                or not isinstance(m.get("content"), str)):
            return None
    if messages[-1]["role"] == "assistant":
        return None
    return messages


def chat_digests(messages: list[dict[str, str]]) -> tuple[int, ...]:
    """One digest per message (role and content), to recognise a conversation a slot holds.

    Python's string hash (64 bits, salted per process): a collision can only send a request to a
    slot that holds less of it than thought, which llama-server sees and recomputes.
    """
    return tuple(hash((m["role"], m["content"])) for m in messages)


def asked_of(kind: str, body: Mapping[str, Any]) -> tuple[int, ...] | str | None:
    """What a completion request asks, as a slot remembers it for follow-ups (``slots.continues``):
    a plain chat's message digests, a text prompt itself; None for anything else."""
    if kind == "chat":
        messages = plain_chat(body)
        return chat_digests(messages) if messages is not None else None
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) and prompt else None


class PromptTokens:
    """Turns a completion request into the prompt tokens llama-server will see."""

    def __init__(self, client: LlamaServerClient, metrics: Metrics, *, in_process: bool = True):
        self.client = client
        self.metrics = metrics
        self.in_process = in_process
        self.vocab: Vocab | None = None
        self.template: ChatTemplate | None = None
        self._vocab_path = ""
        self._off: set[str] = set()  # steps a request's check turned off, until kvtier restarts
        self._retired: list[Vocab] = []  # turned off while a thread may still be tokenizing with it

    @property
    def render_here(self) -> bool:
        return self.template is not None

    @property
    def tokenize_here(self) -> bool:
        return self.vocab is not None

    async def setup(self, props: Mapping[str, Any], model_path: str) -> None:
        """Load the vocabulary and template of the model llama-server serves; check both on a sample.

        Never raises: whatever cannot be loaded or does not match is asked of llama-server instead.
        """
        if not self.in_process:
            return
        if model_path != self._vocab_path:  # first probe, or llama-server came back with another model
            self._retire()
            self._off.clear()
            self._vocab_path = model_path
            if not os.path.isfile(model_path):
                log.info("prompts are tokenized by llama-server: model file %r not readable here "
                         "(mount it and set --model to tokenize in-process)", model_path)
            else:
                try:
                    self.vocab = await asyncio.to_thread(Vocab, model_path)
                except VocabUnavailable as exc:
                    log.info("prompts are tokenized by llama-server: %s", exc)
        self.template = None
        try:
            if self.vocab is not None:
                await self._check_tokenizer()
            await self._load_template(props)
        except LlamaServerError as exc:
            log.warning("could not check in-process prompts against llama-server (%s): asking it instead", exc)
            self._retire()
            self._vocab_path = ""  # tried again at the next probe
            self.template = None
        self._publish()
        log.info("prompts: chat rendered %s, tokenized %s", "here" if self.render_here else "by llama-server",
                 "here" if self.tokenize_here else "by llama-server")

    async def _check_tokenizer(self) -> None:
        assert self.vocab is not None
        for sample in (SAMPLE_TEXT, "", SAMPLE_BASE, SAMPLE_EXTENDED):
            ours = [self.vocab.tokenize(sample), self.vocab.tokenize_whole(sample)]
            theirs = as_token_array(await self.client.tokenize(sample))
            if not all(np.array_equal(t, theirs) for t in ours):
                self.turn_off("tokenize", f"{self._vocab_path} tokenizes a sample differently from llama-server")
                return

    async def _load_template(self, props: Mapping[str, Any]) -> None:
        source = props.get("chat_template")
        if "render" in self._off or not isinstance(source, str) or not source:
            return
        add_bos = self.vocab.add_bos if self.vocab is not None else bool(await self.client.tokenize(""))
        theirs = await self.client.apply_template({"messages": SAMPLE_CHAT})
        try:
            template = ChatTemplate(source, str(props.get("bos_token") or ""), str(props.get("eos_token") or ""),
                                    add_bos)
            for template.enable_thinking in (False, True):
                if template.render(SAMPLE_CHAT) == theirs:
                    self.template = template
                    return
        except Exception as exc:  # a template this Jinja cannot run: llama-server renders
            log.info("chat template not rendered here: %s", exc)
            return
        self._count_mismatch("render", "the chat template renders a sample differently here than in llama-server")

    async def prompt_for(self, kind: str, body: Mapping[str, Any], scope: str = "") -> Prompt | None:
        """The request's prompt tokens, or None when it is not cacheable (several prompts, media).

        ``scope``: the tenant (its salt). In-process tokenizing reuses only what was tokenized for
        the same tenant, so how long this takes tells nothing of other tenants' prompts.
        """
        t0 = time.perf_counter()
        rendered_here = False
        if kind == "chat":
            if not isinstance(body.get("messages"), list):
                return None
            text: Any = self._render(body)
            rendered_here = text is not None
            if text is None:
                text = await self.client.apply_template(body)
        else:
            text = body.get("prompt")
            if isinstance(text, list) and text and set(map(type, text)) == {int}:  # ints, not bools
                try:
                    ids = np.fromiter(text, np.int32, len(text))
                except OverflowError:  # not token ids: llama-server answers
                    return None
                self.metrics.prompt_seconds.labels("ids").observe(time.perf_counter() - t0)
                return Prompt(ids)
        if not isinstance(text, str):
            return None
        tokens = await self._tokenize(text, scope)
        tokenized_here = tokens is not None
        if tokens is None:
            tokens = as_token_array(await self.client.tokenize(text))
        way = "in_process" if tokenized_here and (rendered_here or kind != "chat") else "llama_server"
        self.metrics.prompt_seconds.labels(way).observe(time.perf_counter() - t0)
        return Prompt(tokens, rendered_here, tokenized_here)

    def _render(self, body: Mapping[str, Any]) -> str | None:
        if self.template is None:
            return None
        messages = plain_chat(body)
        if messages is None:
            return None
        try:
            return self.template.render(messages)
        except Exception as exc:  # the template refused these messages: llama-server answers for itself
            log.debug("chat not rendered here: %s", exc)
            return None

    async def _tokenize(self, text: str, scope: str) -> np.ndarray | None:
        vocab = self.vocab
        if vocab is None:
            return None
        try:
            if len(text) > THREAD_TOKENIZE_CHARS:
                return await asyncio.to_thread(vocab.tokenize, text, scope)
            return vocab.tokenize(text, scope)
        except UnicodeEncodeError:  # lone surrogates: llama-server decides what they mean
            return None
        except (VocabUnavailable, RuntimeError) as exc:  # closed (shutting down) or refused: ask the server
            log.debug("not tokenized here: %s", exc)
            return None

    def check(self, prompt: Prompt | None, saved: np.ndarray) -> None:
        """Compare what kvtier computed with the tokens llama-server saved for the same request."""
        if prompt is None or not (prompt.rendered_here or prompt.tokenized_here):
            return
        n = min(prompt.tokens.size, saved.size)
        if np.array_equal(prompt.tokens[:n], saved[:n]):
            return
        first = int(np.argmax(prompt.tokens[:n] != saved[:n])) if n else 0
        step = "render" if prompt.rendered_here else "tokenize"
        self.turn_off(step, f"a request's tokens differ from llama-server's from token {first} on")

    def turn_off(self, step: str, reason: str) -> None:
        """Stop rendering (``render``) or tokenizing (``tokenize``) here until kvtier restarts;
        count and log why."""
        if step == "render":
            if self.template is None:
                return
            self.template = None
        else:
            if self.vocab is None:
                return
            self._retire()
        self._off.add(step)
        self._count_mismatch(step, reason)
        self._publish()

    def _count_mismatch(self, step: str, reason: str) -> None:
        self.metrics.prompt_mismatches.labels(step).inc()
        log.warning("%s: asking llama-server to %s prompts from now on", reason, step)

    def _publish(self) -> None:
        self.metrics.prompt_in_process.labels("render").set(1 if self.render_here else 0)
        self.metrics.prompt_in_process.labels("tokenize").set(1 if self.tokenize_here else 0)

    def _retire(self) -> None:
        # Freed only at shutdown: a thread may still be tokenizing a long prompt with it.
        if self.vocab is not None:
            self._retired.append(self.vocab)
            self.vocab = None

    def close(self) -> None:
        for vocab in [*self._retired, *([self.vocab] if self.vocab is not None else [])]:
            vocab.close()
        self._retired.clear()
        self.vocab = None
