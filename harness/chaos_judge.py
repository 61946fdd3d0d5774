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
from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.testing.fault_proxy import FaultProxy

from .bench.common import percentile
from .chaos_scenario import Scenario
from .workload import Engine


@dataclass
class Result:
    """One scenario's verdict. hung: calls past their deadline + the slack
    (`chaos.deadline_slack_s`) + what the machine took from them (run queue, host steal,
    garbage collection: `testing.os_delay`), and engines stuck in a round; leaked: slots,
    read locks, sessions, debts still owed; wrong bytes: loaded KV differing from a recompute; counters:
    metrics equal to the outcomes the engines saw; recovery: fault end -> first hit; and the
    daemon errors `expect_logged` names."""

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
            dead.add(lane.thread.name)
    return dead


def count_leaks(lanes: list, daemon: DaemonProcess,
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


@dataclass
class Played:
    """How a run's rounds went (`chaos.run_scenario`)."""

    rounds: int = 0
    max_debts: int = 0
    dead: set = field(default_factory=set)
    hung_engines: list = field(default_factory=list)
    t_fault_end: float | None = None


def judge(scn: Scenario, lanes: list, daemon: DaemonProcess, proxy: FaultProxy | None,
          played: Played, errors: ErrorLog) -> Result:
    """After the rounds: wait for the daemon and the owed releases to settle, count leaks,
    reconcile every engine's counters and sum the engines' tallies into one Result."""
    engines = len(lanes)
    dead = played.dead | dead_threads(lanes, engines_alive=False)
    if proxy is not None:
        proxy.clear()
    leaks, by_engine = count_leaks(lanes, daemon)
    dead |= dead_threads(lanes, engines_alive=False)
    # A hostile payload that ran would leave its marker file: count it as wrong bytes.
    ran = sum(1 for r in scn.fault.rules
              if r.get("payload_path") and Path(r["payload_path"]).exists())
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
            {"engine": worst_lane.name} if engines > 1 and worst.worst_overshoot_detail else {}),
        errors_logged=dict(sorted(errors.seen.items())),
        missing_errors=[e for e in scn.expect_logged if not errors.logged(e)],
        engines=engines, max_debts_queued=played.max_debts, dead_threads=sorted(dead),
        extra=_extra(lanes, tallies, by_engine, proxy, played),
        **{k: sum(getattr(t, k) for t in tallies) for k in (
            "requests", "loaded", "loaded_tokens", "recomputed_tokens", "loaded_from_others")},
    )


def _extra(lanes: list, tallies: list, by_engine: list, proxy: FaultProxy | None,
           played: Played) -> dict:
    """The run's details beside the verdict (the JSON report leaves them out)."""
    return {"late_replies": sum(lane.conn.late_replies for lane in lanes),
            "load_times": [x for t in tallies for x in t.load_times],
            "proxy": proxy.stats if proxy is not None else {},
            "rounds": played.rounds, "hung_engines": played.hung_engines,
            "engine_errors": {lane.name: lane.error for lane in lanes if lane.error},
            "per_engine": [{"name": lane.name, "requests": t.requests, "loaded": t.loaded,
                            "loaded_from_others": t.loaded_from_others, "hung": t.hung,
                            "leaks": by_engine[lane.index]}
                           for lane, t in zip(lanes, tallies)]}
