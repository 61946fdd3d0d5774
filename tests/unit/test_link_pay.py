"""DaemonLink.pay is exception-safe, and the releaser pays a debt as soon as its copy is done.

A debt's `run` or `ready` that raises something no daemon failure explains (a bug, a CUDA
error in `Event.query()`) must not cost the other debts, nor reorder a request's debts. The
raising callables here are plain functions standing for such a bug: the real daemon cannot
produce one. The link talks to the in-process connector (its epoch and registration only).
"""

from __future__ import annotations

import logging
import threading

import torch

from lmcache_loadback.connectors.errors import DaemonTimeout, RequestDropped
from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.testing.memory import InMemoryConnector
from lmcache_loadback.orchestrator import LoadBackConfig
from lmcache_loadback.orchestrator.instruments import product_metrics
from lmcache_loadback.orchestrator.debts import Debt
from lmcache_loadback.orchestrator.link import DaemonLink
from lmcache_loadback.orchestrator.policies import CircuitBreaker


def _link(*, background: bool = False, interval_ms: float = 1000.0) -> DaemonLink:
    layout = KVLayout(num_layers=1, num_heads=2, head_dim=8, dtype=torch.float16, chunk_size=16)
    cfg = LoadBackConfig.from_dict({"chunk_size": 16, "heartbeat": {"interval_ms": interval_ms}})
    conn = InMemoryConnector(layout)
    return DaemonLink(conn, cfg, CircuitBreaker(cfg.breaker), product_metrics(),
                      background=background)


def _failed(link: DaemonLink, what: str) -> float:
    return link.metrics.snapshot()[f"loadback_releases_failed_total{{what={what}}}"]


class Ledger:
    """Debts that record their payment, in order."""

    def __init__(self, link: DaemonLink) -> None:
        self.link = link
        self.paid: list[str] = []

    def debt(self, name: str, request_id: str, *, what: str = "free_locks", raises=None,
             ready=None, idempotent: bool = False, max_tries: int = 20) -> Debt:
        def run(_timeout_s: float) -> bool:
            if raises is not None and raises():
                raise RuntimeError(f"bug in {name}")
            self.paid.append(name)
            return True

        return Debt(what, request_id, self.link.connector.epoch, run, idempotent, ready,
                    max_tries=max_tries)

    def queue(self, *debts: Debt) -> None:
        for d in debts:
            self.link._queue(d)  # queued as the releaser finds them (no inline payment)


def test_a_raising_run_between_two_good_debts_pays_both_and_keeps_request_order():
    link = _link()
    led = Ledger(link)
    broken = threading.Event()
    broken.set()
    bad = led.debt("bad", "r2", what="end_session", raises=broken.is_set, idempotent=True)
    led.queue(led.debt("good1", "r1"), bad, led.debt("after-bad", "r2"),
              led.debt("good2", "r3"))
    link.pay()
    assert led.paid == ["good1", "good2"]  # r2's later debt waits behind the failed one
    assert link.pending() == 2 and link.pending("r2") == 2 and bad.tries == 1
    broken.clear()  # the bug is gone: the same debt is paid, then the one behind it
    link.pay()
    assert led.paid == ["good1", "good2", "bad", "after-bad"]
    assert link.pending() == 0 and _failed(link, "end_session") == 0


def test_a_raising_run_that_may_have_reached_the_daemon_is_given_up_once_and_counted(caplog):
    """Not idempotent (a second free would strip another reader's lock): given up at once,
    counted, warned once; the request's next debt is paid in the same pass."""
    link = _link()
    led = Ledger(link)
    caplog.set_level(logging.DEBUG, logger="loadback")
    led.queue(led.debt("bad", "r1", what="commit_retrieve", raises=lambda: True),
              led.debt("after-bad", "r1"), led.debt("good", "r2"))
    link.pay()
    assert led.paid == ["after-bad", "good"]
    assert link.pending() == 0 and link.given_up == 1
    assert _failed(link, "commit_retrieve") == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "r1" in warnings[0].getMessage()


def test_a_raising_ready_never_pays_and_is_given_up_after_max_tries(caplog):
    """Whether a copy still reads the daemon's buffer is unknown: the commit is never sent
    on it. Asked again each pass, given up after max_tries, counted, warned about once."""
    link = _link()
    led = Ledger(link)
    caplog.set_level(logging.DEBUG, logger="loadback")

    def cuda_error() -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    bad = led.debt("commit", "r1", what="commit_retrieve", ready=cuda_error, max_tries=3)
    led.queue(led.debt("before", "r0"), bad, led.debt("end", "r1", what="end_session"),
              led.debt("after", "r2"))
    link.pay()
    assert led.paid == ["before", "after"] and link.pending("r1") == 2
    link.pay()
    assert link.pending("r1") == 2 and _failed(link, "commit_retrieve") == 0
    link.pay()  # third try: given up, and the request's session end goes ahead
    assert led.paid == ["before", "after", "end"]
    assert link.pending() == 0 and bad.tries == 3
    assert _failed(link, "commit_retrieve") == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "r1" in warnings[0].getMessage()


def test_a_ready_that_raised_once_then_holds_is_paid():
    link = _link()
    led = Ledger(link)
    calls = []

    def flaky_ready() -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("transient")
        return True

    led.queue(led.debt("commit", "r1", what="commit_retrieve", ready=flaky_ready))
    link.pay()
    assert led.paid == [] and link.pending() == 1
    link.pay()
    assert led.paid == ["commit"] and link.pending() == 0
    assert _failed(link, "commit_retrieve") == 0


def test_out_of_tries_is_counted():
    link = _link()
    d = Debt("abandon_lookup", "r1", link.connector.epoch, lambda _t: False, True, None,
             max_tries=2)
    link._queue(d)
    link.pay()
    link.pay()
    assert link.pending() == 0 and _failed(link, "abandon_lookup") == 1


def test_the_releaser_pays_within_milliseconds_of_ready_not_a_heartbeat_later():
    """The heartbeat interval is 30 s: the old releaser looked at a debt blocked on `ready`
    once per interval, holding the daemon's buffer that long after the copy completed."""
    link = _link(background=True, interval_ms=30_000)
    try:
        assert link.wait_registered(10)
        checked, copied, paid = threading.Event(), threading.Event(), threading.Event()

        def ready() -> bool:
            checked.set()
            return copied.is_set()

        link.owe("commit_retrieve", "r1", link.connector.epoch,
                 lambda _t: paid.set() or True, ready=ready)
        assert checked.wait(10)  # the releaser saw the copy still running
        copied.set()
        assert paid.wait(5)  # well under the 30 s interval (milliseconds in practice)
        assert link.pending() == 0
    finally:
        link.stop_threads()


def test_a_debt_being_paid_is_still_pending_until_its_call_returned():
    """pending() counts the pass in flight: a caller waiting for "nothing owed" (settle, the
    status page) must not read 0 while a session end is on its way to the daemon."""
    link = _link()
    in_call, go = threading.Event(), threading.Event()

    def run(_timeout_s: float) -> bool:
        in_call.set()
        assert go.wait(10)
        return True

    e = Debt("end_session", "r1", link.connector.epoch, run, True, None)
    other = Debt("free_locks", "r2", link.connector.epoch, lambda _t: True, False, None)
    link._queue(e)
    link._queue(other)
    payer = threading.Thread(target=link.pay)
    payer.start()
    try:
        assert in_call.wait(10)
        assert link.pending() == 2 and link.pending("r1") == 1 and link.pending("r2") == 1
    finally:
        go.set()
        payer.join(10)
    assert not payer.is_alive() and link.pending() == 0


def _timing_out(led: Ledger, name: str, request_id: str, calls: list) -> Debt:
    """A free_locks whose call times out the first time (sent: the daemon may serve it)."""
    def run(timeout_s: float) -> bool:
        calls.append(name)
        if len(calls) == 1:
            raise DaemonTimeout("free_lookup_locks", timeout_s)
        led.paid.append(name)
        return True

    return Debt("free_locks", request_id, led.link.connector.epoch, run)


def test_a_release_that_timed_out_stays_owed_until_the_daemon_answered_it_never_resent():
    """Not idempotent, so never sent twice; but not paid either until the daemon answered
    it: the request's later debts wait behind it (a session end must not overtake it).
    Before: marked paid at the timeout, and the debts behind it went out at once."""
    link = _link()
    led = Ledger(link)
    calls: list[str] = []
    waiting = {"r1": 1}
    link.connector.unanswered = lambda request_id=None: waiting.get(request_id, 0)
    led.queue(_timing_out(led, "timed-out", "r1", calls), led.debt("after", "r1"),
              led.debt("other", "r2"))
    link.pay()
    link.pay()
    assert calls == ["timed-out"] and led.paid == ["other"] and link.pending("r1") == 2
    waiting["r1"] = 0  # the daemon answered it
    link.pay()
    assert calls == ["timed-out"] and led.paid == ["other", "after"]
    assert link.pending() == 0 and _failed(link, "free_locks") == 0


def test_a_timed_out_release_of_a_daemon_that_restarted_is_dropped_and_counted():
    link = _link()
    led = Ledger(link)
    link.connector.unanswered = lambda request_id=None: 1
    led.queue(_timing_out(led, "timed-out", "r1", []))
    link.pay()
    assert link.pending() == 1
    link.connector.epoch += 1  # the daemon restarted: it never held what it would release
    link.pay()
    assert link.pending() == 0 and link.stale_dropped == 1


def test_a_release_the_daemon_dropped_unserved_is_counted_failed():
    """RequestDropped: the daemon answered a later call but never this one (its handler
    raised). Never applied, so never paid: counted. Before: counted nowhere."""
    link = _link()

    def dropped(_t: float) -> bool:
        raise RequestDropped("free_lookup_locks: the daemon answered a later noop")

    link._queue(Debt("free_locks", "r1", link.connector.epoch, dropped))
    link.pay()
    assert link.pending() == 0 and _failed(link, "free_locks") == 1


def test_close_stops_paying_at_the_first_timeout_and_counts_the_rest_dropped(caplog):
    """A hung daemon: the first call of close's settling times out, nothing more is sent,
    and every debt left (the timed-out one included) is counted, with one WARNING."""
    link = _link()
    led = Ledger(link)
    calls: list[str] = []
    led.queue(_timing_out(led, "first", "r1", calls), led.debt("a", "r2"),
              led.debt("b", "r3", what="end_session", idempotent=True))
    link.begin_close(1.0)
    caplog.set_level(logging.WARNING, logger="loadback")
    link.close_out()
    assert calls == ["first"] and led.paid == [] and link.pending() == 0
    assert link.closed_dropped == 3
    assert _failed(link, "free_locks") == 2 and _failed(link, "end_session") == 1
    warned = [r.getMessage() for r in caplog.records if "not paid at close" in r.getMessage()]
    assert len(warned) == 1 and "3 release(s)" in warned[0] and "TTL" in warned[0]


def test_close_sends_nothing_while_the_breaker_is_open():
    link = _link()
    led = Ledger(link)
    led.queue(led.debt("a", "r1"))
    link.breaker.trip()
    link.begin_close(1.0)
    link.close_out()
    assert led.paid == [] and link.closed_dropped == 1 and _failed(link, "free_locks") == 1


def test_close_pays_what_a_healthy_daemon_is_owed():
    link = _link()
    led = Ledger(link)
    led.queue(led.debt("a", "r1"), led.debt("b", "r1"), led.debt("c", "r2"))
    link.begin_close(1.0)
    link.close_out()
    assert led.paid == ["a", "b", "c"] and link.closed_dropped == 0
