"""The engines of a chaos run, as production runs them: one engine per process.

Each engine owns its connector (instance id), orchestrator (own metrics registry), KV pool,
slot allocator, workload stream and `Engine`. With `--engines N > 1` every engine runs in a
spawned process of its own against the shared daemon (`ProcessCrew`), so one engine's
threads never stand between another's calls and their deadlines (the interpreter lock, the
collector); it reports back an `EngineReport` (tally, counter mismatches, what it still
holds, the errors it logged). One engine runs on a thread of the harness (`ThreadCrew`),
with the fault proxy in its process (`loadback demo` serves its metrics registry).

Rounds: at each round's gate the harness and every engine meet at a barrier, each engine
issues one request, and they meet again once every request returned.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from lmcache_loadback.connectors.kv_layout import KVPool
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator.core import LoadBackOrchestrator
from lmcache_loadback.orchestrator.instruments import product_metrics
from lmcache_loadback.orchestrator.l2_canary import start_l2_canary
from lmcache_loadback.testing.os_delay import OsDelay

from .chaos_judge import (EngineReport, ErrorLog, Played, count_leaks, dead_threads, report_of,
                          settle_engine)
from .chaos_scenario import LAYOUT, Scenario, base_config
from .workload import Engine, SlotAllocator, Workload

#: How far past its deadline a call may return before it counts as hung, beyond what the
#: machine took from its thread: one interpreter switch interval (another thread of the
#: engine's own process, its heartbeat or releaser, may hold the interpreter lock).
DEADLINE_SLACK_S = 0.005
#: The most of one call the judgement excuses as the machine's (its thread's run-queue
#: wait, steal, garbage collection, the proxy's CPU): a call delayed longer counts as hung
#: whatever the machine did (the longest run-queue wait of one call seen here, 4 engines on
#: 2 shared cores at load 8, was 0.88 s).
EXCUSE_CAP_S = 1.0
#: How long an engine process may take to import, connect and register.
START_TIMEOUT_S = 120.0


@dataclass
class Lane:
    """One engine of the run, in the process that runs it."""

    index: int
    name: str
    conn: LMCacheMPConnector
    orch: LoadBackOrchestrator
    slots: SlotAllocator
    work: Workload
    engine: Engine
    thread: threading.Thread | None = None
    rounds_done: int = 0
    max_debts: int = 0
    error: str = ""   # the traceback that ended its engine loop


def _fresh_metrics(n_engines: int):
    """A metrics registry of one engine: `product_metrics()` must give each a fresh one, or
    the counters would add up and never reconcile per engine."""
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


def make_lane(scn: Scenario, endpoint: str, cfg_port: int, index: int, engines: int, *,
              metrics=None, foreign: tuple[int, ...] = (), admin_port: int = 0) -> Lane:
    """Engine `index` of `engines`: requests named `e{i}-req-{n}` when there are several.
    `foreign`: threads of this process standing for another (the fault proxy). The engine's
    process copies on the calling thread: with torch's intra-op pool the call waited for
    pool threads queued for a CPU (a soak load_back: 163 ms blocked, 1 ms of its own CPU),
    time the judge cannot tell from a wait on the daemon. In an L2 scenario the first engine
    runs the L2 canary against the daemon's admin API (`admin_port`), as production's
    factory starts it."""
    torch.set_num_threads(1)
    overrides = {"transfer": scn.transfer, **scn.config}
    canary = bool(scn.l2 and scn.l2.canary_interval_ms > 0 and admin_port and index == 0)
    if canary:
        overrides["mp_http_port"] = admin_port
        overrides["l2"] = {"canary_interval_ms": scn.l2.canary_interval_ms,
                           **overrides.get("l2", {})}
    cfg = base_config(cfg_port, overrides)
    pool = KVPool([torch.zeros(8192, 4, 16, dtype=torch.float16) for _ in range(2)],
                  [torch.zeros(8192, 4, 16, dtype=torch.float16) for _ in range(2)])
    conn = LMCacheMPConnector(endpoint, LAYOUT, transfer=scn.transfer,
                              connect_timeout_s=cfg.deadlines.connect_ms / 1000)
    orch = LoadBackOrchestrator(cfg, conn, kv_pool=pool,
                                metrics=metrics or _fresh_metrics(engines))
    if canary:
        # Its first check imports lmcache's key resolver (0.2 s holding the interpreter
        # lock): here, before the rounds, as an engine's start-up would.
        import lmcache.v1.multiprocess.cache_control.key_resolver  # noqa: F401
        start_l2_canary(orch)
    slots = SlotAllocator(8192)
    name = f"e{index}" if engines > 1 else ""
    return Lane(index, name or "e0", conn, orch, slots, Workload(LAYOUT, scn.seed, stream=index),
                Engine(orch, pool, LAYOUT, slots, seed=scn.seed + index, name=name,
                       deadline_slack_s=DEADLINE_SLACK_S, excuse_cap_s=EXCUSE_CAP_S,
                       os_delay=functools.partial(OsDelay, foreign=foreign)))


#: A stand-in for `Engine.request` (tests): `hook(lane, barrier, prompt, local, phase)`.
RequestHook = Callable[..., None]


def drive(lane: Lane, barrier, stop, phase: Callable[[], str], wait_s: float,
          hook: RequestHook | None = None, on_round: Callable[[], None] | None = None,
          on_error: Callable[[], None] | None = None) -> None:
    """An engine's loop: at each round's gate every engine is released at once and issues
    one request; then it waits at the gate for the round's end. Ends when the harness says
    stop, or the barrier breaks (the harness ended the run). A harness or product bug ends
    it with `lane.error` set and the barrier broken: the run ends at once."""
    try:
        while True:
            barrier.wait(timeout=wait_s)
            if stop.is_set():
                return
            prompt, local = lane.work.next_prompt()
            if hook is not None:
                hook(lane, barrier, prompt, local, phase())
            else:
                lane.engine.request(prompt, local, phase=phase())
            lane.rounds_done += 1
            lane.max_debts = max(lane.max_debts, lane.orch.pending_debts())
            if on_round is not None:
                on_round()
            barrier.wait(timeout=wait_s)
    except threading.BrokenBarrierError:
        return
    except BaseException:
        lane.error = traceback.format_exc()
        if on_error is not None:
            on_error()  # known before the broken barrier is seen: dead, not stuck
        barrier.abort()


class ThreadCrew:
    """One engine on a thread of the harness process (the single-engine run)."""

    def __init__(self, lane: Lane, hook: RequestHook | None = None) -> None:
        self.lanes = [lane]
        self.barrier = threading.Barrier(2)
        self._stop = threading.Event()
        self._phase = ""
        self._hook = hook

    names = property(lambda self: [lane.name for lane in self.lanes])

    def start(self, wait_s: float) -> None:
        lane = self.lanes[0]
        lane.thread = threading.Thread(
            target=drive, name=f"chaos-engine-{lane.index}", daemon=True,
            args=(lane, self.barrier, self._stop, lambda: self._phase, wait_s, self._hook))
        lane.thread.start()

    def set_phase(self, phase: str) -> None:
        self._phase = phase

    def rounds_done(self) -> list[int]:
        return [lane.rounds_done for lane in self.lanes]

    def loads(self) -> list[int]:
        """Each engine's loads so far."""
        return [lane.engine.tally.loaded for lane in self.lanes]

    def stuck(self, rounds: int) -> list[str]:
        """Engines inside round `rounds` still, alive and not failed."""
        return [lane.name for lane in self.lanes if lane.rounds_done < rounds and not lane.error
                and lane.thread.is_alive()]

    def failed(self) -> bool:
        return any(lane.error for lane in self.lanes)

    def sample(self, played: Played) -> None:
        played.max_debts = max(played.max_debts, *(lane.orch.pending_debts() for lane in self.lanes))
        played.dead |= dead_threads(self.lanes, engines_alive=True)

    def stop(self, timeout_s: float) -> None:
        _release_engines(self.barrier, self._stop, timeout_s)
        for lane in self.lanes:
            lane.thread.join(timeout=5)

    def reports(self, daemon, settle_s: float) -> tuple[list[EngineReport], dict[str, int]]:
        leaks, by_engine = count_leaks(self.lanes, daemon, settle_s)
        daemon_part = {k: v for k, v in leaks.items() if k not in by_engine[0]}
        return [report_of(lane, part) for lane, part in zip(self.lanes, by_engine)], daemon_part

    def close(self) -> None:
        for lane in self.lanes:
            lane.orch.close()


def _release_engines(barrier, stop, timeout_s: float) -> None:
    stop.set()
    if not barrier.broken:
        try:
            barrier.wait(timeout=timeout_s)  # releases the engines: they see stop
        except threading.BrokenBarrierError:
            pass
    barrier.abort()


class ProcessCrew:
    """N engines, one spawned process each, against the shared daemon. Each builds its lane
    (`make_lane`), waits for registration when asked, runs `drive`, and once the harness
    stops the rounds settles what it holds and sends its `EngineReport` back; it keeps its
    orchestrator open (nothing released by a close) until the harness has read the daemon's
    holds and says close."""

    def __init__(self, scn: Scenario, endpoint: str, cfg_port: int, engines: int, *,
                 wait_registered: bool, hook: RequestHook | None = None,
                 admin_port: int = 0) -> None:
        ctx = mp.get_context("spawn")
        self.n = engines
        self.barrier = ctx.Barrier(engines + 1)
        self._stop = ctx.Event()
        self._phase = ctx.Value("i", 0)  # 1: recovery
        self._rounds = ctx.Array("i", engines)
        self._loads = ctx.Array("i", engines)
        self._failed = ctx.Array("i", engines)
        self.names = [f"e{i}" for i in range(engines)]
        self._pipes, self.procs = [], []
        for i in range(engines):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=engine_main, name=f"chaos-engine-{i}", daemon=True, args=(
                scn, endpoint, cfg_port, i, engines, wait_registered, there, self.barrier,
                self._stop, self._phase, self._rounds, self._failed, hook, admin_port,
                self._loads))
            proc.start()
            there.close()
            self._pipes.append(here)
            self.procs.append(proc)
        for i, pipe in enumerate(self._pipes):
            msg = self._recv(pipe, START_TIMEOUT_S)
            if msg != "ready":
                raise RuntimeError(f"{scn.name}: engine e{i} did not start: {msg}")

    def _recv(self, pipe, timeout_s: float):
        if not pipe.poll(timeout_s):
            return f"no answer within {timeout_s:g} s"
        try:
            return pipe.recv()
        except EOFError:
            return "its process ended"

    def start(self, wait_s: float) -> None:
        for pipe in self._pipes:
            pipe.send(wait_s)

    def set_phase(self, phase: str) -> None:
        self._phase.value = int(phase == "recovery")

    def rounds_done(self) -> list[int]:
        return list(self._rounds)

    def loads(self) -> list[int]:
        """Each engine's loads so far, as of its last round."""
        return list(self._loads)

    def stuck(self, rounds: int) -> list[str]:
        return [self.names[i] for i in range(self.n) if self._rounds[i] < rounds
                and not self._failed[i] and self.procs[i].is_alive()]

    def failed(self) -> bool:
        return any(self._failed) or not all(p.is_alive() for p in self.procs)

    def sample(self, played: Played) -> None:
        played.dead |= {p.name for p in self.procs if not p.is_alive()}

    def stop(self, timeout_s: float) -> None:
        _release_engines(self.barrier, self._stop, timeout_s)

    def reports(self, daemon, settle_s: float) -> tuple[list[EngineReport], dict[str, int]]:
        """Each engine settles (bounded) and reports; then the daemon's holds are counted."""
        from .chaos_judge import daemon_running, settle_daemon

        running = daemon_running(daemon)
        for pipe in self._pipes:
            pipe.send(("settle", running, settle_s))
        out = []
        for i, pipe in enumerate(self._pipes):
            msg = self._recv(pipe, settle_s + 30)
            if not isinstance(msg, EngineReport):
                raise RuntimeError(f"engine e{i} sent no report: {msg}")
            out.append(msg)
        return out, settle_daemon(daemon, settle_s)

    def close(self) -> None:
        for pipe in self._pipes:
            try:
                pipe.send("close")
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()  # our own child, by its handle
                proc.join(timeout=5)


def engine_main(scn: Scenario, endpoint: str, cfg_port: int, index: int, engines: int,
                wait_registered: bool, pipe, barrier, stop, phase, rounds, failed,
                hook: RequestHook | None, admin_port: int, loads) -> None:
    """An engine process: build, register, run the rounds, settle, report, close."""
    errors = ErrorLog().__enter__()
    lane = None
    try:
        lane = make_lane(scn, endpoint, cfg_port, index, engines, admin_port=admin_port)
        if wait_registered and not lane.orch.wait_registered(30):
            pipe.send(f"{scn.name}: orchestrator e{index} never registered")
            return
        pipe.send("ready")
        wait_s = pipe.recv()

        def counted() -> None:
            loads[index] = lane.engine.tally.loaded
            rounds[index] = lane.rounds_done

        def died() -> None:
            failed[index] = 1

        drive(lane, barrier, stop, lambda: "recovery" if phase.value else "", wait_s, hook,
              on_round=counted, on_error=died)
        _, running, settle_s = pipe.recv()
        leaks = settle_engine(lane, running, settle_s)
        pipe.send(report_of(lane, leaks, max_debts=lane.max_debts, errors_seen=errors.seen))
        pipe.recv()  # "close": the harness has read the daemon's holds
    except (EOFError, OSError):
        pass  # the harness went away: close below
    except BaseException:
        failed[index] = 1
        try:
            pipe.send(traceback.format_exc())
        except OSError:
            pass
    finally:
        errors.__exit__()
        if lane is not None:
            lane.orch.close()
