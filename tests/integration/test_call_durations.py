"""loadback_daemon_call_duration_seconds{op} on a real daemon: each call the daemon answered
is timed once under its wire operation (as many observations as answers, per op), and a call
it did not answer in time is not timed."""

from __future__ import annotations

import pytest
import torch

from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator import LoadBackConfig, LoadBackOrchestrator, PrefixState
from tests.conftest import CHUNK, make_pool

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(120)]


#: The calls a request's store, match, load and release send (the heartbeat's pings and
#: registrations run beside them on their own clock).
REQUEST_OPS = ("prepare_store", "commit_store", "lookup", "query_prefetch_status",
               "prepare_retrieve", "commit_retrieve", "free_lookup_locks", "end_session")


def counts(orch) -> dict[str, float]:
    """The histogram's count per op, non-zero only."""
    head = "loadback_daemon_call_duration_seconds_count{op="
    return {k[len(head):-1]: v for k, v in orch.metrics.snapshot().items()
            if k.startswith(head) and v}


def answered_calls(conn: LMCacheMPConnector) -> dict[str, int]:
    """Counts, per op, the connector's calls that returned (the daemon answered them)."""
    seen: dict[str, int] = {}
    real = conn.transport.call

    def call(op, *a, **kw):
        out = real(op, *a, **kw)
        seen[op] = seen.get(op, 0) + 1
        return out
    conn.transport.call = call
    return seen


def settle(orch, wait_s: float = 10.0) -> None:
    import time
    end = time.monotonic() + wait_s
    while orch.pending_debts() and time.monotonic() < end:
        time.sleep(0.01)
    assert not orch.pending_debts()


def test_each_answered_call_is_timed_once_under_its_op(live_daemon, layout):
    pool = make_pool(layout, 1024)
    cfg = LoadBackConfig.from_dict({"mp_port": live_daemon.port, "chunk_size": CHUNK})
    conn = LMCacheMPConnector(live_daemon.endpoint, layout)
    orch = LoadBackOrchestrator(cfg, conn, kv_pool=pool)
    try:
        assert orch.wait_registered(20)
        # the heartbeat's first registration is timed: the hook is set before it starts
        assert counts(orch).get("register_kv_cache_engine_driven_context", 0) >= 1
        seen = answered_calls(conn)
        before = counts(orch)
        prompt = list(range(5000, 5000 + 4 * CHUNK))
        assert orch.store("s", prompt, torch.arange(0, 4 * CHUNK))
        orch.finish("s")
        n = orch.match("hit", prompt).tokens
        assert n == 4 * CHUNK
        r = orch.load_back("hit", torch.arange(512, 512 + n))
        assert r.state == PrefixState.LOADED
        orch.finish("hit")
        settle(orch)
        after = counts(orch)
        grown = {op: after.get(op, 0) - before.get(op, 0) for op in REQUEST_OPS}
        sent = {op: seen.get(op, 0) for op in REQUEST_OPS}
        assert grown == sent  # one observation per answered call, under its own op
        for op in ("lookup", "query_prefetch_status", "prepare_retrieve", "commit_retrieve",
                   "end_session"):
            assert grown.get(op, 0) >= 1, (op, grown)
        snap = orch.metrics.snapshot()
        assert snap["loadback_daemon_call_duration_seconds_sum{op=lookup}"] > 0
    finally:
        orch.close()


def test_a_call_the_daemon_does_not_answer_is_not_timed(live_daemon, layout):
    cfg = LoadBackConfig.from_dict({
        "mp_port": live_daemon.port, "chunk_size": CHUNK,
        "deadlines": {"lookup_ms": 150, "control_ms": 150}})
    conn = LMCacheMPConnector(live_daemon.endpoint, layout)
    orch = LoadBackOrchestrator(cfg, conn, kv_pool=make_pool(layout, 256))
    try:
        assert orch.wait_registered(20)
        sent: list[str] = []
        real = conn.transport.call
        conn.transport.call = lambda op, *a, **kw: (sent.append(op), real(op, *a, **kw))[1]
        seen = answered_calls(conn)
        before = counts(orch)
        live_daemon.pause()
        try:
            res = orch.match("unanswered", list(range(9000, 9000 + 2 * CHUNK)))
        finally:
            live_daemon.resume()
        assert res.tokens == 0 and res.reason is not None
        assert "lookup" in sent and "lookup" not in seen  # sent, never answered
        assert counts(orch).get("lookup", 0) == before.get("lookup", 0)
        orch.finish("unanswered")
    finally:
        orch.close()
