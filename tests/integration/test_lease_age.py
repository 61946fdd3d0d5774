"""A LOOKUP's read locks have an age limit (`lease_max_age_ms`) under the daemon's read TTL.
lmcache 0.5.6's read lock is a counter whose TTL restarts with each new lock and which a new
lock resets to 1 once expired, so a free sent after the TTL strips a newer reader's lock and
its chunks may be evicted mid-read. Past the age a promise degrades (`lease_expired`) and its
locks are forfeited, never freed. The age is read on the orchestrator's injectable clock,
moved by the test; the daemon's real TTL is shortened to 2 s (`--l1-read-ttl-seconds`)."""

from __future__ import annotations

import time

import pytest
import torch

from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator import LoadBackConfig, LoadBackOrchestrator, PrefixState
from lmcache_loadback.orchestrator.states import DegradeReason
from lmcache_loadback.testing.daemon import DaemonProcess
from tests.conftest import CHUNK, make_pool

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(120)]

TTL_S = 2
AGE_MS = 1000.0


@pytest.fixture(scope="module")
def ttl_daemon():
    with DaemonProcess(chunk_size=CHUNK, http=True,
                       extra_args=["--l1-read-ttl-seconds", str(TTL_S)]) as d:
        yield d


def _orch(daemon, layout) -> tuple[LoadBackOrchestrator, list[float]]:
    now = [1000.0]
    cfg = LoadBackConfig.from_dict({
        "mp_port": daemon.port, "chunk_size": CHUNK, "prepare_at_match": False,
        "daemon_read_ttl_s": TTL_S, "lease_max_age_ms": AGE_MS, "prepare_max_age_ms": AGE_MS,
        "deadlines": {"lookup_ms": 2000, "control_ms": 1000, "connect_ms": 5000}})
    conn = LMCacheMPConnector(daemon.endpoint, layout, connect_timeout_s=1.0)
    orch = LoadBackOrchestrator(cfg, conn, kv_pool=make_pool(layout, 1024),
                                clock=lambda: now[0], start_heartbeat=False)
    orch.tick()
    assert orch.link.registered()
    return orch, now


def _settle(orch) -> None:
    deadline = time.monotonic() + 10
    while orch.pending_debts() or orch.connector.unanswered():
        assert time.monotonic() < deadline, orch.pending_debts()
        orch.link.pay()
        time.sleep(0.01)


def _wait_held(daemon, kind: str, want: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while daemon.held()[kind] != want:
        assert time.monotonic() < deadline, (kind, daemon.held(), want)
        time.sleep(0.05)


def _stored(orch, seed: int) -> list[int]:
    """A prompt of 4 chunks the daemon holds, its store's session ended."""
    toks = torch.randint(0, 32000, (4 * CHUNK,),
                         generator=torch.Generator().manual_seed(seed)).tolist()
    assert orch.store("s", toks, torch.arange(len(toks)))
    orch.finish("s")
    _settle(orch)
    return toks


def test_a_promise_past_its_age_never_frees_a_newer_readers_locks(ttl_daemon, layout):
    orch, now = _orch(ttl_daemon, layout)
    try:
        toks = _stored(orch, 11)
        assert orch.match("old", toks).tokens == 4 * CHUNK
        locked = ttl_daemon.held()["read_locks"]
        assert locked > 0
        now[0] += AGE_MS / 1000 + 0.001           # the request waited past the lease's age
        _wait_held(ttl_daemon, "read_locks", 0)   # ... and the daemon's TTL ended its locks
        assert orch.match("new", toks).tokens == 4 * CHUNK   # a newer reader locks them
        assert ttl_daemon.held()["read_locks"] == locked
        orch.finish("old")                        # past its age: forfeited, not freed
        _settle(orch)
        assert ttl_daemon.held()["read_locks"] == locked     # the newer reader's, intact
        s = orch.metrics.snapshot()
        assert s["loadback_leases_expired_total"] == 1
        assert s["loadback_prefix_outcomes_total{reason=lease_expired,state=degraded}"] == 1
        res = orch.load_back("new", torch.arange(100, 100 + 4 * CHUNK))
        assert res.loaded_tokens == 4 * CHUNK
        orch.finish("new")
        _settle(orch)
        _wait_held(ttl_daemon, "read_locks", 0, timeout_s=TTL_S + 5)
    finally:
        orch.close()


def test_a_promise_past_its_age_is_neither_answered_nor_loaded(ttl_daemon, layout):
    orch, now = _orch(ttl_daemon, layout)
    try:
        toks = _stored(orch, 12)
        assert orch.match("asked", toks).tokens == 4 * CHUNK
        assert orch.match("loaded", toks).tokens == 4 * CHUNK
        now[0] += AGE_MS / 1000 + 0.001
        # the engine asks again from the marker: the promise has lapsed
        m = orch.match("asked", toks)
        assert (m.tokens, m.state, m.reason) == (0, PrefixState.DEGRADED,
                                                  DegradeReason.LEASE_EXPIRED)
        res = orch.load_back("loaded", torch.arange(4 * CHUNK))
        assert (res.loaded_tokens, res.reason) == (0, DegradeReason.LEASE_EXPIRED)
        for rid in ("asked", "loaded"):
            orch.finish(rid)
        _settle(orch)
        s = orch.metrics.snapshot()
        assert s["loadback_leases_expired_total"] == 2        # each lease forfeited once
        assert s["loadback_prefix_outcomes_total{reason=lease_expired,state=degraded}"] == 2
        assert s.get("loadback_prefix_outcomes_total{reason=none,state=loaded}", 0) == 0
        _wait_held(ttl_daemon, "read_locks", 0, timeout_s=TTL_S + 5)   # the TTL ends them
        _wait_held(ttl_daemon, "sessions", 0)
    finally:
        orch.close()
