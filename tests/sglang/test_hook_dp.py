"""Data parallelism (`--dp-size N`): every replica is a scheduler process of its own whose
TP ranks start at 0, so with `metrics.enabled` each must serve on a port of its own; and a
port that cannot be bound never stops the scheduler from starting. Built the way SGLang
builds the backend (`build_cache(TreeCacheBuildContext)`, the replica's dp rank in the
process the way SGLang's router passes it); no daemon (a degraded start is enough here).
"""

from __future__ import annotations

import logging
import socket
import urllib.request

from lmcache_loadback.engines.sglang import build_cache
from lmcache_loadback.testing.daemon import free_port

from .test_hook_behaviour import build_context


def _yaml(tmp_path, metrics_port: int):
    cfg = tmp_path / "loadback.yaml"
    cfg.write_text(f"mp_host: 127.0.0.1\nmp_port: {free_port()}\nchunk_size: 16\n"
                   f"metrics:\n  enabled: true\n  port: {metrics_port}\n")
    return str(cfg)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_each_dp_replica_serves_metrics_on_its_own_port(tmp_path, monkeypatch):
    base = free_port()
    cfg = _yaml(tmp_path, base)
    caches = []
    try:
        for dp in (0, 1):  # two replicas' schedulers, each TP rank 0 of its own group
            monkeypatch.setenv("SGLANG_DP_RANK", str(dp))
            caches.append(build_cache(build_context(cfg)))
        ports = [c.orch.metrics_server.port for c in caches]
        assert ports == [base, base + 1]
        for port in ports:
            assert "loadback_config_generation" in _scrape(port)
    finally:
        for c in caches:
            c.close()


def test_metrics_port_taken_starts_without_the_metrics_server(tmp_path, caplog):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        with caplog.at_level(logging.ERROR, logger="loadback"):
            cache = build_cache(build_context(_yaml(tmp_path, port)))
        try:
            assert getattr(cache.orch, "metrics_server", None) is None
            errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
            assert len(errors) == 1, errors
            assert str(port) in errors[0] and "metrics.port" in errors[0]
        finally:
            cache.close()
    finally:
        taken.close()
