"""``kvtier serve`` as a real process: start-up errors, and SIGTERM in the middle of a save."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from launch import Node
from tests.servers import RedisProc, smollm2_path
from tiers.codec import BlobCodec, peek_header

pytestmark = pytest.mark.llama


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar.cli", "serve", *args], capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.mark.parametrize("args, message", [
    (["--slot-dir", "/nonexistent/dir"], "does not exist"),
    (["--slot-dir", "/tmp", "--chunk-tokens", "12abc"], "chunk_tokens: expected an integer"),
    (["--slot-dir", "/tmp", "--chunk-tokens", "8"], "chunk_tokens must be in"),
    (["--slot-dir", "/tmp", "--compress", "gzip"], "compress must be one of"),
    (["--slot-dir", "/tmp", "--cache-size=-1G"], "cannot parse size"),
    (["--slot-dir", "/tmp", "--cache-size"], "expected one argument"),
    (["--slot-dir", "/tmp", "--cache-size", "lots"], "cannot parse size"),
    (["--slot-dir", "/tmp", "--ttl", "-5"], "ttl must not be negative"),
    (["--slot-dir", "/tmp", "--redis-url", "http://x"], "unknown redis url scheme"),
    (["--slot-dir", "/tmp", "--listen", "nowhere"], "listen: expected HOST:PORT"),
    (["--slot-dir", "/tmp", "--llama-url", "ftp://x"], "llama_url"),
    (["--slot-dir", "/tmp", "--auth-all"], "auth_all needs"),
    (["--slot-dir", "/tmp", "--auth-token", "a", "--auth-token-file", "/etc/hostname"], "not both"),
    (["--slot-dir", "/tmp", "--prewarm"], "prewarm needs redis_url"),
    (["--slot-dir", "/tmp", "--config", "/nonexistent.yaml"], "cannot read config file"),
])
def test_bad_options_stop_startup_with_one_line(args: list[str], message: str) -> None:
    result = serve(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_bad_config_files(tmp_path: Path) -> None:
    cases = {"list.yaml": "- a\n- b\n", "bad.yaml": "a: [unclosed\n", "unknown.yaml": "cache_sise: 2G\n",
             "type.yaml": "chunk_tokens: [1]\n"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        result = serve("--slot-dir", str(tmp_path), "--config", str(tmp_path / name))
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, (name, result.stderr)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def listens(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_sigterm_during_save_leaves_nothing_half_written(redis_srv: RedisProc, tmp_path: Path) -> None:
    node = Node("t", tmp_path, smollm2_path(), ["-c", "4096", "-np", "1", "-t", "2", "--cache-ram", "0"],
                redis_srv.url, 64, extra_sidecar_args=["--shutdown-timeout", "20"])
    node.start(with_sidecar=True)
    paused = redis.Redis(port=redis_srv.port)
    try:
        # Redis holds every write back until the sidecar is shutting down: the save that follows
        # the answer cannot end before the signal.
        paused.client_pause(120_000, all=False)
        prompt = " ".join(f"Line {i}: the value of item {i} is {i * 3}." for i in range(60))
        req = urllib.request.Request(node.sidecar_url + "/completion", json.dumps(
            {"prompt": prompt, "n_predict": 2}).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.load(r)
            prompt_tokens = int(r.headers["X-KVTier-Prompt-Tokens"])
        assert answer["timings"]["prompt_n"] > 500
        # The save starts right after the answer: its chunks have reached Redis, which holds them.
        wait_until(lambda: any("b" in c["flags"] and c["cmd"] == "set" for c in paused.client_list()),
                   "the save's chunks wait in Redis")
        assert node.sidecar is not None and node.sidecar.proc is not None
        proc = node.sidecar.proc
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        # Shutting down (no longer listening) but still draining the save: nothing written yet.
        wait_until(lambda: not listens(node.sidecar_port), "the sidecar stops listening")
        assert proc.poll() is None and not paused.keys(b"kvtier:*:c:*")
        paused.client_unpause()
        rc = proc.wait(30)
        assert rc == 0 and time.monotonic() - t0 < 30
    finally:
        paused.client_unpause()
        paused.close()
        node.stop()
    assert not list(node.slot_dir.glob("kvtier-*")), "kvtier left files in the slot dir"
    codec = BlobCodec()
    with redis.Redis(port=redis_srv.port) as r:
        keys = r.keys(b"kvtier:*:c:*")
        # The drain finished the save: every full chunk of the prompt is there, and every value is whole.
        assert len(keys) >= prompt_tokens // 64
        for key in keys:
            blob = r.get(key)
            chunk_hash = bytes.fromhex(key.decode().rsplit(":", 1)[1])
            assert peek_header(blob)[0] == chunk_hash
            codec.decode(blob, chunk_hash=chunk_hash)  # raises on a partial or damaged value
