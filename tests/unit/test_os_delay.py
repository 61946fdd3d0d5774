"""OsDelay measures what the machine took from a call: run-queue wait and host steal. The
chaos judge and the deadline tests excuse exactly that much, no more."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import threading
import time

import pytest

from lmcache_loadback.harness.workload import Engine
from lmcache_loadback.testing.os_delay import OsDelay, steal_ticks, thread_sched

linux = pytest.mark.skipif(thread_sched() == (0, 0), reason="needs /proc schedstat (Linux)")


def _spin_cpu(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _hog(cpu: int, ready, stop) -> None:
    os.sched_setaffinity(0, {cpu})
    ready.set()
    while not stop.is_set():
        pass


@contextlib.contextmanager
def busy_cpu():
    """A process spinning on one CPU (this thread's first), until the block ends."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    hog = ctx.Process(target=_hog, args=(cpu, ready, stop), daemon=True)
    hog.start()
    try:
        assert ready.wait(30), "the busy process never started"
        yield cpu
    finally:
        stop.set()
        hog.join(10)


@linux
def test_a_thread_sharing_its_cpu_with_a_busy_process_shows_the_run_queue_wait():
    before = os.sched_getaffinity(0)
    with busy_cpu() as cpu:
        os.sched_setaffinity(0, {cpu})  # this thread only, on the hog's CPU
        try:
            with OsDelay() as d:
                _spin_cpu(0.1)
        finally:
            os.sched_setaffinity(0, before)
    # Half the CPU each (CFS): about as long waiting as working.
    assert d.cpu_s == pytest.approx(0.1, abs=0.02)
    assert d.run_queue_s >= 0.03, d.describe()
    assert d.seconds >= d.run_queue_s and d.took_s >= d.cpu_s + d.run_queue_s - 0.01


@linux
def test_another_threads_run_queue_wait_is_reported_and_not_excused():
    """The call sleeps; another thread of this process (pinned beside the busy process, as
    a heartbeat holding the interpreter lock might be) waits for a CPU meanwhile: reported,
    but no part of what the machine took from this call's thread."""
    spun, done = threading.Event(), threading.Event()

    def other(cpu: int) -> None:
        os.sched_setaffinity(0, {cpu})
        _spin_cpu(0.1)
        spun.set()
        done.wait(30)  # alive until the measurement ended (an ended thread is not seen)

    with busy_cpu() as cpu:
        th = threading.Thread(target=other, args=(cpu,))
        try:
            with OsDelay() as d:
                th.start()
                assert spun.wait(30)
        finally:
            done.set()
            th.join(30)
    assert d.others_run_queue_s >= 0.03 and d.run_queue_s < d.others_run_queue_s, d.describe()
    assert d.seconds == pytest.approx(d.run_queue_s + d.foreign_cpu_s + d.steal_s + d.gc_s)
    assert d.excused(0.001) == min(d.seconds, 0.001)


@linux
def test_an_idle_wait_is_neither_run_queue_nor_cpu():
    with OsDelay() as d:
        time.sleep(0.05)
    # Asleep is neither: only a wake-up may wait for a CPU (longer on a loaded machine).
    assert d.took_s >= 0.05 and d.cpu_s < 0.01, d.describe()
    assert d.run_queue_s <= d.took_s - 0.04, d.describe()


def test_steal_is_read_per_virtual_cpu():
    ticks = steal_ticks()
    if not os.path.exists("/proc/stat"):
        assert ticks == []
    else:
        assert len(ticks) == os.cpu_count() and all(t >= 0 for t in ticks)


class _Took:
    """What OsDelay would say of a call, set by the test: how long it took and the
    machine's share of that."""

    def __init__(self, took_s: float, run_queue_s: float, steal_s: float, gc_s: float) -> None:
        self.took_s, self.run_queue_s, self.steal_s, self.gc_s = took_s, run_queue_s, steal_s, gc_s
        self.cpu_s = self.others_run_queue_s = self.foreign_cpu_s = 0.0

    def __call__(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    @property
    def seconds(self) -> float:
        return self.run_queue_s + self.steal_s + self.gc_s

    def excused(self, cap_s: float) -> float:
        return min(self.seconds, cap_s)


@pytest.mark.parametrize("run_queue_s, steal_s, gc_s, hung", [
    (0.0, 0.0, 0.0, 1),      # 40 ms late, nothing the machine's: hung
    (0.03, 0.0, 0.0, 1),     # 30 of the 40 ms waiting for a CPU: 10 ms ours, over the 5 ms slack
    (0.038, 0.0, 0.0, 0),    # all but 2 ms the run queue's
    (0.0, 0.04, 0.0, 0),     # the host stole it
    (0.0, 0.0, 0.036, 0),    # a full garbage collection
    (0.01, 0.01, 0.01, 1),   # 30 ms of the machine's, 10 still ours
    (0.02, 0.01, 0.01, 0),
])
def test_the_judge_excuses_what_the_machine_took_and_nothing_more(run_queue_s, steal_s, gc_s,
                                                                  hung):
    """A 50 ms call against a 10 ms deadline and a 5 ms slack."""
    delay = _Took(0.05, run_queue_s, steal_s, gc_s)
    e = Engine(None, None, None, None, deadline_slack_s=0.005, os_delay=delay)
    result, took = e._timed("load_back", 0.01, lambda: "done")
    assert (result, took) == ("done", 0.05)
    assert e.tally.hung == hung
    assert e.tally.worst_overshoot_s == pytest.approx(0.04)  # the raw figure, reported as is
    d = e.tally.worst_overshoot_detail
    assert d["steal_ms"] == pytest.approx(steal_s * 1e3)
    assert d["run_queue_wait_ms"] == pytest.approx(run_queue_s * 1e3)
    assert d["gc_ms"] == pytest.approx(gc_s * 1e3)


def test_the_allowance_is_capped_per_call_and_what_was_excused_is_kept():
    """A 600 ms call against a 10 ms deadline during which the process collected garbage
    for 500 ms: at most the cap (250 ms) is the machine's; the rest is the call's."""
    e = Engine(None, None, None, None, deadline_slack_s=0.005, os_delay=_Took(0.6, 0, 0, 0.5),
               excuse_cap_s=0.25)
    e._timed("load_back", 0.01, lambda: None)
    assert e.tally.hung == 1
    assert e.tally.excused_s == e.tally.worst_excused_s == pytest.approx(0.25)
    e.os_delay = _Took(0.05, 0.038, 0, 0)  # 40 ms late, 38 ms of it waiting for a CPU
    e._timed("load_back", 0.01, lambda: None)
    assert e.tally.hung == 1  # excused: only what it needed, 35 ms past the 5 ms slack
    assert e.tally.excused_s == pytest.approx(0.25 + 0.035)
    assert e.tally.worst_excused_s == pytest.approx(0.25)


@pytest.mark.parametrize("over_s", [0.5408, 0.1234567, 0.0456789, 0.3, 0.7])
def test_a_call_that_waited_for_a_cpu_longer_than_it_was_late_is_not_hung(over_s):
    """A kill_shm match 541 ms late had waited 694 ms for a CPU: excused whole (what the
    verdict needed, 536 ms), never hung by a rounding of (late - excused) past the slack."""
    delay = _Took(0.01 + over_s, over_s + 0.15, 0.0, 0.0)
    e = Engine(None, None, None, None, deadline_slack_s=0.005, os_delay=delay,
               excuse_cap_s=1.0)
    e._timed("match", 0.01, lambda: None)
    assert e.tally.hung == 0


def test_a_garbage_collection_during_the_call_is_counted_whichever_thread_ran_it():
    junk = [[i] for i in range(200_000)]  # a heap for the collector to walk
    ran = threading.Event()

    def collect():
        gc.collect()
        ran.set()

    with OsDelay() as here:
        gc.collect()
    with OsDelay() as there:
        th = threading.Thread(target=collect)
        th.start()
        th.join(30)
    assert ran.is_set() and len(junk) == 200_000
    assert here.gc_s > 0 and there.gc_s > 0
    assert here.gc_s <= here.took_s and there.gc_s <= there.took_s


@linux
def test_a_foreign_threads_cpu_is_excused_and_only_when_named():
    """The chaos harness names its fault proxy's thread: it stands for another process, and
    its CPU (holding the interpreter lock) is not the caller's."""
    started, go, spun, done = (threading.Event() for _ in range(4))
    tid: list[int] = []

    def proxy_like() -> None:
        tid.append(threading.get_native_id())
        started.set()
        assert go.wait(30)
        _spin_cpu(0.05)
        spun.set()
        done.wait(30)  # alive until the measurement ended (an ended thread is not seen)

    th = threading.Thread(target=proxy_like)
    th.start()
    try:
        assert started.wait(30)
        with OsDelay(foreign=tid) as named, OsDelay() as unnamed:
            go.set()
            assert spun.wait(30)
    finally:
        go.set()
        done.set()
        th.join(30)
    assert named.foreign_cpu_s >= 0.04, named.describe()
    assert unnamed.foreign_cpu_s == 0 and named.seconds >= named.foreign_cpu_s


def test_the_fault_proxy_names_its_thread():
    from lmcache_loadback.connectors.ports import free_port
    from lmcache_loadback.testing.fault_proxy import FaultProxy

    proxy = FaultProxy(f"tcp://127.0.0.1:{free_port()}", upstream_wait_s=0.01)
    assert proxy.thread_ids == []
    proxy.start()
    try:
        assert proxy.thread_ids == [proxy._thread.native_id] and proxy.thread_ids[0] > 0
    finally:
        proxy.close()
