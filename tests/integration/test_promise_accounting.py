"""What counts as promised: only tokens `match` answered to the engine. A prefix that ends
inside match (its retrieve prepared at match failed on a daemon stopped right after the
LOOKUP) answered 0: none of its tokens were promised, so none were recomputed instead of
loaded. Real daemon on shared memory; the SIGSTOP lands at the exact point (between the
LOOKUP's answer and the prepare), by wrapping the prepare call, not by timing."""

from __future__ import annotations

import os

import pytest
import torch

from lmcache_loadback.orchestrator import LoadBackConfig, LoadBackOrchestrator, PrefixState
from lmcache_loadback.orchestrator.states import DegradeReason
from lmcache_loadback.testing.daemon import DaemonProcess
from tests.conftest import CHUNK, make_pool

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def shm_daemon():
    with DaemonProcess(chunk_size=CHUNK, shm_name=f"lbpa{os.getpid()}") as d:
        yield d


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_prefix_that_ends_inside_match_promised_nothing(shm_daemon, layout, monkeypatch):
    from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector

    cfg = LoadBackConfig.from_dict({
        "mp_port": shm_daemon.port, "chunk_size": CHUNK, "transfer": "shm",
        "prepare_at_match": True,
        "deadlines": {"lookup_ms": 2000, "retrieve_base_ms": 150, "retrieve_max_ms": 150,
                      "control_ms": 1000, "connect_ms": 5000}})
    conn = LMCacheMPConnector(shm_daemon.endpoint, layout, transfer="shm", connect_timeout_s=1.0)
    orch = LoadBackOrchestrator(cfg, conn, kv_pool=make_pool(layout, 1024), start_heartbeat=False)
    try:
        orch.tick()
        assert orch.link.registered()
        toks = _tokens(4 * CHUNK, 7)
        assert orch.store("s", toks, torch.arange(len(toks)))
        orch.finish("s")
        real = conn.prepare

        def prepare_on_a_stopped_daemon(*args, **kwargs):
            shm_daemon.pause()  # the LOOKUP was answered; the prepare meets a hung daemon
            try:
                return real(*args, **kwargs)
            finally:
                shm_daemon.resume()

        monkeypatch.setattr(conn, "prepare", prepare_on_a_stopped_daemon)
        m = orch.match("r", toks, local_hit_tokens=8)
        assert (m.tokens, m.state, m.reason) == (0, PrefixState.DEGRADED,
                                                  DegradeReason.RETRIEVE_TIMEOUT)
        orch.finish("r")
        s = orch.metrics.snapshot()
        assert s["loadback_prefix_outcomes_total{reason=retrieve_timeout,state=degraded}"] == 1
        recomputed = sum(v for k, v in s.items()
                         if k.startswith("loadback_recomputed_tokens_total"))
        # The engine was answered 0 tokens: nothing promised, nothing recomputed instead.
        assert (s.get("loadback_promised_tokens_total", 0), recomputed) == (0, 0)
    finally:
        shm_daemon.resume()
        orch.close()
