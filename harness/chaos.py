"""`loadback chaos run`: break the daemon on purpose and check that only recompute is lost.

A scenario (harness/chaos_scenario.py) names a fault and when it acts; N engines (`--engines`)
share the one daemon, one request each per round; after a bounded run every invariant is
judged (harness/chaos_judge.py).
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from lmcache_loadback.connectors.kv_layout import KVPool
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator.config import LoadBackConfig
from lmcache_loadback.orchestrator.core import LoadBackOrchestrator
from lmcache_loadback.orchestrator.instruments import product_metrics
from lmcache_loadback.testing.daemon import DaemonProcess, free_port
from lmcache_loadback.testing.fault_proxy import FaultProxy, FaultRule
from lmcache_loadback.testing.os_delay import OsDelay

from .bench.common import progress_bar
from .chaos_judge import ErrorLog, Played, Result, dead_threads, judge
from .chaos_scenario import LAYOUT, SCENARIO_DIR, Fault, Scenario, base_config, load_scenarios
from .workload import Engine, SlotAllocator, Workload

__all__ = ["LAYOUT", "MAX_ENGINES", "ROUND_TIMEOUT_S", "SCENARIO_DIR", "ErrorLog", "Fault",
           "Lane", "Progress", "Result", "Scenario", "base_config", "load_scenarios",
           "print_results", "run", "run_scenario"]

#: How long the harness waits for every engine to finish one round (its one request, whose
#: calls are bounded by deadlines of at most a few hundred ms) before it judges the engines
#: still inside it hung and ends the run.
ROUND_TIMEOUT_S = 30.0
MAX_ENGINES = 32


@dataclass
class Lane:
    """One engine of the run: its own connector (own instance id), orchestrator (own metrics
    registry), KV pool, slot allocator, workload stream and `Engine`, run on its own thread."""

    index: int
    name: str
    conn: LMCacheMPConnector
    orch: LoadBackOrchestrator
    slots: SlotAllocator
    work: Workload
    engine: Engine
    thread: threading.Thread | None = None
    rounds_done: int = 0
    error: str = ""   # the traceback that ended its thread


def _fresh_metrics(n_engines: int):
    """A metrics registry of one engine: `product_metrics()` must give each a fresh one, or
    the engines' counters would add up and never reconcile per engine."""
    m = product_metrics()
    if n_engines > 1 and m.multiprocess:
        raise SystemExit("chaos --engines N > 1 reconciles each engine's own counters: unset "
                         "PROMETHEUS_MULTIPROC_DIR (in multiprocess mode every registry of a "
                         "process reads the same files)")
    seen = {k: v for k, v in m.snapshot().items()
            if k.startswith(("loadback_prefix_outcomes_total", "loadback_promised_tokens_total")) and v}
    if seen:
        raise RuntimeError(f"product_metrics() did not give a fresh registry: {seen}")
    return m


def _drive(lane: Lane, barrier: threading.Barrier, stop: threading.Event, state: dict,
           wait_s: float) -> None:
    """An engine's thread: at each round's gate every engine is released at once and issues
    one request; then it waits at the gate for the round's end. Ends when the harness says
    stop, or the barrier breaks (the harness ended the run)."""
    try:
        while True:
            barrier.wait(timeout=wait_s)
            if stop.is_set():
                return
            prompt, local = lane.work.next_prompt()
            lane.engine.request(prompt, local, phase=state["phase"])
            lane.rounds_done += 1
            barrier.wait(timeout=wait_s)
    except threading.BrokenBarrierError:
        return
    except BaseException:  # a harness or product bug: the thread dies, the run ends at once
        lane.error = traceback.format_exc()
        barrier.abort()


@dataclass
class _Rig:
    """What a run holds until it ends, closed whatever happened: the daemon, the fault proxy
    (wire faults), the engines."""

    daemon: DaemonProcess
    proxy: FaultProxy | None = None
    lanes: list[Lane] = field(default_factory=list)

    def close(self) -> None:
        for lane in self.lanes:
            lane.orch.close()
        if self.proxy is not None:
            self.proxy.close()
        self.daemon.resume()
        self.daemon.stop()


def run_scenario(scn: Scenario, requests: int = 0, *, metrics=None, progress=None,
                 engines: int = 1) -> Result:
    """Run one scenario: `engines` engines share one daemon, and in each of the `requests`
    rounds every engine issues one request at the same instant (a burst). One engine is
    the single-engine run of before, request for request.

    Each engine has its own connector (instance id), orchestrator and metrics registry, KV
    pool, slot allocator and request names (`e{i}-req-{n}`), on its own thread; they share
    the system prompts, so one loads what another stored. Rounds are paced by
    `request_interval_ms`; faults begin and end at round indices. An engine stuck in a round
    past ROUND_TIMEOUT_S breaks the barrier: it counts as hung and the run ends there."""
    if not 1 <= engines <= MAX_ENGINES:
        raise ValueError(f"engines must be 1..{MAX_ENGINES}, got {engines}")
    if metrics is not None and engines > 1:
        raise ValueError("metrics= is the one engine's registry: give none with engines > 1")
    n_rounds = requests or scn.requests
    rig = _Rig(DaemonProcess(chunk_size=LAYOUT.chunk_size, http=True,
                             shm_name=f"lbchaos{free_port()}" if scn.transfer == "shm" else None))
    errors = ErrorLog().__enter__()
    try:
        endpoint = _start_daemon(scn, rig)
        cfg = base_config(int(endpoint.rsplit(":", 1)[1]), {"transfer": scn.transfer, **scn.config})
        _add_lanes(rig, scn, cfg, endpoint, engines, metrics)
        if scn.fault.kind != "absent_at_start" and not scn.fault.from_start:
            for lane in rig.lanes:
                if not lane.orch.wait_registered(30):
                    raise RuntimeError(f"{scn.name}: orchestrator {lane.name} never registered")
        played = _play(scn, rig, n_rounds, progress)
        return judge(scn, rig.lanes, rig.daemon, rig.proxy, played, errors)
    finally:
        errors.__exit__()
        rig.close()


def _start_daemon(scn: Scenario, rig: _Rig) -> str:
    """Start the daemon (unless it is absent at start) and, for wire faults, the proxy in
    front of it; returns the endpoint the engines talk to."""
    fault = scn.fault
    if fault.kind != "absent_at_start":
        rig.daemon.start()
    endpoint = rig.daemon.endpoint
    if fault.kind == "wire":
        rig.proxy = FaultProxy(rig.daemon.endpoint, layout=LAYOUT, seed=scn.seed).start()
        endpoint = rig.proxy.endpoint
        if fault.from_start:
            _begin_fault(fault, rig.daemon, rig.proxy)
    return endpoint


def deadline_slack_s(engines: int) -> float:
    """How far past its deadline a call may return before it counts as hung: 5 ms, plus one
    GIL switch interval per other engine. The harness runs its engines as threads of one
    process, where a call whose deadline passed may wait for the GIL while the others run;
    in production each engine is a process of its own."""
    return 0.005 + (engines - 1) * sys.getswitchinterval()


def _add_lanes(rig: _Rig, scn: Scenario, cfg: LoadBackConfig, endpoint: str, engines: int,
               metrics) -> None:
    # The fault proxy is a thread of this process standing for the network and the daemon:
    # its CPU (re-encoding payloads, holding the interpreter lock) is not the caller's.
    delay = functools.partial(OsDelay, foreign=rig.proxy.thread_ids if rig.proxy else ())
    for i in range(engines):
        pool = KVPool([torch.zeros(8192, 4, 16, dtype=torch.float16) for _ in range(2)],
                      [torch.zeros(8192, 4, 16, dtype=torch.float16) for _ in range(2)])
        conn = LMCacheMPConnector(endpoint, LAYOUT, transfer=scn.transfer,
                                  connect_timeout_s=cfg.deadlines.connect_ms / 1000)
        orch = LoadBackOrchestrator(cfg, conn, kv_pool=pool,
                                    metrics=metrics or _fresh_metrics(engines))
        slots = SlotAllocator(8192)
        name = f"e{i}" if engines > 1 else ""
        rig.lanes.append(Lane(i, name or "e0", conn, orch, slots,
                              Workload(LAYOUT, scn.seed, stream=i),
                              Engine(orch, pool, LAYOUT, slots, seed=scn.seed + i, name=name,
                                     deadline_slack_s=deadline_slack_s(engines),
                                     os_delay=delay)))


def _play(scn: Scenario, rig: _Rig, n_rounds: int, progress) -> Played:
    """The rounds: the fault begins and ends at its round indices; each round releases every
    engine at once and waits until each returned. Stops early past `max_seconds`, or when an
    engine dies or hangs."""
    lanes, fault, played = rig.lanes, scn.fault, Played()
    state = {"phase": ""}
    barrier = threading.Barrier(len(lanes) + 1)
    stop = threading.Event()
    engine_wait_s = scn.max_seconds + 2 * ROUND_TIMEOUT_S + 300  # a backstop only
    for lane in lanes:
        lane.thread = threading.Thread(target=_drive, name=f"chaos-engine-{lane.index}",
                                       args=(lane, barrier, stop, state, engine_wait_s),
                                       daemon=True)
        lane.thread.start()
    begin, stop_at = int(fault.start * n_rounds), int(fault.end * n_rounds)
    deadline = time.monotonic() + scn.max_seconds
    due = time.monotonic()
    try:
        for i in range(n_rounds):
            if time.monotonic() > deadline:
                break
            # Paced from the previous round, never a burst to catch up after a stall.
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            due = time.monotonic() + scn.request_interval_ms / 1000
            if fault.kind not in ("none", "absent_at_start") and i == begin and not fault.from_start:
                _begin_fault(fault, rig.daemon, rig.proxy)
            if fault.kind != "none" and i == stop_at:
                _end_fault(fault, rig.daemon, rig.proxy)
                played.t_fault_end, state["phase"] = time.monotonic(), "recovery"
            if not _round(barrier, lanes, played):
                break
            played.max_debts = max(played.max_debts, *(lane.orch.pending_debts() for lane in lanes))
            played.dead |= dead_threads(lanes, engines_alive=True)
            if progress:
                progress(scn.name, i + 1, n_rounds)
    finally:
        _stop_engines(lanes, barrier, stop)
    return played


def _round(barrier: threading.Barrier, lanes: list[Lane], played: Played) -> bool:
    """One round at the harness's side of the barrier; False when it broke (the run ends)."""
    try:
        barrier.wait(timeout=ROUND_TIMEOUT_S)  # the gate: all engines at once
        played.rounds += 1
        barrier.wait(timeout=ROUND_TIMEOUT_S)  # every engine's request returned
        return True
    except threading.BrokenBarrierError:
        # An engine died (dead_threads), or one is stuck inside its request: hung
        # (a broken barrier nobody can be blamed for counts as one hung engine).
        if not any(lane.error for lane in lanes):
            played.hung_engines = [lane.name for lane in lanes if lane.rounds_done < played.rounds
                                   and lane.thread.is_alive()] or ["(barrier broken)"]
        return False


def _stop_engines(lanes: list[Lane], barrier: threading.Barrier, stop: threading.Event) -> None:
    stop.set()
    if not barrier.broken:
        try:
            barrier.wait(timeout=ROUND_TIMEOUT_S)  # releases the engines: they see stop
        except threading.BrokenBarrierError:
            pass
    barrier.abort()
    for lane in lanes:
        lane.thread.join(timeout=5)


def _begin_fault(fault: Fault, daemon: DaemonProcess, proxy: FaultProxy | None) -> None:
    if fault.kind == "kill":
        daemon.kill()
    elif fault.kind == "hang":
        daemon.pause()
    elif fault.kind == "restart":
        daemon.restart()
    elif fault.kind == "wire":
        for rule in fault.rules:
            proxy.add_rule(FaultRule(**rule))


def _end_fault(fault: Fault, daemon: DaemonProcess, proxy: FaultProxy | None) -> None:
    if fault.kind in ("kill", "absent_at_start"):
        daemon.start()
    elif fault.kind == "hang":
        daemon.resume()
    elif fault.kind == "wire":
        proxy.clear()


class Progress:
    """One tqdm bar per scenario on stderr (quiet in a log: see bench.common.progress_bar);
    call it as `progress(name, done, total)`, `close()` when the run ends."""

    def __init__(self) -> None:
        self._bar = None

    def __call__(self, name: str, i: int, n: int) -> None:
        if self._bar is None or self._bar.desc != name:
            self.close()
            self._bar = progress_bar(n, name)
        self._bar.update(i - self._bar.n)
        if i >= n:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def print_results(results: list[Result]) -> None:
    from .bench.common import print_table

    rows = []
    for r in results:
        deg = ", ".join(f"{k}={v}" for k, v in r.degraded.items()) or "-"
        rows.append([r.name, r.engines, r.requests, r.hung,
                     "-" if r.worst_overshoot_ms is None else f"{r.worst_overshoot_ms:+.1f}",
                     r.leaked, r.wrong_bytes,
                     "yes" if r.counters_ok else "NO", f"{r.p99_return_s * 1000:.1f}",
                     "-" if r.recovery_s is None else f"{r.recovery_s:.2f}",
                     r.loaded, r.max_debts_queued, deg])
    print_table(["scenario", "engines", "requests", "hung", "worst over ms", "leaked", "wrong",
                 "counters ok", "p99 ms", "recovery s", "loaded", "max queued",
                 "degraded by reason"], rows)
    for r in results:
        for m in r.counter_mismatches:
            print(f"  {r.name}: counter mismatch: {m}")
        if r.leaked:
            print(f"  {r.name}: leaks: {r.leaks}")
        d = r.worst_overshoot_detail
        if r.hung and d:
            print(f"  {r.name}: worst call, {d['op']}, {d['took_ms']:.1f} ms against a "
                  f"{d['deadline_ms']:.0f} ms deadline: {d['run_queue_wait_ms']:.1f} ms waiting "
                  f"for a CPU (OS run queue; other threads {d['others_run_queue_ms']:.1f} ms), "
                  f"{d['foreign_cpu_ms']:.1f} ms of the fault proxy's CPU, "
                  f"{d['steal_ms']:.0f} ms stolen by the host, "
                  f"{d['gc_ms']:.1f} ms in garbage collection, "
                  f"{d['own_cpu_ms']:.1f} ms on its CPU, "
                  f"{d['blocked_ms']:.1f} ms blocked while this process's other threads used "
                  f"{d['other_threads_cpu_ms']:.1f} ms of CPU")
        if r.dead_threads:
            print(f"  {r.name}: threads dead while they should run: {', '.join(r.dead_threads)}")
        for name, tb in r.extra.get("engine_errors", {}).items():
            print(f"  {r.name}: engine {name} died: {tb.strip().splitlines()[-1]}")
        if r.extra.get("hung_engines"):
            print(f"  {r.name}: engines stuck in a round past {ROUND_TIMEOUT_S:g} s (the run ended "
                  f"there): {', '.join(r.extra['hung_engines'])}")
        for e in r.missing_errors:
            print(f"  {r.name}: the orchestrator never logged {e} (logged: {r.errors_logged or 'none'})")


def run(args) -> int:
    scenarios = load_scenarios(args.scenario)
    engines = getattr(args, "engines", 1)
    more = {"engines": engines} if engines != 1 else {}
    results = []
    t0 = time.monotonic()
    progress = Progress()
    try:
        for scn in scenarios:
            results.append(run_scenario(scn, args.requests, progress=progress, **more))
    finally:
        progress.close()
    print_results(results)
    print(f"{len(results)} scenarios in {time.monotonic() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"scenarios": [
            {k: v for k, v in asdict(r).items() if k not in ("leaks", "extra")} | {
                "leaks": r.leaks} for r in results]}, indent=2, default=str))
    failed = [r.name for r in results if not r.ok]
    if failed:
        print(f"invariants violated in: {', '.join(failed)}")
        return 1
    return 0
