"""`loadback bench core` exits 1 when a target is missed and 0 when all are met, as its
docstring says; the printed verdicts are the ones the exit code follows. The suites' figures
are replaced by fixed ones here (the real runs are tests/integration/test_bench_client.py
and `make bench`), so the judgement itself is what is pinned."""

from __future__ import annotations

import argparse
import collections
import json

import pytest

from lmcache_loadback.harness.bench import core

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


# --- bench gpu (issue 17): no CUDA, a dropped contender and a missed target exit non-zero ---

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from lmcache_loadback.orchestrator.cli import main  # noqa: E402
from lmcache_loadback.harness.bench import gpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MET_GPU = {"p7_ratio": 0.95, "p7_ratio_1k": 0.8, "p7_vs_lmcache": 1.5}


def _gpu_result(dropped=None, **figures) -> dict:
    out = {**MET_GPU, **figures}
    return {**out, "dropped": dropped or {}, "wall_s": 1.0,
            "targets_met": {k: out[k] is not None and out[k] >= v
                            for k, v in gpu.TARGETS.items()}}


def test_bench_gpu_without_cuda_exits_69_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu, "run_sizes", lambda *a, **k: pytest.fail("ran without CUDA"))
    assert main(["bench", "gpu"]) == 69
    out = capsys.readouterr()
    assert out.err == "bench gpu needs a CUDA device; none found " \
        "(torch.cuda.is_available() is False)\n" and out.out == ""


def test_bench_gpu_console_exit_code_on_a_host_without_cuda():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1")
    r = subprocess.run([sys.executable, "-m", "lmcache_loadback.orchestrator.cli", "bench", "gpu"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 69, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [gpu.NO_CUDA]


@pytest.mark.parametrize("result, rc, lines", [
    (_gpu_result(), 0, []),
    (_gpu_result({"lmcache": "ImportError: cannot import name 'LMCacheMPConnector'"},
                 p7_vs_lmcache=None), 1,
     ["contender dropped: lmcache: ImportError: cannot import name 'LMCacheMPConnector'",
      "target missed: p7_vs_lmcache = -, target >= 1.3"]),
    (_gpu_result({"lmcache-p256": "proof at 1024 tokens: AssertionError: bytes differ"}), 1,
     ["contender dropped: lmcache-p256: proof at 1024 tokens: AssertionError: bytes differ"]),
    (_gpu_result(p7_ratio=0.5), 1, ["target missed: p7_ratio = 0.500, target >= 0.9"]),
])
def test_bench_gpu_verdict_names_each_drop_and_miss(result, rc, lines):
    assert gpu.verdict(result) == (rc, lines)


@pytest.mark.parametrize("result", [
    _gpu_result({"lmcache": "ImportError: no module named 'lmcache.c_ops'"}),
    _gpu_result(p7_ratio_1k=0.1),
])
def test_bench_gpu_run_exits_with_the_verdict(monkeypatch, tmp_path, capsys, result):
    """The exit code of `run` is its verdict over what `run_sizes` measured (replaced here:
    no GPU): 1 with the reasons printed, 0 for the same run with every target met."""
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu.torch.cuda, "current_device", lambda: 0)
    args = argparse.Namespace(samples=0, json=str(tmp_path / "gpu.json"))
    monkeypatch.setattr(gpu, "run_sizes", lambda *a, **k: result)
    assert gpu.run(args) == 1
    printed = capsys.readouterr().out
    assert printed.count("contender dropped: ") + printed.count("target missed: ") == 1
    for line in gpu.verdict(result)[1]:
        assert line in printed
    monkeypatch.setattr(gpu, "run_sizes", lambda *a, **k: _gpu_result())
    assert gpu.run(args) == 0


def test_bench_gpu_drop_records_which_contender_and_why(capsys):
    dropped = {}
    try:
        import lmcache_not_installed_here  # noqa: F401
    except ImportError as exc:
        gpu.drop(dropped, "lmcache", exc)
    assert dropped == {"lmcache": "ModuleNotFoundError: No module named "
                       "'lmcache_not_installed_here'"}
    assert "contender dropped: lmcache: ModuleNotFoundError" in capsys.readouterr().out
