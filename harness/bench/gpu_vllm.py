"""`loadback bench gpu`'s vLLM contender: the vLLM connector's CUDA path (`PagedCUDAView`: the
load written straight into vLLM's blocks) into KV layers allocated as vLLM 0.32 allocates them
on CUDA for FlashAttention (no vLLM needed).
"""

from __future__ import annotations

import time

import torch

from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool
from lmcache_loadback.engines.vllm.paged_cuda import PagedCUDAView

from .gpu_contenders import CHUNK, LAYOUT, T, Ours, request_ids, sync

NAME = "vllm-cuda"
#: vLLM's default --block-size on CUDA (FlashAttention takes it as its kernel block size).
BLOCK = 16


def vllm_cuda_layers(num_blocks: int, dev: torch.device, layout: KVLayout = LAYOUT,
                     block: int = BLOCK, order: str = "LBNHC",
                     kernel_block: int | None = None) -> list[torch.Tensor]:
    """As `vllm/v1/worker/utils.py` `allocate_kv_cache` does for FlashAttention (vLLM 0.32,
    without vLLM): one zeroed int8 buffer, layer-major, each layer the logical `[num_blocks
    x block / N, heads, N, 2*head_dim]` (N = `kernel_block`, default `block`) over memory
    `[layer, block, token, head, K|V]` (LBNHC, FlashAttention's default) or `[layer, block,
    head, token, K|V]` (LBHNC, `VLLM_KV_CACHE_LAYOUT=HND`)."""
    h, d, L = layout.num_heads, layout.head_dim, layout.num_layers
    n = kernel_block or block
    nb = num_blocks * (block // n)
    per_layer = nb * n * h * 2 * d  # elements
    buf = torch.zeros(L * per_layer * layout.dtype.itemsize, dtype=torch.int8, device=dev)
    flat = buf.view(layout.dtype)
    stride = {"LBNHC": (n * h * 2 * d, 2 * d, h * 2 * d, 1),
              "LBHNC": (h * n * 2 * d, n * 2 * d, 2 * d, 1)}[order]  # B, H, N, C
    return [flat.as_strided((nb, h, n, 2 * d), stride, l * per_layer) for l in range(L)]


class VllmCuda:
    """Ours (prepare at match, shm) through the view's load pool, the K and V halves of vLLM's
    blocks, as the vLLM worker loads: timed from after the match phase (slots from the block
    ids included) until the bytes are in the blocks."""

    def __init__(self, endpoint: str, dev: torch.device, top: int,
                 gen: torch.Generator) -> None:
        num_blocks = top // BLOCK + 64
        self.layers = vllm_cuda_layers(num_blocks, dev)  # zeros
        self.view = PagedCUDAView(self.layers, LAYOUT, BLOCK, top, store_tokens=CHUNK)
        #: random distinct blocks; a size of n tokens loads into the first n // BLOCK
        perm = torch.randperm(num_blocks, generator=gen)
        self.blocks = perm[:top // BLOCK].tolist()
        self.never = perm[top // BLOCK:].to(dev)  # no load writes them: they stay zero
        self.ours = Ours(endpoint, dev, "shm", early=True)
        self.dev = dev
        self.note = (f"{self.ours.note}, straight into vLLM's blocks of {BLOCK} "
                     f"(FlashAttention LBNHC, strided K and V views)")

    def _load(self, toks, rid, n) -> float:
        self.ours.lookup(toks[:n], rid, n)
        t0 = time.perf_counter()
        prepared, self.ours.prepared = self.ours.prepared, None
        blocks = self.blocks[:n // BLOCK]
        r = self.ours.conn.retrieve_into(toks[:n], rid, self.view.pool,
                                         self.view.load_slots(blocks, n), start=0, end=n,
                                         timeout_s=T, prepared=prepared)
        self.view.to_blocks(blocks, n, ready=r.ready)
        sync(self.dev)
        dt = time.perf_counter() - t0
        self.ours.after(r, rid)
        return dt

    def run(self, toks, rid, pool, slots, n) -> float:
        return self._load(toks, rid, n)

    def prove(self, toks, src: KVPool, stored: torch.Tensor, n: int) -> dict:
        """Poison the blocks, load, and compare every token's K and V where FlashAttention
        reads them (`kv.transpose(1, 2).split(head_dim, -1)`) with the stored rows."""
        blocks = torch.tensor(self.blocks[:n // BLOCK], device=self.dev)
        for t in self.layers:
            t[blocks] = -7.0
        self._load(toks, f"prove-{NAME}-{n}-{next(request_ids)}", n)
        d = LAYOUT.head_dim
        for l, t in enumerate(self.layers):
            rows = t[blocks].transpose(1, 2).reshape(n, LAYOUT.num_heads, 2 * d)
            for got, want in ((rows[..., :d], src.k_buffer[l]), (rows[..., d:], src.v_buffer[l])):
                ok = torch.equal(got.contiguous().view(torch.int16),
                                 want[stored[:n]].view(torch.int16))
                assert ok, f"{NAME}: layer {l} differs from the stored prefix at {n} tokens"
            assert not t[self.never].count_nonzero(), f"{NAME}: layer {l}: a load wrote a " \
                "block outside its own"
        return {"tokens": n, "random_blocks": True, "other_blocks_untouched": True, "ok": True}

    def close(self) -> None:
        self.ours.close()


def add_vllm_cuda(b, endpoint: str, closers: list, drop) -> None:
    """The contender beside the others on the shm daemon (ours-shm's prefix); one that cannot
    be built is dropped, named (the run then exits 1)."""
    try:
        c = VllmCuda(endpoint, b.dev, b.top, b.gen)
    except Exception as exc:  # noqa: BLE001 - named in the verdict, not a crash
        drop(b.dropped, NAME, exc)
        return
    closers.append(c.close)
    b.contenders[NAME] = c
    print(f"{NAME}: registered ({c.note})", flush=True)
