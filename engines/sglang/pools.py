"""SGLang's KV pool -> the engine-neutral `KVLayout` and `KVPool`; start-up refusal of the rest.

Served: `MHATokenToKVPool` (per-layer K and V), `MLATokenToKVPool` (one latent buffer per
layer) and subclasses keeping their buffers; refused in one line: hybrid SWA/SSM, sparse
(DSA, ...) and any pool not built like those two (its KV is not the daemon's chunks).
"""

from __future__ import annotations

from typing import Sequence

import torch

from lmcache_loadback.connectors.errors import UnsupportedKVPool
from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool, check_pool

SUPPORTED = ("LMCache MP load-back supports full-attention MHA and MLA pools only "
             "(MHATokenToKVPool, MLATokenToKVPool)")
FIX = "start without --radix-cache-backend loadback"

# A class in the pool's MRO -> the model feature it means (checked before the served kinds).
_FEATURES = (
    ("BaseSWAKVPool", "sliding-window attention (hybrid SWA pool {cls})"),
    ("HybridLinearKVPool", "state-space / linear-attention layers (hybrid SSM pool {cls})"),
    ("DSATokenToKVPool", "DeepSeek sparse attention (DSA pool {cls})"),
    ("DeepSeekV4SingleKVPool", "DeepSeek-V4 compressed sparse attention (pool {cls})"),
    ("MiniMaxSparseKVPool", "sparse attention (pool {cls})"),
    ("HiSparseMHAMainPool", "hierarchical sparse attention (pool {cls})"),
)
# SGLang's build flags -> the feature they mean.
_FLAGS = (
    ("is_hybrid_swa", "sliding-window attention (hybrid SWA pool {cls})"),
    ("is_hybrid_ssm", "state-space / linear-attention layers (hybrid SSM pool {cls})"),
    ("is_dsa", "DeepSeek sparse attention (DSA pool {cls})"),
)
_SERVED = {"MHATokenToKVPool": "mha", "MLATokenToKVPool": "mla"}


def refusal(feature: str) -> UnsupportedKVPool:
    return UnsupportedKVPool(f"loadback: model uses {feature}; {SUPPORTED}; {FIX}")


def check_build_context(ctx, kvcache) -> None:
    """Refuse what SGLang's TreeCacheBuildContext says the model is (flags a version lacks
    count as False), then the pool itself."""
    name = type(kvcache).__name__
    for flag, feature in _FLAGS:
        if getattr(ctx, flag, False):
            raise refusal(feature.format(cls=name))
    pool_kind(kvcache)


def pool_kind(kvcache) -> str:
    """'mha' or 'mla'; UnsupportedKVPool for anything else."""
    cls = type(kvcache)
    mro = {c.__name__: c for c in cls.__mro__}
    for base, feature in _FEATURES:
        if base in mro:
            raise refusal(feature.format(cls=cls.__name__))
    for base, kind in _SERVED.items():
        if base in mro and getattr(cls, "_create_buffers", None) is getattr(
                mro[base], "_create_buffers", None):
            return kind
    raise UnsupportedKVPool(
        f"loadback: KV pool {cls.__name__} is not one this backend knows (its buffers are "
        f"not laid out like MHATokenToKVPool's or MLATokenToKVPool's); {SUPPORTED}; {FIX}")


def layout_and_pool(kvcache, chunk_size: int) -> tuple[KVLayout, KVPool]:
    """The chunk layout the daemon registers and the buffers loads and stores move.

    Who calls it: `LoadBackRadixCache` at construction, after `pool_kind` accepted the pool."""
    if pool_kind(kvcache) == "mla":
        return latent_layout(list(kvcache.kv_buffer), chunk_size)
    return mha_layout(list(kvcache.k_buffer), list(kvcache.v_buffer), chunk_size)


def mha_layout(k_buffer: Sequence[torch.Tensor], v_buffer: Sequence[torch.Tensor],
               chunk_size: int) -> tuple[KVLayout, KVPool]:
    """MHATokenToKVPool's buffers: per layer a K and a V `[num_slots + page_size, num_heads,
    head_dim]`. ValueError if they are not all that shape, dtype and device."""
    first = _first(k_buffer, "k_buffer must be a list of [num_slots, num_heads, head_dim] "
                             "tensors")
    layout = KVLayout(len(k_buffer), first.shape[1], first.shape[2], first.dtype, chunk_size)
    pool = KVPool(list(k_buffer), list(v_buffer))
    check_pool(layout, pool)
    return layout, pool


def latent_layout(kv_buffer: Sequence[torch.Tensor], chunk_size: int
                  ) -> tuple[KVLayout, KVPool]:
    """MLATokenToKVPool's buffers: one latent `[num_slots + page_size, 1, kv_lora_rank +
    qk_rope_head_dim]` per layer. ValueError if they are not all that shape, dtype and device."""
    first = _first(kv_buffer, "kv_buffer must be a list of [num_slots, 1, latent_dim] tensors")
    layout = KVLayout(len(kv_buffer), first.shape[1], first.shape[2], first.dtype, chunk_size,
                      mla=True)
    pool = KVPool.latent(kv_buffer)
    check_pool(layout, pool)
    return layout, pool


def _first(buffers: Sequence[torch.Tensor], expected: str) -> torch.Tensor:
    first = buffers[0] if len(buffers) else None
    if not isinstance(first, torch.Tensor) or first.dim() != 3:
        raise ValueError(expected)
    return first
