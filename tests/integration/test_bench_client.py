"""`loadback bench client` end to end: two real daemons, every contender, a JSON report whose
headlines follow from its rows, printed verdicts that follow from the figures, and an exit
code that follows from the gated targets."""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest

from lmcache_loadback.harness.bench import client

pytestmark = [pytest.mark.daemon]

VERDICT = re.compile(r"^(\w+)\s+=\s+([\d.]+)\s+target (<=|>=) ([\d.]+)\s+(MET|NOT MET)\b", re.M)


def _met(value: float, op: str, bar: float) -> bool:
    return value <= bar if op == "<=" else value >= bar


@pytest.mark.timeout(300)
def test_bench_client_verdicts_and_exit_code_follow_from_its_measurements(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = client.run(argparse.Namespace(json=str(out), samples=3))
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out

    rows = {row["tokens"]: row for row in report["rows"]}
    assert set(rows) == {256, 1024, 4096}
    for n, row in rows.items():
        assert row["bytes"] == n * 16384 and row["samples"] == 3
        ms = row["median_ms"]
        for name in client.NAMES:
            assert ms[name] > 0 and math.isfinite(ms[name]), (n, name)
        assert row["ratio_ours_over_lmc_pickle"] == pytest.approx(ms["ours-pickle"] / ms["lmc-pickle"])
        assert row["ratio_ours_over_lmc_shm"] == pytest.approx(ms["ours-shm"] / ms["lmc-shm"])
        assert row["ours_shm_vs_copy_bytes_per_s"] == pytest.approx(ms["copy"] / ms["ours-shm"])
    # Each headline is the documented aggregate of the rows.
    assert report["p1_ratio_same_mode"] == pytest.approx(max(
        max(r["ratio_ours_over_lmc_pickle"], r["ratio_ours_over_lmc_shm"]) for r in rows.values()))
    assert report["p1_ratio_best"] == pytest.approx(max(
        r["ratio_ours_shm_over_lmc_pickle"] for n, r in rows.items() if n >= 1024))
    assert report["p6_shm_vs_memcpy"] == pytest.approx(rows[4096]["ours_shm_vs_copy_bytes_per_s"])

    verdicts = {m[0]: m for m in VERDICT.findall(printed)}
    assert set(verdicts) == set(client.TARGETS)
    for key, (op, bar) in client.TARGETS.items():
        _, value, p_op, p_bar, word = verdicts[key]
        assert (p_op, float(p_bar)) == (op, bar)
        assert float(value) == pytest.approx(report[key], abs=5e-4)
        met = _met(report[key], op, bar)  # the verdict follows from the figure, "NOT MET" too
        assert report["targets_met"][key] is met
        assert word == ("MET" if met else "NOT MET"), (key, report[key])
    assert report["gated"] == list(client.GATED)
    assert rc == (0 if all(report["targets_met"][k] for k in client.GATED) else 1)
