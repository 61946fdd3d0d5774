"""A daemon restarted behind something that keeps our connection open (a proxy, a load
balancer) is noticed by the calls it drops, whichever they are.

The connection's epoch cannot move when the socket we hold never closed. lmcache 0.5.6 then
drops the transfers of an instance it never registered without an answer. A rank whose only
calls are stores (a TP rank that is not the leader sends no LOOKUP) saw only store timeouts;
those did not make the registration suspect, so that rank never re-registered, its stores
were dropped for good, and the leader's LOOKUP (which needs every rank's shard) never hit
again: `tests/sglang/e2e/test_tp_server.py` saw no hit for 30 s after a restart.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.testing.fault_proxy import FaultProxy
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator import LoadBackConfig, LoadBackOrchestrator
from tests.conftest import CHUNK, make_pool
from tests.integration.test_orchestrator_daemon import wait_for

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(120)]


def test_a_store_dropped_by_a_restarted_daemon_re_registers(layout, tmp_path):
    d = DaemonProcess(chunk_size=CHUNK, log_dir=str(tmp_path)).start()
    proxy = FaultProxy(d.endpoint).start()
    cfg = LoadBackConfig.from_dict({
        "mp_port": proxy.port, "chunk_size": CHUNK,
        "deadlines": {"store_ms": 300, "control_ms": 200},
        # No ping falls between the kill and the new daemon: only the store can tell.
        "heartbeat": {"interval_ms": 600_000},
        "breaker": {"consecutive_failures": 50, "cooldown_ms": 50, "cooldown_max_ms": 200},
    })
    conn = LMCacheMPConnector(proxy.endpoint, layout, connect_timeout_s=0.5)
    pool = make_pool(layout, 1024)
    orch = LoadBackOrchestrator(cfg, conn, kv_pool=pool)
    try:
        assert orch.wait_registered(10)
        epoch, registered = conn.epoch, orch.link.registered_epoch
        d.kill()
        d.start()  # the same port; the proxy keeps our connection, so the epoch stays
        toks = [(7 * i) % 50_000 for i in range(2 * CHUNK)]
        # The first store goes to a daemon that never registered us: dropped unanswered.
        assert not orch.store("first", toks, torch.arange(2 * CHUNK))
        orch.finish("first")
        assert conn.epoch == epoch and orch.link.registered_epoch == registered
        # That timeout makes the registration suspect and wakes the heartbeat: a store
        # goes through again without waiting for the next ping (ten minutes away).
        n = iter(range(1000))

        def stored() -> bool:
            rid = f"again-{next(n)}"
            ok = orch.store(rid, toks, torch.arange(2 * CHUNK))
            orch.finish(rid)
            return ok
        assert wait_for(stored, 10), "the orchestrator never re-registered with the new daemon"
        assert orch.match("hit", toks).tokens == 2 * CHUNK
        orch.finish("hit")
    finally:
        orch.close()
        proxy.close()
        d.stop()
