"""Re-registration and the shared-memory mapping, against real daemons in shm mode.

A timeout marks the daemon suspect and the heartbeat registers again. With the same daemon
incarnation naming the same segment, the mapping (and on a GPU its page-locking) is kept:
remapping 6 GiB and page-locking it again takes 0.5-0.8 s, and a load in that window would
fail and mark the daemon suspect again. Only a new segment (a restarted daemon) replaces it,
in one store: a thread that already read the old mapping keeps a valid object, and whatever
fails reaches the orchestrator as a ConnectorError (never AttributeError or TypeError,
which match would raise into the engine). Threads are stepped by Events at the exact point
between reading the mapping and using it.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import lmcache_loadback.connectors.lmcache_mp as mp
from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.connectors.errors import ConnectorError, DaemonUnavailable
from lmcache_loadback.connectors.gpu_transfer import GpuTransfer
from lmcache_loadback.connectors.shm_pool import ShmPool
from lmcache_loadback.orchestrator import LoadBackConfig, LoadBackOrchestrator, PrefixState
from tests.conftest import CHUNK, kv_of, make_pool, same_kv
from tests.stepping import Stepped

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(180)]
T = 10.0


@pytest.fixture(scope="module")
def _daemon():
    with DaemonProcess(chunk_size=CHUNK, shm_name=f"lbsw{os.getpid()}") as d:
        yield d


@pytest.fixture
def running(_daemon):
    """The module's shm daemon, started again if a test killed it."""
    if _daemon.proc is None or _daemon.proc.poll() is not None:
        _daemon.start()
    return _daemon


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _attach_spy(conn, monkeypatch) -> list:
    """A CPU GpuTransfer on the connector (registration attaches the segment to it, as with
    device=cuda) whose attach calls are recorded."""
    calls: list = []
    gt = GpuTransfer("cpu")
    real = gt.attach
    monkeypatch.setattr(gt, "attach", lambda b, **kw: (calls.append(b), real(b, **kw))[1])
    conn._gpu = gt
    return calls


def _orch(d: DaemonProcess, layout, pool):
    cfg = {"mp_port": d.port, "chunk_size": CHUNK, "transfer": "shm",
           "deadlines": {"lookup_ms": 2000, "retrieve_base_ms": 2000, "control_ms": 1000,
                         "connect_ms": 5000}}
    conn = mp.LMCacheMPConnector(d.endpoint, layout, transfer="shm", connect_timeout_s=1.0)
    # No heartbeat thread: each registration below is a tick this test runs itself.
    orch = LoadBackOrchestrator(LoadBackConfig.from_dict(cfg), conn, kv_pool=pool,
                                start_heartbeat=False)
    return orch, conn


def _register(orch, conn, monkeypatch) -> list:
    calls = _attach_spy(conn, monkeypatch)
    orch.tick()
    assert orch.link.registered() and conn.transfer == "shm" and conn._shm is not None
    return calls


def _held_view(monkeypatch) -> Stepped:
    """Holds the matching thread's first `ShmPool.view`: it has read the mapping and not
    used it yet."""
    return Stepped(monkeypatch, ShmPool, "view")


def test_a_suspect_reregistration_keeps_the_mapping_under_a_running_match(running, layout,
                                                                          monkeypatch):
    """Match has read the mapping for its prepared range when a timeout's suspicion makes
    the heartbeat register again with the same daemon: nothing is remapped or page-locked
    again, and the prefix still loads byte-exact from the views match took."""
    pool = make_pool(layout, 2048)
    orch, conn = _orch(running, layout, pool)
    try:
        attach_calls = _register(orch, conn, monkeypatch)
        assert len(attach_calls) == 1
        mapped = conn._shm
        n = 3 * CHUNK
        toks = _tokens(n, 1)
        src = torch.arange(n)
        assert orch.store("s", toks, src)
        orch.finish("s")
        step = _held_view(monkeypatch)
        with step.held(lambda: orch.match("r", toks)):
            orch.link.suspect()  # e.g. a LOOKUP of another request timed out
            orch.tick()  # the heartbeat's re-registration
            assert not orch.link._suspect.is_set()  # it did register again
            assert conn._shm is mapped, "a re-registration with the same segment remapped it"
            assert len(attach_calls) == 1, "the same segment was page-locked again"
        assert step.result().tokens == n and orch.state_of("r") is PrefixState.MARKED
        dst = torch.arange(1024, 1024 + n)
        res = orch.load_back("r", dst)
        assert res.state is PrefixState.LOADED and res.loaded_tokens == n
        assert same_kv(kv_of(pool, dst), kv_of(pool, src))
        orch.finish("r")
    finally:
        orch.close()


def _reregister_with_restarted(orch, conn, old, timeout_s: float = 30.0) -> None:
    """Heartbeat ticks until the connector registered with the restarted daemon (its
    reconnection is noticed asynchronously: poll that outside condition, bounded)."""
    end = time.monotonic() + timeout_s
    while conn._shm is old or conn._shm is None:
        assert time.monotonic() < end, "never registered with the restarted daemon"
        orch.link.suspect()
        orch.tick()
        if conn._shm is old or conn._shm is None:
            time.sleep(0.05)


def test_a_new_segment_swapped_in_under_a_running_match_fails_it_typed(running, layout,
                                                                       monkeypatch):
    """The daemon restarts (a new segment under the same name) while match has read the old
    mapping and not used it: the re-registration swaps the mapping in, the old one is
    closed, and match ends the prefix degraded (a ConnectorError inside), never raising."""
    pool = make_pool(layout, 2048)
    orch, conn = _orch(running, layout, pool)
    try:
        attach_calls = _register(orch, conn, monkeypatch)
        old = conn._shm
        n = 2 * CHUNK
        toks = _tokens(n, 2)
        assert orch.store("s", toks, torch.arange(n))
        orch.finish("s")
        step = _held_view(monkeypatch)
        with step.held(lambda: orch.match("r", toks)):
            running.kill()
            running.start()
            _reregister_with_restarted(orch, conn, old)
            assert old.bytes is None and len(attach_calls) == 2  # a new segment: remapped
        assert step.result().tokens == 0 and orch.state_of("r") in (None, PrefixState.DEGRADED)
        orch.finish("r")
        # The new daemon serves the same connector over the new mapping.
        assert orch.store("s2", toks, torch.arange(n))
        orch.finish("s2")
        assert orch.match("r2", toks).tokens == n
        dst = torch.arange(1024, 1024 + n)
        assert orch.load_back("r2", dst).state is PrefixState.LOADED
        assert same_kv(kv_of(pool, dst), kv_of(pool, torch.arange(n)))
        orch.finish("r2")
    finally:
        orch.close()


def test_reregistration_remaps_only_for_a_new_segment(running, layout, monkeypatch):
    """Same incarnation, same segment: the same ShmPool and no second attach; a view
    taken before stays valid. After a restart: a new mapping, attached once more."""
    conn = mp.LMCacheMPConnector(running.endpoint, layout, transfer="shm")
    try:
        calls = _attach_spy(conn, monkeypatch)
        conn.register(T)
        first = conn._shm
        conn.register(T)
        conn.register(T)
        assert conn._shm is first and first.bytes is not None and len(calls) == 1
        running.restart()
        end = time.monotonic() + 30
        while True:
            try:
                conn.register(T)
                if conn._shm is not first:
                    break
            except ConnectorError:
                pass
            assert time.monotonic() < end, "never registered with the restarted daemon"
            time.sleep(0.05)
        assert first.bytes is None and len(calls) == 2 and calls[-1] is conn._shm.bytes
    finally:
        conn.close()


def test_no_mapping_is_a_connector_error_everywhere(running, layout):
    """A closed or missing mapping is DaemonUnavailable at every use, never an
    AttributeError or TypeError."""
    conn = mp.LMCacheMPConnector(running.endpoint, layout, transfer="shm")
    try:
        conn.register(T)
        pool = conn._shm
        slot = mp.wire.ShmSlot(offset=0, length=layout.chunk_bytes,
                               shape=list(layout.chunk_shape), dtype=layout.dtype_str)
        pool.close()  # e.g. swapped out by a re-registration on another thread
        with pytest.raises(DaemonUnavailable):
            pool.view(slot, layout)
        with pytest.raises(DaemonUnavailable):
            conn._shm_views(mp.wire.ShmContext(slots=[slot]), 1)
        toks = _tokens(CHUNK, 3)
        with pytest.raises(DaemonUnavailable):
            conn.store_from(toks, "s", make_pool(layout, 64), torch.arange(CHUNK),
                            timeout_s=T)
        conn.end_session("s", T)
    finally:
        conn.close()
