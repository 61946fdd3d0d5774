"""A shared-memory STORE whose prepare_store timed out leaves no reservation and no garbage.

The real daemon is stopped (SIGSTOP) right before prepare_store goes out: the call times
out, and once resumed the daemon serves it anyway, reserving the chunks write-locked until a
commit_store (lmcache 0.5.6 has no abort; its write TTL is 600 s). A commit of slots nobody
wrote would publish whatever they held under the real keys; the store instead kept a host
copy of its chunks and, once the daemon answered the abandoned call, writes them into the
slots it reserved and commits. Measured before the fix: 16 write locks held after the debts
were paid, and nothing stored.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_loadback.orchestrator import PrefixState
from tests.conftest import kv_of, make_pool, same_kv
from tests.integration.test_abandoned_prepare import (  # noqa: F401 - the module's daemon
    _orch,
    _released,
    _tokens,
    shm_daemon,
)
from tests.integration.test_release_steps import HELD, stop_at_first

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(180)]


def test_a_store_whose_prepare_timed_out_leaves_no_write_lock_and_no_garbage(
        shm_daemon, layout):
    d = shm_daemon
    pool = make_pool(layout, 2048)
    orch = _orch(d, layout, pool, early=False)
    try:
        toks = _tokens(11)
        src = torch.arange(len(toks))
        orch.connector.noop(2.0)  # this thread's connection is up: the stopped daemon gets the call
        timed_out = stop_at_first(orch, d, "prepare_store")
        try:
            assert orch.store("s", toks, src) is False  # timed out
        finally:
            d.resume()
        assert timed_out.is_set()
        orch.finish("s")
        held = _released(orch, d)
        assert orch.pending_debts() == 0
        assert {k: held[k] for k in HELD} == dict.fromkeys(HELD, 0), held  # before: 16 write
        # Whatever the daemon now serves under these keys is the store's own bytes.
        assert orch.wait_registered(10)
        m = orch.match("r", toks)
        assert m.tokens == len(toks)
        dst = torch.arange(1024, 1024 + m.tokens)
        res = orch.load_back("r", dst)
        assert res.state is PrefixState.LOADED
        assert same_kv(kv_of(pool, dst), kv_of(pool, src))
        orch.finish("r")
        assert not any(_released(orch, d)[k] for k in HELD)
    finally:
        d.resume()
        orch.close()
