"""The GPU data path's logic with CPU tensors: pieces, skip, pinned staging, gather, segment
lifetime. The CUDA-only parts (cudaHostRegister, streams, events, the Triton kernel) run in
tests/gpu on a GPU host."""

from __future__ import annotations

import mmap
import os
from types import SimpleNamespace

import pytest
import torch

from lmcache_loadback.connectors.gpu_transfer import GpuTransfer, GpuTransferError, _cuda_call, _pieces
from lmcache_loadback.connectors.kv_copy import gather_chunks, scatter_skipping
from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool
from lmcache_loadback.connectors.shm_pool import ShmPool
from lmcache_loadback.connectors import wire
from tests.stepping import Stepped

LAYOUT = KVLayout(num_layers=3, num_heads=2, head_dim=8, dtype=torch.bfloat16, chunk_size=16)


def _pool(slots: int = 512, fill: bool = False) -> KVPool:
    shape = (slots, LAYOUT.num_heads, LAYOUT.head_dim)
    mk = (lambda: torch.randn(shape).to(LAYOUT.dtype)) if fill else (
        lambda: torch.full(shape, -7.0, dtype=LAYOUT.dtype))
    return KVPool([mk() for _ in range(LAYOUT.num_layers)],
                  [mk() for _ in range(LAYOUT.num_layers)])


def _segment_chunks(n: int, order: list[int] | None = None):
    """n random chunks laid out in a uint8 'segment' (in `order` of slots), as views."""
    seg = torch.zeros((n + 2) * LAYOUT.chunk_bytes, dtype=torch.uint8)
    order = order or list(range(n))
    views = []
    for j in range(n):
        off = order[j] * LAYOUT.chunk_bytes
        v = seg[off:off + LAYOUT.chunk_bytes].view(LAYOUT.dtype).view(LAYOUT.chunk_shape)
        v.copy_(torch.randn(LAYOUT.chunk_shape).to(LAYOUT.dtype))
        views.append(v)
    return seg, views


def _expected(chunks, slots, skip) -> KVPool:
    want = _pool()
    scatter_skipping(LAYOUT, [c.clone() for c in chunks], want, slots, skip)
    return want


def _same(a: KVPool, b: KVPool) -> bool:
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16))
               for x, y in zip([*a.k_buffer, *a.v_buffer], [*b.k_buffer, *b.v_buffer]))


@pytest.mark.parametrize("pieces", [1, 2, 3, 7])
@pytest.mark.parametrize("skip", [0, 5])
@pytest.mark.parametrize("back_to_back", [True, False])
def test_segment_load_lands_every_row_in_its_slot(pieces, skip, back_to_back):
    n = 5
    seg, chunks = _segment_chunks(n, None if back_to_back else [4, 0, 3, 1, 2])
    slots = torch.randperm(512)[:n * 16 - skip]
    gt = GpuTransfer("cpu", pieces=pieces)
    gt.attach(seg)
    pool = _pool()
    assert gt.load(LAYOUT, chunks, pool, slots, skip, from_segment=True) is None  # CPU: done
    assert _same(pool, _expected(chunks, slots, skip))


@pytest.mark.parametrize("skip", [0, 11])
def test_pickle_load_goes_through_staging_byte_exact(skip, monkeypatch):
    import lmcache_loadback.connectors.gpu_transfer as gt_mod
    monkeypatch.setattr(gt_mod, "PICKLE_PIECE_BYTES", LAYOUT.chunk_bytes * 2)  # 3 pieces of 2
    chunks = [torch.randn(LAYOUT.chunk_shape).to(LAYOUT.dtype) for _ in range(6)]
    slots = torch.randperm(512)[:6 * 16 - skip]
    gt = GpuTransfer("cpu", pieces=1)
    pool = _pool()
    gt.load(LAYOUT, chunks, pool, slots, skip, from_segment=False)
    assert _same(pool, _expected(chunks, slots, skip))


def test_segment_load_without_attached_segment_is_a_typed_error():
    _, chunks = _segment_chunks(2)
    with pytest.raises(GpuTransferError, match="no_segment"):
        GpuTransfer("cpu").load(LAYOUT, chunks, _pool(), torch.arange(32), 0, from_segment=True)


@pytest.mark.parametrize("indices", [[0, 1, 2, 3], [2, 0], []])
def test_store_gathers_selected_chunks_into_views_and_staging(indices):
    src = _pool(fill=True)
    slots = torch.randperm(512)[:4 * 16]
    want = gather_chunks(LAYOUT, src.k_buffer, src.v_buffer, slots, chunk_indices=indices)
    gt = GpuTransfer("cpu")
    got = gt.store(LAYOUT, src, slots, indices, out=None)
    assert len(got) == len(indices) and all(torch.equal(a, b) for a, b in zip(got, want))
    seg, views = _segment_chunks(len(indices))
    gt.store(LAYOUT, src, slots, indices, out=views)
    assert all(torch.equal(a, b) for a, b in zip(views, want))


def test_pieces_cover_every_chunk_once():
    for n in range(1, 20):
        for k in range(1, 9):
            b = _pieces(n, k)
            assert b[0][0] == 0 and b[-1][1] == n and len(b) == min(n, k)
            assert all(x[1] == y[0] for x, y in zip(b, b[1:]))


class _Ev:
    """A completion event stand-in (the CUDA one needs a GPU): done when told."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_replaced_segment_stays_mapped_until_its_loads_complete():
    gt = GpuTransfer("cpu")
    old = torch.zeros(64, dtype=torch.uint8)
    gt.attach(old)
    ev = _Ev()
    gt.segment.hold(ev)  # a load still reading the old segment
    first = gt.segment
    gt.attach(torch.zeros(64, dtype=torch.uint8))  # re-registration (daemon restarted)
    assert first.bytes is old and gt._retired == [first]
    ev.done = True
    gt.attach(None)  # next registration reaps it
    assert first.bytes is None and gt._retired == []
    gt.close()


def test_close_waits_for_running_loads():
    gt = GpuTransfer("cpu")
    gt.attach(torch.zeros(64, dtype=torch.uint8))
    ev = _Ev()
    gt.segment.hold(ev)
    gt.close()
    assert ev.done and gt.segment is None


def test_cuda_errors_become_a_degrade_with_a_reason():
    def boom():
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
    with pytest.raises(GpuTransferError) as ei:
        _cuda_call("copy_failed", boom)
    assert ei.value.reason == "copy_failed" and "illegal memory access" in str(ei.value)
    from lmcache_loadback.connectors.errors import ConnectorError
    assert isinstance(ei.value, ConnectorError)


def test_bad_options_name_the_fix():
    with pytest.raises(ValueError, match="pieces must be >= 1"):
        GpuTransfer("cpu", pieces=0)
    with pytest.raises(ValueError, match="scatter must be 'auto', 'torch' or 'triton'"):
        GpuTransfer("cpu", scatter="fast")


def test_closing_the_shm_pool_keeps_the_mapping_under_a_live_view():
    name = f"lbtest{os.getpid()}"
    path = "/dev/shm/" + name
    size = LAYOUT.chunk_bytes * 2
    with open(path, "wb") as f:
        f.truncate(size)
    try:
        pool = ShmPool(name, size)
        slot = wire.ShmSlot(offset=LAYOUT.chunk_bytes, length=LAYOUT.chunk_bytes,
                            shape=list(LAYOUT.chunk_shape), dtype=LAYOUT.dtype_str)
        view = pool.view(slot, LAYOUT)
        view.fill_(1.5)
        m = pool._map
        pool.close()  # e.g. re-registration after a restart, while a copy still reads
        assert not m.closed, "the mapping was unmapped under a live view"
        assert bool((view == 1.5).all())
        del view
    finally:
        os.unlink(path)


def test_mmap_close_needs_the_memoryview_export():
    """Why ShmPool maps through a memoryview: a plain frombuffer view does not pin it."""
    m = mmap.mmap(-1, 4096)
    t = torch.frombuffer(memoryview(m), dtype=torch.uint8)[8:16]
    with pytest.raises(BufferError):
        m.close()
    del t
    m.close()


def test_pickle_message_over_the_wire_limit_is_refused_before_sending(monkeypatch):
    """msgpack cannot carry 4 GiB: a raw EncodeError (or a reply that never comes) would
    reach the engine; a typed error naming the fix is raised before any call instead."""
    import lmcache_loadback.connectors.lmcache_mp as mp
    import lmcache_loadback.connectors.mp_retrieve as retrieve
    from lmcache_loadback.connectors.errors import ProtocolError

    monkeypatch.setattr(retrieve, "PICKLE_MAX_BYTES", 3 * LAYOUT.chunk_bytes)
    conn = mp.LMCacheMPConnector("tcp://127.0.0.1:9", LAYOUT, transfer="pickle")
    sent = []
    monkeypatch.setattr(conn, "_call", lambda *a, **k: sent.append(a))
    pool = _pool()
    toks = list(range(4 * 16))
    try:
        with pytest.raises(ProtocolError, match="--shm-name NAME --no-l1-use-lazy"):
            conn.store_from(toks, "big", pool, torch.arange(64), timeout_s=1)
        with pytest.raises(ProtocolError, match="limit of one pickle message"):
            conn.retrieve_into(toks, "big", pool, torch.arange(64), start=0, end=64,
                               timeout_s=1)
        assert sent == []
        conn.store_from(toks[:48], "ok", pool, torch.arange(48), timeout_s=1)  # at the limit
        assert sent and sent[0][0] == "commit_store"  # pickled: no prepare_store
    finally:
        conn.close()


# -- ownership: segments counted while copies read them, staging with one owner at a time ----

def test_a_segment_replaced_mid_load_stays_registered_until_the_copy_ran(monkeypatch):
    """A load counts on its segment from before its first copy, not only once it finished:
    a re-registration in between retires the segment but must not unregister it."""
    import lmcache_loadback.connectors.gpu_transfer as gt_mod
    unregistered = []
    monkeypatch.setattr(gt_mod.torch.cuda, "cudart", lambda: SimpleNamespace(
        cudaHostUnregister=lambda ptr: unregistered.append(ptr) or 0))
    gt = GpuTransfer("cpu", pieces=2)
    seg, chunks = _segment_chunks(4)
    gt.attach(seg)
    old = gt.segment
    old.registered = True  # as cudaHostRegister left it on a GPU
    pool, slots = _pool(), torch.randperm(512)[:4 * 16]
    step = Stepped(monkeypatch, gt_mod, "_copy_chunks")  # the first copy is not queued yet
    with step.held(lambda: gt.load(LAYOUT, chunks, pool, slots, 0, from_segment=True)):
        gt.attach(torch.zeros(64, dtype=torch.uint8))  # the daemon restarted: a new segment
        assert unregistered == [] and old.registered and old.bytes is seg, \
            "the segment was unregistered while a queued copy reads it"
        assert gt._retired == [old]
    step.result()
    assert _same(pool, _expected(chunks, slots, 0))
    assert unregistered == [seg.data_ptr()] and gt._retired == []  # released once it ran
    gt.close()


def test_store_chunks_stay_intact_while_a_pickle_load_uses_staging():
    """The store's chunks are serialised after it returns: a load's staging must not be
    the buffer they live in."""
    src = _pool(fill=True)
    slots = torch.randperm(512)[:2 * 16]
    gt = GpuTransfer("cpu", pieces=1)
    got = gt.store(LAYOUT, src, slots, [0, 1], out=None)
    want = [t.clone() for t in got]
    other = [torch.randn(LAYOUT.chunk_shape).to(LAYOUT.dtype) for _ in range(2)]
    pool, dst = _pool(), torch.randperm(512)[:2 * 16]
    gt.load(LAYOUT, other, pool, dst, 0, from_segment=False)  # stages the same byte count
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "the store's bytes changed"
    assert _same(pool, _expected(other, dst, 0))


def test_a_store_never_takes_the_staging_a_queued_load_still_reads(monkeypatch):
    """A pickle load staged its chunks and is about to copy them: a store in between must
    take another buffer, not overwrite the staged bytes."""
    import lmcache_loadback.connectors.gpu_transfer as gt_mod
    gt = GpuTransfer("cpu", pieces=1)
    chunks = [torch.randn(LAYOUT.chunk_shape).to(LAYOUT.dtype) for _ in range(2)]
    pool, slots = _pool(), torch.randperm(512)[:2 * 16]
    step = Stepped(monkeypatch, gt_mod, "_copy_chunks")  # staged, not yet copied
    with step.held(lambda: gt.load(LAYOUT, chunks, pool, slots, 0, from_segment=False)):
        stored = gt.store(LAYOUT, _pool(fill=True), torch.randperm(512)[:2 * 16], [0, 1],
                          out=None)
        assert len(stored) == 2
    step.result()
    assert _same(pool, _expected(chunks, slots, 0)), "the load copied the store's bytes"


def test_staging_is_handed_out_again_only_after_the_copy_that_used_it():
    """Given back with its copy's event, a buffer is written by the next owner only once
    that event completed; with every buffer owned, a taker waits (bounded), then fails
    typed."""
    from lmcache_loadback.connectors.gpu_staging import PinnedRing
    ring = PinnedRing(size=1)
    i, buf = ring.take(8, pin=False)
    ev = _Ev()
    ring.give(i, ev)  # the copy reading it is queued, not done
    j, buf2 = ring.take(8, pin=False)
    assert j == i and ev.done, "handed out before the copy that read it completed"
    with pytest.raises(GpuTransferError, match="staging_busy"):
        ring.take(8, pin=False, wait_s=0.05)
    ring.give(j, None)
    assert ring.take(8, pin=False)[0] == i
