"""KV bytes between the daemon's host memory and a CUDA KV pool (engine-driven transfer on GPU).

`LMCacheMPConnector` calls it when the pool lives on a CUDA device: a load copies host chunks
host-to-device in pieces on two side streams and scatters each into the slots, returning a
`torch.cuda.Event`; a store gathers on the GPU and copies to the daemon's segment or staging.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

from .gpu_errors import GpuTransferError, cuda_call as _cuda_call
from .gpu_kernel import pick_kernel as _pick_kernel
from .gpu_segment import Segment, SegmentHolder, register_host
from .gpu_staging import STAGING_BUFFERS, STAGING_WAIT_S, PinnedRing
from .kv_layout import KVLayout

# Re-exported: callers import the GPU data path's names from here.
__all__ = ["DEFAULT_PIECES", "PICKLE_PIECE_BYTES", "STAGING_BUFFERS", "STAGING_WAIT_S",
           "GpuTransfer", "GpuTransferError", "PinnedRing", "Segment", "on_cuda",
           "pool_device", "register_host"]

#: Pieces a load is split into (each copied, then scattered, on alternating streams).
DEFAULT_PIECES = 4
#: Largest pinned staging piece for pickle loads (host memcpy of piece i+1 overlaps DMA of i).
PICKLE_PIECE_BYTES = 256 << 20


def pool_device(pool) -> torch.device:
    return pool.k_buffer[0].device


def on_cuda(pool) -> bool:
    return pool_device(pool).type == "cuda"


class GpuTransfer(SegmentHolder):
    """One connector's GPU data path: the registered segment, side streams, staging.

    Copies read the daemon's segment page-locked (cudaHostRegister): pageable memory copies
    at a fraction of the link's speed. Copy plus scatter run in pieces over two streams so
    the scatter of one piece overlaps the copy of the next. Never raises anything but
    `GpuTransferError` for CUDA failures; nothing here blocks on the daemon. Everything but
    registration and streams also runs with a CPU "device" (tests)."""

    def __init__(self, device: torch.device | str, *, pieces: int = DEFAULT_PIECES,
                 sync: bool = False, scatter: str = "auto") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if pieces < 1:
            raise ValueError(f"pieces must be >= 1, got {pieces}")
        if scatter not in ("auto", "torch", "triton"):
            raise ValueError(f"scatter must be 'auto', 'torch' or 'triton', got {scatter!r}")
        self.pieces = pieces
        self.sync = sync
        self.cuda = self.device.type == "cuda"
        self.streams = ([torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)]
                        if self.cuda else [None, None])
        self._init_segments()
        self._ring = PinnedRing()
        self._tables: dict[tuple, torch.Tensor] = {}
        self._kernel = _pick_kernel(scatter, self.device)
        self._turn = 0  # the side stream the next piece goes to (pieces of one load alternate)

    @property
    def scatter_impl(self) -> str:
        return "triton" if self._kernel is not None else "torch"

    def close(self, wait_s: float = 30.0) -> None:
        """Wait for running copies, unregister every segment, free staging."""
        self._release_segments(wait_s)
        self._ring.drain()
        self._ring = PinnedRing()
        self._tables.clear()

    # -- streams and events ----------------------------------------------------

    def _stream_ctx(self, s):
        return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()

    def _begin(self) -> None:
        """Side streams start after whatever the engine queued (it may have just freed or
        written these slots)."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            for s in self.streams:
                s.wait_stream(cur)

    def _finish(self):
        """One event after every op on both side streams; None on CPU."""
        if not self.cuda:
            return None
        s0, s1 = self.streams
        s0.wait_stream(s1)
        ev = torch.cuda.Event()
        ev.record(s0)
        return ev

    def _table(self, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Device pointers of every (K/V, layer) buffer, order kv * L + l (the chunk's)."""
        key = tuple(t.data_ptr() for t in (*ks, *vs))
        tab = self._tables.get(key)
        if tab is None:
            if len(self._tables) > 8:
                self._tables.clear()
            tab = self._tables[key] = torch.tensor(key, dtype=torch.int64, device=self.device)
        return tab

    # -- load ------------------------------------------------------------------

    def load(self, layout: KVLayout, chunks: Sequence[torch.Tensor], pool,
             slots: torch.Tensor, skip: int, *, from_segment: bool,
             before_scatter: Callable[[], None] | None = None):
        """Write chunk rows [skip, n*chunk) into `slots` of the pool; returns the ready event.

        `chunks` are validated host tensors of `layout.chunk_shape`; `slots` are validated
        (len n*chunk - skip, in range). `from_segment`: the chunks are views into an
        attached (page-locked) segment, counted as read until the returned event completed;
        else they are copied through pinned staging first.
        `before_scatter`: runs once the first piece's host-to-device copy is queued and
        before anything is written to the pool (e.g. the slot checks, so they overlap the
        copy); whatever it raises is raised after the queued copies have run.
        """
        if not chunks:
            return None
        seg = self._pin([c.data_ptr() for c in chunks], required=True) if from_segment \
            else None
        staged: list[int] = []  # the staging buffer this load owns (given back once queued)
        try:
            ready = self._load(layout, chunks, pool, slots, skip, from_segment,
                               before_scatter, staged)
        except BaseException:
            self.drain()  # pieces already queued must not write the slots after the raise
            for i in staged:
                self._ring.give(i, None)
            self._unpin(seg, None)
            raise
        self._unpin(seg, ready)
        if ready is not None and self.sync:
            _cuda_call("copy_failed", ready.synchronize)
            return None
        return ready

    def drain(self) -> None:
        """Wait until every copy and scatter queued on the side streams has run."""
        for s in self.streams:
            if s is not None:
                try:
                    s.synchronize()
                except RuntimeError:  # a sticky CUDA error: nothing more will run anyway
                    pass

    def _slots_on_device(self, slots: torch.Tensor) -> torch.Tensor:
        """Our own int64 copy of `slots` on the device, queued on the first side stream.

        Never a host wait: CPU slots go through page-locked staging (a copy from pageable
        memory would make the host wait for every copy already queued on that stream, which
        serialises a pipelined load); CUDA slots are copied on the device. Our own copy: the
        caller may free or reuse its tensor once this returns.
        """
        if not self.cuda:
            return slots.to(torch.int64).clone()
        s0 = self.streams[self._turn % 2]
        with self._stream_ctx(s0):
            if slots.device.type == "cpu":
                src = _cuda_call("alloc_failed", lambda: slots.to(torch.int64).pin_memory())
            else:
                src = slots
            out = _cuda_call("alloc_failed", torch.empty, slots.numel(), dtype=torch.int64,
                             device=self.device)
            _cuda_call("copy_failed", out.copy_, src, True)
            copied = torch.cuda.Event()
            copied.record(s0)
        for s in self.streams:  # a scatter on either stream reads them after the copy
            if s is not s0:
                s.wait_event(copied)
                out.record_stream(s)
        return out

    def _load(self, layout, chunks, pool, slots, skip, from_segment, before_scatter, staged):
        n = len(chunks)
        ks, vs = list(pool.k_buffer), list(pool.v_buffer)
        self._begin()
        c = layout.chunk_size
        bounds = _pieces(n, self.pieces if from_segment else max(
            self.pieces, -(-n * layout.chunk_bytes // PICKLE_PIECE_BYTES)))
        slots_dev = None
        table = self._table(ks, vs) if self._kernel is not None else None
        for p, (j0, j1) in enumerate(bounds):
            s = self.streams[self._turn % 2]
            self._turn += 1
            with self._stream_ctx(s):
                stage = _cuda_call("alloc_failed", torch.empty, (j1 - j0, *layout.chunk_shape),
                                   dtype=layout.dtype, device=self.device)
                src = chunks[j0:j1]
                if not from_segment:
                    src = self._through_pinned(layout, src, staged)
                _cuda_call("copy_failed", _copy_chunks, stage, src, self.cuda)
                if staged:  # the event is recorded before anyone else can take the buffer
                    ev = None
                    if self.cuda:
                        ev = torch.cuda.Event()
                        ev.record(s)
                    self._ring.give(staged.pop(), ev)
            if slots_dev is None:  # the first copy is on its way: the rest overlaps it
                if before_scatter is not None:
                    before_scatter()
                slots_dev = self._slots_on_device(slots)
            with self._stream_ctx(s):
                lo = max(0, j0 * c - skip)  # first slot this piece writes
                hi = j1 * c - skip
                first = skip if j0 == 0 else 0  # rows of the piece's first chunk to drop
                _cuda_call("scatter_failed", self._scatter, layout, stage, ks, vs,
                           slots_dev[lo:hi], first, table)
        return self._finish()

    def _through_pinned(self, layout: KVLayout, src: Sequence[torch.Tensor],
                        staged: list[int]):
        """Host memcpy of decoded chunks into a staging buffer this load then owns (its id
        goes on `staged`) until the host-to-device copy reading it is queued."""
        i, buf = self._ring.take(len(src) * layout.chunk_bytes, pin=self.cuda)
        staged.append(i)
        block = buf.view(layout.dtype).view(len(src), *layout.chunk_shape)
        for k, t in enumerate(src):
            block[k].copy_(t)
        return [block]

    def _scatter(self, layout, stage, ks, vs, slots_dev, first, table) -> None:
        """pool[kv][l][slots[r]] = stage rows (chunk-major), dropping `first` leading rows."""
        rows = slots_dev.numel()
        if rows == 0:
            return
        if table is not None:
            self._kernel(stage, table, slots_dev, rows, first, layout, gather=False,
                         strides=row_strides(layout, ks))
            return
        cnt, c = stage.shape[0], layout.chunk_size
        L = layout.num_layers
        for kv, bufs in ((0, ks), (1, vs)):
            for l in range(L):
                dst = bufs[l]  # [slots, heads, head_dim], its rows dense or not
                src = stage[:, kv, l].unflatten(-1, tuple(dst.shape[1:]))  # [cnt, c, h, d]
                if first:
                    dst.index_put_((slots_dev[:c - first],), src[0, first:])
                    if cnt > 1:
                        dst.index_put_((slots_dev[c - first:].view(cnt - 1, c),), src[1:])
                else:
                    dst.index_put_((slots_dev.view(cnt, c),), src)

    # -- store -----------------------------------------------------------------

    def store(self, layout: KVLayout, pool, slots: torch.Tensor, chunk_indices: Sequence[int],
              out: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """Gather the chunks `chunk_indices` of `slots` on the device, copy them to host.

        `out`: views into the attached segment (written in place), or None: the chunks come
        back as host tensors of their own (copied out of pinned staging, which goes back to
        the ring before this returns: a load may reuse it at once). Returns once the bytes
        are on the host (the caller commits them next).
        """
        idx = [int(i) for i in chunk_indices]
        if not idx:
            return list(out or [])
        ks, vs = list(pool.k_buffer), list(pool.v_buffer)
        c, m = layout.chunk_size, len(idx)
        seg = self._pin([t.data_ptr() for t in out], required=False) if out else None
        staged = None
        try:
            self._begin()
            s0 = self.streams[0]
            with self._stream_ctx(s0):
                sl = _cuda_call("copy_failed", lambda: slots.to(self.device, torch.int64))
                sl = sl.view(-1, c)[torch.tensor(idx, device=self.device)].reshape(-1)
                stage = _cuda_call("alloc_failed", torch.empty, (m, *layout.chunk_shape),
                                   dtype=layout.dtype, device=self.device)
                if self._kernel is not None:
                    _cuda_call("gather_failed", self._kernel, stage, self._table(ks, vs), sl,
                               m * c, 0, layout, gather=True, strides=row_strides(layout, ks))
                else:
                    for kv, bufs in ((0, ks), (1, vs)):
                        for l in range(layout.num_layers):
                            stage[:, kv, l] = bufs[l][sl].reshape(m, c, layout.hidden_dim)
                if out is None:
                    staged, buf = self._ring.take(m * layout.chunk_bytes, pin=self.cuda)
                    host = buf.view(layout.dtype).view(m, *layout.chunk_shape)
                    _cuda_call("copy_failed", host.copy_, stage, self.cuda)
                else:
                    for k in range(m):
                        _cuda_call("copy_failed", out[k].copy_, stage[k], self.cuda)
            done = self._finish()
            if done is not None:
                _cuda_call("copy_failed", done.synchronize)
            if out is None:  # our own bytes: the staging buffer is free once this returns
                out = [host[k].clone() for k in range(m)]
        except BaseException:
            self.drain()  # nothing queued may still write the staging or the segment
            raise
        finally:
            if staged is not None:
                self._ring.give(staged, None)
            self._unpin(seg, None)
        return list(out)


def row_strides(layout: KVLayout, bufs: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """The (slot, head) strides in elements of `[slots, heads, head_dim]` buffers whose rows
    are not dense (K and V halves of vLLM's interleaved `[.., heads, 2*head_dim]` rows), else
    None; ValueError unless every buffer has the same strides with each head's elements
    contiguous."""
    st = tuple(bufs[0].stride())
    if any(tuple(b.stride()) != st for b in bufs) or st[-1] != 1:
        raise ValueError(f"KV buffers with strides {st} (and others): each head's "
                         f"{layout.head_dim} elements must be contiguous, every buffer alike")
    dense = (layout.hidden_dim, layout.head_dim)
    return None if st[:2] == dense else st[:2]


def _pieces(n: int, pieces: int) -> list[tuple[int, int]]:
    """Split n chunks into at most `pieces` runs of near-equal size."""
    k = max(1, min(n, pieces))
    edges = [round(i * n / k) for i in range(k + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def _copy_chunks(stage: torch.Tensor, src: Sequence[torch.Tensor], non_blocking: bool) -> None:
    """Host chunks -> stage[k]: one copy per run of chunks back to back in host memory."""
    k = 0
    while k < len(src):
        t = src[k]
        if t.dim() == stage.dim():  # already a block of chunks (pinned staging)
            stage[k:k + t.shape[0]].copy_(t, non_blocking=non_blocking)
            k += t.shape[0]
            continue
        run, nb = 1, t.numel() * t.element_size()
        while k + run < len(src) and src[k + run].data_ptr() == t.data_ptr() + run * nb \
                and src[k + run].is_contiguous():
            run += 1
        if run > 1 and t.is_contiguous():
            block = t.as_strided((run, *t.shape), (t.numel(), *t.stride()))
            stage[k:k + run].copy_(block, non_blocking=non_blocking)
        else:
            stage[k].copy_(t, non_blocking=non_blocking)
        k += run
