"""Registration checks and the operator's log lines, against the real lmcache 0.5.6 daemon.

A daemon whose --chunk-size is not the config's chunk_size is refused: never registered, every
request recomputes (match answers 0 at once), one ERROR naming both values and the fix,
`loadback_daemon_refused{reason="chunk_size"}` 1; restarted with the right size it is accepted
without a new orchestrator. A daemon killed and restarted gives one WARNING per change: down,
breaker open, re-registered with the new epoch, breaker closed.

The daemon's CPU worker count (the lookup fence's single-worker precondition) is checked only
through its HTTP API (`mp_http_port`, its /config): lmcache 0.5.6 reports `max_cpu_workers` over
no ZMQ operation (nor in its /status); test_cpu_workers.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.testing.os_delay import OsDelay
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator import LoadBackOrchestrator
from tests.conftest import CHUNK, make_pool
from tests.integration.test_orchestrator_daemon import Harness, config_for, wait_for

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(180)]

REFUSED = 'loadback_daemon_refused{reason=chunk_size}'


def _ticks(orch) -> list[int]:
    """A counter of the heartbeats run from now on (the orchestrator's on_tick)."""
    n = [0]

    def tick() -> None:
        n[0] += 1

    orch.on_tick(tick)
    return n


def _records(caplog, level, text):
    return [r.getMessage() for r in caplog.records
            if r.name == "loadback" and r.levelno == level and text in r.getMessage()]


def test_a_daemon_of_another_chunk_size_is_refused_then_accepted_after_its_restart(
        layout, caplog):
    caplog.set_level(logging.DEBUG, logger="loadback")
    d = DaemonProcess(chunk_size=2 * CHUNK, http=True)
    d.start()
    conn = LMCacheMPConnector(d.endpoint, layout, connect_timeout_s=0.2)
    pool = make_pool(layout, 4096)
    orch = LoadBackOrchestrator(config_for(d), conn, kv_pool=pool)
    try:
        assert wait_for(lambda: orch.link.refused is not None, 20)
        ticks = _ticks(orch)
        assert wait_for(lambda: ticks[0] >= 6, 20)  # six more heartbeats: nothing new
        errors = _records(caplog, logging.ERROR, "refused")
        assert errors == [
            f"daemon refused, every request recomputes until one with the right chunk size "
            f"registers: daemon {d.endpoint} --chunk-size {2 * CHUNK}, this config chunk_size "
            f"{CHUNK}: start the daemon with --chunk-size {CHUNK} or set chunk_size: "
            f"{2 * CHUNK}"]
        assert orch.metrics.snapshot()[REFUSED] == 1
        assert orch.link.registered_epoch is None and d.held()["registered"] == 0
        toks = list(range(8 * CHUNK))
        with OsDelay() as delay:
            res = orch.match("refused-1", toks)
        assert res.tokens == 0 and delay.took_s < 0.005 + delay.seconds, (res, delay.describe())
        assert not orch.store("refused-s", toks, torch.arange(len(toks)))
        assert orch.metrics.snapshot()["loadback_daemon_up"] == 1

        # The right size, same port: accepted at the next registration, no new orchestrator.
        d.chunk_size = CHUNK
        d.restart()
        assert orch.wait_registered(30)
        assert orch.link.refused is None and orch.metrics.snapshot()[REFUSED] == 0
        assert len(_records(caplog, logging.WARNING, "accepted: its chunk size")) == 1
        assert len(_records(caplog, logging.ERROR, "refused")) == 1
        h_toks = list(range(1000, 1000 + 4 * CHUNK))
        assert orch.store("ok-s", h_toks, torch.arange(len(h_toks)))
        orch.finish("ok-s")
        assert orch.match("ok-1", h_toks).tokens == len(h_toks)
        orch.finish("ok-1")
    finally:
        orch.close()
        d.stop()


def test_kill_and_restart_give_one_warning_per_change(live_daemon, layout, caplog):
    caplog.set_level(logging.DEBUG, logger="loadback")
    h = Harness(live_daemon, layout,
                breaker={"consecutive_failures": 2, "cooldown_ms": 50, "cooldown_max_ms": 200})
    try:
        assert h.orch.wait_registered(20)
        assert _records(caplog, logging.WARNING, "transfer mode") == [
            f"daemon {live_daemon.endpoint}: transfer mode pickle chosen (setting auto)"]
        first = h.orch.link.registered_epoch
        live_daemon.kill()
        assert wait_for(lambda: h.orch.breaker.state != "closed", 10)
        ticks = _ticks(h.orch)
        assert wait_for(lambda: ticks[0] >= 10, 20)  # ten heartbeats and probes: nothing new
        down = _records(caplog, logging.WARNING, " down")
        assert len(down) == 1 and down[0].startswith(f"daemon {live_daemon.endpoint} down: ")
        assert len(_records(caplog, logging.WARNING, "circuit breaker open")) == 1
        assert len(_records(caplog, logging.WARNING, "circuit breaker half-open")) == 1
        live_daemon.start()
        assert h.orch.wait_registered(30)
        epoch = h.orch.link.registered_epoch
        assert _records(caplog, logging.WARNING, "re-registered") == [
            f"daemon {live_daemon.endpoint}: re-registered with a new incarnation (epoch "
            f"{first} -> {epoch}); what was owed to the old one is dropped"]
        assert len(_records(caplog, logging.WARNING, "circuit breaker closed")) == 1
        # The same transfer mode again: not logged again.
        assert len(_records(caplog, logging.WARNING, "transfer mode")) == 1
    finally:
        h.close()
