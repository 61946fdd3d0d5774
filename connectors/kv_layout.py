"""The engine-neutral KV layout and the pool view, and the checks of a pool and of slots.

A `KVLayout` says what the daemon registers (layers, heads, head_dim, dtype, chunk size, K/V or
latent); a `KVPool` holds the engine's per-layer `[slots, heads, head_dim]` buffers. Each engine
builds both from its own pool (engines/sglang/pools.py); the connector moves whole chunks
between them (kv_copy.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from lmcache_loadback.connectors.errors import SlotsError

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass(frozen=True)
class KVLayout:
    """Shape of one model's KV cache as LMCache chunks see it; built once per engine, by the
    engine's adapter, from numbers alone. `mla` picks the kind: False, K and V per layer
    (chunks `[2, L, chunk, heads * head_dim]`); True, one latent buffer per layer (chunks
    `[L, chunk, heads * head_dim]`, what the daemon registers with `use_mla`)."""

    num_layers: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    chunk_size: int
    #: MLA: one latent buffer per layer (no separate K and V), chunks [L, chunk, hidden].
    mla: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "chunk_size"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {val!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVLayout.dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.mla, bool):
            raise ValueError(f"KVLayout.mla must be a bool, got {self.mla!r}")

    @property
    def hidden_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def planes(self) -> int:
        """Buffers per layer: 2 (K and V), or 1 (MLA's latent KV)."""
        return 1 if self.mla else 2

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """One chunk as the daemon registers it: [2, L, chunk, hidden], MLA [L, chunk, hidden]."""
        if self.mla:
            return (self.num_layers, self.chunk_size, self.hidden_dim)
        return (2, self.num_layers, self.chunk_size, self.hidden_dim)

    @property
    def bytes_per_token(self) -> int:
        return self.planes * self.num_layers * self.hidden_dim * self.dtype.itemsize

    @property
    def chunk_bytes(self) -> int:
        return self.bytes_per_token * self.chunk_size

    @property
    def dtype_str(self) -> str:
        return str(self.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVPool:
    """The engine's KV memory as the connector copies into it: per layer a K and a V tensor
    `[slots, heads, head_dim]` (slot = the token's index in every layer); a latent pool
    (`KVPool.latent`) keeps its one buffer per layer in `k_buffer`, no V. Engines whose memory
    is shaped otherwise pass views (vLLM's paged `[2, blocks, block_size, heads, dim]` layer:
    `kv[0].flatten(0, 1)` and `kv[1].flatten(0, 1)`, slot = block * block_size + offset)."""

    k_buffer: Sequence[torch.Tensor]
    v_buffer: Sequence[torch.Tensor] = ()

    @classmethod
    def latent(cls, kv_buffer: Sequence[torch.Tensor]) -> "KVPool":
        """A latent (MLA) pool: one `[slots, heads, latent_dim]` buffer per layer."""
        return cls(list(kv_buffer), ())

    @property
    def kv_buffer(self) -> Sequence[torch.Tensor]:
        """The latent buffers of an MLA pool."""
        if len(self.v_buffer):
            raise AttributeError("an MHA pool (K and V buffers) has no latent kv_buffer")
        return self.k_buffer

    @property
    def num_slots(self) -> int:
        return self.k_buffer[0].shape[0]


def check_pool(layout: KVLayout, pool: KVPool) -> None:
    """ValueError, naming the buffer, unless every buffer of `pool` is `[slots, num_heads,
    head_dim]` of `layout.dtype` on one device, with one buffer per layer and plane."""
    pool_views(layout, pool.k_buffer, pool.v_buffer)


def pool_views(layout: KVLayout, k_buffer, v_buffer) -> tuple[list, int, torch.device]:
    """Per plane (K, V; or MLA's latent KV) the 2-D [slots, hidden] views of every layer;
    ValueError if the pool does not match layout."""
    v_buffer = () if v_buffer is None else v_buffer
    if layout.mla and len(v_buffer):
        raise ValueError("an MLA layout takes the latent buffers alone: pass no v_buffer")
    if len(k_buffer) != layout.num_layers or (
            not layout.mla and len(v_buffer) != layout.num_layers):
        what = (f"{len(k_buffer)} latent KV" if layout.mla
                else f"{len(k_buffer)} K / {len(v_buffer)} V")
        raise ValueError(f"pool has {what} layers, layout expects {layout.num_layers}")
    size, dev = k_buffer[0].shape[0], k_buffer[0].device
    want = (size, layout.num_heads, layout.head_dim)
    named = (("kv_buffer", k_buffer),) if layout.mla else (("k_buffer", k_buffer),
                                                           ("v_buffer", v_buffer))
    planes: list[list[torch.Tensor]] = []
    for name, bufs in named:
        views = []
        for i, b in enumerate(bufs):
            if tuple(b.shape) != want or b.dtype != layout.dtype or b.device != dev:
                raise ValueError(f"{name}[{i}] is {tuple(b.shape)} {b.dtype} on {b.device}, "
                                 f"expected {want} {layout.dtype} on {dev}")
            views.append(b.view(size, layout.hidden_dim) if b.stride()[1:] == (
                layout.head_dim, 1) else b)  # else heads apart (vLLM's K|V halves): 3-D
        planes.append(views)
    return planes, size, dev


def check_slots(layout: KVLayout, slots: torch.Tensor, num_tokens: int, *,
                pool_size: int | None = None, device: torch.device | str | None = None
                ) -> torch.Tensor:
    """Validate engine-provided slot indices; called by gather/scatter and by the connector.

    Returns a contiguous int64 tensor of exactly ``num_tokens`` slots on ``device`` (CPU when
    not given). Raises SlotsError saying how to fix it; never truncates or pads silently.
    """
    if not isinstance(slots, torch.Tensor):
        raise SlotsError(f"slots must be a torch.Tensor of KV indices, got {type(slots).__name__}")
    if slots.dtype not in _INT_DTYPES:
        raise SlotsError(f"slots must be an integer tensor, got {slots.dtype}; pass the KV "
                         f"allocator's indices (e.g. slots.to(torch.int64)), not values")
    if slots.dim() != 1:
        raise SlotsError(f"slots must be 1-D (one slot per token), got shape "
                         f"{tuple(slots.shape)}; flatten it with slots.reshape(-1)")
    c = layout.chunk_size
    if num_tokens < 0 or num_tokens % c:
        raise SlotsError(f"num_tokens={num_tokens} is not a multiple of chunk_size={c}; only "
                         f"whole chunks move: use {max(num_tokens, 0) // c * c} tokens")
    if slots.numel() != num_tokens:
        raise SlotsError(f"expected {num_tokens} slots (one per token), got {slots.numel()}; "
                         f"pass slots[:{num_tokens}] of the indices allocated for these tokens")
    out = slots.to(device=device or "cpu", dtype=torch.int64).contiguous()
    if num_tokens:
        lo, hi = torch.stack(torch.aminmax(out)).tolist()  # one device sync, not two
        bad = lo if lo < 0 else (hi if pool_size is not None and hi >= pool_size else None)
        if bad is not None:
            pos = int((out == bad).nonzero()[0, 0])
            rng = f"[0, {pool_size})" if pool_size is not None else ">= 0"
            raise SlotsError(f"slot {bad} at position {pos} is out of range {rng} of the KV "
                             f"pool; pass indices from this pool's allocator")
    return out
