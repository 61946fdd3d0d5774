"""`loadback demo` (`make demo-sim`, the simulated-engine demo; `make demo` runs the SGLang
demo): a real LMCache 0.5.6 daemon, /metrics on 127.0.0.1, a realistic workload through the
orchestrator, the daemon SIGKILLed at 35% and a new one started on the same port at 55%, then
a summary. About a minute; leaves nothing running (the daemon is stopped by PID, the metrics
server closed).
"""

from __future__ import annotations

import json
import time
import urllib.request

from lmcache_loadback.metrics import start_metrics_server

from .bench.common import median, percentile
from .chaos import Fault, Progress, Scenario, print_results, run_scenario
from lmcache_loadback.orchestrator.instruments import product_metrics


def run(args) -> int:
    metrics = product_metrics()
    server = start_metrics_server("127.0.0.1", 0, registry=metrics)
    print(f"metrics: {server.url}")
    scn = Scenario(name="demo", seed=42, requests=args.requests, max_seconds=150,
                   request_interval_ms=args.interval_ms,
                   description="kill the daemon at 35%, a new one on the same port at 55%",
                   fault=Fault(kind="kill", start=0.35, end=0.55))
    t0 = time.monotonic()
    try:
        progress = Progress()
        try:
            result = run_scenario(scn, metrics=metrics, progress=progress)
        finally:
            progress.close()
        scraped = urllib.request.urlopen(server.url, timeout=5).read().decode()
    finally:
        server.close()
    snap = metrics.snapshot()

    def total(prefix: str) -> float:
        return sum(v for k, v in snap.items() if k.startswith(prefix))

    print()
    print_results([result])
    promised = total("loadback_promised_tokens_total")
    loaded = total("loadback_loaded_tokens_total")
    print(f"\ntokens promised by match(): {promised:,.0f}   loaded: {loaded:,.0f}   "
          f"recomputed after a failed load: {total('loadback_recomputed_tokens_total'):,.0f}")
    print("lookups: " + ", ".join(
        f"{k.split('=', 1)[1].rstrip('}')}={v:g}" for k, v in sorted(snap.items())
        if k.startswith("loadback_lookups_total")) + " (skipped: answered 0 at once, the "
        "breaker open while the daemon was down)")
    print("outcomes:", ", ".join(
        f"{k.split('{', 1)[1].rstrip('}')}={v:g}" for k, v in sorted(snap.items())
        if k.startswith("loadback_prefix_outcomes_total") and v))
    lk = result.extra
    times = result.extra.get("load_times", [])
    print(f"load_back latency p50 {median(times) * 1000:.1f} ms, p99 "
          f"{percentile(times, 99) * 1000:.1f} ms; every call's p99 {result.p99_return_s * 1000:.1f} ms")
    print("breaker transitions:", ", ".join(
        f"{k.split('=', 1)[1].rstrip('}')}={v:g}" for k, v in sorted(snap.items())
        if k.startswith("loadback_breaker_transitions_total") and v) or "none")
    print(f"re-registrations after the restart: {total('loadback_reregistrations_total'):g}; "
          f"late replies dropped: {lk.get('late_replies', 0)}")
    rec = "-" if result.recovery_s is None else f"{result.recovery_s:.2f} s"
    print(f"recovery (new daemon up -> first hit again): {rec}")
    print(f"hung: {result.hung}   leaked: {result.leaked}   wrong bytes: {result.wrong_bytes}   "
          f"counters reconcile: {'yes' if result.counters_ok else 'NO'}   "
          f"/metrics served {len(scraped.splitlines())} lines")
    print(f"done in {time.monotonic() - t0:.0f} s; daemon stopped, metrics server closed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"result": result.__dict__, "metrics": snap}, f, indent=2, default=str)
    return 0 if result.ok else 1

