"""A prepare_retrieve abandoned at its deadline is settled once the daemon could serve it.

The real daemon, on shared memory, is stopped (SIGSTOP) right before a prepare_retrieve
goes out, so the call times out; resumed, it serves the call anyway and parks the range's
read locks in a pending transfer that only a commit_retrieve of the same key releases
(else its 300 s read TTL). The orchestrator must owe that commit, and pay it only after
the daemon answered the abandoned call (the releaser's connection may be served on
another worker and must not overtake it). Measured before the fix: the 16 locks stayed.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator import DegradeReason, LoadBackConfig, LoadBackOrchestrator, PrefixState
from tests.conftest import CHUNK, make_pool
from tests.integration.test_prepare_pieces import _spy_ops

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(180)]

N_CHUNKS = 16
#: The wait for the daemon to let go: generous (a busy machine), still far below its TTL.
SETTLE_S = 20.0


@pytest.fixture(scope="module")
def shm_daemon():
    with DaemonProcess(chunk_size=CHUNK, http=True, shm_name=f"lbab{os.getpid()}") as d:
        yield d


def _orch(d: DaemonProcess, layout, pool, *, early: bool) -> LoadBackOrchestrator:
    cfg = LoadBackConfig.from_dict({
        "mp_port": d.port, "chunk_size": CHUNK, "transfer": "shm", "prepare_at_match": early,
        "deadlines": {"lookup_ms": 2000, "retrieve_base_ms": 300, "retrieve_per_ki_token_ms": 0,
                      "control_ms": 200},
        "heartbeat": {"interval_ms": 50}})
    conn = LMCacheMPConnector(d.endpoint, layout, transfer="shm", connect_timeout_s=0.2)
    orch = LoadBackOrchestrator(cfg, conn, kv_pool=pool)
    assert orch.wait_registered(10)
    return orch


def _tokens(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (N_CHUNKS * CHUNK,), generator=g).tolist()


def _stop_before_prepare(orch, d: DaemonProcess, name: str, on_call: int = 1) -> list[int]:
    """SIGSTOP the daemon just before the connector's `on_call`-th `name` call goes out;
    returns the read locks the daemon held at that moment (read from its admin API)."""
    seen: list[int] = []
    real = getattr(orch.connector, name)

    def stop_then_call(*a, **k):
        seen.append(d.held()["read_locks"])
        if len(seen) == on_call:
            d.pause()
        return real(*a, **k)

    setattr(orch.connector, name, stop_then_call)
    return seen


def _commit_waits(orch) -> None:
    """A pass of the releaser while the abandoned call is still unanswered (the daemon is
    stopped) sends no commit: sent now, on the releaser's own connection, it could be
    served before the prepare (another daemon worker) and release nothing."""
    sent = _spy_ops(orch)
    orch.link.pay()
    assert "commit_retrieve" not in sent and orch.pending_debts() >= 1


def _released(orch, d: DaemonProcess) -> dict:
    """Wait (bounded) until the orchestrator owes nothing and the daemon holds no read
    lock and no session; what the daemon holds then."""
    end = time.monotonic() + SETTLE_S
    held = d.held()
    while time.monotonic() < end and (orch.pending_debts() or held["read_locks"]
                                      or held["sessions"]):
        time.sleep(0.05)
        held = d.held()
    return held


def test_a_prepare_at_match_abandoned_at_its_deadline_is_committed_once_served(
        shm_daemon, layout):
    d = shm_daemon
    pool = make_pool(layout, 2048)
    orch = _orch(d, layout, pool, early=True)
    try:
        toks = _tokens(1)
        assert orch.store("s", toks, torch.arange(len(toks)))
        orch.finish("s")
        assert _released(orch, d)["read_locks"] == 0
        seen = _stop_before_prepare(orch, d, "prepare")
        try:
            t0 = time.monotonic()
            m = orch.match("r", toks)
            took = time.monotonic() - t0
            _commit_waits(orch)
        finally:
            d.resume()
        assert seen == [N_CHUNKS]  # the LOOKUP locked every chunk, then the daemon stopped
        assert m.tokens == 0 and m.reason is DegradeReason.RETRIEVE_TIMEOUT
        assert took < 2.0 + 0.3 + 0.5  # lookup + retrieve deadline, plus slack
        orch.finish("r")
        held = _released(orch, d)
        assert held["read_locks"] == 0, held  # before the fix: 16, until the read TTL
        assert held["sessions"] == 0, held
    finally:
        d.resume()
        orch.close()


@pytest.mark.parametrize("pieces", [None, [4, 12]], ids=["whole", "pieces"])
def test_a_load_time_prepare_abandoned_at_its_deadline_is_committed_once_served(
        shm_daemon, layout, pieces):
    """prepare_at_match off: load_back's prepare_retrieve times out. In pieces (the CUDA
    path's pipelining, forced here on a CPU pool) the stop hits the second piece: the
    answered first piece and the abandoned second are both committed."""
    d = shm_daemon
    pool = make_pool(layout, 2048)
    orch = _orch(d, layout, pool, early=False)
    try:
        toks = _tokens(2 if pieces is None else 3)
        assert orch.store("s", toks, torch.arange(len(toks)))
        orch.finish("s")
        assert _released(orch, d)["read_locks"] == 0
        if pieces is not None:
            orch.connector.force_pieces = lambda n: list(pieces)
        m = orch.match("r", toks)
        assert m.tokens == len(toks)
        seen = _stop_before_prepare(orch, d, "_prepare_range", on_call=1 if pieces is None
                                    else 2)
        try:
            res = orch.load_back("r", torch.arange(1024, 1024 + m.tokens))
            _commit_waits(orch)
        finally:
            d.resume()
        assert seen[0] == N_CHUNKS
        assert res.state is PrefixState.DEGRADED and res.loaded_tokens == 0
        assert res.reason is DegradeReason.RETRIEVE_TIMEOUT
        orch.finish("r")
        held = _released(orch, d)
        assert held["read_locks"] == 0, held  # before the fix: the abandoned range's locks
        assert held["sessions"] == 0, held
    finally:
        d.resume()
        orch.close()
