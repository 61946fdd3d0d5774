"""Ours and upstream on a real SGLang 0.5.23 server at `--tp-size 2`, against ONE daemon.

Both ranks of the server talk to the one daemon (through the fault proxy). Ours: the storage
hit with the recomputed output; the daemon SIGSTOPped while the LOOKUP is asked and SIGKILLed
between LOOKUP and RETRIEVE, each request completing within REQUEST_BOUND_S with the
recomputed output and hits resuming after a restart; on the defaults, the first hit within
SERVING_TO_HIT_BOUND_S of a new daemon serving, behind the proxy and on the dialed address;
idle, the daemon holds no read lock and no session of ours (asked of the daemon). Upstream at TP 2 gets the same traffic, measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import bring_up, report
from .helpers import RECOVERY_FAULTS, SERVING_TO_HIT_BOUND_S, loaded_tokens, prompt, wait_until
from .test_loadback_server import (RECOVERY_BOUND_S, assert_same_output, assert_within_bound,
                                   live, storage_hit)
from .test_upstream_server import _restart_and_watch, killed_between_lookup_and_retrieve

TP = 2
UPSTREAM_DEADLINE_S = 15.0


@pytest.fixture(scope="module")
def ours_tp(make_stack):
    return make_stack("loadback", tp=TP)


def _sglang_metric(stack, series: str) -> float:
    """One series from the SGLang server's /metrics (0 when absent)."""
    with urllib.request.urlopen(stack.server.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _idle_and_clean(stack, what: str) -> dict:
    """The daemon holds nothing of ours once nothing runs (bounded): every kind of hold."""
    wait_until(lambda: not stack.daemon.client_holds(),
               15, f"{what}: the daemon still holds {stack.daemon.held()}")
    return stack.daemon.held()


def test_tp2_storage_hit_has_the_recomputed_output(ours_tp):
    ref, again, details = storage_hit(ours_tp, "TP 2 happy path")
    held = _idle_and_clean(ours_tp, "after a hit")
    # Both ranks' outcomes reach SGLang's own /metrics (one series, summed over the ranks'
    # processes): every load is counted once per rank.
    loaded = _sglang_metric(ours_tp, 'loadback_prefix_outcomes_total{reason="none",state="loaded"}')
    hits = sum(1 for g in ours_tp.log if loaded_tokens(g) > 0)
    assert loaded == TP * hits, (loaded, hits)
    # `loadback status` reads the same endpoint: what an operator sees of this server.
    loadback = Path(sys.executable).with_name("loadback")
    url = ours_tp.server.url + "/metrics"
    st = json.loads(subprocess.run([str(loadback), "status", "--url", url, "--json"],
                                   capture_output=True, text=True, timeout=60,
                                   check=True).stdout)
    assert st["daemon"]["endpoint"] == f"tcp://127.0.0.1:{ours_tp.proxy_port}", st
    assert st["daemon"]["up"] and not st["daemon"]["refused"], st
    assert st["registration_epoch"] is not None and st["registration_epoch"] >= 0, st
    assert st["breaker"] == "closed" and st["transfer_mode"] == "pickle", st
    assert st["owed_releases"] == 0 and st["queues"]["store"] == 0, st
    assert st["scheduler_wait"]["calls"] > 0, st
    table = subprocess.run([str(loadback), "status", "--url", url], capture_output=True,
                           text=True, timeout=60, check=True).stdout
    print(f"\nloadback status of the TP 2 server:\n{table}")
    report("ours_tp2_happy", details=details, recompute_s=round(ref.latency_s, 3),
           loaded_s=round(again.latency_s, 3), start_s=round(ours_tp.server.start_s, 1),
           daemon_after=held)


def test_tp2_daemon_stopped_during_lookup(ours_tp):
    live(ours_tp)
    ids = prompt(ours_tp.new_seed())
    ref = ours_tp.cold(ids)
    assert ours_tp.stored and ours_tp.server.flush_cache()
    ours_tp.daemon.pause()
    try:
        hung = ours_tp.generate(ids)
    finally:
        ours_tp.daemon.resume()
    assert_within_bound([hung], "daemon stopped at LOOKUP")
    assert hung.output_ids == ref.output_ids and loaded_tokens(hung) == 0
    took, cycles = ours_tp.until_hits(RECOVERY_BOUND_S)
    assert_same_output(cycles)
    assert took <= RECOVERY_BOUND_S, "hits did not resume after the daemon continued"
    held = _idle_and_clean(ours_tp, "after SIGSTOP")
    report("ours_tp2_sigstop_lookup", stopped_latency_s=round(hung.latency_s, 3),
           hits_resumed_s=round(took, 2), daemon_after=held)


def test_tp2_daemon_killed_between_lookup_and_retrieve(ours_tp):
    live(ours_tp)
    ids = prompt(ours_tp.new_seed())
    ref = ours_tp.cold(ids)
    assert ours_tp.stored and ours_tp.server.flush_cache()
    hit = ours_tp.fault_before_answer("prepare_retrieve", ids).result()
    assert_within_bound([hit], "the request whose prepare_retrieve was never answered")
    assert hit.output_ids == ref.output_ids
    down = ours_tp.generate(prompt(ours_tp.new_seed()))
    assert_within_bound([down], "daemon down")
    up_at = bring_up(ours_tp)
    took, cycles = ours_tp.until_hits(RECOVERY_BOUND_S)
    assert_same_output(cycles)
    assert_within_bound([g for c in cycles for g in c], "after the restart")
    assert took <= RECOVERY_BOUND_S, f"hits did not resume within {RECOVERY_BOUND_S} s"
    held = _idle_and_clean(ours_tp, "after the restart")
    report("ours_tp2_kill_prepare_retrieve", faulted_latency_s=round(hit.latency_s, 3),
           down_latency_s=round(down.latency_s, 3),
           hits_resumed_after_restart_s=round(time.monotonic() - up_at, 2), daemon_after=held)


@pytest.mark.parametrize("fault", [f for f in RECOVERY_FAULTS if f != "hang"])
def test_tp2_first_hit_soon_after_a_restart_on_the_defaults(ours_tp, fault):
    """Both ranks on the defaults (the YAML names only the daemon's address and chunk size):
    from the new daemon's first answer to a client of the test's own, hit cycles until one
    loads. Behind the proxy each rank's breaker has probed at its cap first."""
    live(ours_tp)
    served_at = ours_tp.serve_again(fault, ranks=TP)
    took, cycles = ours_tp.first_hit_after(served_at, RECOVERY_BOUND_S)
    assert_same_output(cycles)
    assert_within_bound([g for c in cycles for g in c], f"after the {fault}")
    assert took <= SERVING_TO_HIT_BOUND_S, (
        f"{fault}: the first hit {took:.2f} s after the daemon served again")
    held = _idle_and_clean(ours_tp, f"after the {fault}")
    report(f"ours_tp2_recovery_{fault}", serving_to_first_hit_s=round(took, 2),
           cycles=len(cycles), daemon_after=held)


@pytest.mark.upstream
def test_upstream_tp2_same_traffic(make_stack):
    """Upstream at TP 2: the happy path hits (the comparison means something), then the
    daemon SIGKILLed between LOOKUP and RETRIEVE blocks the scheduler for mq_timeout-sized
    waits; what came back after the restart is measured."""
    stack = make_stack("upstream", deadline_s=UPSTREAM_DEADLINE_S, tp=TP)
    try:
        ref, again = stack.hit_cycle(stack.new_seed(), store_wait_s=10.0)
        assert ref.ok and again.ok and loaded_tokens(again) > 0, (
            "upstream's happy path at TP 2 must work for the comparison to mean anything")
        cold, hit = killed_between_lookup_and_retrieve(stack)
        report("upstream_tp2", happy_loaded=loaded_tokens(again),
               happy_same_output=again.output_ids == ref.output_ids,
               faulted_ok=hit.ok, faulted_latency_s=round(hit.latency_s, 2),
               faulted_output_correct=hit.ok and hit.output_ids == cold.output_ids,
               **_restart_and_watch(stack))
    finally:
        stack.close()
