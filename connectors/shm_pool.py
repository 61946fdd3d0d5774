"""The daemon's shared-memory segment as this process maps it (`ShmPool`), and the part of
the connector that swaps that mapping at registration and hands out views into it."""

from __future__ import annotations

import logging
import mmap
import os
import threading

import torch

from . import wire
from .errors import DaemonUnavailable, ProtocolError, ShortRead, UnsupportedKVPool
from .gpu_transfer import GpuTransfer, pool_device
from .kv_layout import KVLayout, KVPool

log = logging.getLogger(__name__)


def segment_identity(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the segment `path` names now; None when there is none. A daemon
    restarted with the same --shm-name unlinks the old segment and creates another: the
    name stays, the inode changes."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class ShmPool:
    """A read/write mapping of the daemon's L1 pool (/dev/shm/<name>), as registration with
    daemon incarnation `epoch` (the connection epoch) named it. The segment mapped is
    `identity` (its inode), not its name: the name outlives a daemon's restart."""

    def __init__(self, name: str, size: int, epoch: int | None = None) -> None:
        self.path = "/dev/shm/" + name.lstrip("/")
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError as exc:
            raise DaemonUnavailable(
                f"cannot open the daemon's shared-memory pool {self.path}: {exc}; the daemon "
                "must run on this host with --shm-name NAME --no-l1-use-lazy"
            ) from exc
        try:
            st = os.fstat(fd)
            self.identity: tuple[int, int] = (st.st_dev, st.st_ino)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.name = name
        self.size = size
        self.epoch = epoch
        # Through a memoryview, every view holds a buffer export: close() then cannot unmap
        # the pool under a copy still reading it (the mapping goes with the last view).
        self.bytes: torch.Tensor | None = torch.frombuffer(memoryview(self._map),
                                                           dtype=torch.uint8)

    def names(self, name: str, size: int, epoch: int) -> bool:
        """This mapping is the segment a registration with incarnation `epoch` named: the
        same name, size and epoch, and the name still names the segment we mapped (a
        restart hidden from the epoch, behind a proxy, leaves all three unchanged)."""
        return self.bytes is not None and (self.name, self.size, self.epoch) == (
            name, size, epoch) and self.current()

    def current(self) -> bool:
        """The daemon's segment name still names the segment this maps (one stat)."""
        return segment_identity(self.path) == self.identity

    def view(self, slot: wire.ShmSlot, layout: KVLayout) -> torch.Tensor:
        data = self.bytes  # once: close() may run on another thread
        if data is None:
            raise DaemonUnavailable("the daemon's shared-memory pool was unmapped (a "
                                    "re-registration replaced it, or the client closed)")
        if slot.dtype != layout.dtype_str or tuple(slot.shape) != layout.chunk_shape:
            raise ProtocolError(
                f"shm slot of {slot.dtype}{slot.shape}, expected "
                f"{layout.dtype_str}{list(layout.chunk_shape)}"
            )
        if slot.length != layout.chunk_bytes or slot.offset < 0 or (
            slot.offset + slot.length > self.size
        ):
            raise ProtocolError(
                f"shm slot [{slot.offset}, +{slot.length}) outside the {self.size}-byte pool"
            )
        raw = data[slot.offset : slot.offset + slot.length]
        return raw.view(layout.dtype).view(layout.chunk_shape)

    def close(self) -> None:
        self.bytes = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with it


def refuse_cuda_mla(layout: KVLayout) -> None:
    if layout.mla:
        raise UnsupportedKVPool(
            "loadback: an MLA KV pool on CUDA is not supported (the GPU data path moves "
            "K/V pools only; MLA load-back runs with the KV pool on CPU); start without "
            "--radix-cache-backend loadback to serve this model on GPU")


class SegmentMapping:
    """Mixed into `LMCacheMPConnector`: its mapping of the daemon's segment (`_shm`) and its
    CUDA data path (`_gpu`), swapped under `_map_lock` at registration; readers take
    `_shm` once and keep that object."""

    layout: KVLayout
    epoch: int
    gpu_sync: bool
    transfer: str
    _shm: ShmPool | None
    _gpu: GpuTransfer | None
    _map_lock: threading.Lock

    def _swap_mapping(self, mode: str, reply: wire.RegisterReply, epoch: int | None) -> None:
        """After a registration (holding `_map_lock`): keep the mapping when the same daemon
        incarnation named the same segment (a suspect re-registration: no remap, no second
        page-locking), else map the new one, page-lock it, then publish it in one store.
        Readers take `self._shm` once and keep that object: an old mapping stays valid while
        views of it live, and a copy from it stays counted on its page-locking."""
        old = self._shm
        if mode == "shm" and old is not None and epoch is not None and old.names(
                reply.shm_name, reply.pool_size, epoch):
            self.transfer = mode
            return
        new = None
        try:
            if mode == "shm":
                new = ShmPool(reply.shm_name, reply.pool_size, epoch)
            if self._gpu is not None:  # before anyone can take a view of the new mapping
                self._gpu.attach(new.bytes if new is not None else None,
                                 identity=new.identity if new is not None else None)
        except BaseException:
            self._shm = None
            if new is not None:
                new.close()
            if old is not None:
                old.close()
            raise
        self._shm = new
        self.transfer = mode
        if old is not None:
            old.close()

    def _gpu_for(self, pool: KVPool) -> GpuTransfer:
        """The CUDA data path for this pool's device (made, and the segment page-locked, on
        first use when the connector was not built with `device=`)."""
        dev = pool_device(pool)
        gpu = self._gpu
        if gpu is not None and gpu.device == dev:
            return gpu
        with self._map_lock:
            gpu = self._gpu
            if gpu is None or gpu.device != dev:
                refuse_cuda_mla(self.layout)
                if gpu is not None:
                    gpu.close()
                log.warning("KV pool on %s: page-locking the daemon's segment now; pass "
                            "device=%r to the connector to do it at registration", dev,
                            str(dev))
                gpu = GpuTransfer(dev, sync=self.gpu_sync)
                shm = self._shm
                gpu.attach(shm.bytes if shm is not None else None,
                           identity=shm.identity if shm is not None else None)
                self._gpu = gpu
            return gpu

    def _mapping(self, epoch: int | None = None) -> ShmPool:
        """The mapping of the segment of the daemon we talk to now (and, given `epoch`, the
        one a call started then was answered by), read once: a re-registration may swap
        it on another thread; the object read stays valid. DaemonUnavailable otherwise."""
        shm = self._shm
        if shm is None:
            raise DaemonUnavailable("shared-memory pool not mapped: register first")
        if shm.epoch is None or shm.epoch != self.epoch or (
                epoch is not None and epoch != shm.epoch):
            raise DaemonUnavailable("the shared-memory pool mapped is another daemon "
                                    "incarnation's: register again first")
        if not shm.current():
            # A daemon restarted under the same --shm-name, unseen by the epoch (a proxy):
            # its slots lie in a segment we do not map; copying through ours would load
            # stale bytes and store into a dead segment what the new daemon then commits.
            raise DaemonUnavailable(f"the daemon's shared-memory pool {shm.path} is another "
                                    "segment than the one mapped (the daemon restarted): "
                                    "register again first")
        return shm

    def _shm_views(self, context: wire.ShmContext, n_chunks: int) -> list[torch.Tensor]:
        shm = self._mapping()
        if len(context.slots) != n_chunks:
            raise ShortRead(f"daemon offered {len(context.slots)} of {n_chunks} chunks")
        return [shm.view(s, self.layout) for s in context.slots]
