"""vLLM 0.32's CUDA paged KV cache (FlashAttention's reading of it) as the engine-neutral
`KVLayout` / `KVPool` see it: a token-major staging pool on the layers' device and whole-block
copies between it and the paged layers (docs/vllm.md, "The CUDA layout").
"""

from __future__ import annotations

from typing import Sequence

import torch

from lmcache_loadback.connectors.errors import UnsupportedKVPool
from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool, check_pool

from .paged import PagedCPUView, block_index

#: Devices whose layers get `PagedCUDAView`; the rest get `PagedCPUView` (tests add "cpu").
CUDA_VIEW_DEVICES: tuple[str, ...] = ("cuda",)


class PagedCUDAView:
    """The paged layers of one vLLM worker on CUDA (in `layout`'s layer order) and a staging
    pool on their device, with `PagedCPUView`'s surface (the worker uses either).

    What vLLM 0.32 allocates (read in its own source):
    - `vllm/v1/worker/utils.py` `allocate_kv_cache` (called by `GPUModelRunner.
      initialize_kv_cache_tensors`, whose result goes to `register_kv_caches`): one int8
      buffer for every layer, viewed per layer by `vllm/v1/kv_cache_interface.py`
      `create_kv_cache_views` as the logical `[B, H, N, C]` (`compute_layer_kv_cache_shape_
      bytes`): B = num_blocks x (block_size / kernel block size), H = num_kv_heads, N = the
      kernel block size (= --block-size unless the backend splits blocks), C = (head_size +
      head_size_v) elements, in the KV dtype. There is no `[2, num_blocks, ...]` dimension.
    - The physical order is a `KVCacheLayout` stride permutation (`vllm/v1/kv_cache_layout.py`)
      resolved once by `resolve_kv_cache_layout` (`vllm/v1/attention/backends/utils.py`):
      FlashAttention declares no `supported_kv_cache_layouts`, so the default preference
      applies, LBNHC first (memory `[L, B, N, H, C]`, "NHD"); `VLLM_KV_CACHE_LAYOUT` or a
      connector's `get_required_kvcache_layout` may pick LBHNC ("HND") or a block-outermost
      one. The logical view is the same in every case.
    - FlashAttention reads it (`FlashAttentionImpl.forward` / `do_kv_cache_update`,
      `vllm/v1/attention/backends/flash_attn.py`) as `kv.transpose(1, 2).split(head_size,
      -1)`: K of (block b, offset n, head h) is `kv[b, h, n, :head_size]`, V is `kv[b, h, n,
      head_size:]`; slot = block * block_size + offset (its `slot_mapping`).
    So K and V of a token interleave per head: no `[slots, heads, head_size]` view with
    contiguous rows exists, which the core's `KVPool` needs (its gather/scatter and CUDA
    kernel view each buffer as `[slots, heads * head_size]`). Hence, as on CPU, a token-major
    `pool` of `2 * staging_tokens` slots (loads [0, staging_tokens), stores the rest) on the
    layers' device, and one index op per layer (by block id, on the device) between it and
    the blocks. The copies read the logical indices above, so every physical order works.
    """

    def __init__(self, layers: Sequence[torch.Tensor], layout: KVLayout, block_size: int,
                 staging_tokens: int) -> None:
        if len(layers) != layout.num_layers:
            raise UnsupportedKVPool(f"loadback: vLLM registered {len(layers)} KV layers, its "
                                    f"KV cache config names {layout.num_layers}")
        self.layout, self.block_size, self.staging_tokens = layout, block_size, staging_tokens
        self.device = layers[0].device
        first = layers[0]
        for i, t in enumerate(layers):
            _check_layer(i, t, first, layout, block_size)
        kb = int(first.shape[2])  # vLLM's kernel block size: block_size / kb of them a block
        self.num_blocks = int(first.shape[0]) * kb // block_size
        h, d = layout.num_heads, layout.head_dim
        # [blocks, kernel blocks per block, heads, kernel block size, K|V]: FlashAttention's
        # logical indexing with vLLM's blocks as dim 0
        self._blocks = [t.unflatten(0, (self.num_blocks, block_size // kb)) for t in layers]
        shape = (2 * staging_tokens, h, d)
        self.pool = KVPool(
            [torch.zeros(shape, dtype=layout.dtype, device=self.device) for _ in layers],
            [torch.zeros(shape, dtype=layout.dtype, device=self.device) for _ in layers])
        check_pool(layout, self.pool)
        self._slots = torch.arange(2 * staging_tokens, dtype=torch.int64)
        self._staged = None  # CUDA event after the last copy into the store region

    @property
    def store_base(self) -> int:
        """Where the store region starts (loads use [0, store_base))."""
        return self.staging_tokens

    def slots(self, n: int, base: int = 0) -> torch.Tensor:
        """The staging slots of `n` tokens from `base` (host tensor: the core moves them to
        the device through page-locked staging, never a host wait). Asked for the store
        region, on the thread that stores, its current stream first waits for the copy
        `from_blocks` queued there (a stream wait, not a host wait)."""
        if base >= self.store_base and self._staged is not None:
            torch.cuda.current_stream(self.device).wait_event(self._staged)
        return self._slots[base:base + n]

    def _index(self, block_ids: Sequence[int], tokens: int, base: int) -> torch.Tensor:
        idx = block_index(self, block_ids, tokens, base)
        if self.device.type != "cuda":
            return idx
        return idx.pin_memory().to(self.device, non_blocking=True)  # no host wait

    def _rows(self, nb: int) -> tuple[int, int, int, int]:
        kb = self._blocks[0].shape[3]
        return nb, self.block_size // kb, kb, self.layout.num_heads

    def to_blocks(self, block_ids: Sequence[int], tokens: int, base: int = 0,
                  ready=None) -> None:
        """Staging slots [base, base + tokens) -> the blocks `block_ids`, every layer, K and V,
        queued on the current stream after `ready` (the load's completion event)."""
        idx = self._index(block_ids, tokens, base)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        shape, end = self._rows(len(block_ids)), base + tokens
        for k, v, dst in zip(self.pool.k_buffer, self.pool.v_buffer, self._blocks):
            kv = torch.cat((k[base:end].view(*shape, -1), v[base:end].view(*shape, -1)), -1)
            dst.index_copy_(0, idx, kv.permute(0, 1, 3, 2, 4))  # [blocks, r, heads, kb, 2D]

    def from_blocks(self, block_ids: Sequence[int], tokens: int, base: int = 0) -> None:
        """The blocks `block_ids` -> staging slots [base, base + tokens), every layer, K, V,
        queued on the current stream (after the forward that wrote them: vLLM may reuse the
        blocks once this step is over, the staging copy stays)."""
        idx = self._index(block_ids, tokens, base)
        d, end = self.layout.head_dim, base + tokens
        nb, r, kb, h = self._rows(len(block_ids))
        for k, v, src in zip(self.pool.k_buffer, self.pool.v_buffer, self._blocks):
            rows = src.index_select(0, idx).permute(0, 1, 3, 2, 4)  # [blocks, r, kb, heads, 2D]
            k[base:end].view(nb, r, kb, h, d).copy_(rows[..., :d])
            v[base:end].view(nb, r, kb, h, d).copy_(rows[..., d:])
        if self.device.type == "cuda" and base >= self.store_base:
            self._staged = torch.cuda.Event()
            self._staged.record(torch.cuda.current_stream(self.device))


def _check_layer(i: int, t: torch.Tensor, first: torch.Tensor, layout: KVLayout,
                 block_size: int) -> None:
    """UnsupportedKVPool, one line naming what is served, unless layer `i` is laid out as
    vLLM 0.32 allocates a FlashAttention layer: `[B, heads, N, 2*head_size]` of the KV dtype
    on layer 0's device, N dividing block_size, K|V of a (token, head) contiguous and each
    block's [heads, N, 2*head_size] one dense run (LBNHC, LBHNC or a block-outermost order)."""
    h, d = layout.num_heads, layout.head_dim
    kb = int(first.shape[2]) if first.dim() == 4 else 0
    want = (int(first.shape[0]) if first.dim() == 4 else "num_blocks", h, block_size, 2 * d)
    served = (f"the vLLM connector serves vLLM 0.32's CUDA layout (FlashAttention: "
              f"[num_blocks, num_kv_heads, block_size, 2*head_size] = {want} {layout.dtype}, "
              f"K = [..., :head_size], V = [..., head_size:])")
    got = f"loadback: KV layer {i} is {tuple(t.shape)} {t.dtype} on {t.device}"
    if (t.dim() != 4 or tuple(t.shape) != tuple(first.shape) or tuple(t.shape[1:]) !=
            (h, kb, 2 * d) or kb <= 0 or block_size % kb or t.shape[0] * kb % block_size):
        raise UnsupportedKVPool(f"{got}; {served}")
    if t.dtype != layout.dtype:
        raise UnsupportedKVPool(f"{got}, KV dtype {layout.dtype} expected; {served}")
    if t.device != first.device:
        raise UnsupportedKVPool(f"{got}, layer 0 on {first.device}: the layers are on more "
                                f"than one device; {served}")
    st = t.stride()
    inner = sorted(((st[1], h), (st[2], kb)))
    if st[3] != 1 or inner[0][0] != 2 * d or inner[1][0] != inner[0][1] * 2 * d \
            or st[0] < h * kb * 2 * d:
        raise UnsupportedKVPool(
            f"{got} with strides {st}: K and V of a token are not [heads, head_size] rows of "
            f"one dense block (K|V of a head contiguous, each block's [heads, block_size, "
            f"2*head_size] one run); {served}")


def paged_view(layers: Sequence[torch.Tensor], layout: KVLayout, block_size: int,
               staging_tokens: int) -> PagedCPUView | PagedCUDAView:
    """The view for vLLM's registered layers: CUDA layers (`CUDA_VIEW_DEVICES`) in vLLM's
    CUDA layout, anything else in its CPU layout; each refuses what it does not serve."""
    view = PagedCUDAView if layers and layers[0].device.type in CUDA_VIEW_DEVICES \
        else PagedCPUView
    return view(layers, layout, block_size, staging_tokens)
