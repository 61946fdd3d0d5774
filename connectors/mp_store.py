"""The STORE side of the daemon client: prepare_store, copy the whole chunks out of the
engine's slots (into the daemon's segment, or pickled), commit_store."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from . import wire
from .errors import ProtocolError
from .gpu_transfer import on_cuda
from .kv_layout import KVPool, check_slots, gather_chunks
from .safe_decode import dump_tensor_list


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
    ) -> bool:
        """STORE the whole chunks of `token_ids`, whose KV sits in `slots`. A rank that is not
        the writer (`writer` False: TP-replicated MLA, where rank 0 stores the one copy)
        answers True without calling the daemon."""
        deadline = time.monotonic() + timeout_s
        end = self.aligned(len(token_ids))
        if end == 0 or not self.writer:
            return True
        slots = check_slots(self.layout, slots[:end], end, pool_size=pool.num_slots)
        self._check_pickle_size(end)
        key = self.key(token_ids, request_id, end=end, cache_salt=cache_salt)
        epoch = self.epoch  # the mapping must be the one of the daemon that answers
        prep = self._call("prepare_store", [key, self.instance_id], timeout_s,
                          request_id=request_id)
        left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
        if self.transfer == "shm":
            ctx = prep.context if prep is not None else wire.ShmContext()
            if not ctx.slots:
                return True  # every chunk is cached already
            if len(ctx.slots) != len(ctx.chunk_indices):
                raise ProtocolError("prepare_store: slots and chunk_indices differ in length")
            shm = self._mapping(epoch)
            views = [shm.view(s, self.layout) for s in ctx.slots]
            if on_cuda(pool):
                self._gpu_for(pool).store(self.layout, pool, slots, list(ctx.chunk_indices),
                                          out=views)
            else:
                gather_chunks(self.layout, pool.k_buffer, pool.v_buffer, slots,
                              out=views, chunk_indices=list(ctx.chunk_indices))
            del views
            return bool(self._call("commit_store", [key, self.instance_id, b""], left(),
                                   request_id=request_id))
        if on_cuda(pool):  # our own host copies: the pinned staging went back to the ring
            chunks = self._gpu_for(pool).store(self.layout, pool, slots,
                                               range(end // self.chunk_size), out=None)
        else:
            chunks = gather_chunks(self.layout, pool.k_buffer, pool.v_buffer, slots)
        data = dump_tensor_list(chunks)
        return bool(self._call("commit_store", [key, self.instance_id, data], left(),
                               request_id=request_id))
