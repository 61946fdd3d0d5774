"""`loadback tune` against a real daemon: a YAML the config loader accepts; a clear exit 2."""

from __future__ import annotations

import argparse
import time

import pytest

from connectors.daemon import DaemonProcess, free_port
from orchestrator.tools import tune
from orchestrator.config import LoadBackConfig

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(240)]


def _args(addr: str, out: str, requests: int = 3) -> argparse.Namespace:
    return argparse.Namespace(daemon=addr, out=out, prefill_tokens_per_s=10000.0,
                              requests=requests)


def test_tune_against_a_real_daemon_writes_a_loadable_config(tmp_path, capsys):
    d = DaemonProcess(chunk_size=16)
    try:
        d.start()
        out = tmp_path / "t.yaml"
        assert tune.run(_args(f"127.0.0.1:{d.port}", str(out))) == 0
    finally:
        d.stop()
    cfg = LoadBackConfig.from_yaml(out)
    assert (cfg.mp_host, cfg.mp_port, cfg.chunk_size) == ("127.0.0.1", d.port, 16)
    dl = cfg.deadlines
    assert dl.lookup_ms > 0 and dl.retrieve_base_ms > 0 and dl.retrieve_per_ki_token_ms >= 0
    assert dl.retrieve_max_ms >= dl.retrieve_base_ms and dl.retrieve_max_ms <= 30000
    assert 1 <= cfg.retries.max_attempts <= 4
    assert cfg.break_even.prefill_tokens_per_s == 10000.0
    assert cfg.break_even.initial_bandwidth_gbps > 0 and cfg.break_even.min_tokens >= 0
    text = out.read_text()
    assert text.startswith("# Tuned by `loadback tune`") and f"127.0.0.1:{d.port}" in text
    assert "4 layers x 8 heads x 128 head_dim float16" in text
    captured = capsys.readouterr()
    assert "recommended" in captured.out and "p99 lookup" in captured.out
    assert "] 12/12" in captured.err  # 4 sizes x 3 requests; the bar reaches the end


def test_tune_without_a_daemon_exits_2_quickly_naming_the_address(tmp_path, capsys):
    addr = f"127.0.0.1:{free_port()}"
    out = tmp_path / "t.yaml"
    t0 = time.monotonic()
    assert tune.run(_args(addr, str(out))) == 2
    assert time.monotonic() - t0 < 5
    err = capsys.readouterr().err
    assert addr in err and "fix:" in err
    assert not out.exists()


def test_tune_rejects_a_malformed_address(tmp_path, capsys):
    assert tune.run(_args("localhost", str(tmp_path / "t.yaml"))) == 64
    assert "HOST:PORT" in capsys.readouterr().err


def test_fit_is_least_squares_and_never_negative():
    a, b = tune.fit([(1.0, 3.0), (2.0, 5.0), (4.0, 9.0)])
    assert a == pytest.approx(1.0) and b == pytest.approx(2.0)
    assert tune.fit([(1.0, 5.0), (2.0, 4.0)]) == (4.5, 0.0)       # falling: flat at the mean
    a, b = tune.fit([(1.0, 1.0), (2.0, 3.0)])                     # negative intercept: origin
    assert a == 0.0 and b == pytest.approx(7 / 5)
    assert tune.fit([(2.0, 4.0)]) == (0.0, 2.0)                   # one point: proportional


def test_tune_stops_at_its_wall_budget_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tune, "WALL_BUDGET_S", 0.0)
    out = tmp_path / "t.yaml"
    d = DaemonProcess(chunk_size=16)
    try:
        d.start()
        t0 = time.monotonic()
        rc = tune.run(_args(f"127.0.0.1:{d.port}", str(out), requests=50))
        assert time.monotonic() - t0 < 30
    finally:
        d.stop()
    assert rc == 1 and not out.exists()  # nothing measured: nothing recommended
    captured = capsys.readouterr()
    assert "STOPPED EARLY" in captured.out and "0 s budget" in captured.out
    assert f"127.0.0.1:{d.port}" in captured.err
