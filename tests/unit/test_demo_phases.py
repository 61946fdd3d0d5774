"""The demos' traffic runs past the window until a hit after the new daemon served (bounded):
on a loaded machine a restarted daemon took 22 s to serve, past a fixed 40 s window's end. The
kill and the restart wait for what the traffic saw (a hit; the outage answered), bounded."""

from __future__ import annotations

import threading
import time

from lmcache_loadback.harness.sglang.demo import AFTER_CAP_S, SideResult, Sent, _after
from lmcache_loadback.harness.sglang.server import Generation


class _Side(SideResult):
    hit = False

    def recovered(self) -> bool:
        return self.hit


def test_traffic_goes_on_after_the_window_until_a_hit_after_the_daemon_served():
    res = _Side("ours")
    assert res.traffic_due(39.0, 40.0)
    res.kill_s = 14.0
    assert res.traffic_due(50.0, 40.0)  # the new daemon is still starting
    res.restart_s = 45.0  # it answered a ping 5 s past the window
    assert res.traffic_due(70.0, 40.0)
    assert not res.traffic_due(45.0 + AFTER_CAP_S, 40.0)  # bounded
    res.hit = True
    assert not res.traffic_due(70.0, 40.0)


def test_without_a_kill_the_traffic_ends_with_the_window():
    assert not _Side("ours").traffic_due(40.0, 40.0)


def _answered(sent_s: float, storage: int) -> Sent:
    gen = Generation([1], [2], {"cached_tokens_details": {"storage": storage}}, 0.05)
    return Sent(0, 0, sent_s, gen, sent_s + 0.05)


def test_the_phases_key_to_what_the_traffic_saw():
    res = SideResult("ours")
    res.sent.append(Sent(0, 0, 1.0))  # sent, not answered yet
    assert not res.answered_since(0.0) and not res.hit_since(0.0)
    res.sent.append(_answered(2.0, 0))
    assert res.answered_since(1.5) and not res.answered_since(2.5) and not res.hit_since(0.0)
    res.sent.append(_answered(3.0, 144))
    assert res.hit_since(3.0) and not res.hit_since(3.5)
    res.restart_s = 2.5
    assert res.recovered()


def test_a_phase_waits_for_its_event_past_its_earliest_time_and_no_later_than_its_latest():
    stop, seen, done = threading.Event(), threading.Event(), []
    t0 = time.monotonic() - 10.0  # the earliest time (5 s in) has passed, the latest has not
    waiter = threading.Thread(target=lambda: done.append(_after(t0, 5.0, 1000.0, seen.is_set,
                                                                 stop)))
    waiter.start()
    assert not done  # nothing seen yet: still waiting
    seen.set()
    waiter.join(timeout=10)
    assert done == [True]
    assert _after(t0, 5.0, 8.0, lambda: False, stop)  # past its latest: goes ahead unseen
    stop.set()
    assert not _after(t0, 5.0, 1000.0, lambda: False, stop)  # the side is ending
