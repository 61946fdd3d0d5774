"""Calls the daemon may still serve are counted until proven served or dropped, so that a
session is ended only after everything that could re-create it (a queued prepare_retrieve
or lookup) has run; real lmcache 0.5.6 daemon, stopped with SIGSTOP."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.connectors.errors import DaemonTimeout
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from tests.conftest import CHUNK, make_pool

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(120)]


def wait_for(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


@pytest.fixture(scope="module", params=[[], ["--max-workers", "4", "--max-cpu-workers", "1"]],
                ids=["default", "max-workers-4"])
def daemon(request):
    """The daemon with its default worker flags, and with 4 GPU workers beside the one CPU
    worker the fence needs (a daemon with more CPU workers is refused: test_cpu_workers.py)."""
    d = DaemonProcess(chunk_size=CHUNK, http=True, extra_args=request.param).start()
    yield d
    d.stop()


@pytest.fixture
def conn(daemon, layout):
    daemon.resume()
    c = LMCacheMPConnector(daemon.endpoint, layout)
    c.register(5.0)
    yield c
    daemon.resume()
    c.close()


def stored_and_looked_up(c: LMCacheMPConnector, layout, n: int = 256):
    pool = make_pool(layout, 2 * n)
    toks = torch.randint(0, 32000, (n,)).tolist()
    sid = "s-" + uuid.uuid4().hex
    assert c.store_from(toks, sid, pool, torch.arange(n), timeout_s=10.0)
    c.end_session(sid, 2.0)
    rid = "r-" + uuid.uuid4().hex
    assert c.lookup_hit_tokens(toks, rid, 5.0) == n
    return pool, toks, rid


def sessions(d: DaemonProcess) -> int:
    return d.held()["sessions"]


def test_abandoned_prepare_retrieve_counts_until_served_then_the_session_ends_for_good(
        daemon, conn, layout):
    pool, toks, rid = stored_and_looked_up(conn, layout)
    conn.end_session(rid, 2.0)
    assert sessions(daemon) == 0
    daemon.pause()
    with pytest.raises(DaemonTimeout):
        conn.retrieve_into(toks, rid, pool, torch.arange(256, 512), start=0, end=256,
                           timeout_s=0.1)
    assert conn.unanswered(rid) >= 2  # prepare_retrieve and the fence(s) behind it
    assert conn.unanswered("another-request") == 0
    assert conn.unanswered() >= 2  # None: any request
    daemon.resume()
    wait_for(lambda: conn.unanswered(rid) == 0)
    # Everything sent was served: the abandoned call re-created the session, and an
    # end_session sent now is the last word on it.
    assert sessions(daemon) == 1
    conn.end_session(rid, 2.0)
    assert sessions(daemon) == 0
    assert conn.late_replies >= 1  # the prepare_retrieve reply, dropped


def test_abandoned_lookup_counts_until_served(daemon, conn, layout):
    toks = list(range(64))
    rid = "l-" + uuid.uuid4().hex
    daemon.pause()
    with pytest.raises(DaemonTimeout):
        conn.lookup(conn.key(toks, rid, lookup=True), 0.05)
    assert conn.unanswered(rid) >= 2
    daemon.resume()
    wait_for(lambda: conn.unanswered(rid) == 0)
    conn.end_session(rid, 2.0)
    assert sessions(daemon) == 0


def test_abandoned_call_dropped_by_the_daemon_is_settled_by_the_fence(daemon, conn, layout):
    """A handler that raises sends no reply at all: only the fence can tell."""
    c2 = LMCacheMPConnector(daemon.endpoint, layout)  # never registered: the daemon drops it
    try:
        rid = "d-" + uuid.uuid4().hex
        key = c2.key(list(range(32)), rid)
        with pytest.raises(DaemonTimeout):
            c2._call("prepare_retrieve", [key, c2.instance_id], 0.1, request_id=rid)
        # The fence (a commit_retrieve) is dropped as well while the daemon does not know
        # this instance; one sent again after registering is answered and settles both.
        assert c2.unanswered(rid) >= 2
        c2.register(5.0)
        wait_for(lambda: c2.unanswered(rid) == 0)
    finally:
        c2.close()
    daemon.pause()
    rid = "n-" + uuid.uuid4().hex
    with pytest.raises(DaemonTimeout):  # bad arity: the lookup handler raises, no reply
        conn._call("lookup", [rid], 0.05, request_id=rid)
    daemon.resume()
    wait_for(lambda: conn.unanswered(rid) == 0)


def test_a_restarted_daemon_settles_what_the_old_one_never_answered(layout):
    d = DaemonProcess(chunk_size=CHUNK, http=True).start()
    c = LMCacheMPConnector(d.endpoint, layout, connect_timeout_s=0.2)
    try:
        c.register(5.0)
        epoch = c.epoch
        d.pause()
        with pytest.raises(DaemonTimeout):
            c.lookup(c.key(list(range(64)), "gone", lookup=True), 0.05)
        assert c.unanswered("gone") >= 2
        d.restart()
        wait_for(lambda: c.epoch > epoch)
        assert c.unanswered("gone") == 0
        assert d.held()["sessions"] == 0
    finally:
        c.close()
        d.stop()


def test_finish_after_a_timed_out_retrieve_leaves_no_session_once_the_daemon_drains(
        daemon, layout):
    """The orchestrator defers end_session until the abandoned prepare_retrieve (and lookup)
    of the request is proven served or dropped; then nothing re-creates the session."""
    from lmcache_loadback.orchestrator import DegradeReason, LoadBackConfig, LoadBackOrchestrator

    daemon.resume()
    cfg = LoadBackConfig.from_dict({
        "mp_port": daemon.port, "chunk_size": CHUNK,
        "deadlines": {"lookup_ms": 100, "retrieve_base_ms": 80, "retrieve_per_ki_token_ms": 0,
                      "retrieve_max_ms": 80, "control_ms": 100},
        "heartbeat": {"interval_ms": 50},
        "breaker": {"consecutive_failures": 50, "cooldown_ms": 50, "cooldown_max_ms": 200},
    })
    pool = make_pool(layout, 4096)
    conn = LMCacheMPConnector(daemon.endpoint, layout, connect_timeout_s=0.2)
    orch = LoadBackOrchestrator(cfg, conn, kv_pool=pool)
    try:
        assert orch.wait_registered(30)
        toks = torch.randint(0, 32000, (256,)).tolist()
        assert orch.store("seed-" + uuid.uuid4().hex, toks, torch.arange(256))
        rids = [f"fin-{i}-{uuid.uuid4().hex}" for i in range(5)]
        for rid in rids:
            assert orch.match(rid, toks).tokens == 256
        wait_for(lambda: orch.pending_debts() == 0 and conn.unanswered() == 0)
        base = sessions(daemon)
        for i, rid in enumerate(rids):
            wait_for(lambda: orch.pending_debts() == 0 and conn.unanswered() == 0)
            conn.noop(2.0)  # this (the scheduler) thread's connection is up before the stop
            daemon.pause()
            res = orch.load_back(rid, torch.arange(512 + 256 * i, 768 + 256 * i))
            assert res.reason == DegradeReason.RETRIEVE_TIMEOUT
            orch.finish(rid)  # at once, while its prepare_retrieve waits on the daemon
            assert conn.unanswered(rid) > 0
            daemon.resume()  # before the session end could time out: it races the queue
        wait_for(lambda: orch.pending_debts() == 0 and conn.unanswered() == 0, 30)
        # Drained: everything sent was served or dropped, and every session end was sent
        # after it. Watch a while: nothing may bring a session back.
        watch_until = time.monotonic() + 0.5
        while time.monotonic() < watch_until:
            assert sessions(daemon) == base - len(rids)
    finally:
        daemon.resume()
        orch.close()
