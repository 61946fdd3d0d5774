"""Chaos `version_skew` through the real detection path: the fault proxy drops registration
but answers noop (what a daemon of another lmcache version does), and the orchestrator must
record VersionSkew, not a timeout; a daemon that answers nothing at all is not skew. Also:
the table and JSON report each scenario's worst overshoot past its deadline."""

from __future__ import annotations

import msgspec
import io
import json
from argparse import Namespace

import pytest

from lmcache_loadback.harness import chaos
from lmcache_loadback.harness.bench.common import progress_bar
from lmcache_loadback.harness.chaos import load_scenarios, print_results, run_scenario


@pytest.mark.daemon
@pytest.mark.timeout(300)
def test_version_skew_scenario_records_version_skew_then_recovers(capsys):
    (scn,) = load_scenarios("version_skew")
    assert scn.fault.from_start and scn.expect_logged == ["VersionSkew"]
    r = run_scenario(scn, 120)
    assert r.errors_logged.get("VersionSkew", 0) >= 1, r.errors_logged
    # Proven by the noop probe, not guessed from a registration that timed out.
    assert "DaemonTimeout:register_kv_cache_engine_driven_context" not in r.errors_logged
    assert not r.missing_errors and r.leaked == 0 and r.wrong_bytes == 0 and r.counters_ok, r
    assert r.recovery_s is not None and r.loaded > 0  # registered once the skew was lifted
    # The worst overshoot agrees with the hung count: a hung call ran past its deadline by more
    # than 5 ms (plus what the machine took from it, which may excuse a larger overshoot);
    # whether a loaded machine made a call overshoot is chaos's judgement, not this test's.
    assert r.worst_overshoot_ms is not None and (r.hung == 0 or r.worst_overshoot_ms > 5.0)
    print_results([r])
    header = capsys.readouterr().out.splitlines()[0]
    assert "worst over ms" in header


@pytest.mark.daemon
@pytest.mark.timeout(300)
def test_a_silent_daemon_is_not_reported_as_version_skew():
    (silent,) = load_scenarios("silent")
    scn = msgspec.structs.replace(silent, expect_logged=["VersionSkew"],
                                  fault=msgspec.structs.replace(silent.fault, from_start=True))
    r = run_scenario(scn, 60)
    assert r.missing_errors == ["VersionSkew"] and not r.ok
    assert "VersionSkew" not in r.errors_logged


def test_chaos_json_carries_the_worst_overshoot(tmp_path, monkeypatch):
    fake = chaos.Result(name="x", requests=2, hung=1, leaked=0, wrong_bytes=0, counters_ok=True,
                        p99_return_s=0.01, recovery_s=None, degraded={}, worst_overshoot_ms=7.25)
    monkeypatch.setattr(chaos, "load_scenarios", lambda which: [object()])
    monkeypatch.setattr(chaos, "run_scenario", lambda scn, requests, progress: fake)
    out = tmp_path / "c.json"
    assert chaos.run(Namespace(scenario="x", requests=0, json=str(out))) == 1  # hung: judged
    (row,) = json.loads(out.read_text())["scenarios"]
    assert row["worst_overshoot_ms"] == 7.25 and row["hung"] == 1


def test_progress_bar_in_a_log_writes_a_few_lines_not_a_frame_per_step():
    log = io.StringIO()  # not a TTY, like a CI log
    bar = progress_bar(500, "scenario", file=log)
    for _ in range(500):
        bar.update(1)
    bar.close()
    text = log.getvalue()
    assert "500/500" in text and text.count("\r") <= 3 and text.endswith("\n")
