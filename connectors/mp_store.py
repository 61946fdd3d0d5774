"""The STORE side of the daemon client: prepare_store, copy the whole chunks out of the
engine's slots (into the daemon's segment, or pickled), commit_store."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from . import wire
from .errors import DaemonTimeout, ProtocolError
from .gpu_transfer import on_cuda
from .kv_copy import gather_chunks
from .kv_layout import KVPool, check_slots
from .safe_decode import dump_tensor_list
from .store import Store


class StoreCalls:
    """Mixed into `LMCacheMPConnector` (its `_call`, `key`, `writer`, mapping and GPU path)."""

    def store_from(
        self,
        token_ids: Sequence[int],
        request_id: str,
        pool: KVPool,
        slots: torch.Tensor,
        *,
        timeout_s: float,
        cache_salt: str = "",
        on_owed: Callable[[Store], None] | None = None,
    ) -> bool:
        """STORE the whole chunks of `token_ids`, whose KV sits in `slots`. A rank that is not
        the writer (`writer` False: TP-replicated MLA, where rank 0 stores the one copy)
        answers True without calling the daemon.

        Shared memory: a prepare_store that timed out may still reserve slots, write-locked
        until a commit publishes what they hold. Before raising, the store keeps a host copy
        of its chunks for `on_owed`'s `Store`, whose `complete` writes it there and commits
        (no `on_owed`: left to the daemon's write TTL). Slots whose copy raised are never
        committed: their garbage would be published under the real keys."""
        deadline = time.monotonic() + timeout_s
        end = self.aligned(len(token_ids))
        if end == 0 or not self.writer:
            return True
        slots = check_slots(self.layout, slots[:end], end, pool_size=pool.num_slots)
        self._check_pickle_size(end)
        key = self.key(token_ids, request_id, end=end, cache_salt=cache_salt)
        left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
        if self.transfer != "shm":
            # No prepare_store: lmcache 0.5.6's pickle one reserves nothing, and a daemon
            # with a pool reserves its slots, which the pickled commit then cannot write.
            data = dump_tensor_list(self._host_chunks(pool, slots, end))
            return bool(self._call("commit_store", [key, self.instance_id, data], left(),
                                   request_id=request_id))
        epoch = self.epoch  # the mapping must be the one of the daemon that answers
        late = Store(epoch, key)
        try:
            prep = self._call("prepare_store", [key, self.instance_id], timeout_s,
                              request_id=request_id, on_late=late.answered)
        except DaemonTimeout:
            if on_owed is not None:  # else no copy outlives the raise
                late.kept, late.finish = self._host_chunks(pool, slots, end), self._finish_late
                on_owed(late)
            raise
        ctx = prep.context if prep is not None else wire.ShmContext()
        if not ctx.slots:
            return True  # every chunk is cached already
        views = self._reserved(ctx, epoch)
        if on_cuda(pool):
            self._gpu_for(pool).store(self.layout, pool, slots, list(ctx.chunk_indices),
                                      out=views)
        else:
            gather_chunks(self.layout, pool.k_buffer, pool.v_buffer, slots,
                          out=views, chunk_indices=list(ctx.chunk_indices))
        del views
        return bool(self._call("commit_store", [key, self.instance_id, b""], left(),
                               request_id=request_id))

    def _reserved(self, ctx: wire.ShmContext, epoch: int) -> list[torch.Tensor]:
        """Views of the shared-memory slots a prepare_store (of daemon `epoch`) reserved, in
        the order of its chunk indices."""
        if len(ctx.slots) != len(ctx.chunk_indices):
            raise ProtocolError("prepare_store: slots and chunk_indices differ in length")
        shm = self._mapping(epoch)
        return [shm.view(s, self.layout) for s in ctx.slots]

    def _host_chunks(self, pool: KVPool, slots: torch.Tensor, end: int) -> list[torch.Tensor]:
        """Host copies of the chunks of tokens [0, end) in `slots`."""
        if on_cuda(pool):  # our own host copies: the pinned staging went back to the ring
            return self._gpu_for(pool).store(self.layout, pool, slots,
                                             range(end // self.chunk_size), out=None)
        return gather_chunks(self.layout, pool.k_buffer, pool.v_buffer, slots)

    def _finish_late(self, late: Store, ctx: wire.ShmContext, timeout_s: float) -> None:
        """Write what `late` kept into the slots its late prepare_store reserved, then commit
        them: the reservation ends with the bytes it was made for."""
        for view, i in zip(self._reserved(ctx, late.epoch), ctx.chunk_indices):
            view.copy_(late.kept[i])
        # Answered, it is settled: False only says the reservation was gone (its TTL).
        self._call("commit_store", [late.key, self.instance_id, b""], timeout_s,
                   request_id=late.key.request_id)
