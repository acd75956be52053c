"""kvtier in front of a llama-server that listens on a Unix socket only (``--llama-socket``)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from launch.processes import accepts
from sidecar.config import MAX_SOCKET_PATH, Settings, load_settings
from tests.servers import DEFAULT_LLAMA_ARGS, LlamaServer, RedisProc, smollm2_path
from tests.sidecars import Answer, post, post_stream, run_sidecar
from tiers.errors import ConfigError

DOC = " ".join(f"Item {i}: a {['red', 'blue', 'green'][i % 3]} box holds {i * 7} coins." for i in range(30))


def chat(question: str, history: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": DOC}, *(history or []), {"role": "user", "content": question}],
            "max_tokens": 8, "temperature": 0}


async def on_socket(sock: Path, body: dict[str, Any]) -> Answer:
    """``body`` straight to llama-server, over its socket."""
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(str(sock))) as s, \
            s.post("http://localhost/v1/chat/completions", json=body) as r:
        return Answer(r.status, await r.json(), dict(r.headers), "")


@pytest.mark.llama
async def test_a_llama_server_on_a_unix_socket_only_is_served_saved_and_restored(redis_srv: RedisProc) -> None:
    # A short directory of its own: a socket's path has at most 107 bytes, and tmp_path may be longer.
    with tempfile.TemporaryDirectory(prefix="kvtier-sock-") as d:
        root = Path(d)
        sock = root / "llama.sock"
        llama = LlamaServer(smollm2_path(), [*DEFAULT_LLAMA_ARGS, "-np", "2"], root / "slots", unix_socket=sock)
        llama.start()
        try:
            assert not accepts(llama.port)(), "llama-server listens on TCP too"
            settings = Settings(llama_url=llama.url, llama_socket=str(sock), slot_dir=str(llama.slot_dir),
                                redis_url=redis_srv.url, node_id="sock", chunk_tokens=64, cache_size=256 << 20)
            async with run_sidecar(settings) as sc:
                assert await sc.engine.ensure_ready()  # /props, /slots and the witness, over the socket
                first = await post(sc.url + "/v1/chat/completions", chat("Which box holds 63 coins?"),
                                   headers={"X-Session-Id": "on-sock"})
                assert first.status == 200 and first.content, first.text
                status, events, _ = await post_stream(sc.url + "/completion", {"prompt": DOC, "n_predict": 4})
                assert status == 200 and events[-1]["stop"] is True  # a streamed answer, relayed whole
                assert await sc.engine.drain(30)
                slot = int(first.headers["X-KVTier-Slot"])
                saved = await post(sc.url + "/v1/sessions/on-sock", {"slot": slot}, method="PUT")
                assert saved.status == 200 and saved.body["tokens"] > 300, saved.text
                other = 1 - slot
                restored = await post(sc.url + "/v1/sessions/on-sock/restore", {"slot": other})
                assert restored.status == 200 and restored.body["n_restored"] == saved.body["tokens"], restored.text
                # The next turn on the restored slot and on the one that computed it: the same answer,
                # and only the new turn computed on either.
                history = [{"role": "user", "content": "Which box holds 63 coins?"},
                           {"role": "assistant", "content": first.content}]
                nxt = {**chat("And which holds 70?", history), "cache_prompt": True}
                on_restored = await on_socket(sock, {**nxt, "id_slot": other})
                on_computed = await on_socket(sock, {**nxt, "id_slot": slot})
                assert on_restored.status == on_computed.status == 200
                assert on_restored.content == on_computed.content
                assert on_restored.prompt_n == on_computed.prompt_n < 40
        finally:
            llama.stop()


@pytest.mark.parametrize("args, message", [
    (["--llama-socket", ""], "expected the path"),
    (["--llama-socket", "/run/" + "x" * MAX_SOCKET_PATH], "over the 107"),
    (["--llama-socket", "/run/l.sock", "--llama-url", "https://127.0.0.1:8080"], "plain HTTP"),
])
def test_a_socket_path_the_kernel_would_refuse_stops_kvtier(args: list[str], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(["--slot-dir", str(tmp_path), *args], env={})
    assert load_settings(["--slot-dir", str(tmp_path), "--llama-socket", "/run/" + "x" * 98], env={}).llama_socket


async def test_a_socket_with_no_llama_server_behind_it_is_named_and_fails_no_request(tmp_path: Path) -> None:
    # The unlucky operator: a socket path that nothing listens on (a typo, llama-server not up yet).
    sock = tmp_path / "nobody.sock"
    settings = Settings(llama_socket=str(sock), slot_dir=str(tmp_path), node_id="nobody")
    async with run_sidecar(settings) as sc:
        ready = await post(sc.url + "/readyz", None, method="GET")
        assert ready.status == 503 and f"Unix socket {sock}" in ready.body["checks"]["llama_server"], ready.text
        answer = await post(sc.url + "/completion", {"prompt": "hi", "n_predict": 1})
        assert answer.status == 503 and f"Unix socket {sock}" in answer.body["error"]["message"], answer.text
