"""close() against a hung daemon returns within `deadlines.close_ms`, whatever it owes.

The real daemon is stopped (SIGSTOP) with many prefixes marked: closing releases each one
(a lock free and a session end apiece). Paying them one by one, each within control_ms,
made shutdown last debts x control_ms (measured before the fix: 30 prefixes, 6.9 s against
a 0.6 s budget); now the first timeout stops the paying, and what is left is counted
dropped with one WARNING (the daemon's TTLs release it).
"""

from __future__ import annotations

import logging

import pytest
import torch

from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator import LoadBackConfig, LoadBackOrchestrator
from lmcache_loadback.testing.os_delay import OsDelay
from tests.conftest import CHUNK, make_pool

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(180)]

PREFIXES = 30
CLOSE_MS = 600
SLACK_S = 0.05


def test_close_against_a_hung_daemon_returns_within_its_budget_and_counts_what_it_dropped(
        live_daemon, layout, caplog):
    d = live_daemon
    cfg = LoadBackConfig.from_dict({
        "mp_port": d.port, "chunk_size": CHUNK, "transfer": "pickle",
        "deadlines": {"lookup_ms": 2000, "control_ms": 200, "close_ms": CLOSE_MS},
        "heartbeat": {"interval_ms": 50}})
    conn = LMCacheMPConnector(d.endpoint, layout, transfer="pickle", connect_timeout_s=0.2)
    orch = LoadBackOrchestrator(cfg, conn, kv_pool=make_pool(layout, 256))
    try:
        assert orch.wait_registered(10)
        toks = list(range(4 * CHUNK))
        assert orch.store("s", toks, torch.arange(len(toks)))
        orch.finish("s")
        for i in range(PREFIXES):
            assert orch.match(f"r{i}", toks).tokens == len(toks)
        d.pause()
        caplog.set_level(logging.WARNING, logger="loadback")
        with OsDelay() as delay:
            orch.close()
        assert delay.took_s < CLOSE_MS / 1000 + SLACK_S + delay.seconds, delay.describe()
        dropped = orch.link.closed_dropped
        assert dropped == 2 * PREFIXES  # each prefix's lock free and session end
        snap = orch.metrics.snapshot()
        assert sum(v for k, v in snap.items()
                   if k.startswith("loadback_releases_failed_total")) == dropped
        warned = [r for r in caplog.records if "not paid at close" in r.getMessage()]
        assert len(warned) == 1 and f"{dropped} release(s)" in warned[0].getMessage()
    finally:
        d.resume()
        orch.close()
