"""A crashed daemon costs at most the calls already in flight a deadline: the transport's
monitor sees the disconnect, later calls raise DaemonUnavailable at once until a daemon
accepts us again, and a call waiting for a reply that can no longer come stops waiting
(real lmcache 0.5.6 daemon, SIGKILL)."""

from __future__ import annotations

import threading
import time

import pytest

from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.connectors.errors import ConnectorError, DaemonTimeout, DaemonUnavailable
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from tests.conftest import CHUNK

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(120)]

DEADLINE_S = 0.05


def timed(fn) -> tuple[float, BaseException | None]:
    t0 = time.monotonic()
    try:
        fn()
    except ConnectorError as exc:
        return time.monotonic() - t0, exc
    return time.monotonic() - t0, None


def test_after_sigkill_calls_fail_fast_and_the_call_in_flight_ends_at_the_disconnect(layout):
    d = DaemonProcess(chunk_size=CHUNK).start()
    c = LMCacheMPConnector(d.endpoint, layout, connect_timeout_s=0.2)
    toks = list(range(64))
    try:
        c.register(5.0)
        assert c.lookup_hit_tokens(toks, "warm", 2.0) == 0
        # One call in flight on another thread when the daemon dies.
        in_flight: list = []
        connected, go = threading.Event(), threading.Event()

        def caller() -> None:
            c.noop(2.0)  # this thread's connection is up
            connected.set()
            go.wait(10)
            in_flight.append(timed(lambda: c.noop(3.0)))

        th = threading.Thread(target=caller)
        th.start()
        assert connected.wait(10)
        d.pause()
        go.set()
        deadline = time.monotonic() + 5
        while c.unanswered() == 0 and time.monotonic() < deadline:
            time.sleep(0.001)  # until the noop is on its way to the hung daemon
        d.kill()
        calls = [timed(lambda: c.lookup_hit_tokens(toks, f"after-{i}", DEADLINE_S))
                 for i in range(20)]
        th.join()
        paid = [t for t, _ in calls if t >= DEADLINE_S * 0.9]
        assert len(paid) <= 1, [round(t * 1000, 1) for t, _ in calls]
        assert all(isinstance(e, DaemonUnavailable) for _, e in calls[-10:])
        fast = sorted(t for t, _ in calls[-10:])
        assert fast[5] < 0.005 and fast[-1] < DEADLINE_S / 2  # no wait (bounds for a busy CI box)
        assert "disconnected" in str(calls[-1][1])
        (t_in_flight, err), = in_flight
        # Sent before the crash: its reply can no longer come, so it ends at the disconnect
        # (a timeout: the daemon may have served it), well before its 3 s deadline.
        assert isinstance(err, DaemonTimeout) and "disconnected" in str(err)
        assert t_in_flight < 2.0
        # Back up: calls resume by themselves once the daemon accepts us again.
        d.start()
        deadline = time.monotonic() + 10
        while timed(lambda: c.noop(0.5))[1] is not None:
            assert time.monotonic() < deadline, "calls did not resume after the restart"
        assert c.noop(0.5) == "OK"
    finally:
        c.close()
        d.stop()
