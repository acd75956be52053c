"""A save's work runs on threads below the process's CPU priority; a restore's, at it (the pace of
the save's work while requests compute: tests/test_pace.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sidecar.config import load_settings
from tiers.codec import BlobCodec
from tiers.errors import ConfigError
from tiers.keys import Namespace, prefix_chain
from tiers.memory import MemoryTier
from tiers.store import TieredStore

# In a child process (the setting is process-wide, made once at start): the niceness of the thread
# that runs a background call, of one that runs a restore's (``in_thread``), of the event loop's,
# and of a Redis bulk lane's write and read threads.
CHILD = """
import asyncio, json, os, sys, threading
from tiers.redis_bulk import BulkLane
from tiers.redis_clients import ClientOptions
from tiers.threads import in_background, in_thread, set_background_nice

def nice():
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

async def main():
    set_background_nice(int(sys.argv[1]))
    lane = BulkLane(ClientOptions.from_url("redis://127.0.0.1:1/0"))
    out = {"loop": nice(), "background": await in_background(nice), "restore": await in_thread(nice),
           "lane_write": lane._pools["write"].submit(nice).result(),
           "lane_read": lane._pools["read"].submit(nice).result()}
    print(json.dumps(out))

asyncio.run(main())
"""


def niceness(nice: int) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(nice)], capture_output=True, text=True, timeout=60,
                         check=True, cwd=Path(__file__).resolve().parent.parent)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_a_saves_threads_run_below_the_process_and_a_restores_at_its_priority() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen = niceness(7)
    assert seen == {"loop": base, "background": min(19, base + 7), "restore": base,
                    "lane_write": min(19, base + 7), "lane_read": base}, seen
    assert set(niceness(0).values()) == {base}


@pytest.mark.parametrize("value", ["-1", "20"])
def test_save_nice_outside_0_to_19_is_refused(value: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="save_nice"):
        load_settings(["--slot-dir", str(tmp_path), "--save-nice", value], env={})


async def test_a_big_saves_chunks_are_encoded_and_a_big_fetch_checked_off_the_event_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Sums (and MACs) over a save's or a restore's hundreds of MiB, in the event loop, stopped the
    # relay of every other user's tokens for as long (bench datapath: the longest gap of a stream
    # beside a save). Which thread encodes and decodes each value of a 4 x 2 MiB store (and a tail)
    # and fetch:
    loop_thread = threading.get_ident()
    where: dict[str, set[bool]] = {"encode": set(), "decode": set()}
    for name in where:
        real = getattr(BlobCodec, name)

        def spy(self: BlobCodec, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            where[_name].add(threading.get_ident() == loop_thread)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(BlobCodec, name, spy)
    chunk = 64
    ns = Namespace("off-loop", "", chunk)
    tokens = np.arange(4 * chunk, dtype=np.int32)
    chain = prefix_chain(ns, tokens, 4)
    store = TieredStore([MemoryTier(64 << 20)], BlobCodec("none", mac_key=b"k" * 32))
    payloads = [np.full(2 << 20, i, np.uint8).tobytes() for i in range(4)]
    assert (await store.store(ns, chain, lambda i: payloads[i])).chunks_written == 4
    await store.store_tail(ns, chain[-1], np.arange(10, dtype=np.int32), payloads[0])  # a partial tail
    fetched = await store.fetch(ns, chain, promote=False)
    assert [bytes(p) for p in fetched.payloads] == payloads
    assert where == {"encode": {False}, "decode": {False}}, where
    await store.aclose()

