"""`loadback sglang-demo` (`make demo`): a real SGLang 0.5.23 server with this product's
backend beside upstream's LMCache class, under the same traffic; the daemon SIGKILLed once 35%
of the window passed and a request hit, a new one started once 55% passed and a request sent
after the kill was answered. From the new daemon's first answer to a ping, the demo also asks
a prompt, flushes the device tree and asks it again, until a hit: a prompt the new daemon
stored comes back at once, not a pool's round later, so the recovery from that answer to the
first hit is the product's, not the traffic's. Traffic goes on past the window until that hit
(at most AFTER_CAP_S), and the table side by side (and `--json FILE`) gives it. Both sides run
on their defaults (where the daemon is, its chunk size). Sides run one at a time (two servers
on two cores would measure each other); all it starts it stops.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lmcache_loadback.connectors.ports import free_port
from lmcache_loadback.testing.daemon import DaemonProcess

from lmcache_loadback.harness.bench.common import median, percentile
from lmcache_loadback.orchestrator.exit_codes import EXIT_UNAVAILABLE, EXIT_USAGE
from .server import (PROBE_DIR, STUBS_DIR, Generation, SGLangServer,
                            write_loadback_yaml, write_upstream_yaml)

CHUNK = 16
PROMPT_LEN = 160
NEW_TOKENS = 8
MAX_TOTAL_TOKENS = 1024  # the device KV pool: 6 prompts fit, the pool below does not
POOL = 8
#: The kill comes once this much of the window passed and a request hit (at the latest at
#: RESTART_AT); the new daemon starts once RESTART_AT passed and a request sent after the kill
#: was answered (at the latest at the window's end).
KILL_AT, RESTART_AT = 0.35, 0.55
#: After the window, traffic runs until a hit after the new daemon served, at most this long
#: past its first answer (a loaded machine took 22 s to start one: no fixed window fits)
AFTER_CAP_S = 60.0
#: A new daemon that has not served this long past the window's end never will (its start's
#: own bound is 90 s)
START_CAP_S = 90.0
#: Numbers the recovery probe's requests after the traffic's (`Sent.n` orders first outputs)
PROBE_N0 = 1_000_000
#: `--sides`: the backends it can run, in the order it runs them
SIDES = ("ours", "upstream")


def _prompt(i: int) -> list[int]:
    rng = random.Random(7919 * (i + 1))
    return [rng.randrange(3, 1000) for _ in range(PROMPT_LEN)]


def _loaded(gen: Generation) -> int:
    """Tokens SGLang reports loaded from LMCache (storage; host when a backend reports the
    load-back as host: no host tier runs here)."""
    d = gen.meta.get("cached_tokens_details") or {}
    return int(d.get("storage", 0) or 0) + int(d.get("host", 0) or 0)


@dataclass
class Sent:
    n: int
    prompt_id: int
    sent_s: float
    gen: Generation | None = None
    done_s: float | None = None


@dataclass
class SideResult:
    side: str
    start_s: float = 0.0
    kill_s: float | None = None
    restart_s: float | None = None
    sent: list[Sent] = field(default_factory=list)
    error: str | None = None
    probe_file: Path | None = None
    #: set when the new daemon first answered a ping (`restart_s`)
    served: threading.Event = field(default_factory=threading.Event, repr=False)

    def hit_since(self, since_s: float) -> bool:
        """A request sent at or after `since_s` (seconds into the window) has hit."""
        return any(s.gen is not None and s.gen.ok and s.sent_s >= since_s and _loaded(s.gen) > 0
                   for s in list(self.sent))

    def answered_since(self, since_s: float) -> bool:
        """A request sent at or after `since_s` has been answered (or given up on)."""
        return any(s.sent_s >= since_s and s.done_s is not None for s in list(self.sent))

    def recovered(self) -> bool:
        """A request sent after the new daemon served has hit."""
        return self.restart_s is not None and self.hit_since(self.restart_s)

    def traffic_due(self, elapsed_s: float, duration_s: float) -> bool:
        """Send more at `elapsed_s`: within the window, then until a hit after the new daemon
        served (at most AFTER_CAP_S past its first answer, or past the window while it
        starts)."""
        if elapsed_s < duration_s:
            return True
        if self.kill_s is None:
            return False
        since = self.restart_s if self.restart_s is not None else duration_s + START_CAP_S
        return elapsed_s < since + AFTER_CAP_S and not self.recovered()

    def summary(self) -> dict:
        done = [s for s in self.sent if s.gen is not None]
        ok = [s for s in done if s.gen.ok]
        lat = [s.gen.latency_s for s in done]
        restart = self.restart_s if self.restart_s is not None else float("inf")
        kill = self.kill_s if self.kill_s is not None else float("inf")
        hits_before = sum(1 for s in ok if s.sent_s < kill and _loaded(s.gen) > 0)
        after = [s for s in ok if s.sent_s >= restart and _loaded(s.gen) > 0]
        recovery = min((s.done_s for s in after), default=None)
        first_output: dict[int, list[int]] = {}
        identical = True
        for s in sorted(ok, key=lambda s: s.n):
            ref = first_output.setdefault(s.prompt_id, s.gen.output_ids)
            identical &= s.gen.output_ids == ref
        return {
            "requests": len(self.sent),
            "completed": len(ok),
            "failed": len(self.sent) - len(ok),
            "timed_out": sum(1 for s in done if s.gen.error == "timeout"),
            "p50_s": round(median(lat), 3) if lat else None,
            "p99_s": round(percentile(lat, 99), 3) if lat else None,
            "max_s": round(max(lat), 3) if lat else None,
            "hits_before_kill": hits_before,
            "hits_after_restart": len(after),
            "recovery_s": None if recovery is None else round(recovery - restart, 2),
            "outputs_identical": identical,
            "server_start_s": round(self.start_s, 1),
            **self._scheduler_time(),
            "error": self.error,
        }

    def _scheduler_time(self) -> dict:
        """Per request, scheduler-thread seconds inside the cache backend (the probe's lines)."""
        if self.probe_file is None:
            return {}
        try:
            lines = [json.loads(x) for x in self.probe_file.read_text().splitlines() if x]
        except OSError:
            lines = []
        per_req = [x["total_s"] for x in lines]
        return {
            "sched_requests_probed": len(per_req),
            "sched_wait_p50_ms": round(median(per_req) * 1000, 3) if per_req else None,
            "sched_wait_p99_ms": round(percentile(per_req, 99) * 1000, 3) if per_req else None,
            "sched_wait_max_ms": round(max(per_req) * 1000, 1) if per_req else None,
            "sched_unattributed_s": round(lines[-1]["unattributed_s"], 3) if lines else None,
        }


def _after(t0: float, earliest_s: float, latest_s: float, event, stop: threading.Event) -> bool:
    """Wait until `earliest_s` into the window, then until `event()` or `latest_s`; False if
    stopped first."""
    if stop.wait(max(0.0, t0 + earliest_s - time.monotonic())):
        return False
    while not event() and time.monotonic() - t0 < latest_s:
        if stop.wait(0.05):  # poll interval of the traffic's record
            return False
    return True


def _control(daemon: DaemonProcess, res: SideResult, t0: float, duration_s: float,
             stop: threading.Event) -> None:
    """Kill the daemon once KILL_AT of the window passed and a request hit, start a new one
    once RESTART_AT passed and a request sent after the kill was answered (each bounded, see
    KILL_AT); `res.restart_s` is when it first answered a ping (start() returns then),
    however long its start took, and `res.served` is set."""
    if not _after(t0, KILL_AT * duration_s, RESTART_AT * duration_s,
                  lambda: res.hit_since(0.0), stop):
        return
    daemon.kill()
    res.kill_s = time.monotonic() - t0
    if not _after(t0, RESTART_AT * duration_s, duration_s,
                  lambda: res.answered_since(res.kill_s), stop):
        return
    daemon.start()
    res.restart_s = time.monotonic() - t0
    res.served.set()


def _recovery_probe(server: SGLangServer, res: SideResult, stop: threading.Event, t0: float,
                    deadline_s: float) -> None:
    """From the new daemon's first answer until a hit after it (or `stop`): a pool prompt,
    the device tree flushed (SGLang refuses while requests run: retried, bounded), the same
    prompt again. What the new daemon stored is asked for at once, so the recovery figure is
    the product's re-registration and store, not the pool's revisit period."""
    while not res.served.wait(0.2):  # bounded: `stop` ends the side
        if stop.is_set():
            return
    k = 0
    while not stop.is_set() and not res.recovered():
        for again in (False, True):
            if again and not server.flush_cache(timeout_s=2.0):
                break
            s = Sent(PROBE_N0 + 2 * k + again, k % POOL, time.monotonic() - t0)
            res.sent.append(s)
            s.gen = server.generate(_prompt(s.prompt_id), max_new_tokens=NEW_TOKENS,
                                    timeout_s=deadline_s)
            s.done_s = time.monotonic() - t0
        k += 1


def side_daemon(ours: bool, *, chunk_size: int, work: Path) -> DaemonProcess:
    """A side's daemon (not started): ours as the README starts it, with a shared-memory pool
    of its own name (one per daemon on a host); upstream's as LMCache documents it for a CPU
    engine, KV pickled in the replies."""
    port = free_port()
    return DaemonProcess(port=port, chunk_size=chunk_size, log_dir=str(work),
                         shm_name=f"loadback-demo-{port}" if ours else None)


def run_side(side: str, *, python: str, duration_s: float, interval_ms: float,
             deadline_s: float, mq_timeout_s: float, work: Path, probe: bool = False,
             progress=print) -> SideResult:
    """One side: a real lmcache 0.5.6 daemon on a free loopback port; `python -m
    sglang.launch_server` on CPU (tiny llama config, dummy weights) with `--enable-lmcache`
    and, for ours, `--radix-cache-backend loadback`; open-loop traffic cycling through a pool
    of prompts larger than the device KV pool, so every revisit is evicted from the device
    tree and can only hit in LMCache. Bounded: the server's start, `duration_s` of traffic
    plus at most one deadline, and a stop (server by process group, daemon by PID). A side
    that cannot run is reported, not raised."""
    res = SideResult(side)
    daemon = side_daemon(side == "ours", chunk_size=CHUNK, work=work)
    daemon.start()
    server = _server(side, daemon, res, python=python, mq_timeout_s=mq_timeout_s, work=work,
                     probe=probe)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        progress(f"[{side}] starting sglang (log {server.log_path}) ...")
        server.start()
        res.start_s = server.start_s
        progress(f"[{side}] ready in {server.start_s:.0f} s; {duration_s:.0f} s of traffic, "
                 f"daemon killed after {KILL_AT * duration_s:.0f} s once a request hit, a new "
                 f"one started after {RESTART_AT * duration_s:.0f} s once the outage was "
                 f"answered, then traffic until a hit after it serves")
        t0 = time.monotonic()
        ctl = threading.Thread(target=_control, args=(daemon, res, t0, duration_s, stop),
                               daemon=True)
        ctl.start()
        threads.append(threading.Thread(target=_recovery_probe, daemon=True,
                                        args=(server, res, stop, t0, deadline_s)))
        threads[-1].start()
        _traffic(server, res, threads, stop, t0, duration_s=duration_s,
                 interval_ms=interval_ms, deadline_s=deadline_s)
        stop.set()  # the traffic is over: the probe ends after its request in flight
        ctl.join(timeout=120)
        for th in threads:  # each is bounded by its client deadline
            th.join(timeout=deadline_s + 30)
    except Exception as exc:  # a side that cannot run is reported, the other still runs
        res.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        progress(f"[{side}] {res.error}")
    finally:
        stop.set()
        server.stop()
        daemon.stop()
    return res



def _server(side: str, daemon: DaemonProcess, res: SideResult, *, python: str,
            mq_timeout_s: float, work: Path, probe: bool) -> SGLangServer:
    """The side's SGLang server (not started): ours with the `loadback` backend, upstream
    with LMCache's own class; with `probe`, the same backend timed by the probe plugin."""
    if side == "ours":
        cfg = write_loadback_yaml(work / "loadback.yaml", daemon.port, chunk_size=CHUNK)
        backend = "loadback"
    else:
        cfg = write_upstream_yaml(work / "upstream.yaml", daemon.port, mq_timeout_s=mq_timeout_s)
        backend = None
    probe_env = {}
    if probe:  # the same backend, built and timed by the test-only probe plugin
        res.probe_file = work / f"{side}-sched.jsonl"
        backend = f"probe-{backend or 'upstream'}"
        probe_env = {"LOADBACK_SCHED_PROBE_FILE": str(res.probe_file)}
    return SGLangServer(python=python, lmcache_config=cfg, backend=backend,
                        max_total_tokens=MAX_TOTAL_TOKENS, log_path=work / f"{side}.log",
                        python_path=[str(PROBE_DIR)] if probe else [], extra_env=probe_env)


def _traffic(server: SGLangServer, res: SideResult, threads: list[threading.Thread],
             stop: threading.Event, t0: float, *, duration_s: float, interval_ms: float,
             deadline_s: float) -> None:
    """Open-loop traffic: a request every `interval_ms` until `duration_s`, each on its own
    thread (appended to `threads`) and capped by its client deadline."""
    n = 0
    while True:
        due = t0 + n * interval_ms / 1000
        if not res.traffic_due(due - t0, duration_s):
            break
        stop.wait(max(0.0, due - time.monotonic()))
        s = Sent(n, n % POOL, time.monotonic() - t0)
        res.sent.append(s)

        def send(s=s):
            s.gen = server.generate(_prompt(s.prompt_id), max_new_tokens=NEW_TOKENS,
                                    timeout_s=deadline_s)
            s.done_s = time.monotonic() - t0

        th = threading.Thread(target=send, daemon=True)
        th.start()
        threads.append(th)
        n += 1

def print_table(summaries: dict[str, dict]) -> None:
    rows = [
        ("requests", "requests"), ("completed", "completed"),
        ("failed or timed out", "failed"), ("  of which timed out", "timed_out"),
        ("latency p50 (s)", "p50_s"), ("latency p99 (s)", "p99_s"), ("latency max (s)", "max_s"),
        ("storage hits before the kill", "hits_before_kill"),
        ("storage hits after the restart", "hits_after_restart"),
        ("recovery: serving -> first hit (s)", "recovery_s"),
        ("outputs identical per prompt", "outputs_identical"),
        ("server start (s)", "server_start_s"),
        ("scheduler in backend p50 (ms)", "sched_wait_p50_ms"),
        ("scheduler in backend p99 (ms)", "sched_wait_p99_ms"),
        ("scheduler in backend max (ms)", "sched_wait_max_ms"),
    ]
    cols = list(summaries)
    print(f"\n{'':36}" + "".join(f"{c:>14}" for c in cols))
    for label, key in rows:
        cells = []
        if all(summaries[c].get(key) is None for c in cols) and key.startswith("sched"):
            continue
        for c in cols:
            v = summaries[c].get(key)
            cells.append("-" if v is None else str(v))
        print(f"{label:36}" + "".join(f"{v:>14}" for v in cells))
    for c in cols:
        if summaries[c].get("error"):
            print(f"{c}: {summaries[c]['error']}")


def _check_python(python: str) -> str | None:
    """Why `python` cannot run the demo (no sglang 0.5.23 there), or None if it can."""
    env = dict(os.environ, PYTHONPATH=str(STUBS_DIR), HF_HUB_OFFLINE="1")
    out = subprocess.run([python, "-c", "import sglang; print(sglang.__version__)"],
                         capture_output=True, text=True, env=env, timeout=120)
    if out.returncode != 0 or out.stdout.strip() != "0.5.23":
        return (
            f"sglang-demo needs a Python with sglang 0.5.23 (got {python!r}: "
            f"{out.stdout.strip() or out.stderr.strip()[-200:]}); build it with "
            f"`make sglang-envs` and pass --sglang-python .venv-sglang-0.5.23/bin/python")


def run(args) -> int:
    python = args.sglang_python or sys.executable
    sides = [s for s in SIDES if s in args.sides.split(",")]
    if not sides:  # the CLI refuses it first; this is for a caller passing args of its own
        print(f"error: --sides must name some of {','.join(SIDES)}, got {args.sides!r}",
              file=sys.stderr)
        return EXIT_USAGE
    missing = _check_python(python)
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    work = Path(tempfile.mkdtemp(prefix="sglang-demo-"))
    print(f"logs: {work}")
    t0 = time.monotonic()
    summaries = {}
    for side in sides:
        res = run_side(side, python=python, duration_s=args.duration_s,
                       interval_ms=args.interval_ms, deadline_s=args.deadline_s,
                       mq_timeout_s=args.mq_timeout_s, work=work, probe=args.probe)
        summaries[side] = res.summary()
        rec = summaries[side]["recovery_s"]
        print(f"[{side}] recovery: daemon serving again -> first hit: "
              f"{'none' if rec is None else f'{rec} s'}")
    print_table(summaries)
    print(f"\nsame traffic both sides: a request every {args.interval_ms:g} ms for "
          f"{args.duration_s:g} s over {POOL} prompts of {PROMPT_LEN} tokens (the device pool "
          f"holds {MAX_TOTAL_TOKENS} tokens, so revisits hit only in LMCache), client deadline "
          f"{args.deadline_s:g} s; upstream's lmcache.mp.mq_timeout {args.mq_timeout_s:g} s "
          f"(default 300). A restarted daemon is empty: recovery is from its first answer to a "
          f"ping to the first hit, a prompt stored again and asked for at once (the demo "
          f"flushes the device tree between the two; the pool alone brings a prompt back "
          f"every {POOL * args.interval_ms / 1000:g} s). Done in {time.monotonic() - t0:.0f} s; "
          f"servers and daemons stopped.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=2)
        print(f"wrote {args.json}")
    ours = summaries.get("ours")
    ok = ours is None or (ours["error"] is None and ours["failed"] == 0
                          and ours["outputs_identical"] and ours["hits_after_restart"] > 0)
    return 0 if ok else 1
