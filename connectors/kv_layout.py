"""The engine-neutral KV layout, the pool view, and gather/scatter between them and chunks.

A `KVLayout` says what the daemon registers (layers, heads, head_dim, dtype, chunk size, K/V or
latent); a `KVPool` holds the engine's per-layer `[slots, heads, head_dim]` buffers. Each engine
builds both from its own pool (engines/sglang/pools.py); the connector moves whole chunks.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from lmcache_loadback.connectors.errors import ProtocolError, SlotsError

# The hot path of every load-back, so no per-token Python loops: each (layer, K/V) moves with one
# index op per run of chunks (all of them when they are views of one token-major tensor, one
# chunk when that is a big enough op, else a group through a scratch tensor); one ascending
# slot range moves by slicing.
# Bytes per index op per CPU thread below which op overhead dominates: small chunks are grouped.
_OP_BYTES = 256 << 10
# Cap on the grouping scratch, kept per thread on CPU: a fresh one costs page faults each call.
_SCRATCH_BYTES = 32 << 20
_local = threading.local()
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
    _pool_views(layout, pool.k_buffer, pool.v_buffer)


def _pool_views(layout: KVLayout, k_buffer, v_buffer) -> tuple[list, int, torch.device]:
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


def _planar(layout: KVLayout, chunks: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """Chunks as [planes, L, chunk, hidden] views (MLA's [L, chunk, hidden] gains a dim 0)."""
    return [t.unsqueeze(0) for t in chunks] if layout.mla else chunks


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


def _run_start(slots: torch.Tensor) -> int | None:
    """First slot if slots is one ascending contiguous range (slicing beats index ops)."""
    n = slots.numel()
    if n == 0 or slots.device.type != "cpu":  # on GPUs index ops run at copy speed anyway
        return None
    a = int(slots[0])
    if int(slots[-1]) - a != n - 1 or (n > 1 and not bool((slots.diff() == 1).all())):
        return None
    return a


def _token_major(chunks: Sequence[torch.Tensor], c: int) -> torch.Tensor | None:
    """[P, L, n*c, hidden] view if chunk j is base[:, :, j*c:(j+1)*c] of one tensor, else None."""
    first, rows = chunks[0], len(chunks) * c
    st, (planes, layers, _, hid) = first.stride(), first.shape
    if len(chunks) < 2 or st[3] != 1 or st[2] != hid or st[1] < rows * hid \
            or st[0] < layers * st[1]:
        return None
    base, stor = first.data_ptr(), first.untyped_storage().data_ptr()
    for j, t in enumerate(chunks):
        if (t.stride() != st or t.device != first.device or t.untyped_storage().data_ptr() != stor
                or t.data_ptr() != base + j * c * hid * t.element_size()):
            return None
    try:
        return first.as_strided((planes, layers, rows, hid), st)
    except RuntimeError:  # would reach past the storage
        return None


def _wide(a: torch.Tensor, b: torch.Tensor, *wide: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Reinterpret both row-major tensors as a wider type (bytes unchanged) when aligned."""
    for wd in wide + (torch.int32,):
        if a.data_ptr() % wd.itemsize or b.data_ptr() % wd.itemsize:  # misaligned loads fault
            continue
        try:
            return a.view(wd), b.view(wd)
        except RuntimeError:
            continue
    return a, b


def _move_rows(planes, idx: torch.Tensor, t: torch.Tensor, start: int | None,
               gather: bool) -> None:
    """gather: t[p, l, r] = planes[p][l][idx[r]]; scatter: the reverse. t is [P, L, R, hidden]."""
    rows = idx.numel()
    for l in range(len(planes[0])):
        for kv, bufs in enumerate(planes):
            pool, x = bufs[l], t[kv, l]
            if pool.dim() == 3:  # rows not dense: move [heads, head_dim] rows
                x = x.unflatten(-1, tuple(pool.shape[1:]))
            if start is not None:
                (x.copy_(pool[start:start + rows]) if gather
                 else pool[start:start + rows].copy_(x))
            elif gather and x.is_contiguous():
                p, xw = _wide(pool, x, torch.int64)
                torch.index_select(p, 0, idx, out=xw)
            elif gather:
                x.copy_(torch.index_select(pool, 0, idx))
            else:  # complex128 index_put_ beats int64 index_copy_ and fp16 index ops
                p, xw = _wide(pool, x, torch.complex128, torch.int64)
                p.index_put_((idx,), xw)


def _group_chunks(layout: KVLayout, dev: torch.device) -> int:
    """Chunks per index op: 1 when a chunk alone is a big enough op, else enough to reach it.

    On GPUs launches, not bytes, cost: group up to the cap."""
    op = layout.chunk_size * layout.hidden_dim * layout.dtype.itemsize
    target = _OP_BYTES * torch.get_num_threads() if dev.type == "cpu" else _SCRATCH_BYTES
    return max(1, min(_SCRATCH_BYTES // layout.chunk_bytes, -(-target // op)))


def _runs(layout: KVLayout, chunks: Sequence[torch.Tensor], dev: torch.device) -> list:
    """(first chunk, count, [P, L, count*chunk, hidden] view, or None: go through scratch)."""
    n, same = len(chunks), all(t.device == dev for t in chunks)
    tm = _token_major(chunks, layout.chunk_size) if same else None
    if tm is not None:
        return [(0, n, tm)]
    g = _group_chunks(layout, dev)
    if g == 1 and same:
        return [(j, 1, t) for j, t in enumerate(chunks)]
    return [(j, min(g, n - j), None) for j in range(0, n, g)]


def _scratch(layout: KVLayout, chunks: int, dev: torch.device) -> torch.Tensor:
    """Contiguous [P, L, chunks*chunk, hidden]; on CPU a per-thread buffer (never returned)."""
    shape = (layout.planes, layout.num_layers, chunks * layout.chunk_size, layout.hidden_dim)
    if dev.type != "cpu":  # the caching allocator already reuses device memory
        return torch.empty(shape, dtype=layout.dtype, device=dev)
    nbytes = chunks * layout.chunk_bytes
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes <= _SCRATCH_BYTES:
            _local.buf = buf
    return buf[:nbytes].view(layout.dtype).view(shape)


def _copy_out(layout: KVLayout, grp: Sequence[torch.Tensor], sc: torch.Tensor) -> None:
    """Split a gathered [P, L, n*chunk, hidden] scratch into the n chunk views of grp."""
    first, c = grp[0], layout.chunk_size
    same = all(t.device == sc.device for t in grp)
    if same and all(  # back to back in one tensor (one block, or shm slots in a row)
            t.is_contiguous() and t.data_ptr() == first.data_ptr() + j * layout.chunk_bytes
            and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            for j, t in enumerate(grp)):
        block = first.as_strided((len(grp), *first.shape), (first.numel(), *first.stride()))
        block.copy_(sc.unflatten(2, (len(grp), c)).permute(2, 0, 1, 3, 4))
    elif same:  # one call instead of one per chunk
        torch._foreach_copy_(list(grp), list(sc.split(c, dim=2)))
    else:
        for t, part in zip(grp, sc.split(c, dim=2)):
            t.copy_(part)


def gather_chunks(layout: KVLayout, k_buffer: Sequence[torch.Tensor],
                  v_buffer: Sequence[torch.Tensor], slots: torch.Tensor, *,
                  out: list[torch.Tensor] | None = None,
                  chunk_indices: list[int] | None = None) -> list[torch.Tensor]:
    """Copy the KV of ``slots`` into chunk tensors; called by the connector before commit_store.

    For an MLA layout ``k_buffer`` holds the latent buffers and ``v_buffer`` is empty.
    ``len(slots)`` must be a whole number of chunks. Returns one ``chunk_shape`` tensor per
    chunk (or per ``chunk_indices`` entry, in that order); on CPU each owns its storage. With
    ``out``, ``out[i]`` is written in place (it may be shared memory). Never writes the pool.
    """
    planes, pool_size, dev = _pool_views(layout, k_buffer, v_buffer)
    n_tok = slots.numel() if isinstance(slots, torch.Tensor) else -1
    slots = check_slots(layout, slots, n_tok, pool_size=pool_size, device=dev)
    c, n_chunks = layout.chunk_size, n_tok // layout.chunk_size
    idx = list(range(n_chunks)) if chunk_indices is None else [int(i) for i in chunk_indices]
    if any(not 0 <= i < n_chunks for i in idx):
        raise SlotsError(f"chunk_indices {idx} out of range: slots hold {n_chunks} chunks")
    if out is None and dev.type != "cpu":  # one block: the grouped copy-out is then one op
        out = list(torch.empty((len(idx), *layout.chunk_shape), dtype=layout.dtype,
                               device=dev).unbind(0))
    elif out is None:  # separate storages: a pickled view would carry its whole base
        out = [torch.empty(layout.chunk_shape, dtype=layout.dtype, device=dev) for _ in idx]
    elif len(out) != len(idx) or any(
            tuple(o.shape) != layout.chunk_shape or o.dtype != layout.dtype for o in out):
        raise ValueError(f"out must be {len(idx)} tensors of {layout.chunk_shape} "
                         f"{layout.dtype}, got {[(tuple(o.shape), o.dtype) for o in out]}")
    if not idx:
        return out
    if idx != list(range(n_chunks)):
        slots = slots.view(n_chunks, c)[torch.tensor(idx, device=dev)].reshape(-1)
    start = _run_start(slots)
    views = _planar(layout, out)
    for j0, cnt, view in _runs(layout, views, dev):
        run = slots[j0 * c:(j0 + cnt) * c]
        first = None if start is None else start + j0 * c
        if view is not None:
            _move_rows(planes, run, view, first, gather=True)
        else:
            sc = _scratch(layout, cnt, dev)
            _move_rows(planes, run, sc, first, gather=True)
            _copy_out(layout, views[j0:j0 + cnt], sc)
    return out


def scatter_chunks(layout: KVLayout, chunks: Sequence[torch.Tensor],
                   k_buffer: Sequence[torch.Tensor], v_buffer: Sequence[torch.Tensor],
                   slots: torch.Tensor) -> None:
    """Write chunk j into ``slots[j*chunk:(j+1)*chunk]`` of every layer, K and V (MLA: the
    latent buffers, passed as ``k_buffer``, ``v_buffer`` empty).

    Called by the connector after prepare_retrieve with tensors that came off the socket.
    Validates every chunk (ProtocolError) and the slots (SlotsError) before writing anything:
    a bad reply must never leave a half-written prefix in the pool.
    """
    planes, pool_size, dev = _pool_views(layout, k_buffer, v_buffer)
    if isinstance(chunks, (str, bytes)) or not isinstance(chunks, Sequence):
        raise ProtocolError(f"chunks must be a list of tensors, got {type(chunks).__name__}")
    for i, ch in enumerate(chunks):
        got = (f"{tuple(ch.shape)} {ch.dtype}" if isinstance(ch, torch.Tensor)
               else type(ch).__name__)
        if not isinstance(ch, torch.Tensor) or tuple(ch.shape) != layout.chunk_shape \
                or ch.dtype != layout.dtype:
            raise ProtocolError(f"chunk {i} is {got}, expected {layout.chunk_shape} "
                                f"{layout.dtype}")
    c = layout.chunk_size
    slots = check_slots(layout, slots, len(chunks) * c, pool_size=pool_size, device=dev)
    if not chunks:
        return
    chunks = _planar(layout, [ch if ch.device == dev else ch.to(dev) for ch in chunks])
    start = _run_start(slots)
    for j0, cnt, view in _runs(layout, chunks, dev):
        if view is None:
            view = _scratch(layout, cnt, dev)
            torch.stack(chunks[j0:j0 + cnt], dim=2, out=view.unflatten(2, (cnt, c)))
        _move_rows(planes, slots[j0 * c:(j0 + cnt) * c], view,
                   None if start is None else start + j0 * c, gather=False)


def scatter_skipping(layout: KVLayout, chunks, pool: KVPool, slots: torch.Tensor, skip: int) -> None:
    """Scatter chunks into slots, dropping the first `skip` tokens of the first chunk."""
    if skip == 0:
        scatter_chunks(layout, chunks, pool.k_buffer, pool.v_buffer, slots)
        return
    for i, c in enumerate(chunks):  # validate all before writing any (all or nothing)
        if not isinstance(c, torch.Tensor) or tuple(c.shape) != layout.chunk_shape \
                or c.dtype != layout.dtype:
            raise ProtocolError(f"chunk {i} is not a {layout.chunk_shape} {layout.dtype} tensor")
    head = layout.chunk_size - skip
    head_layout = dataclasses.replace(layout, chunk_size=head)
    scatter_chunks(head_layout, [chunks[0][..., skip:, :].contiguous()],
                   pool.k_buffer, pool.v_buffer, slots[:head])
    if len(chunks) > 1:
        scatter_chunks(layout, chunks[1:], pool.k_buffer, pool.v_buffer, slots[head:])
