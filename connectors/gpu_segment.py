"""The daemon's shared-memory segment as this process maps it, page-locked for DMA.

The mapping is this process's own, so a daemon dying mid-copy cannot unmap it; a segment
replaced by a re-registration stays mapped and registered until no copy reads it any more
(counted from before a copy is queued until its completion event is done).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .gpu_errors import GpuTransferError

log = logging.getLogger(__name__)


@dataclass
class Segment:
    """The daemon's shared-memory pool as this process maps it, page-locked for DMA.

    Counted while copies read or write it: `users` loads and stores between pinning it and
    having their completion event, then `pending` events until those completed. A retired
    segment is unregistered only once both are empty (`idle`)."""

    bytes: torch.Tensor  # uint8 view of the mapping; holding it keeps the mapping alive
    #: The segment mapped, (st_dev, st_ino) of /dev/shm/<name> (`shm_pool.ShmPool.identity`):
    #: a daemon restarted under the same name makes a new one.
    identity: tuple[int, int] | None = None
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


class SegmentHolder:
    """`GpuTransfer`'s segments: the current one and the retired ones copies still read.

    Page-locking is costly, so the segment is registered once per daemon registration
    (`attach`), not per load."""

    cuda: bool

    def _init_segments(self) -> None:
        self.segment: Segment | None = None
        self._retired: list[Segment] = []
        # Guards segment, _retired and each segment's users (loads run beside registration).
        self._seg_cond = threading.Condition()

    def attach(self, host_bytes: torch.Tensor | None, *,
               identity: tuple[int, int] | None = None) -> None:
        """At every registration: page-lock the daemon's (new) segment, retire the old one.

        `host_bytes` is this process's uint8 mapping of the segment, or None when the daemon
        offers none (pickle); `identity` the segment it maps (its inode). The same mapping
        of the same segment again changes nothing; a segment is never told apart by its
        name or address alone. The new segment is page-locked before it replaces the old
        one; the old one stays mapped and registered until no copy reads it
        (`Segment.users` and `.pending`).
        """
        with self._seg_cond:
            self._reap()
            cur = self.segment
            if cur is not None and host_bytes is not None and cur.bytes is not None \
                    and cur.identity == identity \
                    and cur.bytes.data_ptr() == host_bytes.data_ptr() \
                    and cur.bytes.numel() == host_bytes.numel():
                return
        seg = None
        try:
            if host_bytes is not None:
                seg = Segment(host_bytes, identity)
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

    def _pin(self, ptrs: Sequence[int], *, required: bool) -> Segment | None:
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

    def _unpin(self, seg: Segment | None, event) -> None:
        """The copy counted by `_pin` is queued: `event` completes once it ran (None: it
        already has). A retired segment is unregistered once nothing reads it."""
        if seg is None:
            return
        with self._seg_cond:
            seg.hold(event)
            seg.users -= 1
            self._reap()
            self._seg_cond.notify_all()

    def _release_segments(self, wait_s: float) -> None:
        """Wait (bounded) for copies counting on a segment, then unregister every segment."""
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
