"""``kvtier serve``'s malloc setting: a freed chunk-sized buffer is reused, not faulted in afresh."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sidecar import heap

# In a child process (the setting is process-wide): fill a 33 MiB buffer (an 8B model's 256-token
# chunk with its header), free it, fill another of the same size; the page faults of each fill.
CHILD = """
import json, resource, sys
import numpy as np
from sidecar.heap import reuse_freed_memory
changed = reuse_freed_memory() if sys.argv[1] == "reuse" else False
def fill():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf = np.empty(33 << 20, np.uint8)
    buf[:] = 1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
first = fill()
second = fill()
print(json.dumps({"changed": changed, "first": first, "second": second}))
"""


def faults(mode: str, env: dict[str, str] | None = None) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **(env or {})}, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_chunk_buffer_is_reused_without_fresh_page_faults() -> None:
    plain = faults("plain")
    reused = faults("reuse")
    assert reused["changed"]
    # Without the setting the second buffer is a fresh mapping again (faults like the first one);
    # with it, the freed buffer's pages are taken back as they are.
    assert plain["second"] > plain["first"] / 4, plain
    assert reused["second"] < reused["first"] / 10, reused


def test_an_operators_own_malloc_settings_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")
    assert heap.reuse_freed_memory() is False
    assert faults("reuse", {"MALLOC_MMAP_MAX_": "65536"})["changed"] is False
