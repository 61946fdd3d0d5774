"""Pinned host staging for pickle loads and stores on GPU: a small ring of page-locked buffers,
each with one owner at a time, handed out again only after the copy that used it completed.
"""

from __future__ import annotations

import threading
import time

import torch

from .gpu_errors import GpuTransferError, cuda_call

#: Pinned staging buffers: a pickle load alternates between two while a store owns a third.
STAGING_BUFFERS = 3
#: Longest wait for a staging buffer when all are owned (a bug, never a daemon fault).
STAGING_WAIT_S = 30.0


class PinnedRing:
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
                cuda_call("copy_failed", ev.synchronize)
            buf = self.bufs[i]
            if buf is None or buf.numel() < nbytes:
                self.bufs[i] = None
                buf = self.bufs[i] = cuda_call("alloc_failed", torch.empty, nbytes,
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
