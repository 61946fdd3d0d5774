"""The fleet demo's bookkeeping (`loadback demo --engine sglang --fleet`): what a phase counts
and when ours passes. The servers, daemons and Redis it drives run in the demo itself."""

from __future__ import annotations

from lmcache_loadback.harness.sglang.fleet_demo import PHASES, Phase, Sent, ours_ok, print_table
from lmcache_loadback.harness.sglang.server import Generation


def _gen(loaded: int, *, error: str | None = None, latency_s: float = 0.5) -> Generation:
    meta = {"cached_tokens_details": {"storage": loaded}}
    return Generation([1, 2], None if error else [7], meta, latency_s, error)


def _side(**phase_overrides) -> dict:
    phases = {}
    for key, _ in PHASES:
        ph = Phase(key, [Sent("B", _gen(144), True)], recovery_s=0.4)
        phases[key] = phase_overrides.get(key, ph).summary()
    return {"phases": phases, "b_first_request_hit": True,
            "daemon_holds_idle": {"A": {}, "B": {}}, "seconds": 100.0, "error": None}


def test_a_phase_counts_hits_errors_timeouts_and_outputs_that_differ():
    ph = Phase("redis_hung", [Sent("A", _gen(144), True), Sent("B", _gen(0), False),
                              Sent("A", _gen(0, error="timeout", latency_s=10.0), None),
                              Sent("B", _gen(0), None)])
    got = ph.summary()
    assert got == {"requests": 4, "hits": 1, "errors": 1, "timed_out": 1, "p50_s": 0.5,
                   "max_s": 10.0, "outputs_differ": 1, "recovery_s": None, "loadback": {}}


def test_ours_passes_only_with_every_invariant():
    assert ours_ok(_side())
    assert not ours_ok(_side(redis_hung=Phase("redis_hung", [Sent("A", _gen(0), False)])))
    assert not ours_ok(_side(redis_killed=Phase("redis_killed", [
        Sent("A", _gen(0, error="timeout"), None)])))
    assert not ours_ok(_side(redis_back=Phase("redis_back", [Sent("B", _gen(0), None)])))
    held = _side()
    held["daemon_holds_idle"] = {"A": {"read_locks": 2}, "B": {}}
    assert not ours_ok(held)
    unread = _side()
    unread["daemon_holds_idle"] = {}  # the side failed before it could ask
    assert not ours_ok(unread)
    cold = _side()
    cold["b_first_request_hit"] = False
    assert not ours_ok(cold)


def test_the_table_has_a_row_per_phase_and_a_column_group_per_side(capsys):
    print_table({"ours": _side(), "upstream": _side()})
    out = capsys.readouterr().out
    for _, label in PHASES:
        row = next(line for line in out.splitlines() if line.startswith(label))
        assert row.count("1/1") == 2, row
    assert "ours" in out and "upstream" in out


def test_ours_metrics_per_phase_are_printed_under_the_table(capsys):
    ours = _side()
    ours["phases"]["redis_hung"]["loadback"] = {"lookup miss": 4.0, "degraded lookup_timeout": 2.0}
    print_table({"ours": ours, "upstream": _side()})
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines()
               if line.strip().startswith("3. Redis hung") and "lookup" in line)
    assert "degraded lookup_timeout 2, lookup miss 4" in row, row
    assert "upstream, both servers' /metrics" not in out
