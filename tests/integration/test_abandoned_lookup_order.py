"""A LOOKUP abandoned at its deadline is released only after the daemon answered it.

lmcache 0.5.6 answers query_prefetch_status for a request it has no prefetch for with 0,
and free_lookup_locks without a lookup result releases nothing. So an abandon that reaches
the daemon before the abandoned LOOKUP (both queued on a daemon stopped for a moment, on
two connections, served in either order) frees nothing, and the LOOKUP, served afterwards,
read-locks the whole hit range until the daemon's read TTL and leaves its prefetch job: the
soak's leak of one 16-chunk range. Real daemon, stopped (SIGSTOP) before the match and
continued only after the test paid what was owed: while it is stopped the LOOKUP is surely
unanswered, so the abandon must not go out."""

from __future__ import annotations

import time

import pytest
import torch

from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator import LoadBackConfig, LoadBackOrchestrator
from tests.conftest import CHUNK, make_pool

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(120)]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _settle(orch, conn, timeout_s: float = 20.0) -> bool:
    """Pay (bounded) until nothing is owed and every call was answered."""
    end = time.monotonic() + timeout_s
    while orch.pending_debts() or conn.unanswered():
        if time.monotonic() > end:
            return False
        orch.link.pay()
        time.sleep(0.02)  # poll interval of an outside condition (the daemon's answers)
    return True


def test_an_abandoned_lookup_is_released_only_after_the_daemon_answered_it(live_daemon,
                                                                          layout):
    cfg = LoadBackConfig.from_dict({
        "mp_port": live_daemon.port, "chunk_size": CHUNK,
        "deadlines": {"lookup_ms": 100, "control_ms": 300, "connect_ms": 5000}})
    conn = LMCacheMPConnector(live_daemon.endpoint, layout, connect_timeout_s=1.0)
    # No heartbeat or releaser thread: the test pays the debts itself, when it says.
    orch = LoadBackOrchestrator(cfg, conn, kv_pool=make_pool(layout, 1024),
                                start_heartbeat=False)
    abandons: list[int] = []  # calls of the request unanswered when each abandon went out
    real = conn.abandon_lookup

    def abandon_lookup(token_ids, request_id, *args, **kwargs):
        abandons.append(conn.unanswered(request_id))
        return real(token_ids, request_id, *args, **kwargs)

    conn.abandon_lookup = abandon_lookup
    try:
        orch.tick()
        assert orch.link.registered()
        toks = _tokens(16 * CHUNK, 11)
        assert orch.store("s", toks, torch.arange(len(toks)))
        orch.finish("s")
        assert _settle(orch, conn)
        live_daemon.pause()
        try:
            assert orch.match("r", toks).tokens == 0  # the LOOKUP timed out: abandoned
            orch.finish("r")
            orch.link.pay()  # the LOOKUP is still queued on the stopped daemon
        finally:
            live_daemon.resume()
        assert _settle(orch, conn)
        assert abandons and all(n == 0 for n in abandons), (
            f"abandon_lookup went out while {abandons} calls of the request were unanswered")
        held = live_daemon.held()
        assert (held["read_locks"], held["prefetch_jobs"], held["sessions"]) == (0, 0, 0), held
    finally:
        live_daemon.resume()
        orch.close()
