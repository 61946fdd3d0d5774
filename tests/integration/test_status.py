"""`loadback status` against a real orchestrator's /metrics server after real loads against
the real daemon: every field the operator reads, in the table and in --json; exit 69 once
the server is gone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.orchestrator import LoadBackConfig, PrefixState
from lmcache_loadback.orchestrator.factory import create_orchestrator
from tests.conftest import CHUNK, kv_of, make_pool, same_kv
from tests.integration.test_orchestrator_daemon import wait_for

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1")


def loadback(*argv: str) -> subprocess.CompletedProcess:
    """The real command, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "lmcache_loadback.cli", *argv], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=60)


def test_status_of_a_running_orchestrator(live_daemon, capsys):
    cfg = LoadBackConfig.from_dict({
        "mp_port": live_daemon.port, "chunk_size": CHUNK,
        "mp_http_port": live_daemon.http_port, "l2": {"canary_interval_ms": 50},
        "heartbeat": {"interval_ms": 50},
        "metrics": {"enabled": True, "port": 0}})
    layout = KVLayout(num_layers=2, num_heads=4, head_dim=16, dtype=torch.float16,
                      chunk_size=CHUNK)
    pool = make_pool(layout, 1024)
    orch = create_orchestrator(cfg, layout=layout, kv_pool=pool)
    url = orch.metrics_server.url
    try:
        assert orch.wait_registered(20)
        for i in range(3):  # three real loads, byte-exact
            toks = list(range(1000 * (i + 1), 1000 * (i + 1) + 4 * CHUNK))
            src = torch.arange(i * 64, i * 64 + 4 * CHUNK)
            assert orch.store(f"s{i}", toks, src)
            orch.finish(f"s{i}")
            assert orch.match(f"r{i}", toks).tokens == 4 * CHUNK
            dst = torch.arange(512 + i * 64, 512 + i * 64 + 4 * CHUNK)
            res = orch.load_back(f"r{i}", dst)
            assert res.state == PrefixState.LOADED and same_kv(kv_of(pool, src), kv_of(pool, dst))
            orch.finish(f"r{i}")
        # One refusal: the engine could not allocate slots for a promised prefix.
        assert orch.match("x", list(range(1000, 1000 + 4 * CHUNK))).tokens == 4 * CHUNK
        assert orch.load_back("x", None).reason.value == "alloc_failed"
        orch.finish("x")
        assert wait_for(lambda: orch.pending_debts() == 0, 10)
        # the canary runs (mp_http_port) and idles: this daemon has no --l2-adapter
        assert wait_for(lambda: orch.l2_canary.checks >= 2, 30)  # a busy host: bounded

        r = loadback("status", "--url", url)
        assert r.returncode == 0, r.stderr
        out = r.stdout
        with capsys.disabled():
            print(f"\n$ loadback status --url {url}\n{out}")
        mode = orch.connector.transfer
        assert mode in ("shm", "pickle")
        for pattern in (
                rf"^loadback status of {re.escape(url)}$",
                rf"^  daemon +{re.escape(live_daemon.endpoint)} \(up; transfer setting auto\)$",
                rf"^  registration +epoch {orch.link.registered_epoch}$",
                r"^  breaker +closed$",
                rf"^  transfer mode +{mode}$",
                r"^  live prefixes +0$",
                r"^  owed releases +0$",
                r"^  lookup queue +0$",
                r"^  store queue +0 of 64$",
                r"^  fences dropped +0$",
                r"^  last refusal +alloc_failed \(\d+ s ago; 1 so far\)$",
                r"^  l2 canary +off \(l2.canary_interval_ms 0, no mp_http_port, or a daemon "
                r"without --l2-adapter\)$"):
            assert re.search(pattern, out, re.M), (pattern, out)

        r = loadback("status", "--url", url, "--json")
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        assert st["daemon"] == {"endpoint": live_daemon.endpoint, "transfer_setting": "auto",
                                "up": True, "refused": []}
        assert st["registration_epoch"] == orch.link.registered_epoch >= 0
        assert st["breaker"] == "closed" and st["transfer_mode"] == mode
        assert st["owed_releases"] == 0 and st["fences_dropped"] == 0
        assert st["last_refusal"]["reason"] == "alloc_failed"
    finally:
        orch.close()
    r = loadback("status", "--url", url, "--timeout-s", "2")
    assert r.returncode == 69 and url in r.stderr and r.stderr.count("\n") == 1
