"""`loadback bench client` end to end: two real daemons, every contender, a JSON report."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from orchestrator.tools.bench import client

pytestmark = [pytest.mark.daemon]

HEADLINES = ("p1_ratio_same_mode", "p1_ratio_best", "p6_shm_vs_memcpy")


@pytest.mark.timeout(300)
def test_bench_client_writes_headlines_and_rows(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert client.run(argparse.Namespace(json=str(out), samples=3)) == 0
    report = json.loads(out.read_text())
    for key in HEADLINES:
        value = report[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, key
        assert isinstance(report["targets_met"][key], bool)
    rows = {row["tokens"]: row for row in report["rows"]}
    assert set(rows) == {256, 1024, 4096}
    for n, row in rows.items():
        assert row["bytes"] == n * 16384
        assert row["samples"] == 3
        for name in client.NAMES:
            assert row["median_ms"][name] > 0 and math.isfinite(row["median_ms"][name])
    printed = capsys.readouterr().out
    assert "p1_ratio_same_mode" in printed and ("MET" in printed)
