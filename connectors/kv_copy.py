"""Whole chunks between an engine's KV pool and chunk tensors: `gather_chunks` (a STORE's
bytes), `scatter_chunks` and `scatter_skipping` (a load's), on CPU or on the pool's device.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Sequence

import torch

from lmcache_loadback.connectors.errors import ProtocolError, SlotsError

from .kv_layout import KVLayout, KVPool, check_slots, pool_views

# The hot path of every load-back, so no per-token Python loops: each (layer, K/V) moves with one
# index op per run of chunks (all of them when they are views of one token-major tensor, one
# chunk when that is a big enough op, else a group through a scratch tensor); one ascending
# slot range moves by slicing.
# Bytes per index op per CPU thread below which op overhead dominates: small chunks are grouped.
_OP_BYTES = 256 << 10
# Cap on the grouping scratch, kept per thread on CPU: a fresh one costs page faults each call.
_SCRATCH_BYTES = 32 << 20
_local = threading.local()


def _planar(layout: KVLayout, chunks: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """Chunks as [planes, L, chunk, hidden] views (MLA's [L, chunk, hidden] gains a dim 0)."""
    return [t.unsqueeze(0) for t in chunks] if layout.mla else chunks


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
    planes, pool_size, dev = pool_views(layout, k_buffer, v_buffer)
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
    planes, pool_size, dev = pool_views(layout, k_buffer, v_buffer)
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
