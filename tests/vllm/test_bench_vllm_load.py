"""`loadback bench vllm` at a tiny size: every contender runs against the real daemons, lands
byte-exact in vLLM's CPU paged layout, and the JSON carries the medians and ratios. Its own
read-back (the CPU kernel's reading of a block) is checked against PagedCPUView first.

Run: .venv-vllm/bin/python -m pytest -q tests/vllm/test_bench_vllm_load.py
"""

from __future__ import annotations

import json
import math
from argparse import Namespace

import pytest
import torch

from lmcache_loadback.connectors.kv_layout import KVPool
from lmcache_loadback.engines.vllm.paged import PagedCPUView
from lmcache_loadback.harness.bench import vllm_load


def test_read_back_is_the_kernels_reading():
    """write_tokens / landed_exact agree with PagedCPUView and see a single changed byte."""
    layout, bs, n = vllm_load.make_layout(layers=2, heads=4, head_dim=32), 16, 64
    g = torch.Generator().manual_seed(3)
    mk = lambda: torch.randn((n, 4, 32), generator=g).to(layout.dtype)  # noqa: E731
    ref = KVPool([mk(), mk()], [mk(), mk()])
    layers = [torch.zeros((10, 4, bs, 64), dtype=layout.dtype) for _ in range(2)]
    ids = [7, 2, 9, 4]
    vllm_load.write_tokens(layers, ids, ref, bs, layout)
    assert vllm_load.landed_exact(layers, ids, ref, bs, layout)
    view = PagedCPUView(layers, layout, bs, staging_tokens=n)
    view.from_blocks(ids, n)
    assert all(torch.equal(a[:n], b) for a, b in zip(view.pool.k_buffer, ref.k_buffer))
    assert all(torch.equal(a[:n], b) for a, b in zip(view.pool.v_buffer, ref.v_buffer))
    layers[1][9, 3, 5, 40] += 1  # one element of one block and head
    assert not vllm_load.landed_exact(layers, ids, ref, bs, layout)


@pytest.mark.daemon
@pytest.mark.timeout(120)
def test_bench_vllm_runs_every_contender_byte_exact(tmp_path):
    out = tmp_path / "vllm.json"
    rc = vllm_load.run(Namespace(samples=3, sizes=[512], block_size=16, json=str(out)))
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["byte_exact"] == {name: True for name in vllm_load.NAMES}
    assert res["layout"]["block_size"] == 16 and res["lmc_layout_hints"] == {"kv_layout": "HND"}
    (row,) = res["rows"]
    assert row["tokens"] == 512 and row["samples"] == 3
    for name in vllm_load.NAMES:
        assert len(row["samples_ms"][name]) == 3
        assert math.isfinite(row["median_ms"][name]) and row["median_ms"][name] > 0
        assert math.isfinite(row["gbps"][name]) and row["gbps"][name] > 0
        assert set(row["phases_median_ms"][name]) == set(vllm_load.PHASES)
    for key in ("ours_shm_vs_lmc_pickle", "ours_pickle_vs_lmc_pickle"):
        assert math.isfinite(row[key]) and row[key] > 0
