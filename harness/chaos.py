"""`loadback chaos run`: break the daemon on purpose and check that only recompute is lost.

A scenario (harness/chaos_scenario.py) names a fault and when it acts; N engines (`--engines`)
share the one daemon, one request each per round, each engine in its own process as in
production (harness/chaos_engines.py); after a bounded run every invariant is judged
(harness/chaos_judge.py). Scenarios with an L2 store break that store instead of the daemon
(harness/chaos_l2.py).
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from threading import BrokenBarrierError
from pathlib import Path

from lmcache_loadback.connectors.ports import free_port
from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.testing.fault_proxy import FaultProxy, FaultRule

from .bench.common import progress_bar
from .chaos_engines import (DEADLINE_SLACK_S, EXCUSE_CAP_S, Lane, ProcessCrew, RequestHook,
                            ThreadCrew, make_lane)
from .chaos_judge import ErrorLog, Played, Result, judge
from .chaos_l2 import L2Rig, Peer, Supervisor, l2_verdict
from .chaos_scenario import LAYOUT, SCENARIO_DIR, Fault, Scenario, base_config, load_scenarios

__all__ = ["DEADLINE_SLACK_S", "EXCUSE_CAP_S", "LAYOUT", "MAX_ENGINES", "ROUND_TIMEOUT_S",
           "SCENARIO_DIR", "ErrorLog", "Fault", "Lane", "Progress", "Result", "Scenario",
           "base_config", "load_scenarios", "print_results", "run", "run_scenario"]

#: How long the harness waits for every engine to finish one round (its one request, whose
#: calls are bounded by deadlines of at most a few hundred ms) before it judges the engines
#: still inside it hung and ends the run.
ROUND_TIMEOUT_S = 30.0
MAX_ENGINES = 32


@dataclass
class _Rig:
    """What a run holds until it ends, closed whatever happened: the daemon, the fault proxy
    (wire faults), the engines, the L2 store and the daemon's supervisor (L2 scenarios)."""

    daemon: DaemonProcess
    proxy: FaultProxy | None = None
    crew: ThreadCrew | ProcessCrew | None = None
    l2: L2Rig | None = None
    peer: Peer | None = None
    supervisors: list[Supervisor] = field(default_factory=list)

    def restart_daemons(self) -> None:
        """Every daemon on the store, side by side (an operator's restart of the fleet)."""
        daemons = [self.daemon] + ([self.peer.daemon] if self.peer else [])
        with ThreadPoolExecutor(len(daemons)) as ex:
            for f in [ex.submit(d.restart) for d in daemons]:
                f.result()

    def close(self) -> None:
        if self.crew is not None:
            self.crew.close()
        if self.proxy is not None:
            self.proxy.close()
        for supervisor in self.supervisors:
            supervisor.close()
        if self.peer is not None:
            self.peer.close()
        self.daemon.resume()
        self.daemon.stop()
        if self.l2 is not None:
            self.l2.stop()


def run_scenario(scn: Scenario, requests: int = 0, *, metrics=None, progress=None,
                 engines: int = 1, request_hook: RequestHook | None = None) -> Result:
    """Run one scenario: `engines` engines share one daemon, and in each of the `requests`
    rounds every engine issues one request at the same instant (a burst). One engine runs
    on a thread of this process (`metrics=`: its registry); several run one process each,
    as production runs them, each with its own connector (instance id), orchestrator and
    metrics registry, KV pool, slot allocator and request names (`e{i}-req-{n}`); they share
    the system prompts, so one loads what another stored. Rounds are paced by
    `request_interval_ms`; faults begin and end at round indices. An engine stuck in a round
    past ROUND_TIMEOUT_S breaks the barrier: it counts as hung and the run ends there.
    `request_hook` (tests, picklable): stands in for `Engine.request`."""
    if not 1 <= engines <= MAX_ENGINES:
        raise ValueError(f"engines must be 1..{MAX_ENGINES}, got {engines}")
    if metrics is not None and engines > 1:
        raise ValueError("metrics= is the one engine's registry: give none with engines > 1")
    n_rounds = requests or scn.requests
    rig = _Rig(DaemonProcess(chunk_size=LAYOUT.chunk_size, http=True,
                             shm_name=f"lbchaos{free_port()}" if scn.transfer == "shm" else None))
    errors = ErrorLog().__enter__()
    try:
        admin_port = _start_l2(scn, rig, engines)
        endpoint = _start_daemon(scn, rig)
        port = int(endpoint.rsplit(":", 1)[1])
        wait = not scn.fault.registers_late
        if engines == 1:
            # The fault proxy is then a thread of this process standing for the network and
            # the daemon: its CPU (holding the interpreter lock) is not the caller's.
            lane = make_lane(scn, endpoint, port, 0, 1, metrics=metrics,
                             foreign=tuple(rig.proxy.thread_ids) if rig.proxy else (),
                             admin_port=admin_port)
            rig.crew = ThreadCrew(lane, request_hook)
            if wait and not lane.orch.wait_registered(30):
                raise RuntimeError(f"{scn.name}: orchestrator e0 never registered")
        else:
            rig.crew = ProcessCrew(scn, endpoint, port, engines, wait_registered=wait,
                                   hook=request_hook, admin_port=admin_port)
        played = _play(scn, rig, n_rounds, progress)
        if rig.proxy is not None:
            rig.proxy.clear()
        for supervisor in rig.supervisors:  # its holds are read once it serves
            supervisor.wait(150)
        reports, daemon_leaks = rig.crew.reports(rig.daemon, settle_s=15.0)
        result = judge(scn, reports, daemon_leaks, rig.proxy, played, errors)
        if rig.l2 is not None:
            result.l2 = l2_verdict(scn, played, reports, rig.daemon.starts, rig.peer.stored)
        return result
    finally:
        errors.__exit__()
        rig.close()


def _start_l2(scn: Scenario, rig: _Rig, engines: int) -> int:
    """An L2 scenario's store (unless absent at start) and the peer node on it (its daemon
    started beside the engines'); returns the engines' daemon's admin API port for the L2
    canary (0: no L2)."""
    if scn.l2 is None:
        return 0
    rig.l2 = L2Rig(scn.l2)
    if scn.fault.kind != "l2_absent_at_start":
        rig.l2.start()
    rig.daemon.l2_adapter = rig.l2.adapter()
    rig.daemon.http_port = free_port()  # known before a supervised start
    rig.peer = Peer(LAYOUT, scn.seed, engines, rig.l2.adapter(), scn.l2.peer_lead_rounds)
    return rig.daemon.http_port


def _start_daemon(scn: Scenario, rig: _Rig) -> str:
    """Start the daemon (unless it is absent at start; under a supervisor where its L2
    adapter refuses to start without its store), the L2 peer's beside it, and, for wire
    faults, the proxy in front of it; returns the endpoint the engines talk to."""
    fault = scn.fault
    daemons = [rig.daemon] + ([rig.peer.daemon] if rig.peer else [])
    if fault.kind == "l2_absent_at_start" and scn.l2.adapter == "valkey":
        rig.supervisors = [Supervisor(d) for d in daemons]
    elif fault.kind != "absent_at_start":
        with ThreadPoolExecutor(len(daemons)) as ex:  # seconds each: side by side
            for f in [ex.submit(d.start) for d in daemons]:
                f.result()
    if rig.peer is not None:
        rig.peer.start_writer()
    endpoint = rig.daemon.endpoint
    if fault.kind == "wire":
        rig.proxy = FaultProxy(rig.daemon.endpoint, layout=LAYOUT, seed=scn.seed).start()
        endpoint = rig.proxy.endpoint
        if fault.from_start:
            _begin_fault(fault, rig)
    return endpoint


def _play(scn: Scenario, rig: _Rig, n_rounds: int, progress) -> Played:
    """The rounds: the fault begins and ends at its round indices; each round releases every
    engine at once and waits until each returned. Stops early past `max_seconds`, or when an
    engine dies or hangs."""
    crew, fault, played = rig.crew, scn.fault, Played()
    flicker = _Flicker(rig.daemon, fault, scn.seed) if fault.kind == "flicker" else None
    crew.start(scn.max_seconds + 2 * ROUND_TIMEOUT_S + 300)  # the engines' wait: a backstop
    begin, stop_at = int(fault.start * n_rounds), int(fault.end * n_rounds)
    restart_at = (None if fault.daemon_restart_at is None
                  else int(fault.daemon_restart_at * n_rounds))
    played.fault_rounds = (begin, stop_at, restart_at)
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
            if fault.kind != "none" and not fault.registers_late and i == begin:
                _begin_fault(fault, rig)
            if flicker is not None and begin <= i < stop_at:
                flicker.maybe()
            if fault.kind != "none" and i == stop_at:
                if flicker is not None:
                    flicker.join()
                _end_fault(fault, rig)
                played.t_fault_end = time.monotonic()
                crew.set_phase("recovery")
            if i == restart_at:
                rig.restart_daemons()  # the operator's remedy
            if rig.peer is not None:
                rig.peer.ahead(i)
            if not _round(crew, played):
                break
            crew.sample(played)
            if rig.l2 is not None:
                played.l2.add(time.monotonic(), sum(crew.loads()), rig.l2.reads())
            if progress:
                progress(scn.name, i + 1, n_rounds)
    finally:
        if flicker is not None:
            flicker.join()
        crew.stop(ROUND_TIMEOUT_S)
    return played


class _Flicker:
    """The flicker fault: in a share of the rounds (`probability`), the daemon is stopped
    for `pause_ms` from a random instant in the round's first `within_ms`, on a thread of
    its own (one window at a time), then continued."""

    def __init__(self, daemon: DaemonProcess, fault: Fault, seed: int) -> None:
        self.daemon, self.fault = daemon, fault
        self.rng = random.Random(f"flicker:{seed}")
        self.thread: threading.Thread | None = None
        self.windows = 0

    def maybe(self) -> None:
        if self.rng.random() >= self.fault.probability:
            return
        if self.thread is not None and self.thread.is_alive():
            return  # the last window is still open
        delay = self.rng.uniform(0, self.fault.within_ms / 1000)
        self.thread = threading.Thread(target=self._window, args=(delay,), daemon=True,
                                       name="chaos-flicker")
        self.windows += 1
        self.thread.start()

    def _window(self, delay_s: float) -> None:
        time.sleep(delay_s)  # where in the round the window opens
        self.daemon.pause()
        try:
            time.sleep(self.fault.pause_ms / 1000)  # the window itself
        finally:
            self.daemon.resume()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=10)


def _round(crew, played: Played) -> bool:
    """One round at the harness's side of the barrier; False when it broke (the run ends)."""
    try:
        crew.barrier.wait(timeout=ROUND_TIMEOUT_S)  # the gate: all engines at once
        played.rounds += 1
        crew.barrier.wait(timeout=ROUND_TIMEOUT_S)  # every engine's request returned
        return True
    except BrokenBarrierError:
        # An engine died (its report says so), or one is stuck inside its request: hung
        # (a broken barrier nobody can be blamed for counts as one hung engine).
        if not crew.failed():
            played.hung_engines = crew.stuck(played.rounds) or ["(barrier broken)"]
        return False


def _begin_fault(fault: Fault, rig: _Rig) -> None:
    if fault.on_l2:
        rig.l2.begin(fault.kind, fault.maxmemory)
    elif fault.kind == "kill":
        rig.daemon.kill()
    elif fault.kind == "hang":
        rig.daemon.pause()
    elif fault.kind == "restart":
        rig.daemon.restart()
    elif fault.kind == "wire":
        for rule in fault.rules:
            rig.proxy.add_rule(FaultRule(**rule))


def _end_fault(fault: Fault, rig: _Rig) -> None:
    if fault.on_l2:
        rig.l2.end(fault.kind)
    elif fault.kind in ("kill", "absent_at_start"):
        rig.daemon.start()
    elif fault.kind == "hang":
        rig.daemon.resume()
    elif fault.kind == "wire":
        rig.proxy.clear()


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
                     r.leaked, f"{r.excused_ms:.0f}/{r.worst_excused_ms:.1f}", r.wrong_bytes,
                     "yes" if r.counters_ok else "NO", f"{r.p99_return_s * 1000:.1f}",
                     "-" if r.recovery_s is None else f"{r.recovery_s:.2f}",
                     r.loaded, r.max_debts_queued, deg])
    print_table(["scenario", "engines", "requests", "hung", "worst over ms", "leaked",
                 "excused ms (sum/worst)", "wrong",
                 "counters ok", "p99 ms", "recovery s", "loaded", "max queued",
                 "degraded by reason"], rows)
    l2 = [r for r in results if r.l2 is not None]
    if l2:
        print()
        print_table(["L2 scenario", "adapter", "store reads by phase", "L2 hit again s",
                     "peer stores ok/failed", "daemon starts", "L2 metrics (engines)"], [
            [r.name, r.l2.adapter, ", ".join(f"{k} {v}" for k, v in r.l2.reads.items()),
             ("NEVER" if r.l2.needs_recovery else "-") if r.l2.recovery_s is None
             else f"{r.l2.recovery_s:.2f}",
             "/".join(map(str, r.l2.peer_stores)), r.l2.daemon_starts,
             ", ".join(f"{k} {v}" for k, v in sorted(r.l2.signals.items())) or "-"]
            for r in l2])
    for r in results:
        for m in r.counter_mismatches:
            print(f"  {r.name}: counter mismatch: {m}")
        if r.leaked:
            print(f"  {r.name}: leaks: {r.leaks}")
            if r.extra.get("given_up"):
                print(f"  {r.name}: owed releases given up unpaid (left to the daemon's TTL): "
                      f"{r.extra['given_up']}")
        d = r.worst_judged_detail
        if r.hung and d:
            print(f"  {r.name}: the call judged most late, {d.get('engine', '')} {d['op']}, {d['took_ms']:.1f} ms against a "
                  f"{d['deadline_ms']:.0f} ms deadline: {d['run_queue_wait_ms']:.1f} ms waiting "
                  f"for a CPU (OS run queue; other threads {d['others_run_queue_ms']:.1f} ms), "
                  f"{d['foreign_cpu_ms']:.1f} ms of the fault proxy's CPU, "
                  f"{d.get('excused_ms', 0):.1f} ms excused in all, "
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
        if r.l2 is not None and r.l2.needs_recovery and r.l2.recovery_s is None:
            print(f"  {r.name}: no engine hit served by the L2 store after the fault ended")


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
