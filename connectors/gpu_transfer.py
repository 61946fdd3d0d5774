"""KV bytes between the daemon's host memory and a CUDA KV pool (engine-driven transfer on GPU).

Who calls it: `LMCacheMPConnector`, when the engine's KV pool lives on a CUDA device. The
connector validates the daemon's reply and the slots; this module only moves bytes:
- load: host chunks (views into the daemon's shared-memory segment, or decoded pickle
  tensors) are copied host-to-device in pieces on two side streams, and each piece is
  scattered into the pool's slots on the stream that copied it. `load` returns a
  `torch.cuda.Event` (the `ready` of `connectors.base.Retrieved`) that the engine's forward
  stream waits on; with `sync=True` it waits itself and returns None.
- store: the slots are gathered on the GPU into one staging block, then copied
  device-to-host into the daemon's segment (shm) or pinned staging (pickle).

Why it is shaped this way (measured on an H200, reference/gpu-h200.md): a copy from the
daemon's mapping runs at 5-7 GB/s pageable and at the link limit (~55 GB/s) once the mapping
is page-locked with cudaHostRegister, so the segment is registered once per daemon
registration (`attach`), not per load; copy plus scatter in pieces over two streams reaches
0.95-0.97 of a plain copy.

Lifetime: the segment is this process's own mapping (`connectors.lmcache_mp._ShmPool`), so a
daemon that dies mid-copy cannot unmap it; a segment replaced by a re-registration stays
mapped and registered until no copy reads it any more: a load or store counts on it from
before its first copy is queued until that copy's completion event is done (`_Segment`).
Never raises anything but `GpuTransferError` (a ConnectorError: the orchestrator degrades with
a reason) for CUDA failures; nothing here blocks on the daemon.

Everything except registration and streams also runs with a CPU "device" (tests).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .errors import ConnectorError
from .kv_layout import KVLayout

log = logging.getLogger(__name__)

#: Pieces a load is split into (each copied, then scattered, on alternating streams).
DEFAULT_PIECES = 4
#: Largest pinned staging piece for pickle loads (host memcpy of piece i+1 overlaps DMA of i).
PICKLE_PIECE_BYTES = 256 << 20
#: Pinned staging buffers: a pickle load alternates between two while a store owns a third.
STAGING_BUFFERS = 3
#: Longest wait for a staging buffer when all are owned (a bug, never a daemon fault).
STAGING_WAIT_S = 30.0
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class GpuTransferError(ConnectorError):
    """A CUDA call failed while moving KV (registration, copy, scatter, gather).

    `reason` is a short machine-readable cause (e.g. "host_register_failed", "copy_failed").
    The load is degraded: the slots may hold part of it and must be recomputed.
    """

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        super().__init__(f"GPU transfer failed ({reason}): {detail}")


def pool_device(pool) -> torch.device:
    return pool.k_buffer[0].device


def on_cuda(pool) -> bool:
    return pool_device(pool).type == "cuda"


def _cuda_call(reason: str, fn, *args, **kwargs):
    """Run a torch CUDA operation; RuntimeError (torch's CUDA errors) -> GpuTransferError."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:  # AcceleratorError is one
        raise GpuTransferError(reason, str(exc).splitlines()[0]) from exc


@dataclass
class _Segment:
    """The daemon's shared-memory pool as this process maps it, page-locked for DMA.

    Counted while copies read or write it: `users` loads and stores between pinning it and
    having their completion event, then `pending` events until those completed. A retired
    segment is unregistered only once both are empty (`idle`)."""

    bytes: torch.Tensor  # uint8 view of the mapping; holding it keeps the mapping alive
    registered: bool = False
    users: int = 0
    pending: list = field(default_factory=list)  # events of copies still reading it

    def contains(self, ptr: int) -> bool:
        b = self.bytes
        return b is not None and b.data_ptr() <= ptr < b.data_ptr() + b.numel()

    def hold(self, event) -> None:
        self.pending = [e for e in self.pending if not e.query()]
        if event is not None:
            self.pending.append(event)

    def idle(self) -> bool:
        self.pending = [e for e in self.pending if not e.query()]
        return self.users == 0 and not self.pending

    def release(self) -> None:
        """Wait for the copies still reading it, then unregister and drop the mapping."""
        for e in self.pending:
            e.synchronize()
        self.pending = []
        if self.registered:
            err = torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            if int(err) != 0:
                log.warning("cudaHostUnregister of the daemon's segment returned %s", err)
            self.registered = False
        self.bytes = None


def register_host(t: torch.Tensor) -> None:
    """Page-lock `t`'s memory in place (cudaHostRegister) so copies from it run at link speed."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise GpuTransferError("host_register_failed",
                               f"cudaHostRegister of {t.numel() * t.element_size()} bytes "
                               f"returned {err}")


class _PinnedRing:
    """Pinned host staging for pickle loads and stores; each buffer has one owner at a time.

    `take` hands out a buffer nobody owns (waiting, bounded, when all are owned) and
    `give` returns it with the event of the copy still reading or writing it, recorded
    before the give: the next taker waits for that event before it touches the bytes.
    A load owns a buffer from its host memcpy until its host-to-device copy is queued; a
    store from its device-to-host copy until the bytes were copied out of it."""

    def __init__(self, size: int = STAGING_BUFFERS) -> None:
        self.bufs: list[torch.Tensor | None] = [None] * size
        self.events: list = [None] * size
        self.owned: list[bool] = [False] * size
        self._cond = threading.Condition()

    def _pick(self, nbytes: int) -> int | None:
        """The best unowned buffer: done and big enough, done, then one still copying."""
        free = [i for i, o in enumerate(self.owned) if not o]
        if not free:
            return None

        def rank(i: int) -> tuple[int, int]:
            ev, buf = self.events[i], self.bufs[i]
            done = ev is None or ev.query()
            return (0 if done else 1, 0 if buf is not None and buf.numel() >= nbytes else 1)

        return min(free, key=rank)

    def take(self, nbytes: int, pin: bool, wait_s: float = STAGING_WAIT_S
             ) -> tuple[int, torch.Tensor]:
        """(buffer id, `nbytes` of it), owned by the caller until `give`."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while (i := self._pick(nbytes)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GpuTransferError("staging_busy", f"every pinned staging buffer "
                                           f"stayed owned for {wait_s} s")
                self._cond.wait(left)
            self.owned[i] = True
            ev, self.events[i] = self.events[i], None
        try:
            if ev is not None:  # the copy that last used it must be done before we write
                _cuda_call("copy_failed", ev.synchronize)
            buf = self.bufs[i]
            if buf is None or buf.numel() < nbytes:
                self.bufs[i] = None
                buf = self.bufs[i] = _cuda_call("alloc_failed", torch.empty, nbytes,
                                                dtype=torch.uint8, pin_memory=pin)
        except BaseException:
            self.give(i, None)
            raise
        return i, buf[:nbytes]

    def give(self, i: int, event) -> None:
        """Give buffer `i` back; `event`: the queued copy that still uses it (or None)."""
        with self._cond:
            self.events[i] = event
            self.owned[i] = False
            self._cond.notify()

    def drain(self) -> None:
        with self._cond:
            events, self.events = self.events, [None] * len(self.events)
        for e in events:
            if e is not None:
                e.synchronize()


class GpuTransfer:
    """One connector's GPU data path: the registered segment, side streams, staging."""

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
        self.segment: _Segment | None = None
        self._retired: list[_Segment] = []
        # Guards segment, _retired and each segment's users (loads run beside registration).
        self._seg_cond = threading.Condition()
        self._ring = _PinnedRing()
        self._tables: dict[tuple, torch.Tensor] = {}
        self._kernel = _pick_kernel(scatter, self.device)
        self._turn = 0  # the side stream the next piece goes to (pieces of one load alternate)

    @property
    def scatter_impl(self) -> str:
        return "triton" if self._kernel is not None else "torch"

    # -- the daemon's segment --------------------------------------------------

    def attach(self, host_bytes: torch.Tensor | None) -> None:
        """At every registration: page-lock the daemon's (new) segment, retire the old one.

        `host_bytes` is this process's uint8 mapping of the segment, or None when the daemon
        offers none (pickle). The same mapping again changes nothing. The new segment is
        page-locked before it replaces the old one; the old one stays mapped and registered
        until no copy reads it (`_Segment.users` and `.pending`).
        """
        with self._seg_cond:
            self._reap()
            cur = self.segment
            if cur is not None and host_bytes is not None and cur.bytes is not None \
                    and cur.bytes.data_ptr() == host_bytes.data_ptr() \
                    and cur.bytes.numel() == host_bytes.numel():
                return
        seg = None
        try:
            if host_bytes is not None:
                seg = _Segment(host_bytes)
                if self.cuda:
                    register_host(host_bytes)
                    seg.registered = True
        finally:
            with self._seg_cond:
                if self.segment is not None:
                    self._retired.append(self.segment)
                self.segment = seg if seg is None or seg.registered or not self.cuda else None
                self._reap()

    def _reap(self) -> None:
        """Unregister the retired segments no copy reads any more (holding `_seg_cond`)."""
        keep = []
        for seg in self._retired:
            if seg.idle():
                seg.release()
            else:
                keep.append(seg)
        self._retired = keep

    def _pin(self, ptrs: Sequence[int], *, required: bool) -> _Segment | None:
        """Count a copy into the segment holding every address of `ptrs` (the current one
        or a retired one still mapped): it is not unregistered until `_unpin`."""
        with self._seg_cond:
            self._reap()
            for seg in ([self.segment] if self.segment is not None else []) + self._retired:
                if all(seg.contains(p) for p in ptrs):
                    seg.users += 1
                    return seg
        if required:
            raise GpuTransferError("no_segment", "shared-memory chunks outside every attached "
                                   "segment (none attached, or it was released)")
        return None

    def _unpin(self, seg: _Segment | None, event) -> None:
        """The copy counted by `_pin` is queued: `event` completes once it ran (None: it
        already has). A retired segment is unregistered once nothing reads it."""
        if seg is None:
            return
        with self._seg_cond:
            seg.hold(event)
            seg.users -= 1
            self._reap()
            self._seg_cond.notify_all()

    def close(self, wait_s: float = 30.0) -> None:
        """Wait for running copies, unregister every segment, free staging."""
        with self._seg_cond:
            if self.segment is not None:
                self._retired.append(self.segment)
                self.segment = None
            if not self._seg_cond.wait_for(lambda: all(s.users == 0 for s in self._retired),
                                           wait_s):
                log.warning("closing the GPU transfer while a copy still counts on the "
                            "daemon's segment")
            for seg in self._retired:
                seg.release()
            self._retired = []
        self._ring.drain()
        self._ring = _PinnedRing()
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
            self._kernel(stage, table, slots_dev, rows, first, layout, gather=False)
            return
        cnt, c, hid = stage.shape[0], layout.chunk_size, layout.hidden_dim
        L = layout.num_layers
        for kv, bufs in ((0, ks), (1, vs)):
            for l in range(L):
                dst = bufs[l].view(-1, hid)
                src = stage[:, kv, l]  # [cnt, c, hid], strided
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
                               m * c, 0, layout, gather=True)
                else:
                    for kv, bufs in ((0, ks), (1, vs)):
                        for l in range(layout.num_layers):
                            stage[:, kv, l] = bufs[l].view(-1, layout.hidden_dim)[sl].view(
                                m, c, layout.hidden_dim)
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


# -- the fused scatter/gather kernel (Triton, where present) -------------------

def _pick_kernel(choice: str, device: torch.device):
    """The Triton row mover if asked for (or auto) and it checks out byte-exact, else None."""
    if choice == "torch" or device.type != "cuda":
        return None
    try:
        kernel = _make_triton_kernel()
        _self_check(kernel, device)
        return kernel
    except Exception as exc:  # noqa: BLE001 - any failure means: use the torch path
        if choice == "triton":
            raise GpuTransferError("kernel_unavailable", repr(exc)) from exc
        log.info("GPU scatter: Triton kernel unavailable (%r); using torch index ops", exc)
        return None


def _make_triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _kv_rows(stage_ptr, table_ptr, slots_ptr, first, C: tl.constexpr, L2: tl.constexpr,
                 H: tl.constexpr, BLOCK: tl.constexpr, GATHER: tl.constexpr):
        t = tl.program_id(0)  # row of this call (one token)
        b = tl.program_id(1)  # buffer: kv * L + layer
        g = t + first  # row in the stage, counting dropped rows
        chunk = g // C
        r = g - chunk * C
        slot = tl.load(slots_ptr + t)
        base = tl.load(table_ptr + b).to(tl.pointer_type(stage_ptr.dtype.element_ty))
        srow = stage_ptr + ((chunk * L2 + b) * C + r).to(tl.int64) * H
        prow = base + slot * H
        for i in tl.static_range(0, H, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            m = offs < H
            if GATHER:
                tl.store(srow + offs, tl.load(prow + offs, mask=m), mask=m)
            else:
                tl.store(prow + offs, tl.load(srow + offs, mask=m), mask=m)

    def run(stage, table, slots_dev, rows, first, layout: KVLayout, *, gather: bool) -> None:
        it = _INT_OF_SIZE[layout.dtype.itemsize]
        hid = layout.hidden_dim
        block = min(triton.next_power_of_2(hid), 4096)
        _kv_rows[(rows, 2 * layout.num_layers)](
            stage.view(it), table, slots_dev, first, C=layout.chunk_size,
            L2=2 * layout.num_layers, H=hid, BLOCK=block, GATHER=gather)

    return run


def _self_check(kernel, device: torch.device) -> None:
    """A small scatter and gather against torch indexing; raises unless byte-exact."""
    lay = KVLayout(num_layers=2, num_heads=2, head_dim=8, dtype=torch.bfloat16, chunk_size=4)
    g = torch.Generator(device="cpu").manual_seed(3)
    pool = [torch.zeros(32, lay.hidden_dim, dtype=lay.dtype, device=device) for _ in range(4)]
    stage = torch.randn((2, *lay.chunk_shape), generator=g).to(lay.dtype).to(device)
    slots = torch.randperm(32, generator=g)[:7].to(device)  # first = 1: drops one row
    table = torch.tensor([t.data_ptr() for t in pool], dtype=torch.int64, device=device)
    kernel(stage, table, slots, 7, 1, lay, gather=False)
    rows = stage.permute(1, 2, 0, 3, 4).reshape(4, 8, lay.hidden_dim)[:, 1:]
    for b in range(4):
        if not torch.equal(pool[b][slots], rows[b]):
            raise RuntimeError("Triton scatter self-check mismatch")
    back = torch.zeros_like(stage)
    kernel(back, table, torch.cat([slots[:1], slots]), 8, 0, lay, gather=True)
    back_rows = back.permute(1, 2, 0, 3, 4).reshape(4, 8, lay.hidden_dim)
    if not torch.equal(back_rows[:, 1:], rows):
        raise RuntimeError("Triton gather self-check mismatch")
