"""The L2 chaos verdict's arithmetic and the scenario checks, without a store (the runs
themselves are in tests/integration/test_chaos_subset.py)."""

from __future__ import annotations

import msgspec
import pytest

from lmcache_loadback.harness.chaos_judge import l2_signals
from lmcache_loadback.harness.chaos_l2 import RoundSamples, _calls
from lmcache_loadback.harness.chaos_scenario import Scenario, load_scenarios


def samples(reads: list[int], loads: list[int]) -> RoundSamples:
    s = RoundSamples()
    for i, (r, n) in enumerate(zip(reads, loads)):
        s.add(10.0 + i, n, r)
    return s


def test_reads_are_split_by_phase_and_empty_phases_left_out():
    s = samples(reads=[2, 5, 5, 5, 9, 12], loads=[1, 2, 2, 2, 3, 4])
    assert s.reads_by_phase([("before", 0), ("fault", 2), ("after", 4)]) == {
        "before": 5, "fault": 0, "after": 7}
    # a restart: the fault begins and ends at one round
    assert s.reads_by_phase([("before", 0), ("fault", 3), ("after", 3)]) == {
        "before": 5, "after": 7}


def test_l2_hit_again_needs_a_load_and_a_store_read_in_one_round():
    s = samples(reads=[2, 5, 5, 6, 9], loads=[1, 2, 3, 3, 4])
    # round 2 loaded (from L1: no read), round 3 read (no load), round 4 did both
    assert s.served_hit_after(2, t0=11.5) == pytest.approx(14.0 - 11.5)
    assert samples([1, 1, 1], [1, 2, 3]).served_hit_after(1, t0=10.0) is None


def test_get_calls_are_read_from_commandstats():
    stats = ("# Commandstats\r\ncmdstat_exists:calls=40,usec=9\r\n"
             "cmdstat_get:calls=17,usec=30,usec_per_call=1.76,rejected_calls=0\r\n")
    assert _calls(stats, "get") == 17
    assert _calls(stats, "set") == 0


@pytest.mark.parametrize("data, fix", [
    ({"fault": {"kind": "l2_kill"}}, "give the scenario an l2 section"),
    ({"fault": {"kind": "l2_shard_lost"}, "l2": {}}, "needs l2.shards: 3"),
    ({"l2": {"adapter": "resp", "shards": 3}}, "resp does not speak Redis Cluster"),
])
def test_an_l2_scenario_that_cannot_run_is_refused_naming_the_fix(data, fix):
    with pytest.raises(msgspec.ValidationError, match=fix):
        msgspec.convert({"name": "x", **data}, Scenario)


def test_scenario_l2_selects_every_shipped_l2_scenario_and_only_those():
    l2 = [s.name for s in load_scenarios("l2")]
    assert l2 and all(name.startswith("l2_") for name in l2)
    assert {s.name for s in load_scenarios("all") if s.l2 is not None} == set(l2)


def test_l2_signals_name_what_the_engines_metrics_said_of_the_store():
    snapshot = {"loadback_l2_canary_checks_total{result=ok}": 3.0,
                "loadback_l2_canary_checks_total{result=lost}": 0.0,
                "loadback_l2_stalls_total": 2.0, "loadback_l2_fast_misses_total": 40.0,
                "loadback_l2_state": 1.0, "loadback_lookups_total{result=hit}": 9.0}
    assert l2_signals(snapshot) == {"canary ok": 3, "stalls": 2, "fast misses": 40,
                                    "stalled at the end": 1}
