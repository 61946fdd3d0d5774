"""Two prepare_retrieves of one key identity from one registered instance, on shared memory.

lmcache 0.5.6 parks a prepared retrieve's read locks in `_pending_reads[(instance_id, key)]`,
and the key's equality leaves out request_id: a second prepare of the same range (another
request with the same prefix, or a retry the daemon served late) overwrites the first's
entry. The first's locks are then orphaned until the read TTL, and the first commit releases
the second transfer's locks while it may still be copying. The connector never has two of
one identity outstanding: the second is not sent (`TransferBusy`), its prefix degrades
`transfer_busy` and its lookup's locks are freed as for any degrade.
"""

from __future__ import annotations

import time

import pytest
import torch

from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.connectors.retrieval import Retrieval, TransferBusy
from lmcache_loadback.orchestrator import (DegradeReason, LoadBackConfig, LoadBackOrchestrator,
                                           PrefixState)
from lmcache_loadback.testing.daemon import DaemonProcess
from tests.conftest import CHUNK, kv_of, make_pool, same_kv
from tests.integration.test_prepare_pieces import shm_daemon  # noqa: F401 - a module's own

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(120)]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _settled(d: DaemonProcess, orch=None, timeout_s: float = 10.0) -> dict:
    end = time.monotonic() + timeout_s
    while orch is not None and time.monotonic() < end and orch.pending_debts():
        time.sleep(0.02)
    held = d.held()
    while time.monotonic() < end and (held["read_locks"] or held["sessions"]):
        time.sleep(0.02)
        held = d.held()
    return held


def test_a_second_prepare_of_an_outstanding_range_is_not_sent(shm_daemon, layout):
    conn = LMCacheMPConnector(shm_daemon.endpoint, layout, transfer="shm")
    try:
        conn.register(5)
        n = 3 * CHUNK
        toks = _tokens(n, 1)
        src = make_pool(layout, 1024)
        assert conn.store_from(toks, "s", src, torch.arange(n), timeout_s=5)
        conn.end_session("s", 5)
        assert conn.lookup_hit_tokens(toks, "a", 5) == n
        assert conn.lookup_hit_tokens(toks, "b", 5) == n
        ra, rb = Retrieval(conn.epoch, 0, n), Retrieval(conn.epoch, 0, n)
        conn.prepare(toks, "a", start=0, end=n, timeout_s=5, retrieval=ra)
        with pytest.raises(TransferBusy):
            conn.prepare(toks, "b", start=0, end=n, timeout_s=5, retrieval=rb)
        assert not rb.locks_moved and not rb.owes  # not sent: b's lookup locks are its own
        conn.free_locks(toks, "b", 0, n, 5)
        ra.release(5)
        # a's commit was answered: the identity is free again
        assert conn.lookup_hit_tokens(toks, "c", 5) == n
        rc = Retrieval(conn.epoch, 0, n)
        conn.prepare(toks, "c", start=0, end=n, timeout_s=5, retrieval=rc)
        rc.release(5)
        for rid in ("a", "b", "c"):
            conn.end_session(rid, 5)
        assert _settled(shm_daemon)["read_locks"] == 0
    finally:
        conn.close()


def _orch(d: DaemonProcess, layout, pool) -> LoadBackOrchestrator:
    cfg = {"mp_port": d.port, "chunk_size": CHUNK, "transfer": "shm", "prepare_at_match": True,
           "deadlines": {"lookup_ms": 500, "retrieve_base_ms": 1000, "control_ms": 200},
           "heartbeat": {"interval_ms": 50}}
    conn = LMCacheMPConnector(d.endpoint, layout, transfer="shm", connect_timeout_s=0.2)
    orch = LoadBackOrchestrator(LoadBackConfig.from_dict(cfg), conn, kv_pool=pool)
    assert orch.wait_registered(10)
    return orch


def test_two_requests_of_one_prefix_prepared_at_match_leak_no_read_lock(shm_daemon, layout):
    pool = make_pool(layout, 2048)
    orch = _orch(shm_daemon, layout, pool)
    try:
        n = 4 * CHUNK
        toks = _tokens(n, 2)
        src = torch.arange(n)
        assert orch.store("s", toks, src)
        orch.finish("s")
        ma = orch.match("a", toks)
        mb = orch.match("b", toks)  # same range, prepared (or refused) at match too
        assert ma.tokens == n
        res = orch.load_back("a", torch.arange(1024, 1024 + n))
        assert res.state is PrefixState.LOADED
        assert same_kv(kv_of(pool, torch.arange(1024, 1024 + n)), kv_of(pool, src))
        if mb.tokens:
            orch.load_back("b", torch.arange(1200, 1200 + mb.tokens))
        orch.finish("a")
        orch.finish("b")
        assert _settled(shm_daemon, orch)["read_locks"] == 0
        assert mb.tokens == 0
        assert orch.metrics.snapshot().get(
            f"loadback_prefix_outcomes_total{{reason={DegradeReason.TRANSFER_BUSY.value},"
            "state=degraded}") == 1
        # once a's commit was answered the prefix prepares and loads again
        mc = orch.match("c", toks)
        assert mc.tokens == n
        assert orch.load_back("c", torch.arange(1400, 1400 + n)).state is PrefixState.LOADED
        orch.finish("c")
        assert _settled(shm_daemon, orch)["read_locks"] == 0
    finally:
        orch.close()
