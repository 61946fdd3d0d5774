"""The time the machine and the runtime, not the product, took from a call: how long the
calling thread waited for a CPU (the OS run queue), how long the host kept this machine's
virtual CPUs (steal), and how long Python's garbage collector stopped this process.

Deadline judgements (tests, the chaos harness) allow a call to run past its deadline by a
slack plus this delay, capped (`excused`): a call that waited past its deadline (on the
daemon, on a lock, on another thread of its process) is a hang; one the machine did not run
is not. What other threads of the process waited for a CPU is reported, never excused: it
grows with the thread count and the machine's load, not with what this call lost. A full collection in a process the size of a test run (or an
engine's) takes 100-150 ms here, and it holds the interpreter: every thread stops, whichever
one triggered it. The OS figures are 0 where /proc lacks them (not Linux).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Sequence

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def thread_sched() -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one) of the calling thread; zeros where
    /proc/thread-self/schedstat is missing."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            cpu, wait, _ = f.read().split()
        return int(cpu), int(wait)
    except (OSError, ValueError):
        return 0, 0


def threads_sched_ns() -> dict[int, tuple[int, int]]:
    """(ns on a CPU, ns waiting for one) of each thread of this process since it started,
    by thread id; {} where /proc/self/task is missing."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                cpu, wait = f.read().split()[:2]
            out[int(tid)] = (int(cpu), int(wait))
        except (OSError, ValueError):
            continue  # ended meanwhile
    return out


def steal_ticks() -> list[int]:
    """Steal per virtual CPU, in clock ticks since boot (/proc/stat's 8th field); [] where
    missing."""
    out = []
    try:
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                fields = line.split()
                if fields[0] != "cpu" and len(fields) > 8:
                    out.append(int(fields[8]))
    except (OSError, ValueError):
        return []
    return out


_gc = {"total_s": 0.0, "since": None}


def _on_gc(phase: str, info: dict) -> None:
    # A collection holds the interpreter lock throughout: one at a time, process-wide.
    if phase == "start":
        _gc["since"] = time.perf_counter()
    elif _gc["since"] is not None:
        _gc["total_s"] += time.perf_counter() - _gc["since"]
        _gc["since"] = None


if _on_gc not in gc.callbacks:
    gc.callbacks.append(_on_gc)


def gc_seconds() -> float:
    """Seconds this process spent in garbage collection since this module was imported."""
    return _gc["total_s"]


class OsDelay:
    """`with OsDelay() as d: call()`, then `d.run_queue_s`, `d.steal_s`, `d.gc_s`,
    `d.foreign_cpu_s` and `d.seconds` (their sum: what the machine took from this call's
    thread), `d.excused(cap_s)` (that sum, at most `cap_s`). Steal is the most any one
    virtual CPU lost meanwhile (clock-tick resolution, 10 ms on most kernels): the thread ran
    on one of them at a time. gc_s counts every collection in the process meanwhile, on any
    thread. `foreign`: ids of threads in this process that stand for another process (a
    test's fault proxy, in production the network and the daemon); their CPU time meanwhile
    is `foreign_cpu_s` (they hold the interpreter lock while they work).
    others_run_queue_s, what this process's other threads waited for a CPU meanwhile
    (summed), is reported only: it is no part of `seconds`.

    Also `d.cpu_s`, the calling thread's own time on a CPU, and `d.took_s`."""

    run_queue_s = others_run_queue_s = foreign_cpu_s = steal_s = gc_s = cpu_s = took_s = 0.0

    def __init__(self, foreign: Sequence[int] = ()) -> None:
        self.foreign = set(foreign)

    def __enter__(self) -> "OsDelay":
        self._threads0 = threads_sched_ns()
        self._steal0 = steal_ticks()
        self._sched0 = thread_sched()
        self._gc0 = gc_seconds()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.took_s = time.perf_counter() - self._t0
        self.gc_s = gc_seconds() - self._gc0
        cpu1, wait1 = thread_sched()
        steal1 = steal_ticks()
        me = threading.get_native_id()
        threads1 = threads_sched_ns()
        # A thread started meanwhile counts whole; one that ended meanwhile is not seen.
        d = {t: (c - self._threads0.get(t, (0, 0))[0], w - self._threads0.get(t, (0, 0))[1])
             for t, (c, w) in threads1.items() if t != me}
        self.others_run_queue_s = sum(w for _, w in d.values()) / 1e9
        self.foreign_cpu_s = sum(c for t, (c, _) in d.items() if t in self.foreign) / 1e9
        self.cpu_s = (cpu1 - self._sched0[0]) / 1e9
        self.run_queue_s = (wait1 - self._sched0[1]) / 1e9
        if steal1 and len(steal1) == len(self._steal0):
            self.steal_s = max(b - a for a, b in zip(self._steal0, steal1)) * _TICK_S

    @property
    def seconds(self) -> float:
        return self.run_queue_s + self.foreign_cpu_s + self.steal_s + self.gc_s

    def excused(self, cap_s: float) -> float:
        """What a deadline judgement may excuse of this call: `seconds`, at most `cap_s`."""
        return min(self.seconds, cap_s)

    def describe(self) -> str:
        return (f"took {self.took_s * 1e3:.1f} ms: {self.cpu_s * 1e3:.1f} ms on a CPU, "
                f"{self.run_queue_s * 1e3:.1f} ms waiting for one "
                f"(its process's other threads: {self.others_run_queue_s * 1e3:.1f} ms), "
                f"{self.foreign_cpu_s * 1e3:.1f} ms of foreign threads' CPU, "
                f"{self.steal_s * 1e3:.0f} ms stolen by the host, "
                f"{self.gc_s * 1e3:.1f} ms in garbage collection")
