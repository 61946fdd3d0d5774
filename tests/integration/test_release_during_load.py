"""A release (abort, finish, close) from another thread while load_back runs for the same
request, against the real daemon: the load's thread is stopped at the worst instants (the
daemon's chunks in hand, the copy not yet made; the copy made, the outcome not yet counted)
by events, never sleeps. load_back owns the release while it runs, as match does: the
release is recorded and carried out on load_back's thread once it returned, so the prefix
ends once, counted once, and the daemon is left holding nothing."""

from __future__ import annotations

import threading

import pytest

from lmcache_loadback.orchestrator import PrefixState
from tests.conftest import kv_of, same_kv

from .test_orchestrator_daemon import h  # noqa: F401

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(120)]

SEEDS = {("abort", "before_copy"): 31, ("abort", "after_copy"): 32,
         ("finish", "before_copy"): 33, ("finish", "after_copy"): 34}


def outcomes(h) -> float:
    return sum(v for k, v in h.orch.metrics.snapshot().items()
               if k.startswith("loadback_prefix_outcomes_total"))


class Stop:
    """Stops the first thread that calls `target.name` there, before the call, until `go`
    (`there` is set once it stopped); later calls pass."""

    def __init__(self, target, name: str) -> None:
        self.there, self.go = threading.Event(), threading.Event()
        real = getattr(target, name)

        def stopped(*args, **kwargs):
            if not self.there.is_set():
                self.there.set()
                assert self.go.wait(30), "never let go"
            return real(*args, **kwargs)

        setattr(target, name, stopped)


def load_in_thread(h, rid, dst):
    out: dict = {}

    def run():
        try:
            out["res"] = h.orch.load_back(rid, dst)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            out["exc"] = exc

    th = threading.Thread(target=run)
    th.start()
    return th, out


@pytest.mark.parametrize("release", ["abort", "finish"])
@pytest.mark.parametrize("where", ["before_copy", "after_copy"])
def test_a_release_while_load_back_runs_is_carried_out_once_after_it(h, release, where):
    # A seed per case: the module's daemon keeps what earlier cases stored.
    toks, src = h.stored(256, seed=SEEDS[release, where])
    rid = f"race-{release}-{where}"
    assert h.orch.match(rid, toks).tokens == 256
    dst = h.slots(256)
    before = outcomes(h)
    stop = (Stop(h.conn, "_land") if where == "before_copy"
            else Stop(h.orch, "_record_outcome"))
    th, out = load_in_thread(h, rid, dst)
    try:
        assert stop.there.wait(30), "load_back never reached the stop"
        getattr(h.orch, release)(rid)  # the engine's other thread, mid-load: returns at once
        assert th.is_alive() and outcomes(h) == before  # recorded, not carried out yet
    finally:
        stop.go.set()
        th.join(30)
    assert not th.is_alive() and "exc" not in out, out.get("exc")
    res = out["res"]
    # The load ran to its end: it landed, byte-exact, and says so.
    assert res.state == PrefixState.LOADED and res.loaded_tokens == 256
    assert same_kv(kv_of(h.pool, src), kv_of(h.pool, dst))
    # Then the release: the prefix is gone, one outcome counted, nothing held.
    assert h.orch.state_of(rid) is None and outcomes(h) == before + 1
    held = h.settle()
    assert held["read_locks"] == 0 and held["sessions"] == 0


def test_close_while_load_back_runs_returns_and_the_prefix_ends_once(h):
    """Shutdown does not wait on a load the engine is still running; the load ends its
    prefix when it returns (the daemon's TTL ends what the closed link can no longer pay)."""
    toks, src = h.stored(256, seed=35)
    assert h.orch.match("closing", toks).tokens == 256
    dst = h.slots(256)
    before = outcomes(h)
    stop = Stop(h.conn, "_land")
    th, out = load_in_thread(h, "closing", dst)
    closer = threading.Thread(target=h.orch.close)
    try:
        assert stop.there.wait(30)
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "close waited on the stopped load"
    finally:
        stop.go.set()
        th.join(30)
    assert not th.is_alive() and "exc" not in out, out.get("exc")
    assert out["res"].state in (PrefixState.LOADED, PrefixState.DEGRADED)
    assert h.orch.state_of("closing") is None and outcomes(h) == before + 1
