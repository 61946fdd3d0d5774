"""A daemon restarted behind something that keeps our connection open (a proxy, a load
balancer) is noticed by the calls it drops, whichever they are.

The connection's epoch cannot move when the socket we hold never closed. lmcache 0.5.6 then
drops the transfers of an instance it never registered without an answer. A rank whose only
calls are stores (a TP rank that is not the leader sends no LOOKUP) saw only store timeouts;
those did not make the registration suspect, so that rank never re-registered, its stores
were dropped for good, and the leader's LOOKUP (which needs every rank's shard) never hit
again: `tests/sglang/e2e/test_tp_server.py` saw no hit for 30 s after a restart.

With shared memory the restarted daemon also made a new segment under the same name: the
mapping kept because name, size and epoch matched loaded stale bytes as LOADED (4 of 4) and
stored into the dead segment while the new daemon committed its own slots (4 of 4 poisoned).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.testing.fault_proxy import FaultProxy
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator import LoadBackConfig, LoadBackOrchestrator, PrefixState
from tests.conftest import CHUNK, kv_of, make_pool, same_kv
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


# -- shared memory ------------------------------------------------------------------------


def _shm_orch(endpoint: str, port: int, layout, pool):
    cfg = LoadBackConfig.from_dict({
        "mp_port": port, "chunk_size": CHUNK, "transfer": "shm",
        "deadlines": {"lookup_ms": 300, "retrieve_base_ms": 300, "retrieve_max_ms": 300,
                      "store_ms": 300, "control_ms": 300},
        "breaker": {"consecutive_failures": 50, "cooldown_ms": 50, "cooldown_max_ms": 200},
    })
    conn = LMCacheMPConnector(endpoint, layout, transfer="shm", connect_timeout_s=0.5)
    return LoadBackOrchestrator(cfg, conn, kv_pool=pool), conn


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _load(orch, rid: str, toks: list[int], dst: torch.Tensor):
    """match + load_back of one request: its LoadResult, or None when match promised nothing."""
    try:
        if orch.match(rid, toks).tokens == 0:
            return None
        return orch.load_back(rid, dst)
    finally:
        orch.finish(rid)


def test_shm_after_a_hidden_restart_loads_and_stores_only_the_new_daemons_bytes(layout,
                                                                                tmp_path):
    """A daemon restarted with the same --shm-name behind a proxy: the same name, size and
    epoch, but a new segment (the old one unlinked). The proxied engine's loads are
    byte-exact with what the new daemon holds, or degrade; what it stores afterwards loads
    byte-exact through an engine connected directly (the cache is not poisoned)."""
    n = 2 * CHUNK
    d = DaemonProcess(chunk_size=CHUNK, shm_name=f"lbhr{os.getpid()}",
                      log_dir=str(tmp_path)).start()
    proxy = FaultProxy(d.endpoint).start()
    pool_p, pool_d = make_pool(layout, 1024), make_pool(layout, 1024)
    proxied, conn = _shm_orch(proxy.endpoint, proxy.port, layout, pool_p)
    direct = None
    try:
        assert proxied.wait_registered(10) and conn.transfer == "shm"
        epoch = conn.epoch
        for i in range(4):  # the old segment holds the proxied engine's KV
            assert proxied.store(f"old-{i}", _tokens(n, 100 + i), torch.arange(n))
            proxied.finish(f"old-{i}")
        d.kill()
        d.start()  # the same port and --shm-name; the proxy keeps our connection open
        direct, _ = _shm_orch(d.endpoint, d.port, layout, pool_d)
        assert direct.wait_registered(10)
        src = [torch.arange(64 * i, 64 * i + n) for i in range(4)]
        for i in range(4):
            assert direct.store(f"new-{i}", _tokens(n, i), src[i])
            direct.finish(f"new-{i}")
        dst = torch.arange(512, 512 + n)
        attempt = iter(range(10_000))
        for i in range(4):
            deadline = time.monotonic() + 20
            while True:
                res = _load(proxied, f"load-{i}-{next(attempt)}", _tokens(n, i), dst)
                if res is not None and res.state is PrefixState.LOADED:
                    exact = same_kv(kv_of(pool_p, dst), kv_of(pool_d, src[i]))
                    assert exact, (
                        f"prefix {i} LOADED through the proxy with bytes other than what the "
                        "new daemon holds")
                    break
                assert time.monotonic() < deadline, f"prefix {i} never loaded through the proxy"
                time.sleep(0.02)  # the breaker answers at once while open
        assert conn.epoch == epoch  # the restart stayed hidden from the connection
        for i in range(4):
            toks = _tokens(n, 200 + i)
            deadline = time.monotonic() + 20
            while not proxied.store(f"st-{i}-{next(attempt)}", toks, src[i]):
                assert time.monotonic() < deadline, f"prefix {i} never stored through the proxy"
                time.sleep(0.02)
            # a miss here is a LOOKUP past its 300 ms on a loaded machine, not poison: retry
            while (res := _load(direct, f"check-{i}-{next(attempt)}", toks, dst)) is None \
                    or res.state is not PrefixState.LOADED:
                assert time.monotonic() < deadline, f"prefix {i} never loaded directly: {res}"
                time.sleep(0.02)
            exact = same_kv(kv_of(pool_d, dst), kv_of(pool_p, src[i]))
            assert exact, (
                f"prefix {i} stored through the proxy loads with other bytes directly")
    finally:
        proxied.close()
        if direct is not None:
            direct.close()
        proxy.close()
        d.stop()
