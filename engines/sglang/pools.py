"""Which SGLang KV pools the `loadback` backend serves, and the start-up refusal for the rest.

Who calls it: `LoadBackRadixCache` at construction (and `from_build_context` with SGLang's
build flags), before anything reaches the scheduler. Served: full-attention MHA
(`MHATokenToKVPool`: per-layer K and V) and MLA (`MLATokenToKVPool`: one latent buffer per
layer), and subclasses of those two that keep their buffers (`_create_buffers` not
overridden). Refused, in one line naming the model feature and the fix: hybrid sliding-window
(SWA), hybrid SSM/mamba/linear attention, DeepSeek sparse attention (DSA) and other sparse
pools, and any pool not built like those two (FP4/MXFP8 scales, page-major, no-op, ...): their
KV is not the chunks the daemon registers, so a load could not be byte-exact.
"""

from __future__ import annotations

from lmcache_loadback.connectors.errors import UnsupportedKVPool
from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool

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
    """The chunk layout the daemon registers and the buffers loads and stores move."""
    if pool_kind(kvcache) == "mla":
        kv = list(kvcache.kv_buffer)
        return KVLayout.from_latent_pool(kv, chunk_size), KVPool.latent(kv)
    k, v = list(kvcache.k_buffer), list(kvcache.v_buffer)
    return KVLayout.from_pool(k, v, chunk_size), KVPool(k, v)
