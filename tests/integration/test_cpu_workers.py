"""The fence behind an abandoned call needs the daemon to serve that call's place in order;
lmcache 0.5.6's CPU pool (LOOKUP, prefetch status, free_lookup_locks, end_session, ping) does
only with one worker. `--max-workers N` raises it to N: a ping behind a LOOKUP is answered
while the LOOKUP still runs, and a session ended then comes back. No 0.5.6 operation proves a
request on that pool finished except its own reply, so such a daemon is refused at
registration (its HTTP API reports the count), with the fix in one ERROR line; with the fix
(`--max-cpu-workers 1`) `--max-workers 4` still gives 4 GPU workers, whose pool is bound to
each connection and keeps the fences sound: the fence tests of test_fault_proxy and
test_abandoned_prepare run here again against such a daemon (test_unanswered is
parametrized itself). Real lmcache 0.5.6 daemons.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator import LoadBackOrchestrator
from lmcache_loadback.testing.daemon import DaemonProcess
from tests.conftest import CHUNK, make_pool
from tests.integration.test_abandoned_prepare import (  # noqa: F401 - collected here again
    test_a_load_time_prepare_abandoned_at_its_deadline_is_committed_once_served,
    test_a_prepare_at_match_abandoned_at_its_deadline_is_committed_once_served,
)
from tests.integration.test_fault_proxy import (  # noqa: F401 - its fixtures and fence test
    connector,
    proxy,
    test_calls_swallowed_by_a_wedged_peer_are_settled_once_it_answers_again,
)
from tests.integration.test_orchestrator_daemon import config_for, wait_for

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(180)]

#: What an operator who raised --max-workers for throughput adds: one CPU worker again.
FIXED = ["--max-workers", "4", "--max-cpu-workers", "1"]
REFUSED = "loadback_daemon_refused{reason=cpu_workers}"


@pytest.fixture(scope="module")
def upstream():
    """test_fault_proxy's daemon, with 4 GPU workers and one CPU worker."""
    with DaemonProcess(chunk_size=CHUNK, extra_args=FIXED) as d:
        yield d


@pytest.fixture(scope="module")
def shm_daemon():
    """test_abandoned_prepare's daemon, with 4 GPU workers and one CPU worker."""
    with DaemonProcess(chunk_size=CHUNK, http=True, shm_name=f"lbcw{os.getpid()}",
                       extra_args=FIXED) as d:
        yield d


def _stored_then_hit(orch, toks: list[int]) -> bool:
    """The orchestrator stores `toks` and a later match of them hits in full."""
    stored = orch.store("s", toks, torch.arange(len(toks)))
    orch.finish("s")
    hit = orch.match("hit", toks).tokens
    orch.finish("hit")
    return stored and hit == len(toks)


def test_a_daemon_with_several_cpu_workers_is_refused_with_the_fix_named(layout, caplog):
    caplog.set_level(logging.DEBUG, logger="loadback")
    d = DaemonProcess(chunk_size=CHUNK, http=True, extra_args=["--max-workers", "4"]).start()
    conn = LMCacheMPConnector(d.endpoint, layout, connect_timeout_s=0.2)
    orch = LoadBackOrchestrator(config_for(d, mp_http_port=d.http_port), conn,
                                kv_pool=make_pool(layout, 1024))
    try:
        assert wait_for(lambda: orch.link.refused is not None, 20), "never refused"
        errors = [r.getMessage() for r in caplog.records
                  if r.name == "loadback" and r.levelno == logging.ERROR]
        assert errors == [
            "daemon refused, every request recomputes until one with the right CPU worker "
            f"count registers: daemon {d.endpoint} runs 4 CPU workers (--max-workers or "
            "--max-cpu-workers): a LOOKUP may still run when the fence behind it answers, and "
            "a session ended then comes back with its read locks; start the daemon with "
            "--max-cpu-workers 1 (--max-workers N still sets its GPU workers)"]
        assert orch.metrics.snapshot()[REFUSED] == 1
        assert orch.link.registered_epoch is None and d.held()["registered"] == 0
        toks = list(range(4 * CHUNK))
        assert orch.match("refused", toks).tokens == 0
        # Restarted with the fix, same ports: accepted without a new orchestrator.
        d.extra_args = list(FIXED)
        d.restart()
        assert orch.wait_registered(30)
        assert orch.link.refused is None and orch.metrics.snapshot()[REFUSED] == 0
        assert _stored_then_hit(orch, toks)
    finally:
        orch.close()
        d.stop()
