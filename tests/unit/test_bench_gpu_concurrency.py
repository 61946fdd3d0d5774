"""`loadback bench gpu --concurrency`'s CPU-side figures (harness/bench/gpu_concurrency.py):
the grid, prompts that share no chunk, and makespan / ready-time percentiles / GB/s / the bound
of N concurrent pinned copies, from ready times given here."""

from __future__ import annotations

import pytest

from lmcache_loadback.harness.bench.gpu_concurrency import GRID_N, GRID_S, Concurrent, \
    distinct_prefixes


def test_the_grid_is_n_1_4_8_16_by_1k_4k_16k():
    assert GRID_N == (1, 4, 8, 16) and GRID_S == (1024, 4096, 16384)


def test_prefixes_of_concurrent_requests_share_no_chunk():
    ps = distinct_prefixes(16, 1024, 256, seed=3)
    assert len(ps) == 16 and all(len(p) == 1024 for p in ps)
    assert len({tuple(p[:256]) for p in ps}) == 16
    assert distinct_prefixes(16, 1024, 256, seed=3) == ps  # the same run twice
    with pytest.raises(ValueError, match="whole number of chunks"):
        distinct_prefixes(2, 1000, 256)


def test_figures_of_four_requests_against_four_concurrent_copies():
    mib128 = 128 << 20
    c = Concurrent(start_s=10.0, ready_s=[10.010, 10.020, 10.040, 10.030], bytes_each=mib128)
    f = c.figures(copy_makespan_s=0.036)
    assert f["n"] == 4 and f["makespan_ms"] == pytest.approx(40.0)
    assert f["p50_ready_ms"] == pytest.approx(25.0) and f["p99_ready_ms"] == pytest.approx(39.7)
    assert f["gbps"] == pytest.approx(4 * mib128 / 0.040 / 1e9)
    assert f["bound_ms"] == pytest.approx(36.0) and f["bound_ratio"] == pytest.approx(0.9)
    assert "bound_ms" not in c.figures()
    with pytest.raises(ValueError, match="ready time at or after the start"):
        Concurrent(start_s=10.0, ready_s=[9.9], bytes_each=1).figures()
