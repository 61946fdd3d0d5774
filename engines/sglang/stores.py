"""The STORE side of LoadBackRadixCache: a finished request's whole chunks go to the daemon
on the StoreWorker, their tree node locked until the scheduler thread sees the store done.
A mixin only because SGLang calls these methods on the cache object itself."""

from __future__ import annotations

import logging
import time
from array import array

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from .promises import Promise, StoreJob

log = logging.getLogger("loadback.hook")


class StoreHooks:
    """Mixed into LoadBackRadixCache ahead of RadixCache (so `super()` is the radix tree)."""

    def cache_finished_req(self, req, is_insert: bool = True, **kwargs) -> None:
        """0.5.20: insert into the tree, STORE the whole chunks, end the daemon session."""
        super().cache_finished_req(req, is_insert=is_insert, **kwargs)
        self._finish(req, store=is_insert and not self.disable, limit=None)

    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        """0.5.23: a finished request's checkpoint STOREs its whole chunks."""
        super().checkpoint(req, up_to=up_to, **kwargs)
        if req.finished() and not self.disable:
            self._store(req, limit=up_to)

    def _finish(self, req, *, store: bool, limit: int | None) -> None:
        if store:
            self._store(req, limit=limit)
        self._drop(self._handle(req), abort=False)

    def _store(self, req, *, limit: int | None) -> None:
        try:
            handle = self._handle(req)
            p = self._promises.get(handle)
            if p is None:
                p = self._promises[handle] = Promise(
                    self._next_id(handle), array("q"), "", 0)
            committed = getattr(req.kv, "kv_committed_len", None) if hasattr(req, "kv") else None
            ids = list(req.origin_input_ids) + list(req.output_ids)
            if committed is None:
                committed = len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
            if limit is not None:
                committed = min(committed, limit)
            ids = ids[:committed]
            if len(ids) < self.chunk_size:
                return
            # The tree's own slots for this prefix: they outlive the request's row.
            key = RadixKey(array("q", ids), req.extra_key, cache_salt=req.cache_salt)
            base = super().match_prefix(MatchPrefixParams(key=key))
            slots = self.shim.path_indices(self, base)
            n = len(slots) // self.chunk_size * self.chunk_size
            if n == 0 or handle in self._stores:
                return
            if not self._store_worker.has_room(p.request_id):
                return  # the store queue is full: skipped (counted), its node never locked
            # The node stays locked (its slots unevictable) until the store went through.
            node = base.last_device_node
            taken = self.inc_lock_ref(node)
            job = StoreJob(handle, p.request_id, ids[:n], slots[:n].clone(),
                           self._salt(req.extra_key, req.cache_salt), node,
                           taken.to_dec_params() if hasattr(taken, "to_dec_params") else None)
            self._stores[handle] = job
            self._store_worker.submit(job)
        except Exception:  # a failed store is counted by the orchestrator; never raised
            log.exception("store for %s failed", req.rid)

    def _drain_stores(self, *, safe_point: bool = False) -> None:
        """Scheduler thread: unlock the nodes of stores that went through. With TP > 1 only
        at the scheduler's safe point (`check_hicache_events`, every rank at once), and only
        as many as every rank finished (the ranks' trees stay alike: same evictable nodes,
        same match lengths)."""
        worker = self._store_worker
        if worker is not None:
            worker.ensure_alive()
        if worker is None:
            return
        ready = worker.completed.qsize()
        if self._tp_size > 1:
            if not safe_point:
                return
            ready = self._agree_pass(ready)
        for job in worker.drain(ready):
            if self._stores.get(job.handle) is job:
                del self._stores[job.handle]
            if job.node is not None:
                if job.receipt is None:
                    self.dec_lock_ref(job.node)
                else:
                    self.dec_lock_ref(job.node, job.receipt)
                job.node = None

    def _agree_pass(self, ready: int) -> int:
        """TP > 1, at the scheduler's safe point: one all-reduce per pass, every rank. Every
        rank submitted the same stores in the same order, so the first min(ready) finished
        stores are the same requests on every rank; and a reload every rank has read is
        adopted here, at the same pass on each (orchestrator.tp_reload)."""
        watcher = self.config_watcher
        agreement = watcher.agreement if watcher is not None else None
        offer = agreement.offered() if agreement is not None else 0
        ready, lowest, neg_highest = self.orch.tp.min_each([ready, offer, -offer])
        if agreement is not None:
            config = agreement.settle(lowest, -neg_highest)
            if config is not None:
                self._config_reloaded(config)
        return ready

    def _wait_stores(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        if self._tp_size > 1 and self._store_worker is not None:
            # This rank's own stores first, then one drain the ranks agree on.
            while self._store_worker.completed.qsize() < len(self._stores) \
                    and time.monotonic() < deadline:
                time.sleep(0.005)
            self._drain_stores(safe_point=True)
            return
        self._drain_stores()
        while self._stores and time.monotonic() < deadline:
            time.sleep(0.005)
            self._drain_stores()
