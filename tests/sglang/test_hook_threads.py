"""The hook's worker threads against the real orchestrator and daemon, stepped by Events.

Each race is played in one order, on purpose: a worker thread is stopped at the instant that
matters (inside `match`, inside a STORE) by an Event, the scheduler thread (this test's
thread) does its part, then the worker is let go. Nothing is ordered by sleeping; the only
waits on time are for a deadline to pass and for the daemon's admin counts to settle.
"""

from __future__ import annotations

import logging
import threading

import pytest

from .conftest import (
    CHUNK,
    NEW_API,
    Sched,
    fresh_ids,
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
    wait_for(lambda: daemon.held()["read_locks"] == 0, 15, "the daemon's read locks freed")
    wait_for(lambda: daemon.held()["sessions"] == 0, 15, "the daemon's sessions ended")


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
    real_resolve = worker.resolve

    def resolve_at_deadline(job, now):
        got = real_resolve(job, max(now, job.deadline))  # this pass is at the deadline
        if got == 0 and job.abandoned:
            gate.go.set()                        # ... and the worker's answer lands now
            assert job.done.wait(10)
            assert job.tokens == 4 * CHUNK
        return got

    worker.resolve = resolve_at_deadline
    before = outcomes(orch)
    b = s.new_req("b", ids + [5])
    s.prefetch(b)
    gate.wait_reached()
    assert s.match(b).host_hit_length == 0       # not the late hit
    worker.resolve = real_resolve
    got = s.admit(b, prefetch=False)
    assert got["loaded"] == 0 and got["host_hit"] == 0
    s.finish(b)
    s.flush()
    tree_consistent(cache, idle=True)
    daemon_idle(live_daemon, orch)
    assert errors(caplog) == []
    assert delta(before, outcomes(orch)) == {
        "loadback_prefix_outcomes_total{reason=aborted,state=degraded}": 1.0}
