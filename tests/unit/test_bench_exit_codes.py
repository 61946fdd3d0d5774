"""`loadback bench core` exits 1 when a target is missed and 0 when all are met, as its
docstring says; the printed verdicts are the ones the exit code follows. The suites' figures
are replaced by fixed ones here (the real runs are tests/integration/test_bench_client.py
and `make bench`), so the judgement itself is what is pinned."""

from __future__ import annotations

import argparse
import collections
import json

import pytest

from orchestrator.tools.bench import core

MET = {"p2_overhead_ratio": 0.4, "p4_breaker_open_ratio": 0.02, "p5_scale_ratio": 1.0,
       "p3_match_p99_over_deadline_ms": 1.0, "p3_load_back_p99_over_deadline_ms": 1.0,
       "p6_paid_after_sockets_closed": 0, "lookup_deadline_ms": 20.0,
       "retrieve_deadline_ms": 50.0, "lmcache_client_mq_timeout_s": 0.5, "p6_deadline_ms": 50.0,
       "p6_calls_paid_full_deadline": 0, "p6_calls_after_kill": 10}


def _figures(over: dict):
    figures = collections.defaultdict(lambda: 1.0, {**MET, **over})
    return lambda *a, **k: figures


@pytest.mark.parametrize("over, rc", [
    ({}, 0),
    ({"p2_overhead_ratio": 1.5}, 1),
    ({"p3_load_back_p99_over_deadline_ms": 9.0}, 1),
    ({"p6_paid_after_sockets_closed": 2}, 1),
])
def test_bench_core_exit_code_follows_its_targets(monkeypatch, tmp_path, capsys, over, rc):
    for suite in ("p2_p4_p5", "p3", "p6"):
        monkeypatch.setattr(core, suite, _figures(over))
    out = tmp_path / "core.json"
    assert core.run(argparse.Namespace(samples=10, json=str(out))) == rc
    met = json.loads(out.read_text())["targets_met"]
    printed = capsys.readouterr().out
    for name, ok in met.items():
        assert f"{'MET ' if ok else 'MISS'} {name}" in printed
    assert all(met.values()) is (rc == 0)
