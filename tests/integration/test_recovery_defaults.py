"""Hits come back within 2 s of the daemon serving again, on the default config.

The breaker's backoff after a long outage is what bounds it: while open, nothing reaches the
daemon but one probe per cooldown, so a daemon that serves again just after a failed probe
waits a whole cooldown unseen (the old cap, 30 s). Each test lets the backoff grow to its cap
(or past 2 s, whichever comes first), makes the daemon serve again right after a probe failed
(the worst moment), and measures from the first answer to the test's own ping to the first
LOADED of a request matched after it. A restart without a proxy is seen by the connection's
epoch; a hang that ends (SIGSTOP, SIGCONT) and a restart behind a proxy are not.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator import LoadBackConfig, LoadBackOrchestrator, PrefixState
from lmcache_loadback.orchestrator.policies import BreakerState
from lmcache_loadback.testing.daemon import DaemonProcess, first_answer
from lmcache_loadback.testing.fault_proxy import FaultProxy, FaultRule
from lmcache_loadback.testing.os_delay import OsDelay
from tests.conftest import CHUNK, make_pool

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(180)]

RECOVERY_S = 2.0  # the promise: the first hit within this of the daemon serving again
SLACK_S = 0.25  # a registration and a LOOKUP + RETRIEVE on a loaded 2-core box
EXCUSED_CAP_S = 1.0  # at most this of what the machine took from the waiting thread
GROWN_S = 4.0  # a backoff this long already breaks the promise


def _orch(endpoint: str, port: int, layout) -> LoadBackOrchestrator:
    """The default config: only where the daemon is and its chunk size."""
    cfg = LoadBackConfig.from_dict({"mp_port": port, "chunk_size": CHUNK})
    conn = LMCacheMPConnector(endpoint, layout, model_name=cfg.cache_model(),
                              connect_timeout_s=cfg.deadlines.connect_ms / 1000)
    return LoadBackOrchestrator(cfg, conn, kv_pool=make_pool(layout, 1024))


def _backoff_grown(orch: LoadBackOrchestrator) -> threading.Event:
    """Set when a probe just failed and the breaker reopened with its cooldown at its cap
    (or at GROWN_S when the cap is longer)."""
    grown = threading.Event()
    at_least = min(orch.config.breaker.cooldown_max_ms / 1000, GROWN_S)
    inner = orch.breaker.on_change

    def changed(state: str) -> None:
        inner(state)
        if state == BreakerState.OPEN and orch.breaker.cooldown_s >= at_least:
            grown.set()
    orch.breaker.on_change = changed
    return grown


class Engine(threading.Thread):
    """An engine's traffic, one request every 20 ms: store the prompt until a match hits,
    then match + load_back. `loaded_at`: when the first LOADED of a request matched at or
    after `serving_at` returned (bounded: stops after `limit_s`)."""

    def __init__(self, orch: LoadBackOrchestrator, limit_s: float = 150.0) -> None:
        super().__init__(name="engine", daemon=True)
        self.orch, self.limit_s = orch, limit_s
        self.serving_at: float | None = None
        self.loaded = threading.Event()
        self.loaded_at = 0.0
        self.stop = threading.Event()
        g = torch.Generator().manual_seed(5)
        self.toks = torch.randint(0, 32000, (4 * CHUNK,), generator=g).tolist()

    def run(self) -> None:
        end = time.monotonic() + self.limit_s
        n = len(self.toks)
        for i in range(100_000):
            if self.stop.is_set() or time.monotonic() > end:
                return
            rid = f"r{i}"
            asked = time.monotonic()
            try:
                if self.orch.match(rid, self.toks).tokens:
                    res = self.orch.load_back(rid, torch.arange(n, 2 * n))
                    if (res.state == PrefixState.LOADED and self.serving_at is not None
                            and asked >= self.serving_at):
                        self.loaded_at = time.monotonic()
                        self.loaded.set()
                        return
                else:  # nothing cached (a restarted daemon holds nothing): store it
                    self.orch.store(f"s{i}", self.toks, torch.arange(n))
                    self.orch.finish(f"s{i}")
            finally:
                self.orch.finish(rid)
            self.stop.wait(0.02)


def _recovered(engine: Engine, serving_at: float) -> tuple[float, OsDelay]:
    """Seconds from `serving_at` to the engine's first LOADED, and what the machine took."""
    engine.serving_at = serving_at
    with OsDelay() as delay:
        assert engine.loaded.wait(60), "no hit within 60 s of the daemon serving again"
    return engine.loaded_at - serving_at, delay


def _assert_within(took: float, delay: OsDelay, orch: LoadBackOrchestrator) -> None:
    assert took <= RECOVERY_S + SLACK_S + delay.excused(EXCUSED_CAP_S), (
        f"first hit {took:.2f} s after the daemon served again (breaker cooldown cap "
        f"{orch.config.breaker.cooldown_max_ms:g} ms, heartbeat "
        f"{orch.config.heartbeat.interval_ms:g} ms); the waiting thread {delay.describe()}")


def _run(orch: LoadBackOrchestrator, fault, serve) -> float:
    """Register, start the traffic, `fault()`, wait for the backoff to grow, `serve()` (it
    answers when the daemon served again), then the recovery time."""
    assert orch.wait_registered(30)
    grown = _backoff_grown(orch)
    engine = Engine(orch)
    engine.start()
    try:
        assert engine.stop.wait(0) is False
        fault()
        assert grown.wait(90), f"the breaker's backoff never grew (state {orch.breaker.state})"
        took, delay = _recovered(engine, serve())
        _assert_within(took, delay, orch)
        return took
    finally:
        engine.stop.set()
        engine.join(timeout=30)


@pytest.mark.parametrize("fault", ["restart", "hang"])
def test_hits_resume_within_2s_of_the_daemon_serving_again_on_the_defaults(fault, layout,
                                                                           tmp_path):
    """restart: SIGKILL, then a new daemon on the same port (a new epoch); hang: SIGSTOP,
    then SIGCONT (the same connection, the same epoch)."""
    d = DaemonProcess(chunk_size=CHUNK, log_dir=str(tmp_path)).start()
    orch = _orch(d.endpoint, d.port, layout)

    def serve() -> float:
        d.start() if fault == "restart" else d.resume()
        return first_answer(d.endpoint)
    try:
        took = _run(orch, d.kill if fault == "restart" else d.pause, serve)
        print(f"{fault}: first hit {took:.2f} s after serving")
    finally:
        d.resume()
        orch.close()
        d.stop()


def test_hits_resume_within_2s_of_a_restart_behind_a_proxy_on_the_defaults(layout, tmp_path):
    """The proxy keeps our connection, so the epoch never moves. It swallows every request
    from the kill until the backoff has grown (the new daemon already runs behind it): the
    daemon serves again, through the proxy, when the proxy lets requests through."""
    d = DaemonProcess(chunk_size=CHUNK, log_dir=str(tmp_path)).start()
    proxy = FaultProxy(d.endpoint).start()
    orch = _orch(proxy.endpoint, proxy.port, layout)

    def fault() -> None:
        proxy.add_rule(FaultRule("silence", direction="request"))
        d.kill()
        d.start()

    def serve() -> float:
        proxy.clear()
        return first_answer(proxy.endpoint)
    try:
        print(f"behind a proxy: first hit {_run(orch, fault, serve):.2f} s after serving")
    finally:
        orch.close()
        proxy.close()
        d.stop()
