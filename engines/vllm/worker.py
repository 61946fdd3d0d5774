"""The worker side (vLLM's Worker process): the paged KV view, loads before the forward, stores
after it, load errors reported in the pass they happened (docs/vllm.md, "Worker side",
"Stores").
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import msgspec
import torch

from lmcache_loadback.orchestrator.threads import WorkerThread
from lmcache_loadback.orchestrator.factory import create_orchestrator
from lmcache_loadback.orchestrator.states import DegradeReason

from .meta import LoadBackMeta, LoadOp, StoreOp
from .paged import PagedCPUView, ordered_layers
from .paged_cuda import PagedCUDAView, paged_view
from .settings import Settings, store_tokens_for

log = logging.getLogger("loadback.vllm")


class WorkerSide:
    def __init__(self, settings: Settings, layer_names: Sequence[str]) -> None:
        self.settings = settings
        self.layer_names = list(layer_names)
        self.view: PagedCPUView | PagedCUDAView | None = None
        self.orch = None
        self._errors: set[int] = set()
        self.loads_failed = 0
        self.loads_done = 0
        self.stores_done = 0
        self.stores_skipped = 0
        self._stores: StoreThread | None = None

    def worker_config(self):
        """The scheduler decided whether a hit is worth loading: this side loads any hit."""
        cfg = self.settings.config
        return msgspec.structs.replace(cfg, break_even=msgspec.structs.replace(
            cfg.break_even, min_tokens=0, prefill_tokens_per_s=0.0))

    def register(self, kv_caches: dict[str, torch.Tensor], *, tp_group=None, rank: int = 0,
                 orchestrator=None) -> None:
        """`tp_group`/`rank`: vLLM's TP group (its CPU/gloo group) and this worker's rank in
        it, when --tensor-parallel-size > 1: each rank is a KV rank holding its heads. CUDA
        layers get a `PagedCUDAView` (loads straight into vLLM's blocks through the core's
        CUDA path, a store region sized by the free GPU memory), CPU layers a
        `PagedCPUView`."""
        s = self.settings
        layers = ordered_layers(kv_caches, self.layer_names)
        store = None
        if layers and layers[0].device.type == "cuda":  # outside vLLM's memory budget
            store = store_tokens_for(s, torch.cuda.mem_get_info(layers[0].device)[0],
                                     str(layers[0].device))
        self.view = paged_view(layers, s.layout, s.block_size, s.staging_tokens, store)
        self.orch = orchestrator or create_orchestrator(
            self.worker_config(), layout=s.layout, kv_pool=self.view.pool,
            tp_group=tp_group if s.tp_size > 1 else None, kv_rank=rank, world_size=s.tp_size,
            engine_model=s.model)
        self._stores = StoreThread(self)
        log.info("loadback: vLLM worker registered %d KV layers (%d blocks of %d tokens, "
                 "%d heads x %d, %s), daemon %s, chunk %d, staging %d tokens", s.layout.num_layers,
                 self.view.num_blocks, s.block_size, s.layout.num_heads, s.layout.head_dim,
                 s.layout.dtype_str, s.config.endpoint, s.chunk_size, s.staging_tokens)

    # ------------------------------------------------------------------ loads

    def start_load(self, meta: LoadBackMeta) -> set[str]:
        """Every load of this step, one after another; the request ids that failed. Under TP
        every rank gets the same metadata and runs its loads in this same order, so the core's
        collectives (the leader's LOOKUP shared with all ranks, one load decision) line up."""
        failed: set[str] = set()
        for rid, op in meta.loads.items():
            if not self._load(op):
                failed.add(rid)
                self.loads_failed += 1
                self._errors.update(op.block_ids)
            else:
                self.loads_done += 1
        return failed

    def _load(self, op: LoadOp) -> bool:
        n = op.end - op.start
        if not op.promised or op.locked is None or self.orch is None or self.view is None:
            return False  # nothing on the daemon backs it (logged by the scheduler side)
        try:
            # The scheduler's LOOKUP is the request's only one: load under its session, and
            # release what it locked here whatever happens (finish, below).
            self.orch.handoff.adopt(op.session, op.token_ids, local_hit_tokens=op.start,
                                    hit_tokens=op.end, locked=op.locked,
                                    cache_salt=op.cache_salt)
            if n > self.view.staging_tokens or len(op.block_ids) * self.settings.block_size != n:
                log.warning("%s: load of tokens [%d, %d) into %d blocks cannot be served; "
                            "reported as a load error", op.session, op.start, op.end,
                            len(op.block_ids))
                self.orch.load_back(op.session, None, decline=DegradeReason.ALLOC_FAILED)
                return False
            # counted loaded only once the staged bytes are in vLLM's blocks
            res = self.orch.load_back(
                op.session, self.view.load_slots(op.block_ids, n),
                land=lambda got: self.view.to_blocks(op.block_ids, n, ready=got.ready))
            if res.loaded_tokens != n:
                log.info("%s: load failed (%s); load error, recomputed", op.session,
                         res.reason.value if res.reason else res.state)
                return False
            return True
        except Exception:  # noqa: BLE001 - a load error, never an engine crash
            log.exception("%s: load failed; load error, recomputed", op.session)
            return False
        finally:
            self._finish(op.session)

    def take_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    # ----------------------------------------------------------------- stores

    def save(self, meta: LoadBackMeta, skip: set[str]) -> None:
        """Stage this step's stores and hand them to the store thread; never waits on it."""
        ops = [op for rid, op in meta.stores.items() if rid not in skip]
        if not ops or self.orch is None or self.view is None:
            return
        if self._stores.busy:  # the previous batch is still being stored
            self._skip(len(ops), "the previous stores are still running")
            return
        batch, base = [], self.view.store_base
        end = base + self.view.store_tokens
        for op in ops:
            n = len(op.token_ids)
            if base + n > end:
                self._skip(1, "the staging store region is full this step")
                continue
            try:
                self.view.from_blocks(op.block_ids, n, base)
            except Exception:  # noqa: BLE001 - a lost store is a future miss, never a crash
                log.exception("%s: store not staged", op.session)
                continue
            batch.append((op, base))
            base += n
        if batch:
            self.orch.metrics.queue_depth("store", len(batch))
            self._stores.submit(batch)

    def _skip(self, n: int, why: str) -> None:
        self.stores_skipped += n
        for _ in range(n):
            self.orch.metrics.store_skipped()
        log.debug("%d store(s) skipped: %s", n, why)

    def drain(self, timeout_s: float) -> bool:
        """Wait until the handed-over stores are done (tests; shutdown)."""
        return self._stores is None or self._stores.idle.wait(timeout_s)

    def _store_batch(self, batch: list[tuple[StoreOp, int]]) -> None:
        """The store thread: each staged store; the stores a failure outside `_store` kept
        it from reaching are counted skipped (the thread is then replaced: StoreThread)."""
        done = 0
        try:
            for op, base in batch:
                self._store(op, base)
                done += 1
                self.orch.metrics.queue_depth("store", len(batch) - done)
        finally:
            if done < len(batch):
                self._skip(len(batch) - done, "the store thread failed before them")

    def _store(self, op: StoreOp, base: int) -> bool:
        n = len(op.token_ids)
        try:
            ok = self.orch.store(op.session, op.token_ids, self.view.slots(n, base),
                                 cache_salt=op.cache_salt, pool=self.view.store_pool)
            self.stores_done += int(ok)
            return ok
        except Exception:  # noqa: BLE001 - a lost store is a future miss, never a crash
            log.exception("%s: store failed", op.session)
            return False
        finally:
            self._finish(op.session)

    def _finish(self, session: str) -> None:
        try:
            self.orch.finish(session)
        except Exception:  # noqa: BLE001
            log.exception("%s: finish failed", session)

    def close(self) -> None:
        if self._stores is not None:
            self.drain(self.settings.config.deadlines.store_ms / 1000 + 1.0)
            self._stores.close()
        if self.orch is not None:
            self.orch.close()


class StoreThread(WorkerThread):
    """`loadback-vllm-store`: stores one staged batch at a time off the forward loop. The
    forward loop (`save`) submits and reads `busy`; this thread runs `_serve`. One that died
    is replaced, counted and logged where the next batch is submitted (WorkerThread)."""

    name = "loadback-vllm-store"
    queue = "store"

    def __init__(self, side: WorkerSide) -> None:
        self._side = side
        self.idle = threading.Event()  # no batch is held: the store region may be reused
        self.idle.set()
        super().__init__(side.orch, max_queued=1)

    @property
    def busy(self) -> bool:
        return not self.idle.is_set()

    def submit(self, batch: list[tuple[StoreOp, int]]) -> None:
        self.idle.clear()
        self._queue(batch)

    def _export_depth(self) -> None:
        pass  # WorkerSide exports the stores of the batch left, not batches

    def _serve(self, batch: list[tuple[StoreOp, int]]) -> None:
        try:
            self._side._store_batch(batch)
        finally:
            self._completed()
            self.idle.set()
