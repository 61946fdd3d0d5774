"""Daemon faults at LOOKUP and at RETRIEVE, through SGLang's real classes.

Each scenario checks: every scheduler-thread call returned within its deadline (plus slack
for a loaded 2-core machine), the allocator's available_size() is back to its value before
the request, the tree is consistent, and the next request works (loads back once the daemon
is healthy again).
"""

from __future__ import annotations

import time

import pytest

from lmcache_loadback.testing.daemon import DaemonProcess, free_port

from .conftest import (
    CHUNK,
    Sched,
    fresh_ids,
    kv_matches,
    make_config,
    page_sizes,
    tree_consistent,
    wait_for,
)

pytestmark = pytest.mark.daemon

SLACK_S = 0.5  # scheduling noise on a busy 2-core machine; the deadlines are the point
LOOKUP_S = 0.3
RETRIEVE_S = 1.0


def ready(cache, timeout_s: float = 30.0) -> None:
    orch = cache.orch
    if hasattr(orch, "wait_registered"):
        assert orch.wait_registered(timeout_s), "never registered with the daemon"
    else:
        wait_for(lambda: orch._registered(), timeout_s, "registration with the daemon")


def within_deadlines(s: Sched) -> None:
    bound = {"match_prefix": LOOKUP_S, "init_load_back": RETRIEVE_S,
             "finish": 0.05, "check_prefetch_progress": 0.05, "prefetch_from_storage": 0.05,
             "check_hicache_events": 0.05,
             "release_aborted_request": 0.3}
    for name, took in s.calls:
        assert took <= bound[name] + SLACK_S, f"{name} took {took:.3f} s"


def store(s: Sched, ids) -> None:
    """A request computes `ids`, finishes (STORE), and its device copy is evicted."""
    r = s.new_req(f"store-{ids[0]}", ids)
    s.admit(r)
    s.finish(r)
    s.flush()


def admit_and_check(s: Sched, ids, rid: str) -> dict:
    cache = s.cache
    s.flush()
    free0 = cache.token_to_kv_pool_allocator.available_size()
    r = s.new_req(rid, ids + [5])
    got = s.admit(r)
    s.finish(r)
    s.flush()
    tree_consistent(cache, idle=True)
    assert cache.token_to_kv_pool_allocator.available_size() == free0
    return got


@pytest.mark.parametrize("page", page_sizes())
@pytest.mark.parametrize("fault", ["sigstop", "sigkill"])
def test_lookup_fault_recomputes_within_deadline(live_daemon, make_cache, page, fault):
    cache = make_cache(page, make_config(live_daemon.port))
    ready(cache)
    s = Sched(cache)
    ids = fresh_ids(4 * CHUNK)
    store(s, ids)
    if fault == "sigstop":
        live_daemon.pause()
    else:
        live_daemon.kill()
    try:
        got = admit_and_check(s, ids, "b")
        assert got["loaded"] == 0
        within_deadlines(s)
    finally:
        live_daemon.resume()
    if fault == "sigkill":
        live_daemon.start()
    else:
        # The LOOKUP that outlived its deadline is settled once the daemon answers again.
        wait_for(lambda: not live_daemon.client_holds(), 15, "the late LOOKUP's holds")
    ready(cache)
    s.calls.clear()
    wait_for(lambda: _loads_again(s), 30, "hits to resume after the fault")
    within_deadlines(s)


def _loads_again(s: Sched) -> bool:
    ids = fresh_ids(3 * CHUNK)
    store(s, ids)
    r = s.new_req(f"probe-{ids[0]}", ids + [9])
    got = s.admit(r)
    ok = got["loaded"] == 3 * CHUNK and kv_matches(s.pool, got["loaded_slots"], ids, 0)
    s.finish(r)
    tree_consistent(s.cache, idle=True)
    return ok


@pytest.mark.parametrize("page", page_sizes())
@pytest.mark.parametrize("fault", ["sigstop", "sigkill", "restart"])
def test_retrieve_fault_frees_every_slot_and_recomputes(live_daemon, make_cache, page, fault):
    cache = make_cache(page, make_config(live_daemon.port))
    ready(cache)
    s = Sched(cache)
    ids = fresh_ids(4 * CHUNK)
    store(s, ids)
    free0 = cache.token_to_kv_pool_allocator.available_size()
    b = s.new_req("b", ids + [5])
    s.prefetch(b)
    s.poll(b)
    res = s.match(b)
    assert res.host_hit_length == 4 * CHUNK  # promised: now the daemon fails before RETRIEVE
    {"sigstop": live_daemon.pause, "sigkill": live_daemon.kill,
     "restart": lambda: live_daemon.restart()}[fault]()
    try:
        got = s.admit(b, prefetch=False)
        assert got["loaded"] == 0 and got["host_hit"] == 4 * CHUNK
        tree_consistent(cache)
        s.finish(b)
        s.flush()
        assert cache.token_to_kv_pool_allocator.available_size() == free0
        tree_consistent(cache, idle=True)
        within_deadlines(s)
    finally:
        live_daemon.resume()
    if fault == "sigkill":
        live_daemon.start()
    s.calls.clear()
    wait_for(lambda: _loads_again(s), 30, "hits to resume after the fault")
    within_deadlines(s)


@pytest.mark.parametrize("page", page_sizes())
def test_daemon_absent_at_construction_starts_degraded_then_registers(make_cache, page):
    port = free_port()
    t0 = time.monotonic()
    cache = make_cache(page, make_config(port))
    assert time.monotonic() - t0 < 2.0, "construction waited on the daemon"
    s = Sched(cache)
    got = admit_and_check(s, fresh_ids(4 * CHUNK), "a")
    assert got["loaded"] == 0
    within_deadlines(s)
    d = DaemonProcess(port=port, chunk_size=CHUNK, http=True)
    d.start()
    try:
        ready(cache)
        s.calls.clear()
        wait_for(lambda: _loads_again(s), 30, "hits once the daemon appears")
        within_deadlines(s)
    finally:
        d.stop()


@pytest.mark.parametrize("page", page_sizes())
def test_abort_releases_daemon_locks_and_session(live_daemon, make_cache, page):
    cache = make_cache(page, make_config(live_daemon.port))
    ready(cache)
    s = Sched(cache)
    ids = fresh_ids(4 * CHUNK)
    store(s, ids)
    wait_for(lambda: live_daemon.held()["sessions"] == 0, 10, "the store's session to end")
    b = s.new_req("b", ids + [5])
    s.prefetch(b)
    s.poll(b)
    assert s.match(b).host_hit_length == 4 * CHUNK
    assert live_daemon.held()["read_locks"] > 0
    s.abort(b)
    wait_for(lambda: not live_daemon.client_holds(), 10, "locks, session and job released")
    assert cache.orch.live_prefixes() == 0
    within_deadlines(s)


@pytest.mark.parametrize("op", ["lookup", "prepare_retrieve"])
def test_unanswered_calls_over_many_cycles_conserve_the_pool(live_daemon, make_cache, op):
    """Cycles of store / flush / hit, every other one with the daemon never answering one
    `op` (the fault proxy swallows it): the pool is conserved after every cycle, and the
    healthy cycles keep loading back byte-exact."""
    from lmcache_loadback.testing.fault_proxy import FaultProxy, FaultRule

    proxy = FaultProxy(live_daemon.endpoint).start()
    try:
        cache = make_cache(16, make_config(proxy.port))
        ready(cache)
        s = Sched(cache)
        hits = 0
        for cycle in range(8):
            ids = fresh_ids(4 * CHUNK)
            store(s, ids)
            rule = None
            if cycle % 2:
                rule = proxy.add_rule(FaultRule("drop", op=op, direction="request", count=1))
            r = s.new_req(f"c{cycle}", ids + [3])
            got = s.admit(r)
            s.finish(r)
            s.flush()
            tree_consistent(cache, idle=True)
            if rule is None:
                assert got["loaded"] == 4 * CHUNK, (cycle, got["loaded"])
                assert kv_matches(s.pool, got["loaded_slots"], ids, 0)
                hits += 1
            else:
                assert proxy.fired(rule) == 1 and got["loaded"] == 0, (cycle, got["loaded"])
                proxy.clear()
        assert hits == 4
        within_deadlines(s)
        if op == "lookup":
            # A RETRIEVE lost on its way leaves its locks to the daemon's read TTL (the
            # orchestrator never releases a range twice); a lost LOOKUP is settled.
            wait_for(lambda: not live_daemon.client_holds(), 15, "every hold released")
    finally:
        proxy.close()
