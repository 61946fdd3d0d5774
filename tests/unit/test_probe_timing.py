"""An open breaker's probe goes out when its cooldown ends, not at the heartbeat's next tick.

The link talks to the in-process connector (its ping and registration only): what is timed
here is the heartbeat thread's sleep, which no daemon fault changes.
"""

from __future__ import annotations

import threading
import time

import torch

from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.orchestrator import LoadBackConfig
from lmcache_loadback.orchestrator.instruments import product_metrics
from lmcache_loadback.orchestrator.link import DaemonLink
from lmcache_loadback.orchestrator.policies import BreakerState, CircuitBreaker
from lmcache_loadback.testing.memory import InMemoryConnector


class _Sleeps(threading.Event):
    """The heartbeat's wake event, telling when the heartbeat starts a sleep of a second or
    more (its interval, not a registration retry)."""

    def __init__(self) -> None:
        super().__init__()
        self.long_sleep = threading.Event()

    def wait(self, timeout=None):
        if timeout is None or timeout >= 1.0:
            self.long_sleep.set()
        return super().wait(timeout)


def test_an_open_breaker_is_probed_after_its_cooldown_not_a_heartbeat_interval_later():
    """Heartbeat every 30 s, cooldown 100 ms: the breaker opened by the request path while
    the heartbeat sleeps is probed (and closes: the daemon answers) well within 30 s."""
    layout = KVLayout(num_layers=1, num_heads=2, head_dim=8, dtype=torch.float16, chunk_size=16)
    cfg = LoadBackConfig.from_dict({"chunk_size": 16, "heartbeat": {"interval_ms": 30_000},
                                    "breaker": {"consecutive_failures": 1, "cooldown_ms": 100}})
    breaker = CircuitBreaker(cfg.breaker)
    link = DaemonLink(InMemoryConnector(layout), cfg, breaker, product_metrics(),
                      background=True)
    breaker.on_change = link.breaker_changed
    try:
        assert link.wait_registered(10)
        sleeps, first = _Sleeps(), link._wake
        link._wake = sleeps
        first.set()  # out of whatever it waits on now, into a wait on `sleeps`
        assert sleeps.long_sleep.wait(10), "the heartbeat never went to sleep for its interval"
        breaker.record(False)  # a request's call failed: open
        assert breaker.state == BreakerState.OPEN
        end = time.monotonic() + 10
        while breaker.state != BreakerState.CLOSED and time.monotonic() < end:
            time.sleep(0.01)
        assert breaker.state == BreakerState.CLOSED, "no probe within 10 s of the cooldown"
    finally:
        link.stop_threads()


def test_probe_in_counts_down_the_cooldown_and_is_none_when_closed():
    t = [0.0]
    b = CircuitBreaker(LoadBackConfig().breaker, clock=lambda: t[0])
    assert b.probe_in() is None
    b.trip()
    assert b.probe_in() == 0.5
    t[0] = 0.4
    assert abs(b.probe_in() - 0.1) < 1e-9
    t[0] = 0.6
    assert b.probe_in() == 0.0 and b.probe_due() and b.probe_in() == 0.0
    b.record(False)  # the probe failed: the cooldown doubles, up to the default cap of 1 s
    assert b.cooldown_s == 1.0
    b.probe_in()
    t[0] = 2.0
    assert b.probe_due()
    b.record(False)
    assert b.cooldown_s == 1.0  # capped
