"""The demos' traffic runs past the window until a hit after the new daemon served (bounded):
on a loaded machine a restarted daemon took 22 s to serve, past a fixed 40 s window's end."""

from __future__ import annotations

from lmcache_loadback.harness.sglang.demo import AFTER_CAP_S, SideResult


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
