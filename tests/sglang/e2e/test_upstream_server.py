"""Upstream for comparison: the same traffic and faults against `--enable-lmcache` alone
(LMCacheUnifiedRadixCache + lmcache 0.5.6's connector), `lmcache.mp.mq_timeout` shortened to
UPSTREAM_MQ_TIMEOUT_S, every request capped by a client deadline.

What these pin is the contrast the product exists for (see sglang-plugin.md, measured there):
a daemon killed before a LOOKUP answers starves the request; killed between LOOKUP and
RETRIEVE, the scheduler blocks for seconds; after a restart no hit comes back. Each fault gets
its own server: upstream never recovers from one, so a second would measure the first.
"""

from __future__ import annotations

import time

import pytest

from .conftest import UPSTREAM_MQ_TIMEOUT_S, bring_up, report
from .helpers import loaded_tokens, prompt

CLIENT_DEADLINE_S = 15.0
RESTART_WATCH_S = 20.0  # how long to look for hits after the restart


def _restart_and_watch(stack):
    up_at = bring_up(stack)
    took, cycles = stack.until_hits(RESTART_WATCH_S)
    gens = [g for c in cycles for g in c]
    return {
        "hits_resumed_after_restart_s": None if took == float("inf") else round(
            time.monotonic() - up_at, 2),
        "requests_after_restart": len(gens),
        "failed_after_restart": sum(not g.ok for g in gens),
        "latencies_after_restart_s": [round(g.latency_s, 2) for g in gens],
    }


def killed_between_lookup_and_retrieve(stack):
    """A stored prompt sent again while the daemon is SIGKILLed before its prepare_retrieve
    answers: (the recomputed reference, the faulted request)."""
    ids = prompt(stack.new_seed())
    ref = stack.cold(ids)
    assert stack.stored and stack.server.flush_cache()
    hit = stack.fault_before_answer("prepare_retrieve", ids).result()
    # the scheduler thread blocks for mq_timeout-sized waits before it recomputes
    assert (not hit.ok) or hit.latency_s >= UPSTREAM_MQ_TIMEOUT_S, (
        f"upstream answered in {hit.latency_s:.2f} s: no block measured")
    return ref, hit


@pytest.mark.upstream
def test_upstream_happy_then_killed_between_lookup_and_retrieve(make_stack):
    stack = make_stack("upstream", deadline_s=CLIENT_DEADLINE_S)
    try:
        ref, again = stack.hit_cycle(stack.new_seed(), store_wait_s=10.0)
        assert ref.ok and again.ok and loaded_tokens(again) > 0, (
            "upstream's happy path must work for the comparison to mean anything")
        assert again.output_ids == ref.output_ids
        ref, hit = killed_between_lookup_and_retrieve(stack)
        down = stack.generate(prompt(stack.new_seed()))
        after = _restart_and_watch(stack)
        report("upstream_kill_prepare_retrieve", mq_timeout_s=UPSTREAM_MQ_TIMEOUT_S,
               faulted_ok=hit.ok, faulted_latency_s=round(hit.latency_s, 2),
               faulted_output_correct=hit.ok and hit.output_ids == ref.output_ids,
               down_ok=down.ok, down_latency_s=round(down.latency_s, 2), **after)
    finally:
        stack.close()


# Kept in `make test`: it guards the README's claim that upstream's wiring waits on a lost call
# (a LOOKUP whose daemon died starves its request).
def test_upstream_killed_before_lookup_answers_starves(make_stack):
    stack = make_stack("upstream", deadline_s=CLIENT_DEADLINE_S)
    try:
        ids = prompt(stack.new_seed())
        stack.cold(ids)
        assert stack.stored and stack.server.flush_cache()
        starved = stack.fault_before_answer("lookup", ids).result()
        assert starved.error == "timeout", (
            f"expected the request to starve until the client deadline, got {starved}")
        down = stack.generate(prompt(stack.new_seed()))
        after = _restart_and_watch(stack)
        report("upstream_kill_lookup", mq_timeout_s=UPSTREAM_MQ_TIMEOUT_S,
               client_deadline_s=CLIENT_DEADLINE_S, starved=starved.error,
               down_ok=down.ok, down_error=down.error, down_latency_s=round(down.latency_s, 2),
               **after)
    finally:
        stack.close()
