"""One LOOKUP serving two processes (orchestrator/handoff.py) against the real daemon: one
orchestrator LOOKUPs and hands off, another adopts and loads under the same session, sending
no LOOKUP; whatever the adopter's outcome, the daemon is left holding nothing."""

from __future__ import annotations

import pytest
import torch

from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator import LoadBackOrchestrator, PrefixState
from tests.conftest import CHUNK, kv_of, lookups_sent, same_kv

from .test_orchestrator_daemon import Harness, config_for, wait_for

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(120)]


@pytest.fixture
def pair(live_daemon, layout):
    """The loader (a KV pool: vLLM's worker) and the asker (none: vLLM's scheduler)."""
    loader = Harness(live_daemon, layout)
    conn = LMCacheMPConnector(live_daemon.endpoint, layout, connect_timeout_s=0.2)
    asker = LoadBackOrchestrator(config_for(live_daemon, prepare_at_match=False), conn)
    asker.handoff.hands_off = True  # as vLLM's scheduler: its LOOKUPs' locks stay whole
    assert loader.orch.wait_registered(10) and asker.wait_registered(10)
    yield loader, asker
    asker.close()
    loader.close()


def nothing_held(loader: Harness, asker: LoadBackOrchestrator) -> bool:
    """Once both orchestrators paid what they owe (bounded), the daemon holds nothing."""
    assert wait_for(lambda: not asker.pending_debts() and not loader.orch.pending_debts())
    return not loader.daemon.client_holds()


def ask(asker, rid: str, toks, local: int = 0) -> int:
    return asker.match(rid, toks, local_hit_tokens=local).tokens


def handed(loader: Harness, asker, rid: str, toks, hit: int, keep: int) -> None:
    """The asker's LOOKUP (a hit of `hit` tokens) handed off for `keep` tokens, adopted."""
    assert ask(asker, rid, toks) == hit
    assert loader.daemon.held()["read_locks"] > 0
    locked = asker.handoff.hand_off(rid, keep)
    assert locked == (0, hit)                         # every lock, the ones not taken too
    loader.orch.handoff.adopt(rid, toks, local_hit_tokens=0, hit_tokens=keep, locked=locked)


def test_adopted_lookup_loads_byte_exact_with_no_second_lookup(pair):
    loader, asker = pair
    toks, src = loader.stored(4 * CHUNK, seed=1)
    assert ask(asker, "r#ask1", toks, local=CHUNK // 2) == 4 * CHUNK - CHUNK // 2
    locked = asker.handoff.hand_off("r#ask1", 4 * CHUNK)
    assert asker.state_of("r#ask1") is None          # nothing of it is the asker's any more
    before = lookups_sent(loader.orch)
    got = loader.orch.handoff.adopt("r#ask1", toks, local_hit_tokens=CHUNK // 2,
                                    hit_tokens=4 * CHUNK, locked=locked)
    assert got.tokens == 4 * CHUNK - CHUNK // 2 and got.state == PrefixState.MARKED
    dst = loader.slots(got.tokens)
    res = loader.orch.load_back("r#ask1", dst)
    assert res.loaded_tokens == got.tokens
    assert same_kv(kv_of(loader.pool, dst), kv_of(loader.pool, src[CHUNK // 2:]))
    assert lookups_sent(loader.orch) == before
    loader.orch.finish("r#ask1")
    asker.finish("r#ask1")                            # a finish after the hand-off: a no-op
    assert nothing_held(loader, asker)


def test_adopter_that_never_loads_releases_the_lookup(pair):
    loader, asker = pair
    toks, _ = loader.stored(3 * CHUNK, seed=2)
    handed(loader, asker, "a#ask1", toks, 3 * CHUNK, 3 * CHUNK)
    loader.orch.abort("a#ask1")
    assert loader.orch.state_of("a#ask1") is None
    assert nothing_held(loader, asker)


def test_hand_off_of_fewer_tokens_frees_the_rest_at_once(pair):
    loader, asker = pair
    toks, src = loader.stored(4 * CHUNK, seed=3)
    handed(loader, asker, "s#ask1", toks, 4 * CHUNK, 2 * CHUNK)  # the engine took half
    dst = loader.slots(2 * CHUNK)
    assert loader.orch.load_back("s#ask1", dst).loaded_tokens == 2 * CHUNK
    assert same_kv(kv_of(loader.pool, dst), kv_of(loader.pool, src[:2 * CHUNK]))
    loader.orch.finish("s#ask1")
    assert nothing_held(loader, asker)


def test_only_a_marked_prefix_is_handed_off(pair):
    loader, asker = pair
    toks = loader.tokens(2 * CHUNK, seed=4)           # never stored: a miss
    assert ask(asker, "m#ask1", toks) == 0
    assert not asker.handoff.hand_off("m#ask1", 2 * CHUNK)
    asker.finish("m#ask1")                            # a miss: its session ends here
    stored, _ = loader.stored(2 * CHUNK, seed=5)
    assert ask(asker, "k#ask1", stored) == 2 * CHUNK
    assert not asker.handoff.hand_off("k#ask1", 3 * CHUNK)    # more than was locked
    assert not asker.handoff.hand_off("k#ask1", 0)
    asker.finish("k#ask1")                            # still the asker's: it releases
    assert nothing_held(loader, asker)


def test_adopt_refuses_what_no_lookup_can_have_locked(pair):
    loader, _ = pair
    toks = loader.tokens(2 * CHUNK, seed=7)
    with pytest.raises(ValueError, match="chunk aligned"):
        loader.orch.handoff.adopt("x", toks, local_hit_tokens=0, hit_tokens=CHUNK + 1,
                                  locked=(0, 2 * CHUNK))
    with pytest.raises(ValueError, match="within the 2"):
        loader.orch.handoff.adopt("x", toks[:2], local_hit_tokens=0, hit_tokens=CHUNK,
                                  locked=(0, CHUNK))
    with pytest.raises(ValueError, match="locked range"):
        loader.orch.handoff.adopt("x", toks, local_hit_tokens=0, hit_tokens=2 * CHUNK,
                                  locked=(0, CHUNK))
    assert loader.orch.state_of("x") is None
    assert loader.orch.load_back("x", torch.arange(CHUNK)).loaded_tokens == 0


def test_a_release_still_owed_by_the_asker_keeps_the_prefix_its_own(pair, monkeypatch):
    """An asker that freed the engine's chunks at match (not `hands_off`) and still owes that
    free does not hand off: its free would reach the daemon after the adopter's end."""
    loader, asker = pair
    toks, _ = loader.stored(3 * CHUNK, seed=6)
    asker.handoff.hands_off = False
    monkeypatch.setattr(asker.link, "pay", lambda *a, **k: False)  # the free stays owed
    monkeypatch.setattr(asker.link, "background", True)            # queued, never inline
    assert ask(asker, "o#ask1", toks, local=CHUNK) == 2 * CHUNK
    assert asker.pending_debts() == 1
    assert asker.handoff.hand_off("o#ask1", 3 * CHUNK) is None
    assert asker.state_of("o#ask1") == PrefixState.MARKED   # still the asker's to release
    monkeypatch.undo()
    asker.finish("o#ask1")
    assert nothing_held(loader, asker)
