"""`loadback bench gpu --concurrency`'s CPU-side figures (harness/bench/gpu_concurrency.py):
the grid, prompts that share no chunk, and makespan / ready-time percentiles / GB/s / the bound
of N concurrent pinned copies, from ready times given here."""

from __future__ import annotations

import pytest

from lmcache_loadback.harness.bench.common import median
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


# --- the cell's medians, the judged targets and the verdict (no daemon, no device) ----------

from lmcache_loadback.cli import main  # noqa: E402
from lmcache_loadback.harness.bench import gpu_concurrency as gc  # noqa: E402


def _steps(makespans_ms, n=4, each=1 << 20):
    """Steps whose requests are ready evenly up to each makespan."""
    return [Concurrent(0.0, [m / 1e3 * (i + 1) / n for i in range(n)], each) for m in makespans_ms]


def _row(ours_ms, lmc_ms, tuned_ms, copies_ms, n=8, tokens=4096):
    return gc.cell_row(n, tokens, {"ours": _steps(ours_ms, n), "copies": _steps(copies_ms, n),
                                   "lmcache-p256": _steps(lmc_ms, n),
                                   "lmcache-p256-tuned": _steps(tuned_ms, n)},
                       {"ours": {"matched_ms": 3.0}})


def test_a_cell_takes_medians_over_repeats_and_holds_ours_against_the_bound_and_lmcache():
    r = _row([10.0, 12.0, 11.0], [30.0, 31.0, 29.0], [26.0, 28.0, 27.0], [9.0, 9.5, 9.9])
    ours = r["contenders"]["ours"]
    assert ours["makespan_ms"] == pytest.approx(11.0) and ours["repeats"] == 3
    assert ours["p50_ready_ms"] == pytest.approx(median([m * 4.5 / 8 for m in (10, 12, 11)]))
    assert ours["gbps"] == pytest.approx(8 * (1 << 20) / 0.011 / 1e9)
    assert r["bound_ms"] == pytest.approx(9.5) and ours["bound_ratio"] == pytest.approx(9.5 / 11)
    assert ours["matched_ms"] == 3.0
    # against the faster LMCache setting (the tuned one here), makespan and p99 alike
    assert r["vs_lmcache"] == pytest.approx(27.0 / 11.0)
    tuned_p99 = r["contenders"]["lmcache-p256-tuned"]["p99_ready_ms"]
    assert r["p99_vs_lmcache"] == pytest.approx(tuned_p99 / ours["p99_ready_ms"])
    # the most any client could reach: the faster LMCache setting over the bound
    assert r["lmcache_vs_bound"] == pytest.approx(27.0 / 9.5)


def test_the_verdict_says_when_the_lmcache_target_is_beyond_the_link(capsys):
    """LMCache at 1.15x the copies' makespan: no client can be 1.2x faster than it."""
    rows = [_row([10.0], [11.5], [12.0], [10.0], n=n, tokens=s) for n in (8, 16)
            for s in (4096, 16384)]
    figures = gc.judged(rows, cuda=True)
    assert figures["conc_vs_lmcache_ceiling"] == pytest.approx(1.15)
    gc.print_verdict(figures, gc.targets_met(figures), cuda=True)
    out = capsys.readouterr().out
    assert "conc_vs_lmcache is out of reach on this card" in out and "reach 1.150" in out
    roomy = gc.judged([_row([10.0], [30.0], [28.0], [9.5], n=8, tokens=4096)], cuda=True)
    gc.print_verdict(roomy, gc.targets_met(roomy), cuda=True)
    assert "out of reach" not in capsys.readouterr().out


@pytest.mark.parametrize("ours_ms, met", [([10.0], {"conc_bound_ratio": True,
                                                     "conc_vs_lmcache": True,
                                                     "conc_p99_vs_lmcache": True}),
                                          ([25.0], {"conc_bound_ratio": False,
                                                    "conc_vs_lmcache": False,
                                                    "conc_p99_vs_lmcache": True})])
def test_targets_are_the_worst_over_the_judged_cells_on_cuda_only(ours_ms, met):
    rows = [_row(ours_ms, [30.0], [28.0], [9.5], n=n, tokens=s)
            for n in (4, 8, 16) for s in (1024, 4096, 16384)]
    rows[0]["contenders"]["ours"]["bound_ratio"] = 0.1  # N=4: not judged
    figures = gc.judged(rows, cuda=True)
    assert figures["judged_cells"] == [[8, 4096], [8, 16384], [16, 4096], [16, 16384]]
    assert gc.targets_met(figures) == met
    assert figures["conc_bound_ratio"] == pytest.approx(9.5 / ours_ms[0])
    cpu = gc.judged(rows, cuda=False)
    assert cpu["judged_cells"] == [] and gc.targets_met(cpu) == {}


def test_verdict_names_each_drop_and_each_missed_target():
    from lmcache_loadback.harness.bench.gpu_concurrency_run import verdict
    ok = {"dropped": {}, "targets_met": {"conc_bound_ratio": True}, "conc_bound_ratio": 0.95}
    assert verdict(ok) == (0, [])
    assert verdict({**ok, "targets_met": {}}) == (0, [])  # nothing judged (CPU)
    bad = {"dropped": {"lmcache-p256": "setup: boom"}, "conc_vs_lmcache": 1.1,
           "targets_met": {"conc_bound_ratio": True, "conc_vs_lmcache": False}}
    assert verdict(bad) == (1, ["contender dropped: lmcache-p256: setup: boom",
                                "target missed: conc_vs_lmcache = 1.100, target >= 1.2"])
    short = {**ok, "rows": [{"n": 8, "tokens": 4096, "missed": {"ours": {
        "steps": 2, "first": "timing at 8 x 4096: 1 of 8 requests got less"}}}]}
    assert verdict(short) == (1, ["ours missed 2 step(s) at 8 x 4k: timing at 8 x 4096: 1 of "
                                  "8 requests got less"])


def test_the_byte_exact_check_names_a_request_whose_bytes_differ():
    import torch

    from lmcache_loadback.harness.bench.gpu_concurrency_steps import Workload
    from lmcache_loadback.harness.bench.gpu_contenders import make_pool
    from lmcache_loadback.harness.bench.gpu_concurrency_run import CPU_LAYOUT
    src, dst = make_pool(16, torch.device("cpu"), False, CPU_LAYOUT), \
        make_pool(64, torch.device("cpu"), False, CPU_LAYOUT)
    w = Workload([[1] * 16, [2] * 16], src)  # the source holds one prompt at a time
    slots = [torch.arange(32, 48), torch.arange(48, 64)]
    for i in range(2):
        src_slots = w.fill(i)
        for a, d in zip([*src.k_buffer, *src.v_buffer], [*dst.k_buffer, *dst.v_buffer]):
            d[slots[i]] = a[src_slots]
    assert not torch.equal(dst.k_buffer[0][32:48], dst.k_buffer[0][48:64])  # own bytes each
    w.check("ours", dst, slots, 2, 16)
    dst.v_buffer[3][50] += 1  # one row of request 1's last V layer
    with pytest.raises(AssertionError, match="request 1 of 2 landed other bytes"):
        w.check("ours", dst, slots, 2, 16)


@pytest.mark.parametrize("argv, message", [
    (["bench", "gpu", "--tokens", "1k"], "--tokens applies to bench gpu --concurrency only"),
    (["bench", "gpu", "--device", "cpu"], "--device applies to bench gpu --concurrency only"),
    (["bench", "core", "--concurrency", "4"], "--concurrency applies to bench gpu only"),
    (["bench", "gpu", "--concurrency", "4", "--tokens", "1000"],
     "argument --tokens: 1000 is not a positive multiple of 256"),
    (["bench", "gpu", "--concurrency", "0"], "argument --concurrency: 0 is not a positive"),
])
def test_concurrency_flags_out_of_place_exit_64_before_anything_runs(capsys, argv, message):
    with pytest.raises(SystemExit) if "argument" in message else _no_raise() as raised:
        rc = main(argv)
    code = raised.value.code if raised is not None else rc
    assert code == 64 and message in capsys.readouterr().err


class _no_raise:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_each_daemons_l1_holds_the_grid_under_its_eviction_watermark():
    from lmcache_loadback.harness.bench.gpu_concurrency_run import L1_WATERMARK, LAYOUT, l1_gb
    data_gb = 16 * 4096 * LAYOUT.bytes_per_token / 2**30
    assert l1_gb(LAYOUT, 16, 4096) * L1_WATERMARK > data_gb  # none of it evicted


def test_lmcache_daemons_run_one_a_round_only_when_three_do_not_fit():
    from lmcache_loadback.harness.bench.gpu_concurrency_run import daemon_rounds
    assert daemon_rounds(True, all_fit=True) == [("lmcache-p256", "lmcache-p256-tuned")]
    assert daemon_rounds(True, all_fit=False) == [("lmcache-p256",), ("lmcache-p256-tuned",)]
    assert daemon_rounds(False, all_fit=False) == [()]


def test_rounds_merge_into_one_row_each_lmcache_judged_against_ours_of_its_own_round():
    from lmcache_loadback.harness.bench.gpu_concurrency_run import merge_rounds, verdict
    n, s = 16, 16384

    def row(ours, copies, lmc_name, lmc):
        return gc.cell_row(n, s, {"ours": _steps(ours, n), "copies": _steps(copies, n),
                                  lmc_name: _steps(lmc, n)}, {})
    # round 1: LMCache shipped 1.5x ours; round 2 (ours slower that round): tuned 1.25x ours
    r1 = row([100.0], [92.0], "lmcache-p256", [150.0])
    r2 = row([120.0], [95.0], "lmcache-p256-tuned", [150.0])
    r2["missed"] = {"ours": {"steps": 1, "first": "timing at 16 x 16384: short"}}
    (m,) = merge_rounds([[r1], [r2]])
    assert set(m["contenders"]) == {"ours", "copies", "lmcache-p256", "lmcache-p256-tuned"}
    assert m["contenders"]["ours"]["makespan_ms"] == pytest.approx(100.0)  # round 1's ours
    assert m["contenders"]["ours"]["bound_ratio"] == pytest.approx(0.92)
    # 150/120 of round 2, not 150/100 across rounds
    assert m["vs_lmcache"] == pytest.approx(1.25)
    assert m["lmcache_vs_bound"] == pytest.approx(150.0 / 95.0)  # the worse round's
    assert [len(x["contenders"]) for x in m["rounds"]] == [3, 3]
    assert "ours (round 2)" in m["missed"]
    code, why = verdict({"dropped": {}, "targets_met": {}, "rows": [m]})
    assert code == 1 and why[0].startswith("ours (round 2) missed 1 step(s) at 16 x 16k")
    assert merge_rounds([[r1]]) == [r1]  # one round: its rows as they are


def test_call_figures_give_each_ops_median_call_and_calls_per_step():
    from lmcache_loadback.harness.bench.gpu_concurrency_run import call_figures
    f = call_figures([{"lookup": [0.001, 0.003], "prepare_retrieve": [0.004]},
                      {"lookup": [0.002, 0.002], "prepare_retrieve": [0.006]},
                      {"lookup": [0.004, 0.005]}])
    assert f["lookup"] == {"median_ms": pytest.approx(2.5), "per_step": 2}
    assert f["prepare_retrieve"] == {"median_ms": pytest.approx(5.0), "per_step": 1}
