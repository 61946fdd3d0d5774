"""`loadback bench l2`'s arithmetic and verdicts on fixed samples: medians in ms, a miss
costing its LOOKUP plus the modelled recompute, ratios to break-even's, and the exit code
following the printed verdicts (the traffic itself needs two daemons and redis: `loadback
bench l2` runs it)."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from lmcache_loadback.harness.bench import l2_wait
from lmcache_loadback.harness.bench.l2_wait import Sample, summarize, verdicts


def _samples(fixed_hits: int, base_hits: int = 3) -> list[Sample]:
    out = []
    for i in range(3):  # 16k tokens: unlimited loads all, the others `*_hits` of 3
        out.append(Sample(16384, "break-even", 0.040, 0.020) if i < base_hits
                   else Sample(16384, "break-even", 0.200, None))
        out.append(Sample(16384, "unlimited", 0.040 + 0.001 * i, 0.020))
        out.append(Sample(16384, "fixed-50ms", 0.030, 0.020) if i < fixed_hits
                   else Sample(16384, "fixed-50ms", 0.050, None))
    return out


def test_a_miss_costs_its_lookup_and_the_recompute_and_ratios_are_to_break_even():
    rows = {r["contender"]: r for r in summarize(_samples(fixed_hits=1), 10000.0)}
    base, fixed = rows["break-even"], rows["fixed-50ms"]
    assert (base["hits"], fixed["hits"], rows["unlimited"]["hits"]) == (3, 1, 3)
    assert base["ready_ms"] == pytest.approx(60.0)
    # two misses: 50 ms LOOKUP + 16384 tokens at 10k tokens/s = 1688.4 ms; the median
    assert fixed["ready_ms"] == pytest.approx(50.0 + 1638.4)
    assert fixed["lookup_ms"] == pytest.approx(50.0)
    assert fixed["loaded_ms"] == pytest.approx(50.0)  # the one hit: 30 + 20 ms
    assert fixed["hits_vs_base"] == pytest.approx(1 / 3)
    assert fixed["ready_vs_base"] == pytest.approx(1688.4 / 60.0)
    assert rows["unlimited"]["ready_vs_base"] == pytest.approx(61.0 / 60.0)


@pytest.mark.parametrize("fixed_hits, base_hits, rc", [(1, 3, 0), (3, 3, 0), (3, 2, 1)])
def test_the_exit_code_follows_the_printed_verdicts(monkeypatch, tmp_path, capsys, fixed_hits,
                                                    base_hits, rc):
    monkeypatch.setattr(l2_wait, "measure", lambda *a, **k: _samples(fixed_hits, base_hits))
    out = tmp_path / "l2.json"
    assert l2_wait.run(argparse.Namespace(samples=3, json=str(out), adapter="resp")) == rc
    printed = capsys.readouterr().out
    met = json.loads(out.read_text())["targets_met"]
    for name, ok in met.items():
        assert f"{'MET ' if ok else 'MISS'} {name}" in printed
    assert all(met.values()) is (rc == 0)
    assert re.search(rf"fixed-50ms +{fixed_hits}/3 ", printed)
    assert re.search(rf"break-even +{base_hits}/3 ", printed)


def test_fewer_break_even_hits_than_the_fixed_deadline_is_a_miss():
    samples = [Sample(1024, "break-even", 0.05, None), Sample(1024, "fixed-50ms", 0.01, 0.01),
               Sample(1024, "unlimited", 0.01, 0.01)]
    got = verdicts(summarize(samples))
    assert got == {"break_even_hits_ge_fixed_50ms_1024": False, "unlimited_hits_all_1024": True}
    unlimited_missed = samples[:2] + [Sample(1024, "unlimited", 0.01, None)]
    assert verdicts(summarize(unlimited_missed))["unlimited_hits_all_1024"] is False
