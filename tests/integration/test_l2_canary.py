"""The L2 canary finds what the daemon's own /status hides: stores that never reach L2.

Real parts only: Debian's redis-server, a real lmcache 0.5.6 daemon with the resp adapter and
its admin API. The daemon and redis are shared by the module (a daemon takes seconds to
start), in test order: the last one leaves the daemon's L2 broken."""

from __future__ import annotations

import logging
import os
import time

import pytest
from prometheus_client import CollectorRegistry

from lmcache_loadback.orchestrator import LoadBackConfig
from lmcache_loadback.orchestrator.instruments import product_metrics
from lmcache_loadback.connectors.errors import DaemonTimeout
from lmcache_loadback.orchestrator.l2_canary import CANARY_SALT, MARKER_CHUNKS, L2Canary, marker
from lmcache_loadback.orchestrator.l2_canary import _Verdict
from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.testing.redis import RedisServer
from tests.conftest import require_redis

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(120)]

require_redis()


@pytest.fixture(scope="module")
def resp_fleet():
    with RedisServer() as redis:
        d = DaemonProcess(http=True, l2_adapter=redis.l2_adapter("resp"))
        d.start()
        try:
            yield redis, d
        finally:
            d.stop()


def _canary(d: DaemonProcess, **l2) -> tuple[L2Canary, object]:
    cfg = LoadBackConfig.from_dict({"mp_port": d.port, "mp_http_port": d.http_port,
                                    "chunk_size": d.chunk_size, "l2": l2})
    metrics = product_metrics(CollectorRegistry())
    return L2Canary(lambda: cfg, metrics, background=False), metrics


def _series(metrics, name: str) -> float:
    return metrics.snapshot()[name]


def _idle(d: DaemonProcess) -> None:
    """No hold of any kind, and no marker left in its L1."""
    assert d.client_holds() == {} and d.held()["objects"] == 0, d.held()


def test_canary_checks_a_daemon_with_a_shared_memory_pool(resp_fleet):
    """The fleet's recommended daemon (`--shm-name`) answers a pickled load with slots and
    keeps a pickled store's reservation unwritten: the canary moves its marker through the
    pool there, and its check is ok."""
    redis = resp_fleet[0]
    with DaemonProcess(http=True, shm_name=f"lbcanary{os.getpid()}",
                       l2_adapter=redis.l2_adapter("resp")) as d:
        canary, _ = _canary(d)
        try:
            assert [canary.check(), canary.check()] == ["ok", "ok"], canary.last
            _idle(d)
        finally:
            canary.close(5)


def test_canary_loads_its_marker_back_from_l2_and_leaves_nothing_behind(resp_fleet):
    redis, d = resp_fleet
    canary, metrics = _canary(d)
    try:
        before = time.time()
        assert canary.check() == "ok", canary.last
        assert canary.check() == "ok", canary.last
        assert _series(metrics, 'loadback_l2_canary_checks_total{result=ok}') == 2
        assert _series(metrics, "loadback_l2_canary_last_success_timestamp_seconds") >= before
        assert _series(metrics, "loadback_l2_canary_consecutive_failures") == 0
        assert _series(metrics, "loadback_l2_canary_interval_seconds") == 60
        # the marker went through redis (SET, EXISTS, GET) and was deleted from it afterwards
        stats = redis.command_reply("INFO", "commandstats")
        assert "cmdstat_set:calls=" in stats and "cmdstat_get:calls=" in stats
        assert redis.dbsize() == 0
        _idle(d)
    finally:
        canary.close(5)
    assert d.held()["registered"] == 0


def test_canary_counts_a_hung_l2_as_timeout_within_its_deadline(resp_fleet):
    redis, d = resp_fleet
    canary, metrics = _canary(d, canary_deadline_ms=600)
    try:
        assert canary.check() == "ok", canary.last  # its keys' hasher is loaded: time the rest
        redis.pause()
        try:
            t0 = time.monotonic()
            assert canary.check() == "timeout", canary.last
            first_s = time.monotonic() - t0
            # nothing new is stored while an earlier marker waits on the hung store
            assert canary.check() == "timeout", canary.last
            assert "an earlier marker's L2 write still waits" in canary.last[1]
        finally:
            redis.resume()
        assert first_s < 0.6 + 0.5, first_s  # its deadline, and the calls' own floor
        assert canary.check() == "ok", canary.last  # what the hang held is dropped first
        assert _series(metrics, 'loadback_l2_canary_checks_total{result=timeout}') == 2
        assert _series(metrics, "loadback_l2_canary_consecutive_failures") == 0
        assert redis.dbsize() == 0  # the markers written once it resumed are deleted too
        _idle(d)
    finally:
        canary.close(5)


def test_canary_closed_after_a_lookup_timed_out_releases_what_it_holds(resp_fleet):
    """A check's LOOKUP that timed out on a hung store is owed a release; a canary closed
    before its next check still pays it (within deadlines.control_ms) once the store answers,
    instead of leaving the prefetch job and its locks to the daemon's TTL."""
    redis, d = resp_fleet
    canary, _ = _canary(d)
    canary.config = lambda: LoadBackConfig.from_dict({
        "mp_port": d.port, "mp_http_port": d.http_port, "chunk_size": d.chunk_size,
        "deadlines": {"control_ms": 3000}})
    assert canary.check() == "ok", canary.last  # its connector is registered
    conn = canary._conn
    toks, _ = marker(d.chunk_size, MARKER_CHUNKS)
    redis.pause()
    try:  # what a check's LOOKUP of its marker does when the store hangs (_load_back)
        with pytest.raises(DaemonTimeout):
            conn.lookup_hit_tokens(toks, "canary-owed", 0.3, cache_salt=CANARY_SALT)
        canary._owed = (toks, "canary-owed", conn.epoch)
        assert d.client_holds().get("prefetch_jobs") == 1
    finally:
        redis.resume()
    canary.close(5)
    assert d.client_holds() == {}, d.held()


def test_canary_settles_a_timed_out_lookup_only_once_the_daemon_answered_it(resp_fleet):
    """A check's LOOKUP call unanswered (the daemon hung) may still be served. An abandon
    served before it finds no prefetch job (nothing freed, the session ended), and the late
    LOOKUP then takes its job, session and locks for good: the canary sends nothing for it
    until the daemon answered that LOOKUP (its fence), then releases it."""
    _, d = resp_fleet
    canary, _ = _canary(d)
    assert canary.check() == "ok", canary.last  # its connector is registered
    conn = canary._conn
    toks, _ = marker(d.chunk_size, MARKER_CHUNKS)
    abandons = []
    inner = conn.abandon_lookup
    conn.abandon_lookup = lambda *a, **k: abandons.append(a[1]) or inner(*a, **k)
    d.pause()
    try:  # what a check's LOOKUP does when the daemon does not answer (_load_back)
        with pytest.raises(DaemonTimeout):
            conn.lookup_hit_tokens(toks, "canary-unanswered", 0.2, cache_salt=CANARY_SALT)
        canary._owed = (toks, "canary-unanswered", conn.epoch)
        assert conn.unanswered("canary-unanswered")
        # what the next check does first (its admin API calls would time out here first)
        with pytest.raises(_Verdict, match="has not answered the LOOKUP of an earlier check"):
            canary._settle_owed(conn, lambda: 0.2)
        assert abandons == []
    finally:
        d.resume()
    end = time.monotonic() + 15
    while conn.unanswered("canary-unanswered") and time.monotonic() < end:
        time.sleep(0.01)  # the fence behind it answers once the daemon runs again
    assert canary.check() == "ok", canary.last  # settles it first, then checks
    assert abandons == ["canary-unanswered"]
    canary.close(5)
    assert d.client_holds() == {}, d.held()


def test_canary_finds_stores_lost_after_the_l2_server_restarts(resp_fleet, caplog):
    # Last in the module: it leaves the daemon's resp adapter on a dead connection.
    redis, d = resp_fleet
    canary, metrics = _canary(d)
    try:
        assert canary.check() == "ok", canary.last
        redis.restart()  # resp never reconnects: every later L2 write of this daemon is lost
        assert d.status()["is_healthy"] is True  # what the daemon itself says meanwhile
        with caplog.at_level(logging.WARNING, logger="loadback"):
            assert canary.check() == "lost", canary.last
            assert canary.check() == "lost", canary.last
        assert f"its L2 holds 0 of {MARKER_CHUNKS * d.chunk_size} tokens" in canary.last[1]
        warned = [r.getMessage() for r in caplog.records if "L2 canary lost" in r.getMessage()]
        assert len(warned) == 1 and "never reconnects after its server restarted: restart the " \
            "daemon" in warned[0]  # once per change
        assert _series(metrics, "loadback_l2_canary_consecutive_failures") == 2
        assert _series(metrics, 'loadback_l2_canary_checks_total{result=lost}') == 2
        _idle(d)
    finally:
        canary.close(5)
