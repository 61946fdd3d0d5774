"""`loadback chaos run`: break the daemon on purpose and check that only recompute is lost.

A scenario (YAML in configs/chaos/, shipped in the wheel: orchestrator.resources) names a
fault, when it starts and ends (as fractions of the request count), a seed and a request
count. Process faults act on the real daemon (SIGKILL, SIGSTOP/SIGCONT, restart, absent at
start); wire faults go through the FaultProxy placed between the orchestrator and the
daemon, from `start` or, with `from_start`, before the orchestrator first registers. After a
bounded run every invariant is judged: hung (a call past its deadline + 5 ms; the worst
overshoot is reported too), leaked (slots, read locks, sessions, debts still owed), wrong
bytes (loaded KV differing from a recompute), counters (metrics equal to the outcomes the
engine saw), recovery (fault end -> first hit) and, where a scenario names them in
`expect_logged`, the daemon errors the orchestrator logged (e.g. VersionSkew).

With `engines=N` (`--engines N`), N engines share the one daemon, each with its own
connector (instance id), orchestrator and metrics registry, KV pool, slot allocator and
request names (`e{i}-req-{n}`), on its own thread. The run is then `requests` rounds: in each
round every engine issues one request at the same instant (a threading.Barrier), paced by
`request_interval_ms`; faults begin and end at round indices. The engines share the system
prompts, so one loads what another stored. Leaks, counters and threads are judged per
engine (the daemon's locks and sessions once), plus the deepest queue of owed releases and
any heartbeat, releaser or engine thread found dead. An engine stuck in a round past
ROUND_TIMEOUT_S breaks the barrier: it counts as hung and the run ends there.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import msgspec
import torch
import yaml

from lmcache_loadback.testing.daemon import DaemonProcess, free_port
from lmcache_loadback.testing.fault_proxy import FaultProxy, FaultRule
from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector

from .bench.common import percentile, progress_bar
from lmcache_loadback.orchestrator.config import LoadBackConfig
from lmcache_loadback.orchestrator.core import LoadBackOrchestrator
from lmcache_loadback.orchestrator.instruments import product_metrics
from lmcache_loadback.orchestrator.resources import configs_dir
from .workload import Engine, SlotAllocator, Workload

SCENARIO_DIR = configs_dir() / "chaos"
LAYOUT = KVLayout(num_layers=2, num_heads=4, head_dim=16, dtype=torch.float16, chunk_size=16)


class Fault(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    kind: Literal["none", "kill", "hang", "restart", "absent_at_start", "wire"] = "none"
    start: float = 0.3          # fraction of the requests when the fault begins
    end: float = 0.6            # ... and when it is lifted
    rules: list[dict] = []      # wire: FaultRule fields
    # wire: the rules are in force before the orchestrator's first registration (a daemon of
    # another version at start), lifted at `end`; `start` is then unused.
    from_start: bool = False


class Scenario(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    description: str = ""
    seed: int = 0
    requests: int = 500
    max_seconds: float = 120.0  # the run stops by itself after this, whatever is left
    # Requests arrive at most this often, like traffic, not a tight loop: with the breaker
    # open a request costs microseconds, and recovery is judged in wall time.
    request_interval_ms: float = 10.0
    transfer: Literal["pickle", "shm"] = "pickle"
    fault: Fault = msgspec.field(default_factory=Fault)
    config: dict = {}           # LoadBackConfig overrides for this scenario
    # Error classes the orchestrator must have logged (its `loadback` logger) during the run.
    expect_logged: list[str] = []


@dataclass
class Result:
    name: str
    requests: int
    hung: int
    leaked: int
    wrong_bytes: int
    counters_ok: bool
    p99_return_s: float
    recovery_s: float | None
    degraded: dict[str, int]
    loaded: int = 0
    loaded_tokens: int = 0
    recomputed_tokens: int = 0
    leaks: dict[str, int] = field(default_factory=dict)
    counter_mismatches: list[str] = field(default_factory=list)
    #: The most any match/load_back ran past its deadline, ms (negative: the least headroom).
    worst_overshoot_ms: float | None = None
    #: Where the worst call's time went: own CPU, run-queue wait (the OS), blocked, and the
    #: CPU other threads of this process used meanwhile (workload.Engine._timed).
    worst_overshoot_detail: dict = field(default_factory=dict)
    #: Daemon errors the orchestrator logged: {"Class" or "Class:op": count}.
    errors_logged: dict[str, int] = field(default_factory=dict)
    #: expect_logged entries the orchestrator never logged.
    missing_errors: list[str] = field(default_factory=list)
    #: Engines sharing the daemon (`--engines`); requests, loads and leaks are their sums.
    engines: int = 1
    #: The most owed releases any engine's DaemonLink held at once, sampled after each round.
    max_debts_queued: int = 0
    #: Orchestrator threads (heartbeat, releaser) or engine threads found dead while they
    #: should have been running: each is an invariant failure.
    dead_threads: list[str] = field(default_factory=list)
    #: Loads of KV that the loading engine never stored itself (another engine did).
    loaded_from_others: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (not (self.hung or self.leaked or self.wrong_bytes or self.missing_errors
                     or self.dead_threads) and self.counters_ok)


class ErrorLog(logging.Handler):
    """Counts the exceptions the orchestrator's `loadback` logger reports (as exc_info or as
    a logged argument) by class name, `Class:op` where the error names its operation, so a
    scenario can require e.g. VersionSkew."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: Counter = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        excs = [record.exc_info[1]] if record.exc_info and record.exc_info[1] else []
        args = record.args if isinstance(record.args, tuple) else ()
        excs += [a for a in args if isinstance(a, BaseException)]
        for exc in excs:
            op = getattr(exc, "op", None)  # DaemonTimeout names its operation
            self.seen[type(exc).__name__ + (f":{op}" if op else "")] += 1

    def logged(self, name: str) -> bool:
        """`name` (a class, e.g. VersionSkew) was logged, for any operation."""
        return any(k == name or k.startswith(f"{name}:") for k in self.seen)

    def __enter__(self) -> "ErrorLog":
        logger = logging.getLogger("loadback")
        self._level = logger.level
        logger.addHandler(self)
        if logger.getEffectiveLevel() > logging.DEBUG:
            logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger("loadback")
        logger.removeHandler(self)
        logger.setLevel(self._level)


def load_scenarios(which: str) -> list[Scenario]:
    files = sorted(SCENARIO_DIR.glob("*.yaml"))
    out = []
    for f in files:
        data = yaml.safe_load(f.read_text())
        try:
            scn = msgspec.convert(data, Scenario)
        except msgspec.ValidationError as exc:
            raise SystemExit(f"{f}: {exc}") from None
        if which in ("all", scn.name):
            out.append(scn)
    if not out:
        names = ", ".join(yaml.safe_load(f.read_text())["name"] for f in files)
        raise SystemExit(f"no chaos scenario named {which!r}; known: {names}, or all")
    return out


def base_config(port: int, overrides: dict) -> LoadBackConfig:
    cfg = {
        "mp_port": port, "chunk_size": LAYOUT.chunk_size,
        "deadlines": {"lookup_ms": 50, "retrieve_base_ms": 100, "retrieve_per_ki_token_ms": 20,
                      "retrieve_max_ms": 300, "control_ms": 100, "store_ms": 300},
        "heartbeat": {"interval_ms": 100},
        "breaker": {"consecutive_failures": 3, "cooldown_ms": 100, "cooldown_max_ms": 800},
    }
    for k, v in overrides.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    return LoadBackConfig.from_dict(cfg, source="scenario")


def reconcile(orch: LoadBackOrchestrator, engine: Engine) -> list[str]:
    """Every counter equals what the engine saw; returns the mismatches."""
    s = orch.metrics.snapshot()
    t = engine.tally

    def get(name: str) -> float:
        return s.get(name, 0.0)

    want = {
        "loadback_prefix_outcomes_total{reason=none,state=loaded}": t.loaded,
        "loadback_loaded_tokens_total": t.loaded_tokens,
        "loadback_promised_tokens_total": t.promised_tokens,
    }
    for reason, n in t.degraded.items():
        want[f"loadback_prefix_outcomes_total{{reason={reason},state=degraded}}"] = n
    got_recomputed = sum(v for k, v in s.items() if k.startswith("loadback_recomputed_tokens_total"))
    got_degraded = sum(v for k, v in s.items()
                       if k.startswith("loadback_prefix_outcomes_total") and "state=degraded" in k)
    bad = [f"{k}: metric {get(k):g} != seen {v}" for k, v in want.items() if get(k) != v]
    if got_recomputed != t.recomputed_tokens:
        bad.append(f"recomputed tokens: metric {got_recomputed:g} != seen {t.recomputed_tokens}")
    if got_degraded != sum(t.degraded.values()):
        bad.append(f"degraded outcomes: metric {got_degraded:g} != seen {sum(t.degraded.values())}")
    return bad


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


def _dead_threads(lanes: list[Lane], *, engines_alive: bool) -> set[str]:
    """Orchestrator threads (heartbeat, releaser) and, while rounds run, engine threads that
    are not alive."""
    dead = set()
    for lane in lanes:
        dead.update(f"{lane.name}:{t.name}" for t in lane.orch.link._threads if not t.is_alive())
        if lane.error or (engines_alive and lane.thread is not None and not lane.thread.is_alive()):
            dead.add(lane.thread.name)
    return dead


def run_scenario(scn: Scenario, requests: int = 0, *, metrics=None, progress=None,
                 engines: int = 1) -> Result:
    """Run one scenario: `engines` engines share one daemon, and in each of the `requests`
    rounds every engine issues one request at the same instant (a burst). One engine is
    the single-engine run of before, request for request."""
    if not 1 <= engines <= MAX_ENGINES:
        raise ValueError(f"engines must be 1..{MAX_ENGINES}, got {engines}")
    if metrics is not None and engines > 1:
        raise ValueError("metrics= is the one engine's registry: give none with engines > 1")
    n_rounds = requests or scn.requests
    daemon = DaemonProcess(chunk_size=LAYOUT.chunk_size, http=True,
                           shm_name=f"lbchaos{free_port()}" if scn.transfer == "shm" else None)
    proxy = None
    lanes: list[Lane] = []
    fault, t_fault_end = scn.fault, None
    errors = ErrorLog().__enter__()
    try:
        if fault.kind != "absent_at_start":
            daemon.start()
        endpoint = daemon.endpoint
        if fault.kind == "wire":
            proxy = FaultProxy(daemon.endpoint, layout=LAYOUT, seed=scn.seed).start()
            endpoint = proxy.endpoint
            if fault.from_start:
                _begin_fault(fault, daemon, proxy)
        cfg = base_config(int(endpoint.rsplit(":", 1)[1]), {"transfer": scn.transfer, **scn.config})
        for i in range(engines):
            pool = KVPool([torch.zeros(8192, 4, 16, dtype=torch.float16) for _ in range(2)],
                          [torch.zeros(8192, 4, 16, dtype=torch.float16) for _ in range(2)])
            conn = LMCacheMPConnector(endpoint, LAYOUT, transfer=scn.transfer,
                                      connect_timeout_s=cfg.deadlines.connect_ms / 1000)
            orch = LoadBackOrchestrator(cfg, conn, kv_pool=pool,
                                        metrics=metrics or _fresh_metrics(engines))
            slots = SlotAllocator(8192)
            name = f"e{i}" if engines > 1 else ""
            lanes.append(Lane(i, name or "e0", conn, orch, slots,
                              Workload(LAYOUT, scn.seed, stream=i),
                              Engine(orch, pool, LAYOUT, slots, seed=scn.seed + i, name=name)))
        if fault.kind != "absent_at_start" and not fault.from_start:
            for lane in lanes:
                if not lane.orch.wait_registered(30):
                    raise RuntimeError(f"{scn.name}: orchestrator {lane.name} never registered")
        state = {"phase": ""}
        barrier = threading.Barrier(engines + 1)
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
        max_debts, dead, hung_engines, rounds = 0, set(), [], 0
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
                    _begin_fault(fault, daemon, proxy)
                if fault.kind != "none" and i == stop_at:
                    _end_fault(fault, daemon, proxy)
                    t_fault_end, state["phase"] = time.monotonic(), "recovery"
                try:
                    barrier.wait(timeout=ROUND_TIMEOUT_S)  # the gate: all engines at once
                    rounds += 1
                    barrier.wait(timeout=ROUND_TIMEOUT_S)  # every engine's request returned
                except threading.BrokenBarrierError:
                    # An engine died (dead_threads), or one is stuck inside its request: hung
                    # (a broken barrier nobody can be blamed for counts as one hung engine).
                    if not any(lane.error for lane in lanes):
                        hung_engines = [lane.name for lane in lanes if lane.rounds_done < rounds
                                        and lane.thread.is_alive()] or ["(barrier broken)"]
                    break
                max_debts = max(max_debts, *(lane.orch.pending_debts() for lane in lanes))
                dead |= _dead_threads(lanes, engines_alive=True)
                if progress:
                    progress(scn.name, i + 1, n_rounds)
        finally:
            stop.set()
            if not barrier.broken:
                try:
                    barrier.wait(timeout=ROUND_TIMEOUT_S)  # releases the engines: they see stop
                except threading.BrokenBarrierError:
                    pass
            barrier.abort()
            for lane in lanes:
                lane.thread.join(timeout=5)
        dead |= _dead_threads(lanes, engines_alive=False)
        if proxy is not None:
            proxy.clear()
        leaks, by_engine = _leaks(lanes, daemon)
        dead |= _dead_threads(lanes, engines_alive=False)
        # A hostile payload that ran would leave its marker file: count it as wrong bytes.
        ran = sum(1 for r in fault.rules if r.get("payload_path") and Path(r["payload_path"]).exists())
        mismatches = [f"{lane.name}: {m}" if engines > 1 else m
                      for lane in lanes for m in reconcile(lane.orch, lane.engine)]
        tallies = [lane.engine.tally for lane in lanes]
        worst_lane = max(lanes, key=lambda lane: lane.engine.tally.worst_overshoot_s)
        worst = worst_lane.engine.tally
        return_times = [x for t in tallies for x in t.return_times]
        hits = [t.first_hit_after["recovery"] for t in tallies if "recovery" in t.first_hit_after]
        degraded = Counter()
        for t in tallies:
            degraded.update(t.degraded)
        logged = dict(sorted(errors.seen.items()))
        return Result(
            name=scn.name, requests=sum(t.requests for t in tallies),
            hung=sum(t.hung for t in tallies) + len(hung_engines), leaked=sum(leaks.values()),
            wrong_bytes=sum(t.wrong_bytes for t in tallies) + ran, counters_ok=not mismatches,
            p99_return_s=percentile(return_times, 99), degraded=dict(sorted(degraded.items())),
            recovery_s=(min(hits) - t_fault_end) if hits and t_fault_end else None,
            loaded=sum(t.loaded for t in tallies),
            loaded_tokens=sum(t.loaded_tokens for t in tallies),
            recomputed_tokens=sum(t.recomputed_tokens for t in tallies),
            leaks=leaks, counter_mismatches=mismatches,
            worst_overshoot_ms=(worst.worst_overshoot_s * 1000 if return_times else None),
            worst_overshoot_detail=worst.worst_overshoot_detail | (
                {"engine": worst_lane.name} if engines > 1 and worst.worst_overshoot_detail else {}),
            errors_logged=logged, missing_errors=[e for e in scn.expect_logged if not errors.logged(e)],
            engines=engines, max_debts_queued=max_debts, dead_threads=sorted(dead),
            loaded_from_others=sum(t.loaded_from_others for t in tallies),
            extra={"late_replies": sum(lane.conn.late_replies for lane in lanes),
                   "load_times": [x for t in tallies for x in t.load_times],
                   "proxy": proxy.stats if proxy is not None else {},
                   "rounds": rounds, "hung_engines": hung_engines,
                   "engine_errors": {lane.name: lane.error for lane in lanes if lane.error},
                   "per_engine": [{"name": lane.name, "requests": t.requests, "loaded": t.loaded,
                                   "loaded_from_others": t.loaded_from_others, "hung": t.hung,
                                   "leaks": by_engine[lane.index]}
                                  for lane, t in zip(lanes, tallies)]},
        )
    finally:
        errors.__exit__()
        for lane in lanes:
            lane.orch.close()
        if proxy is not None:
            proxy.close()
        daemon.resume()
        daemon.stop()


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


def _leaks(lanes: list, daemon: DaemonProcess,
           settle_s: float = 15.0) -> tuple[dict[str, int], list[dict[str, int]]]:
    """After the run: wait (bounded) until the daemon has answered or dropped everything sent
    to it by every engine (a call it still holds can re-create a session or take locks once
    served; calls to a replaced daemon count 0) and every owed release is paid, then count
    what is held: per engine (slots, live prefixes, debts, unanswered calls) and, once, the
    daemon's read locks and sessions, which the engines share. Returns (the sum, each
    engine's part); `lanes` need `.orch`, `.slots` and `.conn`."""
    end = time.monotonic() + settle_s
    while True:
        running = bool(daemon.proc and daemon.proc.poll() is None)
        by_engine = []
        for lane in lanes:
            lane.orch.wake()
            by_engine.append({
                "kv_slots": lane.slots.outstanding,
                "live_prefixes": lane.orch.live_prefixes(),
                "debts_owed": lane.orch.pending_debts(),
                # Read before the daemon's state: 0 means all sent so far was served or dropped.
                "unanswered_calls": lane.conn.unanswered() if running else 0,
            })
        held = daemon.held() if running else {}
        live = {k: sum(e[k] for e in by_engine) for k in by_engine[0]} | {
            "read_locks": held.get("read_locks", 0),
            "sessions": held.get("sessions", 0),
        }
        if not any(live.values()) or time.monotonic() > end:
            return live, by_engine
        time.sleep(0.05)


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
                  f"for a CPU (OS run queue), {d['own_cpu_ms']:.1f} ms on its CPU, "
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
