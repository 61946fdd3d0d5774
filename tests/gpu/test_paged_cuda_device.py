"""The vLLM connector's CUDA view (`PagedCUDAView`) on a CUDA device, against the real lmcache
0.5.6 daemon: loads written straight into vLLM's blocks (LBNHC, LBHNC, split kernel blocks)
byte-exact where FlashAttention reads, ordered on vLLM's stream by the load's real event;
stores staged on vLLM's stream and gathered by another thread's stream after that copy only.
The layers are built as vLLM 0.32's `allocate_kv_cache` builds them for FlashAttention
(`harness/bench/gpu_vllm.py`: vLLM itself is not installed on the GPU host); the CPU
counterparts are tests/vllm/test_paged_cuda.py. Skipped where no CUDA device exists (CI)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from lmcache_loadback.connectors.gpu_transfer import GpuTransfer
from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool
from lmcache_loadback.engines.vllm.paged_cuda import PagedCUDAView
from lmcache_loadback.harness.bench.gpu_vllm import vllm_cuda_layers
from lmcache_loadback.testing.daemon import DaemonProcess

pytestmark = [pytest.mark.gpu, pytest.mark.daemon,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CHUNK, BLOCK, T = 32, 16, 30.0
LAY = KVLayout(num_layers=4, num_heads=4, head_dim=64, dtype=torch.bfloat16, chunk_size=CHUNK)
H, D = LAY.num_heads, LAY.head_dim
DEV = torch.device("cuda", 0) if torch.cuda.is_available() else None
NUM_BLOCKS = 64
ORDERS = [("LBNHC", None), ("LBHNC", None), ("LBNHC", 8)]


@pytest.fixture(scope="module")
def daemons():
    made = {"shm": DaemonProcess(chunk_size=CHUNK, l1_size_gb=0.5,
                                 shm_name=f"lbgv{os.getpid()}"),
            "pickle": DaemonProcess(chunk_size=CHUNK, l1_size_gb=0.5)}
    for d in made.values():
        d.start()
    yield made
    for d in made.values():
        d.stop()


def _layers(order="LBNHC", kernel_block=None) -> list[torch.Tensor]:
    layers = vllm_cuda_layers(NUM_BLOCKS, DEV, LAY, BLOCK, order, kernel_block)
    for t in layers:
        t.copy_(torch.randn(t.shape, device=DEV).to(LAY.dtype))
    return layers


def _flash_rows(layer: torch.Tensor, blocks) -> torch.Tensor:
    """[tokens, heads, 2*head_size] of vLLM's blocks `blocks` as FlashAttention reads them
    (`kv.transpose(1, 2)`, then K = [..., :head_size], V = [..., head_size:]), as int16."""
    kb = layer.shape[2]
    r = BLOCK // kb
    ids = torch.as_tensor(blocks, device=layer.device)
    kblocks = (ids[:, None] * r + torch.arange(r, device=layer.device)).reshape(-1)
    return layer.transpose(1, 2)[kblocks].reshape(-1, H, 2 * D).view(torch.int16)


def _others(layer: torch.Tensor, blocks) -> torch.Tensor:
    """Every kernel block of the layer outside vLLM's blocks `blocks` (int16)."""
    r = layer.shape[0] // NUM_BLOCKS
    keep = [b for b in range(NUM_BLOCKS) if b not in set(blocks)]
    return layer.unflatten(0, (NUM_BLOCKS, r))[keep].view(torch.int16)


def _stored(conn, tag: str, n: int):
    """A prefix of n tokens stored from random slots of a dense CUDA pool: (tokens, K rows,
    V rows) per layer, [n, heads, head_size] int16."""
    shape = (512, H, D)
    src = KVPool([torch.randn(shape, device=DEV).to(LAY.dtype) for _ in range(LAY.num_layers)],
                 [torch.randn(shape, device=DEV).to(LAY.dtype) for _ in range(LAY.num_layers)])
    toks = torch.randint(1, 30000, (n,)).tolist()
    slots = torch.randperm(512)[:n].to(DEV)
    assert conn.store_from(toks, f"s-{tag}", src, slots, timeout_s=T)
    conn.end_session(f"s-{tag}", T)
    return toks, [b[slots].view(torch.int16) for b in src.k_buffer], \
        [b[slots].view(torch.int16) for b in src.v_buffer]


@pytest.mark.parametrize("which", ["shm", "pickle"])
@pytest.mark.parametrize("order,kernel_block", ORDERS)
def test_a_load_lands_in_vllm_blocks_byte_exact_where_flash_attention_reads(
        order, kernel_block, which, daemons, conns):
    """The load's copy writes vLLM's blocks itself; vLLM's stream (not the host) waits for
    its ready event, and a read queued there right after sees every byte; no other block
    changes."""
    conn = conns(daemons[which], LAY)
    assert conn.transfer == which
    n = 6 * CHUNK
    toks, want_k, want_v = _stored(conn, f"{which}{order}{kernel_block}", n)
    layers = _layers(order, kernel_block)
    before = [t.clone() for t in layers]
    view = PagedCUDAView(layers, LAY, BLOCK, 8 * CHUNK)
    dst = torch.randperm(NUM_BLOCKS)[:n // BLOCK].tolist()
    rid = f"r-{which}{order}{kernel_block}"
    assert conn.lookup_hit_tokens(toks, rid, T) == n
    vllm = torch.cuda.Stream(DEV)
    with torch.cuda.stream(vllm):
        r = conn.retrieve_into(toks, rid, view.pool, view.load_slots(dst, n), start=0, end=n,
                               timeout_s=T)
        assert isinstance(r.ready, torch.cuda.Event)
        view.to_blocks(dst, n, ready=r.ready)
        got = [_flash_rows(t, dst).clone() for t in layers]  # queued after the wait only
    vllm.synchronize()
    for li, rows in enumerate(got):
        assert torch.equal(rows[..., :D], want_k[li]) and torch.equal(rows[..., D:],
                                                                       want_v[li]), li
        assert torch.equal(_others(layers[li], dst), _others(before[li], dst)), li
    r.commit(T)
    conn.end_session(rid, T)


def test_a_store_reads_the_blocks_as_staged_on_vllms_stream(daemons, conns):
    """vLLM's stream is busy (a sleep) when the step stages its store and then reuses the
    blocks; the store thread's own stream gathers only after the staging copy (its event),
    so the daemon gets the KV as the forward left it, not the zeros or the reuse."""
    conn = conns(daemons["shm"], LAY)
    layers = _layers()
    view = PagedCUDAView(layers, LAY, BLOCK, 8 * CHUNK)
    n, src = 3 * CHUNK, torch.randperm(NUM_BLOCKS)[:3 * CHUNK // BLOCK].tolist()
    want = [torch.randn(n, H, 2 * D, device=DEV).to(LAY.dtype) for _ in layers]
    rows = view.load_slots(src, n).to(DEV)
    toks = torch.randint(1, 30000, (n,)).tolist()
    vllm = torch.cuda.Stream(DEV)
    with torch.cuda.stream(vllm):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: the host runs far ahead
        for k, v, w in zip(view.pool.k_buffer, view.pool.v_buffer, want):  # the forward
            k[rows] = w[..., :D]
            v[rows] = w[..., D:]
        view.from_blocks(src, n, base=CHUNK)
        for t in layers:
            t.fill_(-5.0)  # the next step reuses the blocks
    out = {}

    def store_thread():
        with torch.cuda.stream(torch.cuda.Stream(DEV)):
            out["ok"] = conn.store_from(toks, "st", view.store_pool, view.slots(n, CHUNK),
                                        timeout_s=T)

    th = threading.Thread(target=store_thread)
    th.start()
    th.join(60)
    assert out.get("ok") is True
    conn.end_session("st", T)
    dst = torch.randperm(NUM_BLOCKS)[:n // BLOCK].tolist()
    assert conn.lookup_hit_tokens(toks, "st-r", T) == n
    r = conn.retrieve_into(toks, "st-r", view.pool, view.load_slots(dst, n), start=0, end=n,
                           timeout_s=T)
    view.to_blocks(dst, n, ready=r.ready)
    torch.cuda.synchronize(DEV)
    for t, w in zip(layers, want):
        assert torch.equal(_flash_rows(t, dst), w.view(torch.int16))
    r.commit(T)
    conn.end_session("st-r", T)


@pytest.mark.parametrize("scatter", ["triton", "torch"])
def test_the_cuda_copy_scatters_and_gathers_through_vllms_interleaved_rows(scatter):
    """Both row movers of the CUDA path (the Triton kernel after its self-check, the torch
    index ops) write a load with a local hit of 5 tokens into the K and V halves of vLLM's
    blocks and gather them back, byte-exact, other bytes untouched."""
    gt = GpuTransfer(DEV, scatter=scatter)
    assert gt.scatter_impl == scatter
    layers = _layers()
    before = [t.clone() for t in layers]
    view = PagedCUDAView(layers, LAY, BLOCK, 8 * CHUNK)
    n, skip = 4 * CHUNK, 5
    chunks = [torch.randn(LAY.chunk_shape).to(LAY.dtype) for _ in range(n // CHUNK)]
    dst = torch.randperm(NUM_BLOCKS)[:n // BLOCK].tolist()
    slots = view.load_slots(dst, n)
    gt.load(LAY, chunks, view.pool, slots[skip:], skip, from_segment=False).synchronize()
    whole = torch.stack(chunks).to(DEV)  # [chunks, K|V, layers, chunk, hidden]
    for li, t in enumerate(layers):
        rows = _flash_rows(t, dst)
        old = _flash_rows(before[li], dst)
        for kv, half in ((0, slice(0, D)), (1, slice(D, 2 * D))):
            want = whole[:, kv, li].reshape(n, H, D).view(torch.int16)
            assert torch.equal(rows[skip:, :, half], want[skip:]), (li, kv)
            assert torch.equal(rows[:skip, :, half], old[:skip, :, half]), (li, kv)
        assert torch.equal(_others(t, dst), _others(before[li], dst))
    back = gt.store(LAY, view.pool, slots, list(range(n // CHUNK)), None)
    got = torch.stack(back)
    assert torch.equal(got[1:].view(torch.int16), torch.stack(chunks)[1:].view(torch.int16))
    assert torch.equal(got[0, :, :, skip:].view(torch.int16),
                       chunks[0][:, :, skip:].view(torch.int16))
    gt.close()
