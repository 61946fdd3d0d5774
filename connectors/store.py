"""Store: one shared-memory STORE's obligation to the daemon when its prepare_store went
unanswered, kept until the daemon's late answer can be honoured with the right bytes.

lmcache 0.5.6 keeps what prepare_store reserved write-locked (its 600 s write TTL) until a
commit_store, and every way it ends a live reservation admits it: commit_store, the
instance's unregister and the reaping of a silent worker all run `finish_write`, which
publishes whatever the reserved buffers hold under the real keys. There is no abort over the
wire (only the write TTL drops a reservation unadmitted). So a reservation is ended only by a
commit of bytes that were written: a copy that did not complete is never committed.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from . import wire


class Store:
    """A STORE of `key` on daemon incarnation `epoch` whose prepare_store timed out.

    The daemon may serve that call still (after a SIGSTOP, under load) and reserve slots the
    caller never learnt of. The connector keeps a host copy of the chunks (`kept`, read from
    the engine's slots before `store_from` returned) and hands `answered` to the transport,
    which gives it the reply if it comes late. `complete(timeout_s)`, owed as a debt and paid
    once the daemon answered every call of the session, writes the copy into the slots that
    reply reserved and commits them: the reservation ends with the right bytes under its keys,
    never garbage. Never served, dropped, or nothing reserved: nothing is sent.

    `answered` runs on whichever thread reads the transport's retired socket; `complete` on
    the debt payer's. Only `_reply` crosses between them, under `_lock`.
    """

    def __init__(self, epoch: int, key: wire.CacheKey) -> None:
        self.epoch = epoch
        self.key = key
        self.kept: list[torch.Tensor] = []
        self._reply: bytes | None = None
        self._lock = threading.Lock()
        #: Writes `kept` into the reserved slots and commits them (set by the connector).
        self.finish: Callable[["Store", wire.ShmContext, float], object] | None = None

    def answered(self, frame: bytes | None) -> None:
        """The transport's `on_late`: the prepare_store reply, after the caller gave up."""
        with self._lock:
            self._reply = frame

    def reserved(self) -> wire.ShmContext | None:
        """What the late reply reserved (None: no reply, or nothing reserved)."""
        with self._lock:
            frame = self._reply
        if frame is None:
            return None
        ctx = wire.DECODERS["prepare_store"].decode(frame).context
        return ctx if ctx.slots else None

    def complete(self, timeout_s: float) -> bool:
        """Honour the late reservation with the kept bytes, if there is one; once."""
        ctx = self.reserved()
        if ctx is not None and self.finish is not None:
            self.finish(self, ctx, timeout_s)  # a raise leaves it owed: the same bytes again
        with self._lock:
            self._reply, self.kept = None, []
        return True

    def __repr__(self) -> str:
        return f"Store([{self.key.start}, {self.key.end}) of {self.key.request_id}, epoch " \
               f"{self.epoch})"
