"""`loadback bench gpu --concurrency --device cpu` end to end on a real daemon: ours through
the SGLang backend's calls and N copies, each proven byte-exact per cell before its timed
steps, then the cell's figures, the table and the JSON exactly as `run` wrote them. LMCache's
contenders are left out here (its SGLang connector cannot register a CPU pool with lmcache
0.5.6, so a CPU run drops them after a registration timeout; the device run has them)."""

from __future__ import annotations

import argparse
import functools
import json

import pytest

from lmcache_loadback.harness.bench import gpu_concurrency_run as run_mod

pytestmark = [pytest.mark.daemon]


@pytest.mark.timeout(240)
def test_bench_gpu_concurrency_on_cpu_proves_times_and_reports_each_cell(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_mod, "run_grid", functools.partial(run_mod.run_grid, lmcache=False))
    out = tmp_path / "conc.json"
    rc = run_mod.run(argparse.Namespace(concurrency=[1, 4], tokens=[1024], device="cpu",
                                        samples=2, json=str(out)))
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert rc == 0 and report["dropped"] == {} and "partial" not in report
    assert report["run"]["grid"] == {"n": [1, 4], "tokens": [1024]}
    assert report["device"] == "cpu" and report["layout"]["bytes_per_token"] == 2048
    assert [(r["n"], r["tokens"]) for r in report["rows"]] == [(1, 1024), (4, 1024)]
    for r in report["rows"]:
        c = r["contenders"]
        assert set(c) == {"ours", "ours-pipelined", "copies"}
        for name, m in c.items():
            assert m["repeats"] == 2 and len(m["makespan_samples_ms"]) == 2
            assert 0 < m["p50_ready_ms"] <= m["p99_ready_ms"] <= m["makespan_ms"] + 1e-9
            assert m["gbps"] == pytest.approx(r["n"] * 1024 * 2048 / m["makespan_ms"] * 1e3 / 1e9)
        assert r["bound_ms"] == pytest.approx(c["copies"]["makespan_ms"])
        assert c["ours"]["bound_ratio"] == pytest.approx(r["bound_ms"] / c["ours"]["makespan_ms"])
        for k in ("ours", "ours-pipelined"):
            assert 0 < c[k]["matched_ms"] <= c[k]["makespan_ms"]
        # several LOOKUP threads side by side with one: the ratios of their own medians
        assert r["pipelined_match_ratio"] == pytest.approx(
            c["ours"]["matched_ms"] / c["ours-pipelined"]["matched_ms"])
        assert r["pipelined_makespan_ratio"] == pytest.approx(
            c["ours"]["makespan_ms"] / c["ours-pipelined"]["makespan_ms"])
    # no judged cell on a CPU device: no target judged, and the run says so
    assert report["judged_cells"] == [] and report["targets_met"] == {}
    assert "targets not judged: a CPU device" in printed
    for r in report["rows"]:  # one table line per cell and contender
        assert any(line.split()[:3] == [str(r["n"]), "1k", "ours"] for line in printed.splitlines())
    assert f"wrote {out}" in printed
