"""The hook's worker threads against the real orchestrator and daemon, stepped by Events.

Each race is played in one order, on purpose: a worker thread is stopped at the instant that
matters (inside `match`, inside a STORE) by an Event, the scheduler thread (this test's
thread) does its part, then the worker is let go. Nothing is ordered by sleeping; the only
waits on time are for a deadline to pass and for the daemon's admin counts to settle.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from .conftest import (
    CHUNK,
    NEW_API,
    Sched,
    fresh_ids,
    kv_matches,
    make_config,
    tree_consistent,
    wait_for,
)
from .test_hook_faults import ready, store

pytestmark = [
    pytest.mark.daemon,
    pytest.mark.skipif(not NEW_API, reason="the LOOKUP worker is 0.5.23's (prefetch/poll)"),
]

LOOKUP_THREAD, STORE_THREAD = "loadback-lookup", "loadback-store"


class Gate:
    """Stops the first call made on `thread` until `go` is set; `reached` says it is held."""

    def __init__(self, thread: str) -> None:
        self.thread = thread
        self.reached = threading.Event()
        self.go = threading.Event()
        self.armed = True

    def hold(self) -> None:
        if self.armed and threading.current_thread().name.startswith(self.thread):
            self.armed = False
            self.reached.set()
            assert self.go.wait(30), "the test never let the worker go"

    def wait_reached(self) -> None:
        assert self.reached.wait(10), "the worker never reached the gate"


def hold_after(obj, name: str, gate: Gate):
    """`obj.name` runs, then the first call on the gate's thread stops (instance patch)."""
    real = getattr(obj, name)

    def held(*args, **kwargs):
        out = real(*args, **kwargs)
        gate.hold()
        return out

    setattr(obj, name, held)
    return real


def hold_before(obj, name: str, gate: Gate):
    """The first call of `obj.name` on the gate's thread stops before it runs."""
    real = getattr(obj, name)

    def held(*args, **kwargs):
        gate.hold()
        return real(*args, **kwargs)

    setattr(obj, name, held)
    return real


def fail_once_on(obj, name: str, thread: str, exc: BaseException, *, after: bool = True):
    """`obj.name` raises `exc` once on `thread` (after the real call when `after`);
    returns the list the request ids it raised for land in."""
    real = getattr(obj, name)
    raised: list = []

    def failing(*args, **kwargs):
        mine = threading.current_thread().name.startswith(thread) and not raised
        if mine and not after:
            raised.append(args[0] if args else None)
            raise exc
        out = real(*args, **kwargs)
        if mine:
            raised.append(args[0] if args else None)
            raise exc
        return out

    setattr(obj, name, failing)
    return raised


def make(make_cache, port: int):
    # A short lookup budget (no retrieve budget added: prepare_at_match off) keeps the waits
    # for a deadline short.
    cache = make_cache(16, make_config(port, deadlines={"lookup_ms": 150},
                                       prepare_at_match=False))
    ready(cache)
    return cache, Sched(cache)


def stored(make_cache, daemon):
    """A cache, its scheduler, and a prefix the daemon holds (4 chunks), daemon idle."""
    cache, s = make(make_cache, daemon.port)
    ids = fresh_ids(4 * CHUNK)
    store(s, ids)
    daemon_idle(daemon, cache.orch)
    return cache, s, ids


def outcomes(orch) -> dict[str, float]:
    return {k: v for k, v in orch.metrics.snapshot().items()
            if k.startswith(("loadback_prefix_outcomes_total", "loadback_live_prefixes"))}


def delta(before: dict, after: dict) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def daemon_idle(daemon, orch) -> None:
    wait_for(lambda: orch.pending_debts() == 0, 15, "every owed release paid")
    wait_for(lambda: not daemon.client_holds(), 15, "the daemon to hold nothing of ours")


def errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# --------------------------------------------------------------- defect 2: one owner


@pytest.mark.parametrize("instant", ["_touch_session", "_enter"])
def test_drop_while_match_runs_releases_once(live_daemon, make_cache, caplog, instant):
    """The LOOKUP resolves as a miss at its deadline while the worker is still inside
    match (stopped just after the session was opened, or just after the prefix went live);
    the scheduler thread then drops the request. Released once: one outcome, no
    MachineError, nothing left on the daemon."""
    cache, s, ids = stored(make_cache, live_daemon)
    orch = cache.orch
    gate = Gate(LOOKUP_THREAD)
    hold_after(orch, instant, gate)
    before = outcomes(orch)
    b = s.new_req("b", ids + [5])
    s.prefetch(b)
    job = cache._lookups[b.cache_request_handle]
    gate.wait_reached()
    s.poll(b)                                    # past the deadline: a miss for good
    assert job.abandoned and not job.done.is_set()
    assert s.match(b).host_hit_length == 0
    s.abort(b)                                   # the scheduler drops it: match still runs
    gate.go.set()
    assert job.done.wait(10)
    daemon_idle(live_daemon, orch)
    assert errors(caplog) == []
    assert orch.live_prefixes() == 0
    assert delta(before, outcomes(orch)) == {
        "loadback_prefix_outcomes_total{reason=aborted,state=degraded}": 1.0}


def test_miss_at_deadline_never_becomes_a_live_promise(live_daemon, make_cache, caplog):
    """match_prefix resolves the LOOKUP as a miss at its deadline, and the worker's hit
    lands right after (before the promise is published): the request recomputes, the
    worker releases the hit, counted once."""
    cache, s, ids = stored(make_cache, live_daemon)
    orch = cache.orch
    gate = Gate(LOOKUP_THREAD)
    hold_after(orch, "match", gate)              # the real match answered a hit, then stops
    worker = cache._worker
    real_answer = worker.answer

    def answer_at_deadline(job, now=None):
        now = time.monotonic() if now is None else now
        got = real_answer(job, max(now, job.deadline))  # this pass is at the deadline
        if got == 0 and job.abandoned:
            gate.go.set()                        # ... and the worker's answer lands now
            assert job.done.wait(10)
            assert job.tokens == 4 * CHUNK
        return got

    worker.answer = answer_at_deadline
    before = outcomes(orch)
    b = s.new_req("b", ids + [5])
    s.prefetch(b)
    gate.wait_reached()
    assert s.match(b).host_hit_length == 0       # not the late hit
    worker.answer = real_answer
    got = s.admit(b, prefetch=False)
    assert got["loaded"] == 0 and got["host_hit"] == 0
    s.finish(b)
    s.flush()
    tree_consistent(cache, idle=True)
    daemon_idle(live_daemon, orch)
    assert errors(caplog) == []
    assert delta(before, outcomes(orch)) == {
        "loadback_prefix_outcomes_total{reason=aborted,state=degraded}": 1.0}


def release(req, cache) -> None:
    """SGLang's release_kv_cache of a finished request, without the scheduler passes that
    drain the STORE behind it (Sched.finish minus settle)."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import release_kv_cache

    req.finished_reason = FINISH_LENGTH(length=0)
    release_kv_cache(req, cache, checkpoint=True)


def loads_back(s: Sched, ids, rid: str) -> None:
    """A later request loads `ids` back, byte-exact, and finishes cleanly."""
    r = s.new_req(rid, ids + [7])
    got = s.admit(r)
    assert got["loaded"] == len(ids) and kv_matches(s.pool, got["loaded_slots"], ids, 0)
    s.finish(r)
    s.flush()
    tree_consistent(s.cache, idle=True)


# ------------------------------------------------- defect 3: workers that keep working


def test_raising_finish_on_the_store_worker_does_not_stop_later_stores(live_daemon,
                                                                      make_cache):
    cache, s = make(make_cache, live_daemon.port)
    orch = cache.orch
    gate = Gate(STORE_THREAD)
    hold_before(orch, "store", gate)
    raised = fail_once_on(orch, "finish", STORE_THREAD, RuntimeError("end_session failed"))
    a = s.new_req("a", fresh_ids(2 * CHUNK) + [1])
    s.admit(a)
    release(a, cache)         # the STORE is held: the session end is left to the worker
    gate.wait_reached()
    gate.go.set()
    s.settle()                # the store's node is unlocked although its finish raised
    assert len(raised) == 1 and raised[0].startswith(a.rid)  # it raised, on the worker
    assert cache.protected_size() == 0
    ids = fresh_ids(4 * CHUNK)
    store(s, ids)             # later stores still go through, and unlock their nodes
    tree_consistent(cache, idle=True)
    loads_back(s, ids, "b")
    daemon_idle(live_daemon, orch)


def test_raising_abort_on_the_lookup_worker_does_not_stop_later_lookups(live_daemon,
                                                                       make_cache):
    cache, s, ids = stored(make_cache, live_daemon)
    orch = cache.orch
    gate = Gate(LOOKUP_THREAD)
    hold_after(orch, "match", gate)
    raised = fail_once_on(orch, "abort", LOOKUP_THREAD, RuntimeError("release failed"))
    a = s.new_req("a", ids + [5])
    s.prefetch(a)
    job = cache._lookups[a.cache_request_handle]
    gate.wait_reached()
    s.poll(a)                 # a miss at its deadline: the worker releases its late hit
    gate.go.set()
    assert job.done.wait(10)
    wait_for(lambda: raised, 10, "the worker's release of the late LOOKUP")
    s.abort(a)
    loads_back(s, ids, "b")   # the next LOOKUP is answered by the same worker
    daemon_idle(live_daemon, orch)


def test_lookups_past_their_deadline_never_reach_the_daemon(live_daemon, make_cache,
                                                            caplog):
    """A burst queued behind a LOOKUP the worker is held in; by the time the worker gets
    to them their deadlines have passed (the scheduler has not polled them yet): none is
    sent, each resolves as a miss, nothing is left on the daemon."""
    cache, s, ids = stored(make_cache, live_daemon)
    orch = cache.orch
    gate = Gate(LOOKUP_THREAD)
    hold_after(orch, "match", gate)
    first = s.new_req("first", ids + [1])
    s.prefetch(first)
    gate.wait_reached()
    sent: list[str] = []
    conn = orch.connector
    for name in ("lookup", "lookup_hit_tokens"):
        def counted(*args, _real=getattr(conn, name), _name=name, **kwargs):
            sent.append(_name)
            return _real(*args, **kwargs)
        setattr(conn, name, counted)
    burst = [s.new_req(f"burst{i}", ids + [10 + i]) for i in range(6)]
    for r in burst:
        s.prefetch(r)
    jobs = [cache._lookups[r.cache_request_handle] for r in burst]
    held_depth = getattr(cache, "lookup_queue_depth", None)
    last = max(j.deadline for j in jobs)
    wait_for(lambda: time.monotonic() > last, 10, "the burst's deadlines to pass")
    gate.go.set()
    for j in jobs:
        assert j.done.wait(10)
    assert sent == []
    assert held_depth == 1 + len(burst)
    assert cache.lookup_queue_depth == 0 and cache._worker.expired == len(burst)
    for r in burst:
        s.poll(r)
        assert s.match(r).host_hit_length == 0
        s.abort(r)
    s.abort(first)
    daemon_idle(live_daemon, orch)
    assert errors(caplog) == []
    assert orch.live_prefixes() == 0


def test_lookup_queue_is_bounded_and_a_skipped_lookup_recomputes(live_daemon, make_cache):
    """With the worker held in one LOOKUP and `max_queued` jobs held, a further prefetch
    hands over nothing (no job, counted); that request recomputes; the held ones complete."""
    cache, s, ids = stored(make_cache, live_daemon)
    orch = cache.orch
    worker = cache._worker
    worker.max_queued = 3
    gate = Gate(LOOKUP_THREAD)
    hold_after(orch, "match", gate)
    reqs = [s.new_req(f"lb{i}", ids + [20 + i]) for i in range(5)]
    s.prefetch(reqs[0])
    gate.wait_reached()
    for r in reqs[1:]:
        s.prefetch(r)
    queued = [r for r in reqs if r.cache_request_handle in cache._lookups]
    assert queued == reqs[:3] and worker.skipped == 2
    assert cache.lookup_queue_depth == 3
    gate.go.set()
    for r in reqs:
        s.poll(r)
        s.match(r)
        s.abort(r)
    assert cache.lookup_queue_depth == 0
    daemon_idle(live_daemon, orch)
    assert orch.live_prefixes() == 0


def test_a_store_that_went_through_counts_until_it_is_drained(live_daemon, make_cache):
    """A finished store keeps its tree lock until the scheduler thread drains it: it still
    counts against the bound, so undrained stores cannot pile up locked nodes."""
    cache, s = make(make_cache, live_daemon.port)
    worker = cache._store_worker
    worker.max_queued = 1
    a = s.new_req("d0", fresh_ids(2 * CHUNK) + [1])
    s.admit(a)
    release(a, cache)
    wait_for(lambda: worker.completed.qsize() == 1, 10, "the first store to go through")
    assert not worker.has_room("next") and worker.skipped == 1
    s.settle()
    assert worker.has_room("next") and cache.protected_size() == 0
    daemon_idle(live_daemon, cache.orch)


def test_store_queue_is_bounded_and_a_skipped_store_locks_nothing(live_daemon, make_cache):
    cache, s = make(make_cache, live_daemon.port)
    orch = cache.orch
    worker = cache._store_worker
    worker.max_queued = 2
    gate = Gate(STORE_THREAD)
    hold_before(orch, "store", gate)
    reqs = [s.new_req(f"q{i}", fresh_ids(2 * CHUNK) + [1]) for i in range(4)]
    for r in reqs:
        s.admit(r)
        release(r, cache)
    gate.wait_reached()
    assert cache.protected_size() == 2 * (2 * CHUNK)  # only the queued stores' nodes
    assert cache.store_queue_depth == 2 and worker.skipped == 2
    tree_consistent(cache)
    gate.go.set()
    s.settle()
    assert cache.store_queue_depth == 0 and cache.protected_size() == 0
    tree_consistent(cache, idle=True)
    daemon_idle(live_daemon, orch)


@pytest.mark.parametrize("which", ["store", "lookup"])
def test_a_dead_worker_thread_is_noticed_and_replaced(live_daemon, make_cache, caplog,
                                                     which):
    """A BaseException gets past every handler and ends the thread: its job still settles,
    the next submit or poll starts a new thread (one ERROR), later work goes through."""
    cache, s, ids = stored(make_cache, live_daemon)
    orch = cache.orch
    thread, method = {"store": (STORE_THREAD, "store"), "lookup": (LOOKUP_THREAD, "match")}[which]
    gate = Gate(thread)
    worker = cache._store_worker if which == "store" else cache._worker
    dead = worker._thread
    fail_once_on(orch, method, thread, SystemExit(), after=False)
    hold_before(orch, method, gate)
    if which == "store":
        a = s.new_req("a", fresh_ids(2 * CHUNK) + [1])
        s.admit(a)
        release(a, cache)
        gate.wait_reached()
        gate.go.set()
        wait_for(lambda: not dead.is_alive(), 10, "the store thread to die")
        s.settle()            # its node was unlocked all the same
        assert cache.protected_size() == 0
        ids = fresh_ids(4 * CHUNK)
        store(s, ids)
    else:
        a = s.new_req("a", ids + [5])
        s.prefetch(a)
        job = cache._lookups[a.cache_request_handle]
        gate.wait_reached()
        gate.go.set()
        assert job.done.wait(10)
        wait_for(lambda: not dead.is_alive(), 10, "the lookup thread to die")
        s.poll(a)
        assert s.match(a).host_hit_length == 0
        s.abort(a)
    assert worker._thread is not dead and worker._thread.is_alive() and worker.restarts == 1
    loads_back(s, ids, "b")
    daemon_idle(live_daemon, orch)
    died = [m for m in errors(caplog) if "died" in m]
    assert len(died) == 1, errors(caplog)


@pytest.mark.skipif(not NEW_API, reason="0.5.20 looks up in match_prefix, on the scheduler")
def test_several_lookup_threads_load_each_request_of_a_step_byte_exact(live_daemon,
                                                                       make_cache):
    """sglang.lookup_threads 3: four requests queued in one pass are matched on three
    threads; each loads its own prefix back byte-exact and the daemon ends idle."""
    cache = make_cache(16, make_config(live_daemon.port, sglang={"lookup_threads": 3}))
    ready(cache)
    s = Sched(cache)
    prefixes = [fresh_ids(2 * CHUNK) for _ in range(4)]
    for ids in prefixes:
        store(s, ids)
    assert len(cache._worker._threads) == 3
    reqs = [s.new_req(f"step-{i}", ids + [9]) for i, ids in enumerate(prefixes)]
    for r in reqs:
        s.prefetch(r)
    for r, ids in zip(reqs, prefixes):  # one step admits all four, then they finish
        got = s.admit(r, prefetch=False)
        assert got["loaded"] == len(ids) and kv_matches(s.pool, got["loaded_slots"], ids, 0)
    for r in reqs:
        s.finish(r)
    s.flush()
    tree_consistent(cache, idle=True)
    daemon_idle(live_daemon, cache.orch)
