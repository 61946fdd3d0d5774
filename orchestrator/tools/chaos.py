"""`loadback chaos run`: break the daemon on purpose and check that only recompute is lost.

A scenario (YAML in configs/chaos/) names a fault, when it starts and ends (as fractions
of the request count), a seed and a request count. Process faults act on the real
daemon (SIGKILL, SIGSTOP/SIGCONT, restart, absent at start); wire faults go through the
FaultProxy placed between the orchestrator and the daemon. After a bounded run every
invariant is judged: hung (a call past its deadline + 5 ms), leaked (slots, read locks,
sessions, debts still owed), wrong bytes (loaded KV differing from a recompute), counters
(metrics equal to the outcomes the engine saw) and recovery (fault end -> first hit).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import msgspec
import torch
import yaml

from connectors.daemon import DaemonProcess, free_port
from connectors.fault_proxy import FaultProxy, FaultRule
from connectors.kv_layout import KVLayout
from connectors.lmcache_mp import KVPool, LMCacheMPConnector

from .bench.common import percentile
from ..config import LoadBackConfig
from ..core import LoadBackOrchestrator
from .workload import Engine, SlotAllocator, Workload

SCENARIO_DIR = Path(__file__).resolve().parents[2] / "configs" / "chaos"
LAYOUT = KVLayout(num_layers=2, num_heads=4, head_dim=16, dtype=torch.float16, chunk_size=16)


class Fault(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    kind: Literal["none", "kill", "hang", "restart", "absent_at_start", "wire"] = "none"
    start: float = 0.3          # fraction of the requests when the fault begins
    end: float = 0.6            # ... and when it is lifted
    rules: list[dict] = []      # wire: FaultRule fields


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
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.hung or self.leaked or self.wrong_bytes) and self.counters_ok


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


def run_scenario(scn: Scenario, requests: int = 0, *, metrics=None, progress=None) -> Result:
    n_req = requests or scn.requests
    daemon = DaemonProcess(chunk_size=LAYOUT.chunk_size, http=True,
                           shm_name=f"lbchaos{free_port()}" if scn.transfer == "shm" else None)
    proxy = None
    orch = None
    fault, t_fault_end = scn.fault, None
    try:
        if fault.kind != "absent_at_start":
            daemon.start()
        endpoint = daemon.endpoint
        if fault.kind == "wire":
            proxy = FaultProxy(daemon.endpoint, layout=LAYOUT, seed=scn.seed).start()
            endpoint = proxy.endpoint
        cfg = base_config(int(endpoint.rsplit(":", 1)[1]), {"transfer": scn.transfer, **scn.config})
        pool = KVPool([torch.zeros(8192, 4, 16, dtype=torch.float16) for _ in range(2)],
                      [torch.zeros(8192, 4, 16, dtype=torch.float16) for _ in range(2)])
        conn = LMCacheMPConnector(endpoint, LAYOUT, transfer=scn.transfer,
                                  connect_timeout_s=cfg.deadlines.connect_ms / 1000)
        orch = LoadBackOrchestrator(cfg, conn, kv_pool=pool, metrics=metrics)
        if fault.kind != "absent_at_start" and not orch.wait_registered(30):
            raise RuntimeError(f"{scn.name}: orchestrator never registered")
        slots = SlotAllocator(8192)
        work = Workload(LAYOUT, scn.seed)
        engine = Engine(orch, pool, LAYOUT, slots, seed=scn.seed)
        begin, stop_at = int(fault.start * n_req), int(fault.end * n_req)
        deadline = time.monotonic() + scn.max_seconds
        phase = ""
        due = time.monotonic()
        for i in range(n_req):
            if time.monotonic() > deadline:
                break
            # Paced from the previous request, never a burst to catch up after a stall.
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            due = time.monotonic() + scn.request_interval_ms / 1000
            if fault.kind not in ("none", "absent_at_start") and i == begin:
                _begin_fault(fault, daemon, proxy)
            if fault.kind != "none" and i == stop_at:
                _end_fault(fault, daemon, proxy)
                t_fault_end, phase = time.monotonic(), "recovery"
            prompt, local = work.next_prompt()
            engine.request(prompt, local, phase=phase)
            if progress:
                progress(scn.name, i + 1, n_req)
        if proxy is not None:
            proxy.clear()
        leaks = _leaks(orch, engine, daemon, slots)
        # A hostile payload that ran would leave its marker file: count it as wrong bytes.
        ran = sum(1 for r in fault.rules if r.get("payload_path") and Path(r["payload_path"]).exists())
        mismatches = reconcile(orch, engine)
        t = engine.tally
        hit_at = t.first_hit_after.get("recovery")
        return Result(
            name=scn.name, requests=t.requests, hung=t.hung, leaked=sum(leaks.values()),
            wrong_bytes=t.wrong_bytes + ran, counters_ok=not mismatches,
            p99_return_s=percentile(t.return_times, 99), degraded=dict(sorted(t.degraded.items())),
            recovery_s=(hit_at - t_fault_end) if hit_at and t_fault_end else None,
            loaded=t.loaded, loaded_tokens=t.loaded_tokens, recomputed_tokens=t.recomputed_tokens,
            leaks=leaks, counter_mismatches=mismatches,
            extra={"late_replies": conn.late_replies, "load_times": t.load_times,
                   "proxy": proxy.stats if proxy is not None else {}},
        )
    finally:
        if orch is not None:
            orch.close()
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


def _leaks(orch: LoadBackOrchestrator, engine: Engine, daemon: DaemonProcess,
           slots: SlotAllocator, settle_s: float = 15.0) -> dict[str, int]:
    """After the run: wait (bounded) for owed releases, then count what is still held."""
    end = time.monotonic() + settle_s
    held = {}
    while True:
        orch._wake.set()
        held = daemon.held() if daemon.proc and daemon.proc.poll() is None else {}
        live = {
            "kv_slots": slots.outstanding,
            "live_prefixes": orch.live_prefixes(),
            "debts_owed": orch.pending_debts(),
            "read_locks": held.get("read_locks", 0),
            "sessions": held.get("sessions", 0),
        }
        if not any(live.values()) or time.monotonic() > end:
            return live
        time.sleep(0.05)


def _progress(name: str, i: int, n: int) -> None:
    if i == n or i % 10 == 0:
        width = 30
        done = int(width * i / n)
        sys.stderr.write(f"\r{name:<18} [{'#' * done}{'.' * (width - done)}] {i}/{n}")
        if i == n:
            sys.stderr.write("\n")
        sys.stderr.flush()


def print_results(results: list[Result]) -> None:
    from .bench.common import print_table

    rows = []
    for r in results:
        deg = ", ".join(f"{k}={v}" for k, v in r.degraded.items()) or "-"
        rows.append([r.name, r.requests, r.hung, r.leaked, r.wrong_bytes,
                     "yes" if r.counters_ok else "NO", f"{r.p99_return_s * 1000:.1f}",
                     "-" if r.recovery_s is None else f"{r.recovery_s:.2f}",
                     r.loaded, deg])
    print_table(["scenario", "requests", "hung", "leaked", "wrong", "counters ok",
                 "p99 ms", "recovery s", "loaded", "degraded by reason"], rows)
    for r in results:
        for m in r.counter_mismatches:
            print(f"  {r.name}: counter mismatch: {m}")
        if r.leaked:
            print(f"  {r.name}: leaks: {r.leaks}")


def run(args) -> int:
    scenarios = load_scenarios(args.scenario)
    results = []
    t0 = time.monotonic()
    for scn in scenarios:
        results.append(run_scenario(scn, args.requests, progress=_progress))
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
