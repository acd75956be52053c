"""Async client for llama-server's HTTP API: what the sidecar needs, with clear errors."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from tiers.errors import KVTierError

DEFAULT_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=5, sock_read=600)
KEEPALIVE_S = 2.0  # below llama-server's 5 s keep-alive, so a connection it closed is never reused


class LlamaServerError(KVTierError):
    """llama-server answered with an error, or could not be reached."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class LlamaServerLoading(LlamaServerError):
    """llama-server is still loading its model (HTTP 503)."""


class SlotSaveDisabled(LlamaServerError):
    """llama-server runs without ``--slot-save-path``; slots cannot be saved or restored."""


@dataclass(frozen=True, slots=True)
class SlotAction:
    """Result of a slot save or restore."""

    id_slot: int
    filename: str
    n_tokens: int
    n_bytes: int
    ms: float


@dataclass(frozen=True, slots=True)
class Timings:
    """``timings`` of a completion: what the server recomputed, and how fast."""

    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    cache_n: int = 0

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Timings | None:
        if not isinstance(data, Mapping):
            return None
        try:
            return cls(
                int(data.get("prompt_n", 0)), float(data.get("prompt_ms", 0.0)),
                int(data.get("predicted_n", 0)), float(data.get("predicted_ms", 0.0)),
                int(data.get("cache_n", 0)),
            )
        except (TypeError, ValueError):
            return None

    @classmethod
    def from_answer(cls, tail: bytes) -> Timings | None:
        """The ``timings`` of a completion's answer (plain JSON, or the end of an SSE stream)."""
        text = tail.decode("utf-8", errors="replace")
        candidates: list[str] = []
        stripped = text.strip()
        if stripped.startswith("{"):
            candidates.append(stripped)
        candidates += [line[5:].strip() for line in reversed(text.splitlines()) if line.startswith("data:")]
        for candidate in candidates:
            if '"timings"' not in candidate:
                continue
            try:
                data = json.loads(candidate)
            except json.JSONDecodeError:
                continue
            if isinstance(data, dict):
                return cls.from_json(data.get("timings"))
        return None


def stream_finished(tail: bytes) -> bool:
    """Whether the end of an SSE answer is llama-server's last event: ``data: [DONE]`` (the OpenAI
    endpoints) or an event with ``"stop": true`` (``/completion``). llama-server sends it once the
    task is done and its slot idle, so the slot then holds a complete state whatever becomes of
    the client's connection."""
    lines = [line.strip() for line in tail.decode("utf-8", errors="replace").splitlines()]
    events = [line[5:].strip() for line in lines if line.startswith("data:")]
    if not events:
        return False
    if events[-1] == "[DONE]":
        return True
    try:
        last = json.loads(events[-1])
    except json.JSONDecodeError:
        return False
    return isinstance(last, dict) and last.get("stop") is True


def prefix_reused(timings: Timings | None, prompt_tokens: int, restored_tokens: int, slack: int = 1) -> bool:
    """True when the server recomputed only the suffix after a restore.

    llama.cpp users report restores that silently re-prefill; ``prompt_n`` tells. The server
    re-evaluates at least one token, hence ``slack``.
    """
    if timings is None:
        return False
    return timings.prompt_n <= max(prompt_tokens - restored_tokens, 0) + slack


class LlamaServerClient:
    """Thin async client. Share one ``aiohttp.ClientSession`` per process (pass it in)."""

    def __init__(self, base_url: str, session: aiohttp.ClientSession | None = None, *, unix_socket: str | None = None):
        """``unix_socket``: where ``session``'s connector reaches llama-server (named in errors)."""
        self.base_url = base_url.rstrip("/")
        self.where = f"{self.base_url} (Unix socket {unix_socket})" if unix_socket else self.base_url
        self._session = session
        self._owns_session = session is None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=DEFAULT_TIMEOUT, connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S)
            )
            self._owns_session = True
        return self._session

    async def aclose(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()

    async def _request(self, method: str, path: str, body: Any = None, timeout: float | None = 600) -> Any:
        try:
            async with self.session.request(
                method, self.base_url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                text = await resp.text()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise LlamaServerError(f"llama-server at {self.where} unreachable: {exc!r}") from exc
        try:
            data = json.loads(text) if text else None
        except json.JSONDecodeError:
            data = None
        if status >= 400:
            message = _error_message(data) or text[:200] or f"HTTP {status}"
            if status == 503:
                raise LlamaServerLoading(f"llama-server is loading: {message}", status)
            if status == 501 or "not support" in message.lower() and "slot" in message.lower():
                raise SlotSaveDisabled(
                    f"llama-server cannot save slots ({message}); start it with --slot-save-path", status
                )
            raise LlamaServerError(f"{method} {path}: HTTP {status}: {message}", status)
        return data

    async def health(self) -> dict[str, Any]:
        return await self._request("GET", "/health", timeout=5) or {}

    async def props(self) -> dict[str, Any]:
        return await self._request("GET", "/props", timeout=10) or {}

    async def models(self) -> dict[str, Any]:
        return await self._request("GET", "/v1/models", timeout=10) or {}

    async def tokenize(self, content: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Tokens as the server's completion endpoints tokenize a prompt (special tokens on)."""
        data = await self._request(
            "POST", "/tokenize", {"content": content, "add_special": add_special, "parse_special": parse_special}
        )
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list):
            raise LlamaServerError("unexpected /tokenize answer")
        return [int(t) for t in tokens]

    async def detokenize(self, tokens: Sequence[int]) -> str:
        data = await self._request("POST", "/detokenize", {"tokens": list(tokens)})
        return str(data.get("content", "")) if isinstance(data, dict) else ""

    async def apply_template(self, body: Mapping[str, Any]) -> str:
        """The prompt the server renders for a chat request (messages, tools, template kwargs)."""
        data = await self._request("POST", "/apply-template", dict(body))
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if not isinstance(prompt, str):
            raise LlamaServerError("unexpected /apply-template answer")
        return prompt

    async def slots(self) -> list[dict[str, Any]]:
        data = await self._request("GET", "/slots", timeout=10)
        if not isinstance(data, list):
            raise LlamaServerError("unexpected /slots answer (is the slots endpoint disabled?)")
        return data

    async def _slot_action(self, id_slot: int, action: str, filename: str | None) -> dict[str, Any]:
        if id_slot < 0:
            raise ValueError("slot id must not be negative")
        body = {"filename": filename} if filename is not None else {}
        data = await self._request("POST", f"/slots/{id_slot}?action={action}", body)
        return data if isinstance(data, dict) else {}

    async def save_slot(self, id_slot: int, filename: str) -> SlotAction:
        d = await self._slot_action(id_slot, "save", filename)
        return SlotAction(id_slot, filename, int(d.get("n_saved", 0)), int(d.get("n_written", 0)),
                          float(d.get("timings", {}).get("save_ms", 0.0)))

    async def restore_slot(self, id_slot: int, filename: str) -> SlotAction:
        d = await self._slot_action(id_slot, "restore", filename)
        return SlotAction(id_slot, filename, int(d.get("n_restored", 0)), int(d.get("n_read", 0)),
                          float(d.get("timings", {}).get("restore_ms", 0.0)))

    async def erase_slot(self, id_slot: int) -> int:
        d = await self._slot_action(id_slot, "erase", None)
        return int(d.get("n_erased", 0))

    async def prefill(self, id_slot: int, tokens: Iterable[int]) -> tuple[int, int]:
        """Compute ``tokens`` into slot ``id_slot`` (reusing what it holds) and generate nothing:
        the slot then holds exactly them. The tokens it holds and those computed, as llama-server
        reports them."""
        data = await self.completion({"prompt": [int(t) for t in tokens], "n_predict": 0, "id_slot": id_slot,
                                      "cache_prompt": True})
        timings = data.get("timings")
        if not isinstance(timings, dict):
            raise LlamaServerError("prefill answer has no timings")
        computed = int(timings.get("prompt_n", 0))
        return int(timings.get("cache_n", 0)) + computed, computed

    async def completion(self, body: Mapping[str, Any], path: str = "/completion") -> dict[str, Any]:
        """A non-streaming completion (for tests, benchmarks and warm-up)."""
        data = await self._request("POST", path, {**body, "stream": False})
        if not isinstance(data, dict):
            raise LlamaServerError("unexpected completion answer")
        return data


def _error_message(data: Any) -> str:
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            return str(err.get("message", ""))
        if isinstance(err, str):
            return err
    return ""
