"""One LOOKUP across two OS processes (orchestrator/handoff.py), in the order vLLM runs them,
against the real daemon: the asker (vLLM's scheduler: no KV, LOOKUPs, hands off) and the
loader (a worker rank: adopts, loads, ends the session) each in a spawned process of its own
(tests/processes.py), stepped at the points where their calls to the daemon interleave.
Every test ends with the daemon holding no read or write lock, session or prefetch job."""

from __future__ import annotations

import pytest
import torch

from lmcache_loadback.orchestrator import DegradeReason, PrefixState
from lmcache_loadback.testing.daemon import CLIENT_HOLDS
from tests.conftest import CHUNK
from tests.processes import Remote

from .test_orchestrator_daemon import Harness, wait_for

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(180)]

HELD = CLIENT_HOLDS


@pytest.fixture(scope="module")
def procs(daemon):
    """The asker with its heartbeat and releaser threads (it pays when it will, as vLLM's
    scheduler does); the loader without (the test steps its registration and payments)."""
    asker = Remote("asker", daemon.port, background=True)
    loader = Remote("loader", daemon.port, background=False)
    try:
        assert asker.call("registered") and loader.call("registered")
        yield asker, loader
    finally:
        asker.close()
        loader.close()


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (n,), generator=g).tolist()


def stored(loader: Remote, n: int, seed: int) -> list[int]:
    toks = tokens(n, seed)
    assert loader.call("orch.store", f"store-{seed}", toks, loader.call("slots", 0, n))
    loader.call("orch.finish", f"store-{seed}")
    return toks


def nothing_held(daemon, *sides: Remote) -> dict:
    """Once every side paid what it owes (bounded), what the daemon still holds."""
    for side in sides:
        assert side.call("settled")
    held = daemon.held()
    return {k: held[k] for k in HELD if held[k]}


@pytest.mark.parametrize("local, keep", [(CHUNK, 4 * CHUNK), (0, 2 * CHUNK)],
                         ids=["local_hit_of_a_chunk", "fewer_tokens_taken"])
def test_the_askers_frees_never_follow_the_loaders_session_end(procs, daemon, local, keep):
    """The asker's releases (the chunks the engine had, the tokens it did not take) are held
    in its process until the loader loaded and its end_session was answered: whatever the
    asker still owed then reaches the daemon after the session's end."""
    asker, loader = procs
    sid = f"five-{local}-{keep}#ask1"
    toks = stored(loader, 4 * CHUNK, seed=local + keep)
    asker.hold("free_locks")
    assert asker.call("orch.match", sid, toks, local_hit_tokens=local).tokens == 4 * CHUNK - local
    locked = asker.call("orch.handoff.hand_off", sid, keep)
    assert locked
    got = loader.call("orch.handoff.adopt", sid, toks, local_hit_tokens=local,
                      hit_tokens=keep, locked=locked)
    assert got.tokens == keep - local
    res = loader.call("orch.load_back", sid, loader.call("slots", 512, got.tokens))
    assert (res.loaded_tokens, res.state) == (keep - local, PrefixState.LOADED)
    loader.call("orch.finish", sid)
    assert loader.call("settled")                 # the loader's end_session was answered
    asker.go("free_locks")                        # anything the asker still owed goes now
    assert nothing_held(daemon, asker, loader) == {}


def test_a_same_epoch_reregistration_forfeits_no_adopted_lock(procs, daemon):
    """The loader re-registers with the same daemon (a suspect silence) after the asker's
    LOOKUP: the adopted locks are still the loader's to free."""
    asker, loader = procs
    sid = "six-b#ask1"
    toks = stored(loader, 3 * CHUNK, seed=61)
    assert asker.call("orch.match", sid, toks, local_hit_tokens=0).tokens == 3 * CHUNK
    locked = asker.call("orch.handoff.hand_off", sid, 3 * CHUNK)
    assert locked
    loader.call("link.suspect")
    assert loader.call("registered")              # re-registered: same daemon, same epoch
    loader.call("orch.handoff.adopt", sid, toks, local_hit_tokens=0, hit_tokens=3 * CHUNK,
                locked=locked)
    loader.call("orch.abort", sid)                # vLLM aborted it before its load
    assert nothing_held(daemon, asker, loader) == {}


def test_a_loader_behind_the_askers_registration_releases_the_lookup(procs, daemon, layout):
    """The daemon restarted; the asker re-registered and LOOKUPs on the new daemon, the
    loader has reconnected but its heartbeat has not re-registered yet when it adopts (runs
    last: it restarts the module's daemon)."""
    asker, loader = procs
    epoch, asker_epoch = loader.call("conn.epoch"), asker.call("conn.epoch")
    daemon.restart()
    # The asker saw the restart (a new epoch) and registered there: right after the restart
    # its connection may not have noticed yet, and "registered" would still be the old one's.
    assert wait_for(lambda: asker.call("conn.epoch") > asker_epoch)
    assert asker.call("registered")
    assert wait_for(lambda: loader.call("conn.epoch") > epoch)   # reconnected, not registered
    assert loader.call("link.registered_epoch") == epoch
    storer = Harness(daemon, layout)
    try:
        assert storer.orch.wait_registered(10)
        toks, _ = storer.stored(2 * CHUNK, seed=62)
    finally:
        storer.close()
    sid = "six-a#ask1"
    assert asker.call("orch.match", sid, toks, local_hit_tokens=0).tokens == 2 * CHUNK
    locked = asker.call("orch.handoff.hand_off", sid, 2 * CHUNK)
    assert locked
    got = loader.call("orch.handoff.adopt", sid, toks, local_hit_tokens=0,
                      hit_tokens=2 * CHUNK, locked=locked)
    assert got.tokens == 2 * CHUNK
    res = loader.call("orch.load_back", sid, loader.call("slots", 512, 2 * CHUNK))
    # Not registered with this daemon yet: no load is tried (the engine recomputes) ...
    assert (res.loaded_tokens, res.reason) == (0, DegradeReason.DAEMON_RESTARTED)
    loader.call("orch.finish", sid)
    # ... but the LOOKUP's locks and session are released on the daemon that holds them.
    assert nothing_held(daemon, asker, loader) == {}
