"""prepare_retrieve at match and pipelined pieces, against the real daemon in shm mode.

A pipelined load sends one prepare_retrieve per piece and copies each piece while the next
round trip is in flight (on CUDA pools; `force_pieces` runs the same code on a CPU pool).
What must hold: bytes exact whatever the pieces, and on a failure part-way every lock of the
range is released exactly once (answered pieces by their commits, the rest by a free).
prepare_at_match moves the round trip to match: its buffers are released on every path.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.connectors.errors import DaemonTimeout, DaemonUnavailable
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.connectors.retrieval import Retrieval
from lmcache_loadback.orchestrator import DegradeReason, LoadBackConfig, LoadBackOrchestrator, PrefixState
from tests.conftest import CHUNK, kv_of, make_pool, same_kv

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def shm_daemon():
    d = DaemonProcess(chunk_size=CHUNK, http=True, shm_name=f"lbpp{os.getpid()}")
    d.start()
    yield d
    d.stop()


def _settled(d: DaemonProcess, timeout_s: float = 10.0) -> dict:
    end = time.monotonic() + timeout_s
    held = d.held()
    while time.monotonic() < end and (held["read_locks"] or held["sessions"]):
        time.sleep(0.02)
        held = d.held()
    return held


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def conn(shm_daemon, layout):
    c = LMCacheMPConnector(shm_daemon.endpoint, layout, transfer="shm")
    c.register(5)
    yield c
    c.close()


def _store(conn, layout, toks, seed):
    src = make_pool(layout, 1024)
    slots = torch.randperm(1024, generator=torch.Generator().manual_seed(seed))[:len(toks)]
    assert conn.store_from(toks, f"store-{seed}", src, slots, timeout_s=5)
    conn.end_session(f"store-{seed}", 5)
    return src, slots


def test_piece_plan_covers_every_chunk_once():
    for n in range(1, 300):
        plan = LMCacheMPConnector.piece_plan(n)
        assert sum(plan) == n and all(p > 0 for p in plan)
        assert max(plan) < 48 or len(plan) == 1  # 32 at most, plus a folded-in small tail
    assert LMCacheMPConnector.piece_plan(16) == [16]
    assert LMCacheMPConnector.piece_plan(256)[:5] == [4, 8, 16, 32, 32]


@pytest.mark.parametrize("plan", [[1, 2, 3], [6], [1, 1, 1, 1, 1, 1]])
def test_pieces_land_byte_exact_with_a_local_hit(shm_daemon, conn, layout, plan):
    n, skip = 6 * CHUNK, 5
    seed = 11 + 100 * len(plan)  # a prefix of its own: the daemon keeps what others stored
    toks = _tokens(n, seed)
    src, src_slots = _store(conn, layout, toks, seed)
    conn.force_pieces = lambda k: list(plan)
    assert conn.lookup_hit_tokens(toks, "r-pieces", 5) == n
    dst = make_pool(layout, 1024, fill=False)
    slots = torch.randperm(1024)[:n - skip]
    got = conn.retrieve_into(toks, "r-pieces", dst, slots, start=0, end=n, timeout_s=5,
                             skip=skip)
    assert got.nbytes == 6 * layout.chunk_bytes
    assert same_kv(kv_of(dst, slots), kv_of(src, src_slots[skip:]))
    assert shm_daemon.held()["read_locks"] > 0  # the commits are owed, not yet paid
    got.commit(5)
    conn.end_session("r-pieces", 5)
    assert _settled(shm_daemon)["read_locks"] == 0


@pytest.mark.parametrize("failure", [DaemonUnavailable, DaemonTimeout])
def test_a_piece_failing_part_way_releases_every_lock_once(shm_daemon, conn, layout, failure):
    """Piece 2 of 3 fails. Unavailable: never sent, its locks are still held; timeout: it
    reached the daemon (here it really did not: the fake raise comes before the send, so its
    chunks stay read-locked until freed). Either way the retrieval owes piece 1's commit and
    the free of the pieces never asked for, and `locks_moved` tells the caller to free
    nothing."""
    n = 6 * CHUNK
    seed = 12 + 100 * (failure is DaemonTimeout)
    toks = _tokens(n, seed)
    _store(conn, layout, toks, seed)
    conn.force_pieces = lambda k: [2, 2, 2]
    real, calls = conn._prepare_range, []

    def flaky(key, cnt, timeout_s, retrieval):
        calls.append((key.start, key.end))
        if len(calls) == 2:
            if failure is DaemonUnavailable:
                raise failure("injected: daemon gone")
            # As `_prepare_range` records a call that timed out: its commit is owed.
            retrieval.asked(key.end, conn._owed_commit(key))
            raise failure("prepare_retrieve", timeout_s)
        return real(key, cnt, timeout_s, retrieval)

    conn._prepare_range = flaky
    assert conn.lookup_hit_tokens(toks, "r-fail", 5) == n
    before = shm_daemon.held()["read_locks"]
    assert before >= 6
    dst = make_pool(layout, 1024, fill=False)
    r = Retrieval(conn.epoch, 0, n)
    with pytest.raises(failure):
        conn.retrieve_into(toks, "r-fail", dst, torch.arange(n), start=0, end=n,
                           timeout_s=5, retrieval=r)
    assert r.locks_moved and r.owes
    assert calls == [(0, 2 * CHUNK), (2 * CHUNK, 4 * CHUNK)]  # piece 3 never asked
    r.release(5)
    r.release(5)  # paying again frees nothing twice
    held = shm_daemon.held()["read_locks"]
    if failure is DaemonUnavailable:
        assert held == before - 6  # commit of piece 1 + free of pieces 2 and 3
    else:
        assert held == before - 4  # piece 2 "reached the daemon": left to its read TTL
        conn.free_locks(toks, "r-fail", 2 * CHUNK, 4 * CHUNK, 5)
    conn.end_session("r-fail", 5)
    assert _settled(shm_daemon)["read_locks"] == 0
    # Nothing is stuck: the same prefix loads again in full.
    conn._prepare_range = real
    assert conn.lookup_hit_tokens(toks, "r-again", 5) == n
    got = conn.retrieve_into(toks, "r-again", dst, torch.arange(n), start=0, end=n,
                             timeout_s=5)
    got.commit(5)
    conn.end_session("r-again", 5)
    assert _settled(shm_daemon)["read_locks"] == 0


def test_prepared_range_loads_later_and_its_commit_releases_it(shm_daemon, conn, layout):
    n, skip = 3 * CHUNK, 7
    toks = _tokens(n, 13)
    src, src_slots = _store(conn, layout, toks, 13)
    assert conn.lookup_hit_tokens(toks, "r-prep", 5) == n
    prepared = conn.prepare(toks, "r-prep", start=0, end=n, timeout_s=5)
    assert len(prepared.chunks) == 3 and prepared.epoch == conn.epoch
    dst = make_pool(layout, 1024, fill=False)
    slots = torch.randperm(1024)[:n - skip]
    got = conn.retrieve_into(toks, "r-prep", dst, slots, start=0, end=n, timeout_s=5,
                             skip=skip, prepared=prepared)
    assert same_kv(kv_of(dst, slots), kv_of(src, src_slots[skip:]))
    assert prepared.retrieval.owes and got.commit == prepared.retrieval.release
    got.commit(5)
    conn.end_session("r-prep", 5)
    assert _settled(shm_daemon)["read_locks"] == 0
    with pytest.raises(ValueError, match="prepared range"):
        conn.retrieve_into(toks, "r-prep", dst, slots[:CHUNK - skip], start=0, end=CHUNK,
                           timeout_s=5, skip=skip, prepared=prepared)


def test_a_range_prepared_in_part_loads_the_rest_in_pieces(shm_daemon, conn, layout):
    """With `prepare_in_pieces` on a GPU the match prepares only the first piece and the
    load asks for the rest while that piece copies (`force_prepare_pieces` runs the same
    code on a CPU pool); every commit releases its piece."""
    n, skip = 3 * CHUNK, 7
    toks = _tokens(n, 17)
    src, src_slots = _store(conn, layout, toks, 17)
    conn.force_prepare_pieces = lambda k: [1, 2]
    assert conn.lookup_hit_tokens(toks, "r-part", 5) == n
    prepared = conn.prepare(toks, "r-part", start=0, end=n, timeout_s=5)
    assert len(prepared.chunks) == 1 and prepared.rest == (2,)
    assert prepared.retrieval.asked_to == CHUNK
    dst = make_pool(layout, 1024, fill=False)
    slots = torch.randperm(1024)[:n - skip]
    got = conn.retrieve_into(toks, "r-part", dst, slots, start=0, end=n, timeout_s=5,
                             skip=skip, prepared=prepared)
    assert same_kv(kv_of(dst, slots), kv_of(src, src_slots[skip:]))
    assert [repr(o) for o in prepared.retrieval.owed] == [
        "commit_retrieve[0, 16)", "commit_retrieve[16, 48)"]
    got.commit(5)
    assert shm_daemon.held()["read_locks"] == 0
    conn.end_session("r-part", 5)
    assert _settled(shm_daemon)["read_locks"] == 0


def test_a_range_prepared_in_part_and_never_loaded_releases_every_lock(shm_daemon, conn,
                                                                        layout):
    n = 3 * CHUNK
    toks = _tokens(n, 19)
    _store(conn, layout, toks, 19)
    conn.force_prepare_pieces = lambda k: [1, 1, 1]
    assert conn.lookup_hit_tokens(toks, "r-drop", 5) == n
    prepared = conn.prepare(toks, "r-drop", start=0, end=n, timeout_s=5)
    assert shm_daemon.held()["read_locks"] > 0
    assert [repr(o) for o in prepared.retrieval.owed] == [
        "commit_retrieve[0, 16)", "free_locks[16, 48)"]
    prepared.retrieval.release(5)  # the prefix ended without loading: commit, then the rest
    assert shm_daemon.held()["read_locks"] == 0
    conn.end_session("r-drop", 5)
    assert _settled(shm_daemon)["read_locks"] == 0


# ------------------------------------------------------------------ orchestrator


def _orch(d: DaemonProcess, layout, pool, **over) -> LoadBackOrchestrator:
    cfg = {"mp_port": d.port, "chunk_size": CHUNK, "transfer": "shm",
           "deadlines": {"lookup_ms": 500, "retrieve_base_ms": 1000, "control_ms": 200},
           "heartbeat": {"interval_ms": 50}}
    cfg.update(over)
    conn = LMCacheMPConnector(d.endpoint, layout, transfer="shm", connect_timeout_s=0.2)
    orch = LoadBackOrchestrator(LoadBackConfig.from_dict(cfg), conn, kv_pool=pool)
    assert orch.wait_registered(10)
    return orch


def _stored(orch, toks) -> torch.Tensor:
    """Store `toks` from the first slots of the pool through the orchestrator."""
    src = torch.arange(len(toks))
    assert orch.store("s", toks, src)
    orch.finish("s")
    return src


def _spy_ops(orch) -> list[str]:
    """The ops the connector sends from now on, in order."""
    sent: list[str] = []
    real = orch.connector._call
    orch.connector._call = lambda op, *a, **k: (sent.append(op), real(op, *a, **k))[1]
    return sent


def _settle_orch(orch, d):
    end = time.monotonic() + 10
    while time.monotonic() < end and orch.pending_debts():
        time.sleep(0.02)
    return _settled(d)


@pytest.mark.parametrize("early", [True, False])
def test_match_prepares_and_load_back_only_copies(shm_daemon, layout, early):
    pool = make_pool(layout, 2048)
    orch = _orch(shm_daemon, layout, pool, prepare_at_match=early)
    try:
        n = 4 * CHUNK
        toks = _tokens(n, 20 + early)
        src = _stored(orch, toks)
        sent = _spy_ops(orch)
        m = orch.match("r", toks, local_hit_tokens=CHUNK + 3)
        assert m.tokens == n - CHUNK - 3
        assert ("prepare_retrieve" in sent) == early
        sent.clear()
        dst = torch.arange(1024, 1024 + m.tokens)
        res = orch.load_back("r", dst)
        assert res.state is PrefixState.LOADED and res.loaded_tokens == m.tokens
        assert ("prepare_retrieve" in sent) != early  # early: the load sent no round trip
        assert same_kv(kv_of(pool, dst), kv_of(pool, src[CHUNK + 3:]))
        orch.finish("r")
        assert _settle_orch(orch, shm_daemon)["read_locks"] == 0
    finally:
        orch.close()


@pytest.mark.parametrize("end_with", ["abort", "finish"])
def test_a_prepared_prefix_that_never_loads_releases_its_buffers(shm_daemon, layout, end_with):
    pool = make_pool(layout, 2048)
    orch = _orch(shm_daemon, layout, pool)
    try:
        toks = _tokens(3 * CHUNK, 30)
        _stored(orch, toks)
        assert orch.match("r", toks).tokens == 3 * CHUNK
        assert shm_daemon.held()["read_locks"] >= 3
        getattr(orch, end_with)("r")
        want = DegradeReason.ABORTED if end_with == "abort" else DegradeReason.UNUSED
        assert orch.metrics.snapshot().get(
            f"loadback_prefix_outcomes_total{{reason={want.value},state=degraded}}") == 1
        assert _settle_orch(orch, shm_daemon)["read_locks"] == 0
    finally:
        orch.close()


def test_a_daemon_restart_between_match_and_load_back_degrades(shm_daemon, layout):
    pool = make_pool(layout, 2048)
    orch = _orch(shm_daemon, layout, pool)
    try:
        toks = _tokens(2 * CHUNK, 40)
        _stored(orch, toks)
        assert orch.match("r", toks).tokens == 2 * CHUNK
        shm_daemon.stop()
        shm_daemon.start()
        end = time.monotonic() + 10
        while orch.connector.epoch == orch._live["r"].epoch and time.monotonic() < end:
            try:
                orch.connector.ping(0.05)
            except Exception:  # noqa: BLE001 - polling until the connector sees the restart
                time.sleep(0.02)
        res = orch.load_back("r", torch.arange(1024, 1024 + 2 * CHUNK))
        assert res.state is PrefixState.DEGRADED and res.loaded_tokens == 0
        assert res.reason is DegradeReason.DAEMON_RESTARTED
        orch.finish("r")
        assert orch.wait_registered(10)
        assert _settle_orch(orch, shm_daemon)["read_locks"] == 0
    finally:
        orch.close()


def test_a_prepared_range_past_its_age_is_released_and_asked_for_again(shm_daemon, layout):
    """The daemon's read locks have a TTL: after it, what prepare_retrieve pointed at may be
    evicted and its memory reused. A range older than prepare_max_age_ms is never copied:
    it is released, looked up and prepared again, and still loads byte-exact."""
    pool = make_pool(layout, 2048)
    orch = _orch(shm_daemon, layout, pool, prepare_max_age_ms=30)
    try:
        n = 2 * CHUNK
        toks = _tokens(n, 50)
        src = _stored(orch, toks)
        assert orch.match("r", toks).tokens == n
        time.sleep(0.06)
        sent = _spy_ops(orch)
        dst = torch.arange(1024, 1024 + n)
        res = orch.load_back("r", dst)
        assert res.state is PrefixState.LOADED and res.loaded_tokens == n
        assert sent.count("lookup") == 1 and sent.count("prepare_retrieve") == 1
        assert same_kv(kv_of(pool, dst), kv_of(pool, src))
        assert orch.metrics.snapshot().get("loadback_prepared_expired_total") == 1
        orch.finish("r")
        assert _settle_orch(orch, shm_daemon)["read_locks"] == 0
    finally:
        orch.close()


def test_the_transfer_chosen_at_registration_is_a_metric_label(shm_daemon, live_daemon, layout):
    """transfer auto: shm where the daemon offers a pool, pickle where it does not; the
    choice is made at every registration and exported as loadback_transfer_mode{mode}."""
    for d, want in ((shm_daemon, "shm"), (live_daemon, "pickle")):
        cfg = LoadBackConfig.from_dict({"mp_port": d.port, "chunk_size": CHUNK,
                                        "heartbeat": {"interval_ms": 50}})
        conn = LMCacheMPConnector(d.endpoint, layout, transfer="auto")
        orch = LoadBackOrchestrator(cfg, conn, kv_pool=make_pool(layout, 64))
        try:
            assert orch.wait_registered(10)
            snap = orch.metrics.snapshot()
            assert snap.get(f"loadback_transfer_mode{{mode={want}}}") == 1
            other = "pickle" if want == "shm" else "shm"
            assert snap.get(f"loadback_transfer_mode{{mode={other}}}") == 0
        finally:
            orch.close()
