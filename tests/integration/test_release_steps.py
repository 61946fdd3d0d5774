"""Each step of a release is an obligation of its own, against the real daemon.

A pipelined load (forced in pieces on a CPU pool, as the CUDA path loads over shared
memory) fails at piece 3: the daemon is stopped (SIGSTOP) right before that piece's
prepare_retrieve, which times out and is served once the daemon resumes. Its release owes
three commits and the free of the piece never asked for; the daemon is stopped again as
the first commit goes out, so that step times out too. It stays owed (never sent twice)
until the daemon answered it, and the steps after it still go out: once the debts are paid
the daemon holds nothing. Measured before the fix: the release was one debt, marked paid at
the first timeout, and the daemon kept 12 read locks until its 300 s read TTL.
"""

from __future__ import annotations

import threading

import pytest
import torch

from lmcache_loadback.connectors.errors import DaemonTimeout
from lmcache_loadback.orchestrator import DegradeReason, PrefixState
from lmcache_loadback.testing.daemon import CLIENT_HOLDS
from tests.conftest import make_pool
from tests.integration.test_abandoned_prepare import (  # noqa: F401 - the module's daemon
    SETTLE_S,
    _orch,
    _released,
    _stop_before_prepare,
    _tokens,
    shm_daemon,
)

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(180)]

HELD = CLIENT_HOLDS


def stop_at_first(orch, d, op: str) -> threading.Event:
    """SIGSTOP the daemon just before the connector's first `op` call goes out; the event is
    set once that call timed out."""
    timed_out = threading.Event()
    real = orch.connector._call
    stopped: list[str] = []

    def call(name, *a, **k):
        if name != op or stopped:
            return real(name, *a, **k)
        stopped.append(name)
        d.pause()
        try:
            return real(name, *a, **k)
        except DaemonTimeout:
            timed_out.set()
            raise

    orch.connector._call = call
    return timed_out


def test_a_release_step_that_times_out_leaves_nothing_held_once_debts_are_paid(
        shm_daemon, layout):
    d = shm_daemon
    pool = make_pool(layout, 2048)
    orch = _orch(d, layout, pool, early=False)
    try:
        toks = _tokens(7)
        assert orch.store("s", toks, torch.arange(len(toks)))
        orch.finish("s")
        assert not any(_released(orch, d)[k] for k in HELD)
        orch.connector.force_pieces = lambda n: [4, 4, 4, 4]
        m = orch.match("r", toks)
        assert m.tokens == len(toks)
        seen = _stop_before_prepare(orch, d, "_prepare_range", on_call=3)
        timed_out = stop_at_first(orch, d, "commit_retrieve")
        try:
            res = orch.load_back("r", torch.arange(1024, 1024 + m.tokens))
        finally:
            d.resume()  # the abandoned piece 3 is served; the releaser's first commit stops it
        assert len(seen) == 3
        assert res.state is PrefixState.DEGRADED and res.reason is DegradeReason.RETRIEVE_TIMEOUT
        try:
            assert timed_out.wait(SETTLE_S), "the release's first commit never timed out"
        finally:
            d.resume()
        orch.finish("r")
        held = _released(orch, d)
        assert orch.pending_debts() == 0
        assert {k: held[k] for k in HELD} == dict.fromkeys(HELD, 0), held  # before: 12 read
    finally:
        d.resume()
        orch.close()
