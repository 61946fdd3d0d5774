"""vLLM 0.32's CUDA paged KV cache (FlashAttention's reading of it) as the engine-neutral
`KVLayout` / `KVPool` see it: loads land straight in vLLM's blocks through strided views of
their K and V halves, stores go through a staging region on the layers' device (docs/vllm.md,
"The CUDA layout").
"""

from __future__ import annotations

from typing import Sequence

import torch

from lmcache_loadback.connectors.errors import UnsupportedKVPool
from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool, check_pool

from .paged import PagedCPUView

#: Devices whose layers get `PagedCUDAView`; the rest get `PagedCPUView` (tests add "cpu").
CUDA_VIEW_DEVICES: tuple[str, ...] = ("cuda",)


class PagedCUDAView:
    """The paged layers of one vLLM worker on CUDA (in `layout`'s layer order): `pool`, the
    K and V halves of vLLM's own blocks that loads land in, and `store_pool`, a staging region
    on their device that stores are copied to; `PagedCPUView`'s surface (the worker uses
    either).

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
    So K and V of a token interleave per head, but each head's K (and V) is `head_size`
    contiguous elements at fixed strides: K of kernel block b, offset n, head h sits at
    `b * S_b + n * S_n + h * S_h` (+ head_size for V). With R = S_b / S_n, "row" b * R + n of
    the strided view `[rows, H, head_size]` (strides S_n, S_h, 1) is that token, in every
    physical order (R = N for LBNHC, H * N for LBHNC, more for block-outermost ones). Those
    views are the load pool: the core's copy writes each head's K and V where FlashAttention
    reads them, with no staging copy. Stores still go through `store_pool` (`staging_tokens`
    token-major slots): vLLM may reuse the blocks once the step is over, the staged copy stays.
    """

    def __init__(self, layers: Sequence[torch.Tensor], layout: KVLayout, block_size: int,
                 staging_tokens: int, store_tokens: int | None = None) -> None:
        """`staging_tokens`: the most tokens one load or store moves; `store_tokens` (default
        the same): the store region's slots, on the layers' device."""
        if len(layers) != layout.num_layers:
            raise UnsupportedKVPool(f"loadback: vLLM registered {len(layers)} KV layers, its "
                                    f"KV cache config names {layout.num_layers}")
        self.layout, self.block_size, self.staging_tokens = layout, block_size, staging_tokens
        self.store_tokens = staging_tokens if store_tokens is None else store_tokens
        self.device = layers[0].device
        first = layers[0]
        for i, t in enumerate(layers):
            _check_layer(i, t, first, layout, block_size)
        kb = int(first.shape[2])  # vLLM's kernel block size: block_size / kb of them a block
        self._kb = kb
        self.num_blocks = int(first.shape[0]) * kb // block_size
        h, d = layout.num_heads, layout.head_dim
        s_b, s_h, s_n = first.stride()[:3]
        self._rows_per_kblock = s_b // s_n  # R: pool rows from one kernel block to the next
        rows = (int(first.shape[0]) - 1) * self._rows_per_kblock + kb
        kv = [t.as_strided((rows, h, 2 * d), (s_n, s_h, 1)) for t in layers]
        self.pool = KVPool([x[..., :d] for x in kv], [x[..., d:] for x in kv])
        shape = (self.store_tokens, h, d)
        self.store_pool = KVPool(
            [torch.zeros(shape, dtype=layout.dtype, device=self.device) for _ in layers],
            [torch.zeros(shape, dtype=layout.dtype, device=self.device) for _ in layers])
        check_pool(layout, self.store_pool)
        self._slots = torch.arange(self.store_tokens, dtype=torch.int64)
        self._staged = None  # CUDA event after the last copy into the store region

    #: where the store region starts in `store_pool`
    store_base = 0

    def slots(self, n: int, base: int = 0) -> torch.Tensor:
        """The store region's slots of `n` tokens from `base` (host tensor: the core moves
        them to the device through page-locked staging, never a host wait). On the thread
        that stores, its current stream first waits for the copy `from_blocks` queued there
        (a stream wait, not a host wait)."""
        if self._staged is not None:
            torch.cuda.current_stream(self.device).wait_event(self._staged)
        return self._slots[base:base + n]

    def load_slots(self, block_ids: Sequence[int], tokens: int) -> torch.Tensor:
        """The `pool` rows of `tokens` tokens in vLLM's blocks `block_ids` (host tensor)."""
        idx = self._block_ids(block_ids, tokens)
        r = self.block_size // self._kb
        kblocks = (idx[:, None] * r + torch.arange(r)).reshape(-1)  # kernel blocks in order
        rows = kblocks[:, None] * self._rows_per_kblock + torch.arange(self._kb)
        return rows.reshape(-1)

    def _block_ids(self, block_ids: Sequence[int], tokens: int) -> torch.Tensor:
        """The block ids as a CPU int64 tensor; ValueError unless `tokens` fill them, at most
        `staging_tokens`, and every id is one of vLLM's blocks."""
        nb, bs = len(block_ids), self.block_size
        if tokens != nb * bs or tokens > self.staging_tokens:
            raise ValueError(f"{tokens} tokens in {nb} blocks of {bs} (one load or store "
                             f"moves at most {self.staging_tokens})")
        idx = torch.tensor(list(block_ids), dtype=torch.int64)
        if nb and (int(idx.min()) < 0 or int(idx.max()) >= self.num_blocks):
            raise ValueError(f"block ids {list(block_ids)} outside [0, {self.num_blocks})")
        return idx

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)  # no host wait

    def to_blocks(self, block_ids: Sequence[int], tokens: int, base: int = 0,
                  ready=None) -> None:
        """The load wrote vLLM's blocks itself (`load_slots`): vLLM's current stream (the
        forward's) waits for its completion event `ready`; nothing is copied."""
        self._block_ids(block_ids, tokens)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)

    def from_blocks(self, block_ids: Sequence[int], tokens: int, base: int = 0) -> None:
        """The blocks `block_ids` -> store region slots [base, base + tokens), every layer, K
        and V, queued on the current stream (after the forward that wrote them: vLLM may
        reuse the blocks once this step is over, the staged copy stays)."""
        if base < 0 or base + tokens > self.store_tokens:
            raise ValueError(f"{tokens} tokens at store slot {base} (the store region holds "
                             f"{self.store_tokens})")
        rows = self._on_device(self.load_slots(block_ids, tokens))
        end = base + tokens
        for src, dst in ((self.pool.k_buffer, self.store_pool.k_buffer),
                         (self.pool.v_buffer, self.store_pool.v_buffer)):
            for a, b in zip(src, dst):
                torch.index_select(a, 0, rows, out=b[base:end])
        if self.device.type == "cuda":
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
            or st[0] < h * kb * 2 * d or st[0] % st[2] or st != first.stride():
        raise UnsupportedKVPool(
            f"{got} with strides {st}: K and V of a token are not [heads, head_size] rows of "
            f"one dense block (K|V of a head contiguous, each block's [heads, block_size, "
            f"2*head_size] one run, every layer alike); {served}")


def paged_view(layers: Sequence[torch.Tensor], layout: KVLayout, block_size: int,
               staging_tokens: int, store_tokens: int | None = None
               ) -> PagedCPUView | PagedCUDAView:
    """The view for vLLM's registered layers: CUDA layers (`CUDA_VIEW_DEVICES`) in vLLM's
    CUDA layout (its store region of `store_tokens`, default `staging_tokens`), anything
    else in its CPU layout; each refuses what it does not serve."""
    if layers and layers[0].device.type in CUDA_VIEW_DEVICES:
        return PagedCUDAView(layers, layout, block_size, staging_tokens, store_tokens)
    return PagedCPUView(layers, layout, block_size, staging_tokens)
