"""`--dp-size 2` on a real SGLang 0.5.23 server (CPU) with `metrics.enabled`: two replicas,
each a scheduler whose TP rank is 0, each serving its own metrics port (`metrics.port` and
`metrics.port + 1`). Before, both bound `metrics.port` and the second replica's scheduler
died at start ("Rank 0 scheduler died during initialization"). Kept to one server and one
request (a start is 1-3 min on 2 cores). No daemon: a degraded start is enough here.
"""

from __future__ import annotations

import sys
import urllib.request

import pytest

from lmcache_loadback.harness.sglang.server import SGLangServer, write_loadback_yaml
from lmcache_loadback.testing.daemon import free_port

pytestmark = [pytest.mark.timeout(600)]


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_each_dp_replica_serves_its_own_metrics_port(tmp_path):
    base = free_port()
    cfg = write_loadback_yaml(tmp_path / "loadback.yaml", free_port(), chunk_size=16,
                              overrides=f"metrics:\n  enabled: true\n  port: {base}\n")
    server = SGLangServer(python=sys.executable, lmcache_config=cfg, backend="loadback",
                          extra_args=["--dp-size", "2"], log_path=tmp_path / "server.log",
                          # SGLang on CPU: one core binding per rank (dp_size * tp_size)
                          extra_env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
    server.start(timeout_s=420)
    try:
        out = server.generate(list(range(100, 140)), max_new_tokens=2)
        assert out.ok, out.error
        for port in (base, base + 1):
            assert "loadback_config_generation" in _scrape(port), port
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    assert "metrics server not started" not in log
