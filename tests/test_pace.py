"""The pace of a save's work (tiers/pace.py): while requests compute and the host's tasks wait for
its CPUs, the background pools take at most ``--save-cpu-share`` of one core; otherwise they run
at once. The last test runs a real llama-server (SmolLM2) and a real Valkey: the sidecar tells the
pace when its slots compute.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from pathlib import Path

import pytest

from sidecar.appkeys import METRICS
from sidecar.config import load_settings
from sidecar.metrics import Metrics
from tests.servers import RedisProc
from tests.sidecars import post
from tests.test_aborted_answers import SYSTEM, node
from tiers import pace, threads
from tiers.errors import ConfigError


class Pressure:
    """A host whose tasks wait for a CPU this share of the time."""

    def __init__(self, waited: float | None):
        self.waited = waited

    def share(self) -> float | None:
        return self.waited


def _burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU (not wall time: a loaded machine only makes it longer)."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass


@pytest.fixture
def paced(monkeypatch: pytest.MonkeyPatch) -> tuple[list[bool], Pressure]:
    """The process's pace at a quarter of a core, with a source and a host pressure the test sets."""
    computing, pressure = [True], Pressure(0.5)
    monkeypatch.setattr(pace.PACE, "share", 0.25)
    monkeypatch.setattr(pace.PACE, "pressure", pressure)
    monkeypatch.setattr(pace.PACE, "_sources", [lambda: computing[0]])
    monkeypatch.setattr(pace.PACE, "_resume", 0.0)
    return computing, pressure


def _three_pieces(pool: concurrent.futures.Executor, cpu: float = 0.1) -> float:
    t0 = time.monotonic()
    for _ in range(3):
        pool.submit(_burn, cpu).result()
    return time.monotonic() - t0


def test_while_requests_compute_on_a_contended_host_the_saves_work_keeps_to_its_share(
        paced: tuple[list[bool], Pressure]) -> None:
    # Each piece waits, before it starts, until the CPU the pieces before it took is the share of
    # the time since: a piece of 0.1 s of CPU at a quarter of a core makes the next one wait 0.3 s.
    # Lower bounds only: a slow machine can only make the waits longer.
    computing, _ = paced
    rested_before = pace.PACE.rested_s
    pool = threads.background_executor(2, "test-pace")
    try:
        slow = _three_pieces(pool)
        assert slow >= 2 * 0.3 * 0.95, slow  # the two pieces after the first waited for it
        assert pace.PACE.rested_s - rested_before >= 2 * 0.3 * 0.9  # counted (a metric)
        computing[0] = False  # nothing computes: pieces run at once, and owe nothing
        assert _three_pieces(pool) < slow
        computing[0] = True  # what was done while nothing computed is not owed afterwards
        t0 = time.monotonic()
        pool.submit(_burn, 0.01).result()
        assert time.monotonic() - t0 < 0.3, time.monotonic() - t0
    finally:
        pool.shutdown()


@pytest.mark.parametrize("waited", [0.0, 0.01])
def test_a_host_whose_tasks_do_not_wait_for_a_cpu_runs_the_save_at_once(
        paced: tuple[list[bool], Pressure], waited: float) -> None:
    # A GPU node, or llama-server -t below the host's cores: the save takes a core no one wants.
    _, pressure = paced
    pool = threads.background_executor(2, "test-pace")
    try:
        pressure.waited = 0.5
        slow = _three_pieces(pool)
        pressure.waited = waited
        assert _three_pieces(pool) < slow
        assert pace.PACE._resume == 0.0
    finally:
        pool.shutdown()


def test_without_pressure_figures_the_host_counts_as_contended(paced: tuple[list[bool], Pressure]) -> None:
    _, pressure = paced
    pressure.waited = None
    assert pace.PACE.busy()


def test_a_piece_resting_for_its_share_starts_at_once_when_requests_stop_computing(
        paced: tuple[list[bool], Pressure]) -> None:
    computing, _ = paced
    pace.PACE.share = 0.01  # a piece of 0.05 s owes about 5 s
    pace.PACE.run(_burn, 0.05)
    threading.Timer(0.2, lambda: computing.__setitem__(0, False)).start()
    t0 = time.monotonic()
    pace.PACE.run(lambda: None)
    assert time.monotonic() - t0 < 2.0, time.monotonic() - t0


def test_cpu_pressure_is_the_share_of_time_some_task_waited(tmp_path: Path) -> None:
    psi = tmp_path / "cpu"
    now = [100.0]
    pressure = pace.CpuPressure(str(psi), clock=lambda: now[0])
    psi.write_text("some avg10=1.00 avg60=0.50 avg300=0.10 total=1000000\nfull avg10=0.00 avg60=0.00 "
                   "avg300=0.00 total=0\n")
    assert pressure.share() is None  # one look: no interval yet
    now[0] += 0.5
    psi.write_text("some avg10=1.00 avg60=0.50 avg300=0.10 total=1200000\n")
    assert pressure.share() == pytest.approx(0.4)  # 0.2 s waited in 0.5 s
    now[0] += 0.05
    psi.write_text("some avg10=1.00 avg60=0.50 avg300=0.10 total=9999999\n")
    assert pressure.share() == pytest.approx(0.4)  # too soon to look again
    for damaged in ("", "some avg10=1.00\n", "some total=x\n", "full total=5\n"):
        psi.write_text(damaged)
        now[0] += 1
        assert pace.CpuPressure(str(psi), clock=lambda: now[0]).share() is None, damaged
    assert pace.CpuPressure(str(tmp_path / "none")).share() is None


def test_the_paces_rests_are_exported_as_a_counter() -> None:
    resting = pace.Pace(Pressure(1.0))
    resting.rested_s = 1.5
    metrics = Metrics()
    metrics.attach_pace(resting)
    assert metrics.registry.get_sample_value("kvtier_save_paced_seconds_total") == 1.5


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5"])
def test_save_cpu_share_outside_0_to_1_is_refused(value: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="save_cpu_share"):
        load_settings(["--slot-dir", str(tmp_path), "--save-cpu-share", value], env={})
    with pytest.raises(ValueError, match="share"):
        pace.set_background_pace(float(value))


def test_a_busy_source_counts_only_until_it_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pace.PACE, "pressure", Pressure(1.0))
    assert not pace.PACE.busy()
    stop = pace.tell_busy(lambda: True)
    assert pace.PACE.busy()
    stop()
    assert not pace.PACE.busy()


@pytest.mark.llama
async def test_the_pace_knows_when_the_nodes_slots_compute(
        redis_srv: RedisProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The sidecar tells the pace when its slots compute, and stops telling it when it shuts down,
    # so that the last saves drain at full speed. The host counts as contended here.
    monkeypatch.setattr(pace.PACE, "pressure", Pressure(1.0))
    assert not pace.PACE.busy()
    async with node(tmp_path, redis_srv.url, "a", ("-np", "1")) as (_, a):
        assert not pace.PACE.busy()  # started, nothing computing
        seen: list[bool] = []

        async def watch() -> None:
            while True:
                seen.append(pace.PACE.busy())
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        try:
            answer = await post(a.url + "/completion", {"prompt": f"{SYSTEM}\nQuestion: What does shelf 7 hold?\n"
                                                                  "Answer:", "n_predict": 24, "temperature": 0})
        finally:
            watcher.cancel()
        assert answer.status == 200, answer.text
        assert True in seen, "the pace never saw the slot compute"
        await a.engine.drain(30)
        assert not pace.PACE.busy()  # the answer's slot is saved, not computing
        assert a.app[METRICS].registry.get_sample_value("kvtier_save_paced_seconds_total") is not None
    assert not pace.PACE.busy()  # the sidecar is gone: nothing tells it any more
