"""The GPU data path against the real lmcache 0.5.6 daemon: CUDA KV pools (SGLang layout,
bf16 and fp16), store and load byte-exact through shared memory and pickle, the ready event,
synchronous mode, CUDA errors as a typed degrade, the segment's lifetime across a daemon
kill. Skipped where no CUDA device exists (CI); `loadback bench gpu` measures the speed."""

from __future__ import annotations

import os
import time

import pytest
import torch

from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.connectors.gpu_transfer import GpuTransferError
from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool
from lmcache_loadback.connectors.retrieval import Retrieval
from lmcache_loadback.engines.sglang.pools import mha_layout
from tests.stepping import Stepped

pytestmark = [pytest.mark.gpu, pytest.mark.daemon,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CHUNK = 16
T = 30.0
DEV = torch.device("cuda", 0) if torch.cuda.is_available() else None


def _layout(dtype=torch.bfloat16) -> KVLayout:
    return KVLayout(num_layers=4, num_heads=4, head_dim=64, dtype=dtype, chunk_size=CHUNK)


def _pool(layout: KVLayout, slots: int = 2048, fill: bool = True) -> KVPool:
    shape = (slots, layout.num_heads, layout.head_dim)
    mk = (lambda: torch.randn(shape, device=DEV).to(layout.dtype)) if fill else (
        lambda: torch.full(shape, -7.0, dtype=layout.dtype, device=DEV))
    return KVPool([mk() for _ in range(layout.num_layers)],
                  [mk() for _ in range(layout.num_layers)])


def _rows(pool: KVPool, slots) -> list[torch.Tensor]:
    return [b[slots.to(DEV)].view(torch.int16).cpu() for b in (*pool.k_buffer, *pool.v_buffer)]


@pytest.fixture(scope="module")
def shm_daemon():
    d = DaemonProcess(chunk_size=CHUNK, l1_size_gb=0.5, shm_name=f"lbgt{os.getpid()}")
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def pickle_daemon():
    d = DaemonProcess(chunk_size=CHUNK, l1_size_gb=0.5)
    d.start()
    yield d
    d.stop()


def _roundtrip(conn, layout, *, n_tok=5 * CHUNK, skip=5, tag=""):
    """Store a prefix from random slots of a CUDA pool, load it with a local hit of `skip`
    tokens into random slots of another; returns (Retrieved, want rows, got-slots, dst)."""
    src, dst = _pool(layout), _pool(layout, fill=False)
    toks = torch.randint(1, 30000, (n_tok,)).tolist()
    stored = torch.randperm(2048)[:n_tok].to(DEV)
    assert conn.store_from(toks, f"s{tag}", src, stored, timeout_s=T)
    conn.end_session(f"s{tag}", T)
    rid = f"r{tag}"
    assert conn.lookup_hit_tokens(toks, rid, T) == n_tok
    slots = torch.randperm(2048)[:n_tok - skip].to(DEV)
    r = conn.retrieve_into(toks, rid, dst, slots, start=0, end=n_tok, timeout_s=T, skip=skip)
    return r, _rows(src, stored[skip:]), slots, dst, rid


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layout_reads_off_a_cuda_pool(dtype):
    lay = _layout(dtype)
    pool = _pool(lay)
    assert mha_layout(pool.k_buffer, pool.v_buffer, CHUNK)[0] == lay


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("which", ["shm", "pickle"])
def test_store_and_load_byte_exact_into_cuda_pool(dtype, which, shm_daemon, pickle_daemon,
                                                   conns):
    lay = _layout(dtype)
    conn = conns(shm_daemon if which == "shm" else pickle_daemon, lay)
    assert conn.transfer == which  # auto chose by what the daemon offers
    r, want, slots, dst, rid = _roundtrip(conn, lay, tag=f"{which}{dtype}")
    assert isinstance(r.ready, torch.cuda.Event)
    torch.cuda.current_stream().wait_event(r.ready)  # the engine's forward stream
    assert all(torch.equal(a, b) for a, b in zip(_rows(dst, slots), want))
    assert r.nbytes == 5 * lay.chunk_bytes
    r.commit(T)  # paid once ready completed
    conn.end_session(rid, T)


def test_shm_segment_is_page_locked_at_registration(shm_daemon, conns):
    conn = conns(shm_daemon, _layout())
    assert conn._shm.bytes.is_pinned()
    assert conn._gpu.segment is not None and conn._gpu.segment.registered


def test_sync_mode_lands_before_returning(shm_daemon, conns):
    lay = _layout()
    conn = conns(shm_daemon, lay, gpu_sync=True)
    r, want, slots, dst, rid = _roundtrip(conn, lay, tag="sync")
    assert r.ready is None
    assert all(torch.equal(a, b) for a, b in zip(_rows(dst, slots), want))
    r.commit(T)


def test_cuda_error_degrades_with_a_reason_and_owes_the_commit(shm_daemon, conns,
                                                               monkeypatch):
    import lmcache_loadback.connectors.gpu_transfer as gt

    def broken(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    lay = _layout()
    conn = conns(shm_daemon, lay)
    src = _pool(lay)
    toks = torch.randint(1, 30000, (3 * CHUNK,)).tolist()
    assert conn.store_from(toks, "e-s", src, torch.arange(3 * CHUNK, device=DEV), timeout_s=T)
    assert conn.lookup_hit_tokens(toks, "e-r", T) == 3 * CHUNK
    monkeypatch.setattr(gt, "_copy_chunks", broken)
    r = Retrieval(conn.epoch, 0, 3 * CHUNK)
    with pytest.raises(GpuTransferError) as ei:
        conn.retrieve_into(toks, "e-r", _pool(lay, fill=False),
                           torch.arange(3 * CHUNK, device=DEV), start=0, end=3 * CHUNK,
                           timeout_s=T, retrieval=r)
    assert ei.value.reason == "copy_failed" and r.owes
    r.release(T)
    conn.end_session("e-r", T)


def test_daemon_killed_mid_copy_cannot_unmap_the_segment(conns):
    """The copy reads this process's own mapping: a SIGKILLed daemon and the re-registration
    with its successor leave it mapped and page-locked until the copy completed."""
    d = DaemonProcess(chunk_size=CHUNK, l1_size_gb=0.5, shm_name=f"lbgk{os.getpid()}")
    d.start()
    try:
        lay = KVLayout(num_layers=32, num_heads=8, head_dim=128, dtype=torch.bfloat16,
                       chunk_size=CHUNK)  # 2 MiB a chunk: the copy outlasts the kill
        conn = conns(d, lay)
        n = 64 * CHUNK
        src, dst = _pool(lay, slots=n + 64), _pool(lay, slots=n + 64, fill=False)
        toks = torch.randint(1, 30000, (n,)).tolist()
        assert conn.store_from(toks, "k-s", src, torch.arange(n, device=DEV), timeout_s=T)
        assert conn.lookup_hit_tokens(toks, "k-r", T) == n
        slots = torch.randperm(n + 64)[:n].to(DEV)
        r = conn.retrieve_into(toks, "k-r", dst, slots, start=0, end=n, timeout_s=T)
        d.kill()  # while the copy may still be reading the daemon's memory
        d.start()
        conn.register(T)  # the heartbeat's re-registration: a new segment, the old retired
        r.ready.synchronize()
        assert all(torch.equal(a, b) for a, b in
                   zip(_rows(dst, slots), _rows(src, torch.arange(n))))
    finally:
        d.stop()


@pytest.mark.parametrize("slots_on", ["cuda", "cpu"])
@pytest.mark.parametrize("how", ["prepared", "pieces"])
def test_prepared_and_pipelined_loads_are_byte_exact(how, slots_on, shm_daemon, conns):
    """prepare at match then copy only; or the load's own prepare_retrieve calls in pieces
    ([2, 4, 3] chunks: each piece's copy overlaps the next round trip). Slots from the
    device (SGLang's allocator) or the host (through page-locked staging)."""
    lay = _layout()
    conn = conns(shm_daemon, lay)
    n_tok, skip = 9 * CHUNK, 3
    conn.force_pieces = lambda k: [2, 4, 3]  # the plan pipelines only longer prefixes
    src, dst = _pool(lay), _pool(lay, fill=False)
    toks = torch.randint(1, 30000, (n_tok,)).tolist()
    stored = torch.randperm(2048)[:n_tok].to(DEV)
    assert conn.store_from(toks, f"s-{how}-{slots_on}", src, stored, timeout_s=T)
    rid = f"r-{how}-{slots_on}"
    assert conn.lookup_hit_tokens(toks, rid, T) == n_tok
    kw = {}
    if how == "prepared":
        kw["prepared"] = conn.prepare(toks, rid, start=0, end=n_tok, timeout_s=T)
    slots = torch.randperm(2048)[:n_tok - skip].to(slots_on)
    r = conn.retrieve_into(toks, rid, dst, slots, start=0, end=n_tok, timeout_s=T, skip=skip,
                           **kw)
    torch.cuda.current_stream().wait_event(r.ready)
    assert all(torch.equal(a, b) for a, b in zip(_rows(dst, slots), _rows(src, stored[skip:])))
    r.commit(T)
    conn.end_session(rid, T)


# -- ownership: the segment while copies read it, the staging ring between loads and stores --

def _stored_prefix(conn, layout, tag, n_tok=4 * CHUNK):
    src = _pool(layout)
    toks = torch.randint(1, 30000, (n_tok,)).tolist()
    stored = torch.randperm(2048)[:n_tok].to(DEV)
    assert conn.store_from(toks, f"s-{tag}", src, stored, timeout_s=T)
    conn.end_session(f"s-{tag}", T)
    return src, toks, stored


def _retrieve(conn, toks, rid, dst, slots):
    return conn.retrieve_into(toks, rid, dst, slots, start=0, end=len(toks), timeout_s=T)


def test_a_segment_retired_mid_load_stays_page_locked_until_the_copy_ran(conns, monkeypatch):
    """The daemon restarts and the connector registers again while a load has pinned the
    old segment but not yet queued its copy: the old segment is retired, not unregistered,
    until the load's ready event completed; the load is byte-exact."""
    import lmcache_loadback.connectors.gpu_transfer as gt
    d = DaemonProcess(chunk_size=CHUNK, l1_size_gb=0.5, shm_name=f"lbgr{os.getpid()}")
    d.start()
    try:
        lay = _layout()
        conn = conns(d, lay)
        src, toks, stored = _stored_prefix(conn, lay, "seg", n_tok=8 * CHUNK)
        assert conn.lookup_hit_tokens(toks, "seg-r", T) == len(toks)
        old = conn._gpu.segment
        dst, slots = _pool(lay, fill=False), torch.randperm(2048)[:len(toks)].to(DEV)
        step = Stepped(monkeypatch, gt, "_copy_chunks")
        with step.held(lambda: _retrieve(conn, toks, "seg-r", dst, slots)):
            d.kill()
            d.start()
            end = time.monotonic() + 30
            while conn._gpu.segment is old:
                try:
                    conn.register(T)
                except Exception:  # noqa: BLE001 - until the connector sees the new daemon
                    assert time.monotonic() < end
                    time.sleep(0.05)
            assert old.registered and old in conn._gpu._retired, \
                "the old segment was unregistered under a load that reads it"
        step.result().ready.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(_rows(dst, slots), _rows(src, stored)))
        # any later pass (the same segment: its mapping and inode) reaps what no copy reads
        conn._gpu.attach(conn._shm.bytes, identity=conn._shm.identity)
        assert not old.registered and old not in conn._gpu._retired
    finally:
        d.stop()


def test_a_suspect_reregistration_does_not_page_lock_again(shm_daemon, conns, monkeypatch):
    import lmcache_loadback.connectors.gpu_segment as gseg
    calls = []
    real = gseg.register_host
    monkeypatch.setattr(gseg, "register_host", lambda t: (calls.append(t), real(t))[1])
    conn = conns(shm_daemon, _layout())
    assert len(calls) == 1  # registration page-locked the segment once
    calls.clear()
    seg, mapped = conn._gpu.segment, conn._shm
    t0 = time.monotonic()
    conn.register(T)  # same daemon, same segment
    took = time.monotonic() - t0
    assert conn._shm is mapped and conn._gpu.segment is seg and seg.registered
    assert calls == [], f"page-locked again ({took:.3f} s)"
    print(f"re-registration with the same segment: {took * 1000:.1f} ms")


def _load_exact(conn, layout, src, toks, stored, rid):
    assert conn.lookup_hit_tokens(toks, rid, T) == len(toks)
    dst, slots = _pool(layout, fill=False), torch.randperm(2048)[:len(toks)].to(DEV)
    r = _retrieve(conn, toks, rid, dst, slots)
    r.ready.synchronize()
    ok = all(torch.equal(a, b) for a, b in zip(_rows(dst, slots), _rows(src, stored)))
    r.commit(T)
    conn.end_session(rid, T)
    return ok


def test_a_pickle_store_stays_byte_exact_while_a_load_reuses_staging(pickle_daemon, conns,
                                                                     monkeypatch):
    """The store's host chunks are serialised after its device-to-host copy: a pickle load
    running in between (through pinned staging) must not write where they are."""
    import lmcache_loadback.connectors.mp_store as store
    lay = _layout()
    conn = conns(pickle_daemon, lay)
    o_src, o_toks, o_stored = _stored_prefix(conn, lay, "other")
    src = _pool(lay)
    toks = torch.randint(1, 30000, (4 * CHUNK,)).tolist()
    stored = torch.randperm(2048)[:4 * CHUNK].to(DEV)
    step = Stepped(monkeypatch, store, "dump_tensor_list")  # copied to host, not serialised
    with step.held(lambda: conn.store_from(toks, "p-s", src, stored, timeout_s=T)):
        assert _load_exact(conn, lay, o_src, o_toks, o_stored, "o-r")
    assert step.result() is True
    conn.end_session("p-s", T)
    assert _load_exact(conn, lay, src, toks, stored, "p-r"), "the stored bytes were corrupted"


def test_a_store_never_takes_the_staging_of_a_load_not_yet_copied(pickle_daemon, conns,
                                                                  monkeypatch):
    """A pickle load staged its first piece and has not queued its copy: a store in between
    takes another buffer, and both are byte-exact."""
    import lmcache_loadback.connectors.gpu_transfer as gt
    lay = _layout()
    conn = conns(pickle_daemon, lay)
    src, toks, stored = _stored_prefix(conn, lay, "l")
    assert conn.lookup_hit_tokens(toks, "l-r", T) == len(toks)
    dst, slots = _pool(lay, fill=False), torch.randperm(2048)[:len(toks)].to(DEV)
    step = Stepped(monkeypatch, gt, "_copy_chunks")
    with step.held(lambda: _retrieve(conn, toks, "l-r", dst, slots)):
        # One chunk, like the load's staged piece: a buffer that size would be reused.
        s2, t2, st2 = _stored_prefix(conn, lay, "during", n_tok=CHUNK)
    r = step.result()
    r.ready.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(_rows(dst, slots), _rows(src, stored))), \
        "the load copied the store's bytes"
    r.commit(T)
    conn.end_session("l-r", T)
    assert _load_exact(conn, lay, s2, t2, st2, "during-r")
