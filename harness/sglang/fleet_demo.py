"""`loadback demo --engine sglang --fleet` (`make demo FLEET=1`): a fleet of two real SGLang
0.5.23 servers, A and B, each with its own lmcache 0.5.6 daemon, both daemons on one
redis-server (LMCache's L2 through the `valkey` adapter: bounded calls, reconnects; `resp`
has no timeout and never reconnects). The phases, each a fixed set of requests (greedy, a
client deadline each) sent one at a time:

1. A computes new prompts (stored by daemon A, waited for in Redis);
2. B gets the same prompts: a hit from Redis on its first request, with A's output;
3. Redis hung (SIGSTOP), then resumed; 4. Redis killed: on both servers, stored prompts again
   (device trees flushed) and new prompts on A then B;
5. Redis restarted (empty): new prompts on A, then B, until B hits one; then A computes more;
6. daemon A killed and restarted: A's prompts of phase 5 again (flushed): a hit comes back only
   from Redis.

Ours (`--radix-cache-backend loadback`), then upstream's LMCache class (`--enable-lmcache`
alone) on a fleet of its own built the same way (a fresh Redis, the same prompts), one side at
a time (four servers on two cores would measure each other). A table per phase: hits, errors,
latency, outputs identical to the first computation of each prompt. All it starts it stops.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from lmcache_loadback.harness.bench.common import median, write_json
from lmcache_loadback.orchestrator.exit_codes import EXIT_UNAVAILABLE
from lmcache_loadback.orchestrator.status import parse
from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.testing.redis import RedisServer, RedisUnavailable, find_redis

from .demo import CHUNK, NEW_TOKENS, PROMPT_LEN, SIDES, _check_python, _loaded
from .server import Generation, SGLangServer, write_loadback_yaml, write_upstream_yaml

__all__ = ["PHASES", "SIDES", "run"]

PROMPTS = 3  # new prompts per computing phase
FAULT_ROUNDS = 2  # rounds per Redis fault, each four requests
RECOVERY_CAP_S = 30.0  # phase 5 tries new prompts this long at most
REDIS_WAIT_S = 10.0  # a stored prompt's chunks reach Redis within this (or it is said)
CHUNKS = PROMPT_LEN // CHUNK
#: (key, label) in the order they run
PHASES = (
    ("a_computes", "1. A computes new prompts"),
    ("b_same", "2. B: the same prompts"),
    ("redis_hung", "3. Redis hung (SIGSTOP)"),
    ("redis_killed", "4. Redis killed (SIGKILL)"),
    ("redis_back", "5. Redis restarted: A, then B"),
    ("daemon_a_back", "6. daemon A restarted: A again"),
)


@dataclass
class Sent:
    server: str  # "A" or "B"
    gen: Generation
    same: bool | None  # output equals the prompt's first computation; None: it is that one


@dataclass
class Phase:
    key: str
    sent: list[Sent] = field(default_factory=list)
    #: phases 5 and 6: seconds from Redis (daemon A) serving again to the first hit
    recovery_s: float | None = None
    #: ours: what both servers' /metrics counted in this phase (LOOKUP results, degrades)
    counts: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict:
        lat = [s.gen.latency_s for s in self.sent]
        return {
            "requests": len(self.sent),
            "hits": sum(1 for s in self.sent if s.gen.ok and _loaded(s.gen) > 0),
            "errors": sum(1 for s in self.sent if not s.gen.ok),
            "timed_out": sum(1 for s in self.sent if s.gen.error == "timeout"),
            "p50_s": round(median(lat), 3) if lat else None,
            "max_s": round(max(lat), 3) if lat else None,
            "outputs_differ": sum(1 for s in self.sent if s.same is False),
            "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 2),
            "loadback": self.counts,
        }


class Fleet:
    """One side's fleet: Redis, daemons A and B on it, servers A and B on them."""

    def __init__(self, side: str, *, python: str, mq_timeout_s: float, deadline_s: float,
                 work: Path) -> None:
        self.side, self.deadline_s = side, deadline_s
        work.mkdir(parents=True, exist_ok=True)
        self.redis = RedisServer(dir=str(work))
        l2 = self.redis.l2_adapter("valkey")
        self.daemons = {n: DaemonProcess(chunk_size=CHUNK, http=True, l2_adapter=l2,
                                         log_dir=str(work)) for n in "AB"}
        self.servers = {n: self._server(n, python, mq_timeout_s, work) for n in "AB"}
        self.reference: dict[tuple[int, ...], list[int]] = {}
        self.seeds = 0

    def _server(self, name: str, python: str, mq_timeout_s: float, work: Path) -> SGLangServer:
        port = self.daemons[name].port
        if self.side == "ours":
            cfg = write_loadback_yaml(work / f"loadback-{name}.yaml", port, chunk_size=CHUNK)
            backend = "loadback"
        else:
            cfg = write_upstream_yaml(work / f"upstream-{name}.yaml", port,
                                      mq_timeout_s=mq_timeout_s)
            backend = None
        return SGLangServer(python=python, lmcache_config=cfg, backend=backend,
                            log_path=work / f"server-{name}.log",
                            # SGLang's own /metrics then carries ours' loadback_* series
                            extra_args=["--enable-metrics"] if self.side == "ours" else [])

    def start(self) -> None:
        self.redis.start()
        with ThreadPoolExecutor(2) as ex:  # side by side: each start waits on its own
            list(ex.map(DaemonProcess.start, self.daemons.values()))
            list(ex.map(SGLangServer.start, self.servers.values()))

    def stop(self) -> None:
        try:
            with ThreadPoolExecutor(2) as ex:
                list(ex.map(SGLangServer.stop, self.servers.values()))
                list(ex.map(DaemonProcess.stop, self.daemons.values()))
        finally:
            self.redis.stop()

    def new_prompt(self) -> list[int]:
        self.seeds += 1  # the same sequence on both sides: the same traffic
        rng = random.Random(104729 * self.seeds)
        return [rng.randrange(3, 1000) for _ in range(PROMPT_LEN)]

    def send(self, phase: Phase, name: str, ids: list[int], *, flush: bool = False) -> Sent:
        """One request to server `name` (its device tree flushed first with `flush`, so only
        LMCache can serve the prompt); its output checked against the prompt's first one."""
        server = self.servers[name]
        if flush and not server.flush_cache(timeout_s=self.deadline_s):
            gen = Generation(ids, None, {}, 0.0, "flush_cache refused (requests still running)")
        else:
            gen = server.generate(ids, max_new_tokens=NEW_TOKENS, timeout_s=self.deadline_s)
        ref = self.reference.setdefault(tuple(ids), gen.output_ids) if gen.ok else None
        same = None if ref is gen.output_ids or not gen.ok else gen.output_ids == ref
        phase.sent.append(Sent(name, gen, same))
        return phase.sent[-1]

    def keys(self) -> int:
        try:
            return self.redis.dbsize()
        except (OSError, RuntimeError):
            return 0

    def reach_redis(self, keys: int, wait_s: float) -> bool:
        """Redis holds `keys` keys within `wait_s` (daemon A writes L2 after its STORE)."""
        end = time.monotonic() + wait_s
        while self.keys() < keys:
            if time.monotonic() > end:
                return False
            time.sleep(0.05)  # poll interval while waiting on Redis's key count
        return True

    def counts(self) -> dict[str, float]:
        """Ours: LOOKUPs by result, prefixes degraded by reason, L2 stalls found and the fast
        misses they gave, summed over both servers' /metrics ({} for upstream, which has
        none)."""
        out: dict[str, float] = {}
        if self.side != "ours":
            return out
        for server in self.servers.values():
            with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
                samples = parse(r.read().decode())
            rows = [(f"lookup {lab['result']}", v)
                    for lab, v in samples.get("loadback_lookups_total", [])]
            rows += [(f"degraded {lab['reason']}", v)
                     for lab, v in samples.get("loadback_prefix_outcomes_total", [])
                     if lab.get("state") == "degraded"]
            rows += [(name, v) for series, name in (("loadback_l2_stalls_total", "L2 stalled"),
                                                    ("loadback_l2_fast_misses_total",
                                                     "L2 fast misses"))
                     for _, v in samples.get(series, [])]
            for key, v in rows:
                out[key] = out.get(key, 0.0) + v
        return out

    def holds(self) -> dict[str, dict[str, int]]:
        """What each daemon still holds for its server (bounded settle), `{}` per daemon
        that holds nothing."""
        out = {}
        for name, d in self.daemons.items():
            end = time.monotonic() + 15
            while (held := d.client_holds()) and time.monotonic() < end:
                time.sleep(0.1)  # poll interval while the daemon settles
            out[name] = held
        return out


def _compute_on_a(fleet: Fleet, phase: Phase) -> list[list[int]]:
    prompts = [fleet.new_prompt() for _ in range(PROMPTS)]
    keys = fleet.keys()
    for ids in prompts:
        fleet.send(phase, "A", ids)
    fleet.reach_redis(keys + PROMPTS * CHUNKS, REDIS_WAIT_S)
    return prompts


def _fault_traffic(fleet: Fleet, phase: Phase, stored: list[list[int]]) -> None:
    for r in range(FAULT_ROUNDS):
        for name in "AB":
            fleet.send(phase, name, stored[r % len(stored)], flush=True)
        ids = fleet.new_prompt()
        fleet.send(phase, "A", ids)
        fleet.send(phase, "B", ids)


def _redis_back(fleet: Fleet, phase: Phase) -> list[list[int]]:
    """Redis restarted (empty): new prompts on A, then on B, until B hits one (at most
    RECOVERY_CAP_S); then A computes PROMPTS more for the daemon restart."""
    fleet.redis.restart()
    up = time.monotonic()
    while time.monotonic() - up < RECOVERY_CAP_S:
        ids, keys = fleet.new_prompt(), fleet.keys()
        fleet.send(phase, "A", ids)
        fleet.reach_redis(keys + CHUNKS, 2.0)
        got = fleet.send(phase, "B", ids)
        if got.gen.ok and _loaded(got.gen) > 0:
            phase.recovery_s = time.monotonic() - up
            break
    return _compute_on_a(fleet, phase)


def _daemon_a_back(fleet: Fleet, phase: Phase, prompts: list[list[int]]) -> None:
    fleet.daemons["A"].restart()
    up = time.monotonic()
    for ids in prompts:
        got = fleet.send(phase, "A", ids, flush=True)
        if phase.recovery_s is None and got.gen.ok and _loaded(got.gen) > 0:
            phase.recovery_s = time.monotonic() - up


def _phases(fleet: Fleet):
    """Each phase's key and what it does, in order (a later one uses what an earlier one
    computed)."""
    made: dict[str, list[list[int]]] = {}

    def b_same(ph: Phase) -> None:
        for ids in made["stored"]:
            fleet.send(ph, "B", ids)

    def fault(pause, resume):
        def step(ph: Phase) -> None:
            pause()
            try:
                _fault_traffic(fleet, ph, made["stored"])
            finally:
                resume()
        return step

    return (("a_computes", lambda ph: made.update(stored=_compute_on_a(fleet, ph))),
            ("b_same", b_same),
            ("redis_hung", fault(fleet.redis.pause, fleet.redis.resume)),
            ("redis_killed", fault(fleet.redis.kill, lambda: None)),  # restarted in phase 5
            ("redis_back", lambda ph: made.update(again=_redis_back(fleet, ph))),
            ("daemon_a_back", lambda ph: _daemon_a_back(fleet, ph, made["again"])))


def run_side(side: str, *, python: str, deadline_s: float, mq_timeout_s: float, work: Path,
             progress=print) -> dict:
    """One side's fleet through every phase; its summary (a side that cannot run is
    reported, not raised)."""
    fleet = Fleet(side, python=python, mq_timeout_s=mq_timeout_s, deadline_s=deadline_s,
                  work=work / side)
    phases = {key: Phase(key) for key, _ in PHASES}
    labels = dict(PHASES)
    error, holds = None, {}
    t0 = time.monotonic()
    try:
        progress(f"[{side}] starting Redis, two daemons and two sglang servers (logs {work / side})")
        fleet.start()
        progress(f"[{side}] ready in {time.monotonic() - t0:.0f} s")
        for key, step in _phases(fleet):
            progress(f"[{side}] {labels[key]}")
            before = fleet.counts()
            step(phases[key])
            after = fleet.counts()
            phases[key].counts = {k: v - before.get(k, 0.0) for k, v in after.items()
                                  if v != before.get(k, 0.0)}
        holds = fleet.holds()
    except Exception as exc:  # a side that cannot run is reported; the other still runs
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        progress(f"[{side}] {error}")
    finally:
        fleet.stop()
    b_first = phases["b_same"].sent[:1]
    return {
        "phases": {k: p.summary() for k, p in phases.items()},
        "b_first_request_hit": bool(b_first and b_first[0].gen.ok and _loaded(b_first[0].gen) > 0),
        "daemon_holds_idle": holds,
        "seconds": round(time.monotonic() - t0, 1),
        "error": error,
    }


def print_table(summaries: dict[str, dict]) -> None:
    """Phases down, one column group per side: hits of requests, errors, latency p50 and max,
    whether every output was the prompt's first one; then each side's invariants."""
    sides = list(summaries)
    cols, w = ("hits", "errors", "p50 s", "max s", "same"), 7
    group = len(cols) * w

    def line(label: str, cells: list[str]) -> None:
        print(f"{label:36}" + "".join(f" |{c:>{group}}" for c in cells))

    print()
    print(f"{'':36}" + "".join(f" |{side:^{group}}" for side in sides))
    line("phase", ["".join(f"{c:>{w}}" for c in cols)] * len(sides))
    for key, label in PHASES:
        cells = []
        for side in sides:
            p = summaries[side]["phases"][key]
            cells.append("".join(f"{v:>{w}}" for v in (
                f"{p['hits']}/{p['requests']}", p["errors"], _num(p["p50_s"]), _num(p["max_s"]),
                "yes" if not p["outputs_differ"] else f"NO {p['outputs_differ']}")))
        line(label, cells)
    for label, cell in (
            ("B hit its first request", lambda s: "yes" if s["b_first_request_hit"] else "no"),
            ("Redis back -> B's first hit (s)",
             lambda s: _num(s["phases"]["redis_back"]["recovery_s"])),
            ("daemon A back -> A's first hit (s)",
             lambda s: _num(s["phases"]["daemon_a_back"]["recovery_s"])),
            ("daemons hold nothing when idle", lambda s: "yes" if _idle(s) else "no"),
            ("side took (s)", lambda s: _num(s["seconds"]))):
        line(label, [cell(summaries[side]) for side in sides])
    for side in sides:
        counted = [(label, summaries[side]["phases"][key].get("loadback") or {})
                   for key, label in PHASES]
        if any(c for _, c in counted):
            print(f"\n{side}, both servers' /metrics per phase (loadback_lookups_total by "
                  f"result, prefixes degraded by reason, loadback_l2_stalls_total and "
                  f"loadback_l2_fast_misses_total):")
            for label, c in counted:
                print(f"  {label:34} " + (", ".join(f"{k} {v:g}" for k, v in sorted(c.items()))
                                          or "-"))
    for side in sides:
        if summaries[side]["error"]:
            print(f"{side}: {summaries[side]['error']}")


def _idle(s: dict) -> bool:
    """Both daemons were asked and hold nothing."""
    return bool(s["daemon_holds_idle"]) and not any(s["daemon_holds_idle"].values())


def _num(v) -> str:
    return "-" if v is None else f"{v:g}"


def ours_ok(s: dict) -> bool:
    """Ours held every invariant: no error, every output the first one's, B's first request a
    hit, a hit after Redis and after daemon A came back, nothing held when idle."""
    ph = s["phases"]
    return (s["error"] is None and s["b_first_request_hit"]
            and all(p["errors"] == 0 and p["outputs_differ"] == 0 for p in ph.values())
            and ph["redis_back"]["recovery_s"] is not None
            and ph["daemon_a_back"]["recovery_s"] is not None and _idle(s))


def run(args) -> int:
    python = args.sglang_python or sys.executable
    sides = [s for s in SIDES if s in args.sides.split(",")]
    missing = _check_python(python)
    try:
        find_redis()
    except RedisUnavailable as exc:
        missing = missing or str(exc)
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    work = Path(tempfile.mkdtemp(prefix="sglang-fleet-demo-"))
    print(f"logs: {work}")
    t0 = time.monotonic()
    summaries = {side: run_side(side, python=python, deadline_s=args.deadline_s,
                                mq_timeout_s=args.mq_timeout_s, work=work) for side in sides}
    print_table(summaries)
    print(f"\nper side: two servers, two daemons (--l2-adapter valkey, request_timeout 0.5 s), "
          f"one redis-server; {PROMPTS} prompts of {PROMPT_LEN} tokens per computing phase, "
          f"{FAULT_ROUNDS * 4} requests per Redis fault, one at a time, client deadline "
          f"{args.deadline_s:g} s; upstream's lmcache.mp.mq_timeout {args.mq_timeout_s:g} s "
          f"(default 300). 'same': every output equals the prompt's first computation. Done in "
          f"{time.monotonic() - t0:.0f} s; servers, daemons and Redis stopped.")
    if args.json:
        write_json(args.json, summaries)
        print(f"wrote {args.json}")
    ours = summaries.get("ours")
    return 0 if ours is None or ours_ok(ours) else 1
