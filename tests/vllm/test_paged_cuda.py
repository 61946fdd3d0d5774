"""`PagedCUDAView` on CPU tensors laid out exactly as vLLM 0.32 lays out a CUDA KV cache
(vLLM's own `allocate_kv_cache`, FlashAttention's `[B, H, N, 2*head_size]`, LBNHC and LBHNC):
loads written straight into vLLM's blocks by the core's copy, stores staged token-major, and
both through the worker side against the real lmcache 0.5.6 daemon, checked where
FlashAttention reads each token's K and V (tests/gpu/test_paged_cuda_device.py runs the same
on a CUDA device).

Run: .venv-vllm/bin/python -m pytest tests/vllm/test_paged_cuda.py -q
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, \
    KVCacheTensor
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from lmcache_loadback.connectors.errors import UnsupportedKVPool
from lmcache_loadback.connectors.kv_copy import scatter_chunks
from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.engines.vllm import paged_cuda
from lmcache_loadback.engines.vllm.meta import LoadBackMeta, LoadOp, StoreOp
from lmcache_loadback.engines.vllm.paged_cuda import PagedCUDAView
from lmcache_loadback.engines.vllm.scheduler import SchedulerSide
from lmcache_loadback.engines.vllm.settings import from_vllm
from lmcache_loadback.engines.vllm.worker import WorkerSide

from .conftest import CHUNK
from .mini_engine import BLOCK, DTYPE, HEAD, HEADS, LAYERS, kv_cache_config, vllm_config

NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
LAYOUT = KVLayout(LAYERS, HEADS, HEAD, DTYPE, CHUNK)


def vllm_layers(num_blocks: int, order: KVCacheLayout, kernel_block: int | None = None
                ) -> list[torch.Tensor]:
    """The layers as vLLM's GPU model runner allocates them (on the CPU here): one backing
    buffer, layer-major, `create_kv_cache_views` per layer, random KV."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=LAYERS * num_blocks * page, layers=NAMES,
                           layer_stride=num_blocks * page, block_stride=page)
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                        kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    caches = allocate_kv_cache(cfg, torch.device("cpu"), order,
                               [kernel_block] if kernel_block else None)
    layers = [caches[n] for n in NAMES]
    g = torch.Generator().manual_seed(3)
    for t in layers:
        t.copy_(torch.randn(t.shape, generator=g).to(DTYPE))
    return layers


def flash_kv(layer: torch.Tensor, block: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one token, every head, as FlashAttention reads them (`kv.transpose(1, 2)
    .split(head_size, -1)`, slot = block * block_size + offset), as int16 (bit for bit)."""
    kb = layer.shape[2]
    k, v = layer.transpose(1, 2).split(HEAD, dim=-1)  # [B, N, H, D] each
    b, n = block * (BLOCK // kb) + offset // kb, offset % kb
    return k[b, n].view(torch.int16), v[b, n].view(torch.int16)


ORDERS = [(KVCacheLayout.LBNHC, None), (KVCacheLayout.LBHNC, None), (KVCacheLayout.LBNHC, 16)]


def _chunks(n: int, seed: int) -> list[torch.Tensor]:
    """`n // CHUNK` random chunks as the daemon hands them out ([K|V, layers, chunk, hidden])."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(LAYOUT.chunk_shape, generator=g).to(DTYPE) for _ in range(n // CHUNK)]


def _token(chunks, kv: int, layer: int, t: int) -> torch.Tensor:
    """Token t's K (kv 0) or V (kv 1) of `layer` in the chunks, [heads, head_size] as int16."""
    return chunks[t // CHUNK][kv, layer, t % CHUNK].view(HEADS, HEAD).view(torch.int16)


def _cpu_transfer_load(chunks, pool, slots):
    """The core's CUDA copy path (`GpuTransfer.load`, its torch scatter) run on the CPU."""
    from lmcache_loadback.connectors.gpu_transfer import GpuTransfer
    GpuTransfer("cpu", scatter="torch").load(LAYOUT, chunks, pool, slots, 0,
                                             from_segment=False)


@pytest.mark.parametrize("mover", ["kv_layout", "gpu_transfer"])
@pytest.mark.parametrize("order,kernel_block", ORDERS)
def test_loads_land_in_vllm_blocks_where_flash_attention_reads(order, kernel_block, mover):
    """The load pool is vLLM's own blocks: the core's copy (the CPU scatter or the CUDA
    path's) into `load_slots` writes each token's K and V where FlashAttention reads them,
    and no other byte of the cache."""
    layers = vllm_layers(24, order, kernel_block)
    if order is KVCacheLayout.LBNHC:
        assert not layers[0].is_contiguous()  # FlashAttention's default is strided
    before = [t.clone() for t in layers]
    view = PagedCUDAView(layers, LAYOUT, BLOCK, 4 * CHUNK)
    dst, n = [9, 22, 1, 14, 0, 23, 5, 16], 8 * BLOCK
    chunks = _chunks(n, 5)
    slots = view.load_slots(dst, n)
    if mover == "kv_layout":
        scatter_chunks(LAYOUT, chunks, view.pool.k_buffer, view.pool.v_buffer, slots)
    else:
        _cpu_transfer_load(chunks, view.pool, slots)
    view.to_blocks(dst, n)
    for li, layer in enumerate(layers):
        for j, d in enumerate(dst):
            for off in range(BLOCK):
                k, v = flash_kv(layer, d, off)
                t = j * BLOCK + off
                assert torch.equal(k, _token(chunks, 0, li, t)) and \
                    torch.equal(v, _token(chunks, 1, li, t)), (li, d, off)
        blocks, old = layer.unflatten(0, (24, -1)), before[li].unflatten(0, (24, -1))
        for b in (b for b in range(24) if b not in dst):  # vLLM's blocks (kernel blocks)
            assert torch.equal(blocks[b].view(torch.int16), old[b].view(torch.int16))


@pytest.mark.parametrize("order,kernel_block", ORDERS)
def test_stores_stage_the_blocks_token_major(order, kernel_block):
    """from_blocks copies the blocks' K and V (as FlashAttention reads them) into the store
    region, which the core then gathers from; the blocks may change afterwards."""
    layers = vllm_layers(24, order, kernel_block)
    view = PagedCUDAView(layers, LAYOUT, BLOCK, 4 * CHUNK)
    src, base = [3, 17, 5, 0], BLOCK
    view.from_blocks(src, 4 * BLOCK, base=base)
    want = [[tuple(x.clone() for x in flash_kv(t, s, off)) for s in src for off in range(BLOCK)]
            for t in layers]
    for t in layers:
        t.fill_(-3.0)  # vLLM reuses the blocks
    sl = view.slots(4 * BLOCK, base)
    for li in range(LAYERS):
        got_k = view.store_pool.k_buffer[li][sl].view(torch.int16)
        got_v = view.store_pool.v_buffer[li][sl].view(torch.int16)
        for r, (k, v) in enumerate(want[li]):
            assert torch.equal(got_k[r], k) and torch.equal(got_v[r], v), (li, r)
    with pytest.raises(ValueError, match="store region holds"):
        view.from_blocks(src, 4 * BLOCK, base=view.store_tokens - BLOCK)


def test_load_slots_refuse_what_vllm_did_not_allocate():
    view = PagedCUDAView(vllm_layers(8, KVCacheLayout.LBNHC), LAYOUT, BLOCK, 2 * CHUNK)
    with pytest.raises(ValueError, match=r"block ids \[3, 8\] outside \[0, 8\)"):
        view.load_slots([3, 8], 2 * BLOCK)
    with pytest.raises(ValueError, match="moves at most 128"):
        view.load_slots(list(range(6)), 6 * BLOCK)
    with pytest.raises(ValueError, match="in 2 blocks of 32"):
        view.load_slots([1, 2], BLOCK)


@pytest.fixture
def worker(model_config, daemon, yaml_for, monkeypatch):
    """The worker side with CPU layers routed to the CUDA view (production routes CUDA only)."""
    monkeypatch.setattr(paged_cuda, "CUDA_VIEW_DEVICES", ("cuda", "cpu"))
    cfg = vllm_config(model_config, {"loadback.config_file": yaml_for(daemon.port)})
    w = WorkerSide(from_vllm(cfg, kv_cache_config(64)), NAMES)
    layers = vllm_layers(64, KVCacheLayout.LBNHC)
    w.register(dict(zip(NAMES, layers)))
    try:
        assert isinstance(w.view, PagedCUDAView)
        assert w.orch.wait_registered(30), "never registered with the daemon"
        yield w, layers
    finally:
        w.close()


@pytest.mark.daemon
def test_store_then_load_is_byte_exact_where_flash_attention_reads(worker):
    w, layers = worker
    prompt = [7 + (i * 29) % 3000 for i in range(4 * CHUNK)]
    n = len(prompt)
    src = [40, 3, 57, 12, 33, 8, 61, 20]           # 8 blocks of 32 = 256 tokens
    dst = [5, 44, 18, 29, 50, 1, 36, 63]
    before = [t.clone() for t in layers]
    w.save(LoadBackMeta(stores={"a": StoreOp("a#store1", prompt, src)}), set())
    assert w.drain(10.0) and w.stores_done == 1
    for t in layers:                                # the destination blocks hold other KV
        t[torch.tensor(dst)] = -3.0
    # The scheduler side's LOOKUP, handed off: the worker loads under its session.
    sched = SchedulerSide(w.settings)
    try:
        assert sched.orch.wait_registered(30)
        assert sched.orch.match("b#ask1", prompt[:n], local_hit_tokens=0).tokens == n
        locked = sched.orch.handoff.hand_off("b#ask1", n)
        assert locked
    finally:
        sched.close()
    op = LoadOp("b#ask1", prompt, 0, n, dst, locked=locked)
    failed = w.start_load(LoadBackMeta(loads={"b": op}))
    assert failed == set() and w.loads_done == 1 and w.take_errors() == set()
    for li, layer in enumerate(layers):
        for j, (s, d) in enumerate(zip(src, dst)):
            for off in range(BLOCK):                # every token, every head, K and V
                got, want = flash_kv(layer, d, off), flash_kv(before[li], s, off)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), \
                    (li, j * BLOCK + off)
        for b in (0, 2, 62):                        # blocks outside the load unchanged
            assert torch.equal(layer[b], before[li][b])


def refused(layers, match: str, block_size: int = BLOCK):
    with pytest.raises(UnsupportedKVPool, match=match) as exc:
        PagedCUDAView(layers, LAYOUT, block_size, CHUNK)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_refusals_name_what_is_served_and_what_came():
    good = vllm_layers(8, KVCacheLayout.LBNHC)
    served = r"serves vLLM 0.32's CUDA layout \(FlashAttention"
    msg = refused([torch.zeros(2, 8, BLOCK, HEADS, HEAD, dtype=DTYPE)] * LAYERS, served)
    assert "(2, 8, 32, 2, 64)" in msg                             # the old [2, blocks, ...]
    refused([t.view(8, HEADS, BLOCK * 2, HEAD) for t in
             vllm_layers(8, KVCacheLayout.LBHNC)], served)         # CPU_ATTN's reading
    refused([t.to(torch.float16) for t in good], r"float16 .*KV dtype torch.bfloat16 expected")
    refused(good[:3] + [torch.empty(good[0].shape, dtype=DTYPE, device="meta")],
            r"layer 3 .* on meta, layer 0 on cpu: the layers are on more than one device")
    swapped = [torch.zeros(8, HEADS, 2 * HEAD, BLOCK, dtype=DTYPE).transpose(2, 3)] * LAYERS
    refused(swapped, r"strides .*: K and V of a token are not \[heads, head_size\] rows")
    bcast = [torch.zeros(1, HEADS, BLOCK, 2 * HEAD, dtype=DTYPE).expand(8, -1, -1, -1)] * LAYERS
    refused(bcast, r"K and V of a token are not \[heads, head_size\] rows")
    refused(good, served, block_size=48)                          # blocks of 32 read as 48
    with pytest.raises(UnsupportedKVPool, match="registered 3 KV layers"):
        PagedCUDAView(good[:3], LAYOUT, BLOCK, CHUNK)


def test_the_worker_routes_cuda_layers_only():
    """Production: CPU layers go to the CPU layout's view, which refuses this layout."""
    from lmcache_loadback.engines.vllm.paged_cuda import paged_view

    with pytest.raises(UnsupportedKVPool, match="its CUDA layout on CUDA"):
        paged_view(vllm_layers(8, KVCacheLayout.LBNHC), LAYOUT, BLOCK, CHUNK)
