"""``kvtier serve``'s malloc setting: a freed chunk-sized buffer is reused, not faulted in afresh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from sidecar import heap
from sidecar.metrics import Metrics

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


# The same across threads: four threads, each made before any fills, fill one buffer after the
# other (a cut on one save thread, the next on another); the page faults of each thread's fill.
THREADS_CHILD = """
import json, resource, sys, threading
import numpy as np
from sidecar.heap import reuse_freed_memory
changed = reuse_freed_memory() if sys.argv[1] == "reuse" else False
fills, lock, ready = [], threading.Lock(), threading.Barrier(4)
def work():
    ready.wait()
    with lock:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        buf = np.empty(33 << 20, np.uint8)
        buf[:] = 1
        fills.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
        del buf
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"changed": changed, "first": fills[0], "later": fills[1:]}))
"""


# The heap after a chunk, a smaller tail and another chunk were cut, the tail freed (evicted) and
# a third chunk cut, then a fourth freed (kept at the top for the next cut): MiB in use, free, and
# free at the heap's top (``heap_usage``), and the private memory before and after ``release_holes``.
HOLE_CHILD = """
import json, sys
import numpy as np
from sidecar.heap import heap_usage, release_holes, reuse_freed_memory
if sys.argv[1] == "reuse":
    reuse_freed_memory()
def fill(mib):
    buf = np.empty(mib << 20, np.uint8)
    buf[:] = 1
    return buf
def private():
    return next(int(line.split()[1]) >> 10 for line in open("/proc/self/status") if line.startswith("RssAnon"))
first, tail, second = fill(80), fill(65), fill(80)
del tail
third, fourth = fill(80), fill(90)
del fourth
u, before = heap_usage(), private()
released = release_holes()
print(json.dumps({"in_use": u.in_use >> 20, "free": u.free >> 20, "free_at_top": u.free_at_top >> 20,
                  "released": released, "before": before, "after": private(),
                  "at_top_after": heap_usage().free_at_top >> 20}))
"""


def faults(mode: str, env: dict[str, str] | None = None, child: str = CHILD) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", child, mode], capture_output=True, text=True, timeout=60,
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_buffer_freed_on_one_thread_is_reused_by_another() -> None:
    plain = faults("plain", child=THREADS_CHILD)
    reused = faults("reuse", child=THREADS_CHILD)
    assert reused["changed"]
    # Without one shared arena each thread's fill is fresh pages again; with it, the buffer the
    # previous thread freed is taken back.
    assert min(plain["later"]) > plain["first"] / 4, plain
    assert max(reused["later"]) < reused["first"] / 10, reused


def test_an_operators_own_malloc_settings_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")
    assert heap.reuse_freed_memory() is False
    assert faults("reuse", {"MALLOC_MMAP_MAX_": "65536"})["changed"] is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2 and malloc_trim")
def test_a_freed_tail_that_no_chunk_fits_is_given_back_and_the_top_kept() -> None:
    heap = faults("reuse", child=HOLE_CHILD)
    # The third chunk did not fit the tail's 65 MiB: it came from the top, and the hole stayed in
    # the process's memory (``kvtier_heap_bytes``: free, not at the top) until it was given back.
    assert heap["in_use"] >= 240 and heap["free"] - heap["free_at_top"] >= 64, heap
    assert heap["released"] and heap["before"] - heap["after"] >= 60, heap
    assert heap["at_top_after"] >= 89, heap  # the freed 90 MiB at the top stay for the next cut
    # Without kvtier's malloc settings glibc maps such blocks apart: nothing to do, nothing done.
    assert faults("plain", child=HOLE_CHILD)["released"] is False


def test_the_heap_metric_is_rendered_where_glibc_tells_it() -> None:
    rendered = Metrics().render().decode()
    assert ('kvtier_heap_bytes{state="in_use"}' in rendered) == (heap.heap_usage() is not None)
