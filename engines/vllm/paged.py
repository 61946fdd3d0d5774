"""vLLM's CPU paged KV cache as the engine-neutral `KVLayout` / `KVPool` see it: a token-major
staging pool (a load region, a store region) and whole-block copies between it and the paged
layers (docs/vllm.md, "Staging memory").
"""

from __future__ import annotations

from typing import Sequence

import torch

from lmcache_loadback.connectors.errors import UnsupportedKVPool
from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool, check_pool


class PagedCPUView:
    """The paged layers of one vLLM worker (in `layout`'s layer order) and a staging pool.

    vLLM 0.32's CPU attention (`CPU_ATTN`, v1/attention/backends/cpu_attn.py) keeps each layer
    as one `[num_blocks, num_kv_heads, block_size, 2 * head_size]` tensor that its kernel reads
    as `[num_blocks, num_kv_heads, 2 * block_size, head_size]`: per block and head,
    `block_size` K rows, then `block_size` V rows. A token's slot is
    `block_id * block_size + offset`, but its heads are not contiguous (head-major inside a
    block), hence the token-major `pool` of `2 * staging_tokens` slots: loads use
    [0, staging_tokens), stores [staging_tokens, 2 * staging_tokens) (a store runs off the
    forward path while the next step's loads stage). Loads and stores move whole blocks, one
    `index_copy_` / `index_select` per layer (a chunk is a whole number of blocks, a local hit
    is block aligned).
    """

    def __init__(self, layers: Sequence[torch.Tensor], layout: KVLayout, block_size: int,
                 staging_tokens: int) -> None:
        if len(layers) != layout.num_layers:
            raise UnsupportedKVPool(f"loadback: vLLM registered {len(layers)} KV layers, its "
                                    f"KV cache config names {layout.num_layers}")
        first = layers[0]
        h, d, bs = layout.num_heads, layout.head_dim, block_size
        want = (first.shape[0], h, bs, 2 * d)
        for i, t in enumerate(layers):
            if (tuple(t.shape) != want or t.dtype != layout.dtype or t.device.type != "cpu"
                    or not t.is_contiguous()):
                raise UnsupportedKVPool(
                    f"loadback: KV layer {i} is {tuple(t.shape)} {t.dtype} on {t.device} "
                    f"(contiguous: {t.is_contiguous()}); the vLLM connector serves vLLM's CPU "
                    f"layout [num_blocks, num_kv_heads, block_size, 2*head_size] = {want} "
                    f"{layout.dtype}, contiguous, on CPU, and its CUDA layout on CUDA")
        self.layout = layout
        self.block_size = bs
        self.num_blocks = int(first.shape[0])
        # [blocks, heads, K|V, block_size, head_size]: the kernel's own reading of the bytes
        self._blocks = [t.view(self.num_blocks, h, 2, bs, d) for t in layers]
        self.staging_tokens = staging_tokens
        shape = (2 * staging_tokens, h, d)
        self.pool = KVPool([torch.zeros(shape, dtype=layout.dtype) for _ in layers],
                           [torch.zeros(shape, dtype=layout.dtype) for _ in layers])
        check_pool(layout, self.pool)
        self._slots = torch.arange(2 * staging_tokens, dtype=torch.int64)

    #: where the store region starts (loads use [0, store_base))
    @property
    def store_base(self) -> int:
        return self.staging_tokens

    def slots(self, n: int, base: int = 0) -> torch.Tensor:
        """The staging slots of `n` tokens from `base`."""
        return self._slots[base:base + n]

    @property
    def store_pool(self) -> KVPool:
        """The pool stores read (the staging pool's store region, from `store_base`)."""
        return self.pool

    @property
    def store_tokens(self) -> int:
        """The store region's slots."""
        return self.staging_tokens

    def load_slots(self, block_ids: Sequence[int], tokens: int) -> torch.Tensor:
        """The slots a load of `tokens` into `block_ids` lands in (the load region, then
        `to_blocks`)."""
        block_index(self, block_ids, tokens, 0)
        return self.slots(tokens)

    def _index(self, block_ids: Sequence[int], tokens: int, base: int) -> torch.Tensor:
        return block_index(self, block_ids, tokens, base)

    def to_blocks(self, block_ids: Sequence[int], tokens: int, base: int = 0,
                  ready=None) -> None:
        """Staging slots [base, base + tokens) -> the blocks `block_ids`, every layer, K and V.
        `ready`: the load's completion event (None here: a CPU load has landed on return)."""
        idx = self._index(block_ids, tokens, base)
        nb, bs, h, d = len(block_ids), self.block_size, self.layout.num_heads, self.layout.head_dim
        end = base + tokens
        for k, v, dst in zip(self.pool.k_buffer, self.pool.v_buffer, self._blocks):
            src = torch.stack((k[base:end].view(nb, bs, h, d).transpose(1, 2),
                               v[base:end].view(nb, bs, h, d).transpose(1, 2)), dim=2)
            dst.index_copy_(0, idx, src)

    def from_blocks(self, block_ids: Sequence[int], tokens: int, base: int = 0) -> None:
        """The blocks `block_ids` -> staging slots [base, base + tokens), every layer, K, V."""
        idx = self._index(block_ids, tokens, base)
        nb, bs, h, d = len(block_ids), self.block_size, self.layout.num_heads, self.layout.head_dim
        end = base + tokens
        for k, v, src in zip(self.pool.k_buffer, self.pool.v_buffer, self._blocks):
            blk = src.index_select(0, idx)  # [nb, heads, 2, bs, d]
            k[base:end].view(nb, bs, h, d).copy_(blk[:, :, 0].transpose(1, 2))
            v[base:end].view(nb, bs, h, d).copy_(blk[:, :, 1].transpose(1, 2))


def block_index(view, block_ids: Sequence[int], tokens: int, base: int) -> torch.Tensor:
    """The block ids as a CPU int64 tensor; ValueError unless `tokens` fill them and fit the
    view's staging pool from `base`, and every id is one of its blocks."""
    nb, bs, staging = len(block_ids), view.block_size, view.staging_tokens
    if tokens != nb * bs or base < 0 or base + tokens > 2 * staging:
        raise ValueError(f"{tokens} tokens in {nb} blocks of {bs} at staging slot {base} "
                         f"(staging holds 2 x {staging})")
    idx = torch.tensor(list(block_ids), dtype=torch.int64)
    if nb and (int(idx.min()) < 0 or int(idx.max()) >= view.num_blocks):
        raise ValueError(f"block ids {list(block_ids)} outside [0, {view.num_blocks})")
    return idx


def ordered_layers(kv_caches: dict[str, torch.Tensor], layer_names: Sequence[str]
                   ) -> list[torch.Tensor]:
    """The registered tensors in the KV cache config's layer order (every rank, every start)."""
    missing = [n for n in layer_names if n not in kv_caches]
    if missing:
        raise UnsupportedKVPool(f"loadback: vLLM registered no KV cache for layer(s) {missing}")
    return [kv_caches[n] for n in layer_names]
