"""Judging a chaos run: every invariant counted after the rounds (hung, leaked, wrong bytes,
counters equal to the outcomes the engines saw, recovery, logged daemon errors, dead threads).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from lmcache_loadback.orchestrator.core import LoadBackOrchestrator
from lmcache_loadback.testing.daemon import CLIENT_HOLDS, DaemonProcess
from lmcache_loadback.testing.fault_proxy import FaultProxy

from .bench.common import percentile
from .chaos_l2 import L2Verdict, RoundSamples
from .chaos_scenario import Scenario
from .workload import Engine, Tally


@dataclass
class Result:
    """One scenario's verdict. hung: calls past their deadline + the slack + what the
    machine took from the call's thread (run queue, host steal, its process's garbage
    collection: `testing.os_delay`, capped per call: `workload.Engine`), and engines stuck in
    a round; leaked: slots, live prefixes, debts still owed, unanswered calls, and every hold
    the daemon reports (read and write locks, sessions, prefetch jobs); wrong bytes: loaded
    KV differing from a recompute; counters: metrics equal to the outcomes the engines saw;
    recovery: fault end -> first hit; and the daemon errors `expect_logged` names. An L2
    scenario also needs an engine hit served by the store after the fault (`l2`)."""

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
    #: The call judged the most late (past its deadline less what was excused), detailed
    #: the same way: the one to read when `hung` > 0.
    worst_judged_detail: dict = field(default_factory=dict)
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
    #: What the deadline judgement excused as the machine's, ms: summed over every call,
    #: and the most for one call (at most `workload.Engine.excuse_cap_s`).
    excused_ms: float = 0.0
    worst_excused_ms: float = 0.0
    #: L2 scenarios: what the store served, and when it served a hit again.
    l2: L2Verdict | None = None
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (not (self.hung or self.leaked or self.wrong_bytes or self.missing_errors
                     or self.dead_threads) and self.counters_ok
                and (self.l2 is None or not self.l2.needs_recovery
                     or self.l2.recovery_s is not None))


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


def dead_threads(lanes: list, *, engines_alive: bool) -> set[str]:
    """Orchestrator threads (heartbeat, releaser) and, while rounds run, engine threads that
    are not alive."""
    dead = set()
    for lane in lanes:
        dead.update(f"{lane.name}:{t.name}" for t in lane.orch.link._threads if not t.is_alive())
        if lane.error or (engines_alive and lane.thread is not None and not lane.thread.is_alive()):
            dead.add(lane.thread.name if lane.thread is not None else f"chaos-engine-{lane.index}")
    return dead


#: What the daemon holds for clients that a finished run must have given back: every kind.
DAEMON_HOLDS = CLIENT_HOLDS


def stop_canary(lane) -> None:
    """An engine's L2 canary ends its check and stops before the holds are counted: its
    checks would take locks and sessions while the count runs (what it owes is settled as
    it stops)."""
    canary = getattr(lane.orch, "l2_canary", None)
    if canary is not None:
        canary.close(lane.orch.config.l2.canary_deadline_ms / 1000 + 1)


def engine_held(lane, daemon_running: bool) -> dict[str, int]:
    """What one engine still holds (slots, live prefixes, debts, unanswered calls); `lane`
    needs `.orch`, `.slots` and `.conn`."""
    lane.orch.wake()
    return {
        "kv_slots": lane.slots.outstanding,
        "live_prefixes": lane.orch.live_prefixes(),
        "debts_owed": lane.orch.pending_debts(),
        # Read before the daemon's state: 0 means all sent so far was served or dropped.
        "unanswered_calls": lane.conn.unanswered() if daemon_running else 0,
    }


def daemon_held(daemon: DaemonProcess) -> dict[str, int]:
    """Every hold the daemon reports (`DAEMON_HOLDS`); zeros when it does not run."""
    held = daemon.held() if daemon.proc and daemon.proc.poll() is None else {}
    return {k: held.get(k, 0) for k in DAEMON_HOLDS}


def daemon_running(daemon: DaemonProcess) -> bool:
    return bool(daemon.proc and daemon.proc.poll() is None)


def count_leaks(lanes: list, daemon: DaemonProcess,
                settle_s: float = 15.0) -> tuple[dict[str, int], list[dict[str, int]]]:
    """After the run: wait (bounded) until the daemon has answered or dropped everything sent
    to it by every engine (a call it still holds can re-create a session or take locks once
    served; calls to a replaced daemon count 0) and every owed release is paid, then count
    what is held: per engine (`engine_held`) and, once, what the daemon holds for the
    engines it shares (`DAEMON_HOLDS`). Returns (the sum, each engine's part)."""
    for lane in lanes:
        stop_canary(lane)
    end = time.monotonic() + settle_s
    while True:
        running = daemon_running(daemon)
        by_engine = [engine_held(lane, running) for lane in lanes]
        live = {k: sum(e[k] for e in by_engine) for k in by_engine[0]} | (
            daemon_held(daemon) if running else dict.fromkeys(DAEMON_HOLDS, 0))
        if not any(live.values()) or time.monotonic() > end:
            return live, by_engine
        time.sleep(0.05)


def settle_engine(lane, daemon_running: bool, settle_s: float) -> dict[str, int]:
    """`count_leaks` for one engine in its own process: wait (bounded) until it holds nothing
    and every call it sent was answered; what it still holds."""
    stop_canary(lane)
    end = time.monotonic() + settle_s
    while True:
        held = engine_held(lane, daemon_running)
        if not any(held.values()) or time.monotonic() > end:
            return held
        time.sleep(0.05)


def settle_daemon(daemon: DaemonProcess, settle_s: float) -> dict[str, int]:
    """Once every engine settled: wait (bounded) until the daemon holds nothing for them."""
    end = time.monotonic() + settle_s
    while True:
        held = daemon_held(daemon)
        if not any(held.values()) or time.monotonic() > end:
            return held
        time.sleep(0.05)


@dataclass
class EngineReport:
    """What one engine brings to the verdict (sent back by an engine process, or read off
    an in-process lane): its tally, counter mismatches, what it still holds, the daemon
    errors it logged, its dead threads and, if its engine thread died, the traceback."""

    name: str
    index: int
    tally: Tally
    mismatches: list[str]
    leaks: dict[str, int]
    late_replies: int = 0
    max_debts: int = 0
    dead: list[str] = field(default_factory=list)
    error: str = ""
    errors_seen: dict[str, int] = field(default_factory=dict)
    #: What its metrics say of the L2 store (`L2_SIGNALS`), the zeros left out.
    l2_signals: dict[str, int] = field(default_factory=dict)
    #: Owed releases it gave up unpaid, by kind (`loadback_releases_failed_total`): what
    #: they would have released stays on the daemon until its TTL.
    given_up: dict[str, int] = field(default_factory=dict)


def report_of(lane, leaks: dict[str, int], *, max_debts: int = 0,
              errors_seen: dict[str, int] | None = None) -> EngineReport:
    """An in-process lane's report, once its leaks were counted."""
    snapshot = lane.orch.metrics.snapshot()
    failed = "loadback_releases_failed_total{what="
    return EngineReport(lane.name, lane.index, lane.engine.tally,
                        reconcile(lane.orch, lane.engine), leaks,
                        late_replies=lane.conn.late_replies, max_debts=max_debts,
                        dead=sorted(dead_threads([lane], engines_alive=False)),
                        error=lane.error, errors_seen=dict(errors_seen or {}),
                        l2_signals=l2_signals(snapshot),
                        given_up={k[len(failed):-1]: int(v) for k, v in snapshot.items()
                                  if k.startswith(failed) and v} | _canary_owes(lane))


def _canary_owes(lane) -> dict[str, int]:
    """The engine's L2 canary, closed, still owing a timed-out LOOKUP's release."""
    canary = getattr(lane.orch, "l2_canary", None)
    return {"l2_canary_lookup": 1} if canary is not None and canary.owes_release else {}


#: The series that tell an operator about the L2 store, by the name the verdict gives them:
#: the canary's checks by result, the stalls found and the misses they answered at once, and
#: whether the store was still found stalled when the engine reported (summed: engines).
L2_SIGNALS = {"canary ": "loadback_l2_canary_checks_total{result=",
              "stalls": "loadback_l2_stalls_total", "fast misses": "loadback_l2_fast_misses_total",
              "stalled at the end": "loadback_l2_state"}


def l2_signals(snapshot: dict[str, float]) -> dict[str, int]:
    """`L2_SIGNALS` in one metrics snapshot: `canary <result>`, `stalls`, `fast misses`."""
    out = {}
    for name, series in L2_SIGNALS.items():
        for k, v in snapshot.items():
            if v and (k == series or k.startswith(series) and series.endswith("=")):
                out[name + k[len(series):].rstrip("}") if series.endswith("=") else name] = int(v)
    return out


@dataclass
class Played:
    """How a run's rounds went (`chaos.run_scenario`)."""

    rounds: int = 0
    max_debts: int = 0
    dead: set = field(default_factory=set)
    hung_engines: list = field(default_factory=list)
    t_fault_end: float | None = None
    #: Rounds at which the fault began and ended, and the daemon was restarted (or None).
    fault_rounds: tuple[int, int, int | None] = (0, 0, None)
    #: L2 scenarios: the engines' loads and the store's reads after each round.
    l2: RoundSamples = field(default_factory=RoundSamples)


def judge(scn: Scenario, reports: list[EngineReport], daemon_leaks: dict[str, int],
          proxy: FaultProxy | None, played: Played, errors: ErrorLog) -> Result:
    """After the rounds, once every engine settled and its leaks were counted: reconcile
    every engine's counters and sum the engines' reports into one Result."""
    engines = len(reports)
    dead = set(played.dead).union(*(r.dead for r in reports))
    # A hostile payload that ran would leave its marker file: count it as wrong bytes.
    ran = sum(1 for r in scn.fault.rules
              if r.get("payload_path") and Path(r["payload_path"]).exists())
    mismatches = [f"{r.name}: {m}" if engines > 1 else m for r in reports for m in r.mismatches]
    leaks = {k: sum(r.leaks.get(k, 0) for r in reports) for k in reports[0].leaks} | daemon_leaks
    tallies = [r.tally for r in reports]
    worst_rep = max(reports, key=lambda r: r.tally.worst_overshoot_s)
    worst = worst_rep.tally
    return_times = [x for t in tallies for x in t.return_times]
    hits = [t.first_hit_after["recovery"] for t in tallies if "recovery" in t.first_hit_after]
    degraded, seen = Counter(), Counter(errors.seen)
    for r in reports:
        degraded.update(r.tally.degraded)
        seen.update(r.errors_seen)
    t_end = played.t_fault_end
    return Result(
        name=scn.name, hung=sum(t.hung for t in tallies) + len(played.hung_engines),
        leaked=sum(leaks.values()), wrong_bytes=sum(t.wrong_bytes for t in tallies) + ran,
        counters_ok=not mismatches, p99_return_s=percentile(return_times, 99),
        degraded=dict(sorted(degraded.items())),
        recovery_s=(min(hits) - t_end) if hits and t_end else None,
        leaks=leaks, counter_mismatches=mismatches,
        worst_overshoot_ms=(worst.worst_overshoot_s * 1000 if return_times else None),
        worst_overshoot_detail=worst.worst_overshoot_detail | (
            {"engine": worst_rep.name} if engines > 1 and worst.worst_overshoot_detail else {}),
        worst_judged_detail=_worst_judged(reports),
        errors_logged=dict(sorted(seen.items())),
        missing_errors=[e for e in scn.expect_logged
                        if not any(k == e or k.startswith(f"{e}:") for k in seen)],
        engines=engines, max_debts_queued=max([played.max_debts] + [r.max_debts for r in reports]),
        dead_threads=sorted(dead),
        excused_ms=sum(t.excused_s for t in tallies) * 1e3,
        worst_excused_ms=max(t.worst_excused_s for t in tallies) * 1e3,
        extra=_extra(reports, proxy, played),
        **{k: sum(getattr(t, k) for t in tallies) for k in (
            "requests", "loaded", "loaded_tokens", "recomputed_tokens", "loaded_from_others")},
    )


def _worst_judged(reports: list[EngineReport]) -> dict:
    rep = max(reports, key=lambda r: r.tally.worst_judged_s)
    d = rep.tally.worst_judged_detail
    return d | ({"engine": rep.name} if len(reports) > 1 and d else {})


def _extra(reports: list[EngineReport], proxy: FaultProxy | None, played: Played) -> dict:
    """The run's details beside the verdict (the JSON report leaves them out)."""
    return {"late_replies": sum(r.late_replies for r in reports),
            "load_times": [x for r in reports for x in r.tally.load_times],
            "proxy": proxy.stats if proxy is not None else {},
            "rounds": played.rounds, "hung_engines": played.hung_engines,
            "engine_errors": {r.name: r.error for r in reports if r.error},
            "given_up": dict(sum((Counter(r.given_up) for r in reports), Counter())),
            "per_engine": [{"name": r.name, "requests": r.tally.requests,
                            "loaded": r.tally.loaded,
                            "loaded_from_others": r.tally.loaded_from_others,
                            "hung": r.tally.hung, "leaks": r.leaks,
                            "excused_ms": r.tally.excused_s * 1e3}
                           for r in reports]}
