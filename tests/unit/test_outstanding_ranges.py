"""Outstanding: one prepare_retrieve per key identity and instance (connectors/retrieval.py)."""

from __future__ import annotations

import threading

import pytest

from lmcache_loadback.connectors.retrieval import Outstanding, TransferBusy
from lmcache_loadback.orchestrator import DegradeReason
from lmcache_loadback.orchestrator.failures import classify


def test_a_range_is_busy_until_its_own_claim_is_released():
    o = Outstanding()
    first = o.claim("k", epoch=1)
    with pytest.raises(TransferBusy):
        o.claim("k", epoch=1)
    o.claim("other", epoch=1)  # another range is its own
    o.release("k", object())  # not its claim: nothing ends
    with pytest.raises(TransferBusy):
        o.claim("k", epoch=1)
    o.release("k", first)
    o.claim("k", epoch=1)


def test_a_new_daemon_incarnation_drops_every_outstanding_range():
    o = Outstanding()
    old = o.claim("k", epoch=1)
    o.claim("j", epoch=1)
    new = o.claim("k", epoch=2)
    assert len(o) == 1
    o.release("k", old)  # the old incarnation's commit ends nothing of the new one
    with pytest.raises(TransferBusy):
        o.claim("k", epoch=2)
    o.release("k", new)
    assert len(o) == 0


def test_a_claim_whose_commit_never_came_stops_counting_after_the_read_ttl():
    now = [0.0]
    o = Outstanding(max_age_s=300, clock=lambda: now[0])
    o.claim("k", epoch=1)
    now[0] = 299.0
    with pytest.raises(TransferBusy):
        o.claim("k", epoch=1)
    now[0] = 300.0
    o.claim("k", epoch=1)


def test_of_two_threads_claiming_one_range_exactly_one_wins():
    o = Outstanding()
    start, won, busy = threading.Barrier(8), [], []

    def claim():
        start.wait()
        try:
            won.append(o.claim("k", epoch=1))
        except TransferBusy:
            busy.append(1)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert (len(won), len(busy)) == (1, 7)


def test_a_busy_range_degrades_transfer_busy_and_keeps_the_breaker_closed():
    out = classify("retrieve", TransferBusy("busy"))
    assert out.reason is DegradeReason.TRANSFER_BUSY
    assert out.breaker_ok and not out.suspect and out.timeout_op is None


def test_a_claim_waits_for_a_commit_already_handed_over_and_not_for_a_live_one():
    o = Outstanding()
    live = o.claim("k", epoch=1)
    with pytest.raises(TransferBusy):
        o.claim("k", epoch=1, wait_s=0.05)  # not due: refused without waiting it out
    o.mark_due("k", live)
    waiting, got = threading.Event(), []

    def second():
        waiting.set()
        got.append(o.claim("k", epoch=1, wait_s=30))

    t = threading.Thread(target=second)
    t.start()
    assert waiting.wait(10)
    o.release("k", live)  # the handed-over commit was answered
    t.join(10)
    assert len(got) == 1 and got[0] is not live
    o.mark_due("k", got[0])
    with pytest.raises(TransferBusy):
        o.claim("k", epoch=1, wait_s=0.01)  # due, but not answered in time
