"""LoadBackRadixCache: SGLang's RadixCache with this product's two-phase load-back, called by
SGLang's scheduler thread (0.5.20: LOOKUP in `match_prefix`; 0.5.23: on the core's
AsyncLookups from `prefetch_from_storage`, polled, never waited for). Never: a daemon
failure's exception in the scheduler, a wait past a deadline, a slot or tree lock leaked, a
promise answered stale.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import deque
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from lmcache_loadback.orchestrator.lookups import AsyncLookups, Lookup
from lmcache_loadback.orchestrator.states import DegradeReason

from . import compat, pools
from .contract import Orchestrator
from .prefetch import PrefetchHooks
from .promises import Promise, StoreJob, StoreWorker
from .stores import StoreHooks

log = logging.getLogger("loadback.hook")


class LoadBackRadixCache(PrefetchHooks, StoreHooks, RadixCache):
    """RadixCache + fault-tolerant load-back from an LMCache daemon."""

    def __init__(self, params, *, config, tp_size: int = 1, tp_rank: int = 0,
                 tp_group=None, orchestrator: Orchestrator | None = None,
                 async_lookups: bool | None = None, config_path=None,
                 dp_rank: int = 0, engine_model: str | None = None) -> None:
        """`config_path`: the YAML `config` came from; watched on the orchestrator's
        heartbeat, and a valid change applied live to the orchestrator and to `self.config`
        (orchestrator.reload.ConfigWatcher). `dp_rank`: the data-parallel replica (its
        metrics port). `engine_model`: SGLang's --model-path, the cache's model name unless the
        YAML sets one."""
        self._tp_size = tp_size
        self._promises: dict[Any, Promise] = {}
        self._lookups: dict[Any, Lookup] = {}
        self._stores: dict[Any, StoreJob] = {}
        self._store_worker: StoreWorker | None = None
        # A pool this backend cannot move byte-exact is refused here, at start-up.
        pools.pool_kind(params.token_to_kv_pool_allocator.get_kvcache())
        super().__init__(params)
        self.config = config
        chunk = config.chunk_size
        if chunk % self.page_size:
            raise ValueError(
                f"chunk_size {chunk} (the --lmcache-config-file YAML, = the daemon's "
                f"--chunk-size) must be a multiple of --page-size {self.page_size}: loads and "
                "stores move whole pages; change one of them")
        self.shim = compat.detect(self.device)
        self.chunk_size = chunk
        self.kvcache = self.token_to_kv_pool_allocator.get_kvcache()
        if orchestrator is None:
            orchestrator = self._build_orchestrator(config, tp_size, tp_rank, tp_group,
                                                    dp_rank, engine_model)
        self.orch: Orchestrator = orchestrator
        self.config_watcher = None
        if config_path is not None:
            from lmcache_loadback.orchestrator.reload import ConfigWatcher

            self.config_watcher = ConfigWatcher(self.orch, config_path,
                                                on_apply=self._config_reloaded)
            self.orch.on_tick(self.config_watcher.check)
        # With TP > 1 every rank's collectives must come from one thread in one order, so the
        # LOOKUP runs on the scheduler thread (bounded by deadlines.lookup_ms).
        if async_lookups is None:
            async_lookups = self.shim.prefix_len_api and tp_size == 1
        self._worker = AsyncLookups(self.orch, threads=config.sglang.lookup_threads) \
            if async_lookups else None
        self._store_worker = StoreWorker(self.orch)
        self._ids = 0
        self._id_lock = threading.Lock()
        #: Seconds the scheduler thread spent in calls that may reach the daemon (recent ones).
        self.daemon_wait_s: deque[float] = deque(maxlen=4096)

    # ------------------------------------------------------------ construction

    @classmethod
    def from_build_context(cls, ctx) -> "LoadBackRadixCache":
        from lmcache_loadback.orchestrator.config import LoadBackConfig

        # The model first: a hybrid or unknown pool is refused in one line, whatever else.
        pools.check_build_context(ctx, ctx.params.token_to_kv_pool_allocator.get_kvcache())
        path = getattr(ctx.server_args, "lmcache_config_file", None)
        if not path:
            from sglang.srt.runtime_context import get_memory

            path = getattr(get_memory(), "lmcache_config_file", None)
        if not path:
            raise ValueError(
                "--radix-cache-backend loadback needs --lmcache-config-file FILE (this "
                "product's YAML, or an LMCache MP YAML with mp_host/mp_port)")
        config = LoadBackConfig.from_yaml(path)
        compat.check_version(compat.sglang_version(), allowed=compat.allow_untested(config))
        group = ctx.tp_group
        group = getattr(group, "cpu_group", group) if ctx.tp_size > 1 else None
        return cls(ctx.params, config=config, tp_size=ctx.tp_size, tp_rank=ctx.tp_rank,
                   tp_group=group, config_path=path, dp_rank=compat.dp_rank(),
                   engine_model=getattr(ctx.server_args, "model_path", None))

    def _config_reloaded(self, config) -> None:
        """The watcher applied a changed file to the orchestrator: the backend's own copy
        follows (its store deadline, ...). Runs on the heartbeat thread."""
        self.config = config

    def _build_orchestrator(self, config, tp_size, tp_rank, tp_group, dp_rank, engine_model):
        from lmcache_loadback.orchestrator.factory import create_orchestrator

        chunk = config.ip.chunk_size if config.mode == "ip" else config.chunk_size
        # MHA: per-layer K and V; MLA: the latent buffers (TP-replicated: one writer, every
        # rank reads; the factory gives the daemon that geometry).
        layout, kv_pool = pools.layout_and_pool(self.kvcache, chunk)
        # Never waits on the daemon: registration happens on the orchestrator's heartbeat.
        # Every scheduler process its own metrics port: DP replicas each hold TP ranks from 0.
        return create_orchestrator(config, layout=layout, kv_pool=kv_pool,
                                   tp_group=tp_group, kv_rank=tp_rank, world_size=tp_size,
                                   metrics_offset=dp_rank * tp_size + tp_rank,
                                   engine_model=engine_model)

    def close(self) -> None:
        if self._worker is not None:
            for job in self._lookups.values():
                self._worker.abandon(job)  # queued LOOKUPs are not sent
            self._worker.close()
            self._worker = None
        if self._store_worker is not None:
            self._store_worker.close(self.config.deadlines.store_ms / 1000 + 1)
            self._drain_stores()
            self._store_worker = None
        self.orch.close()

    shutdown = close

    def release_host_resources(self) -> None:
        self.close()

    def reset(self) -> None:
        # A store in flight still reads its slots: let it finish (bounded) before the pool
        # and tree are rebuilt; a store that outlives that no longer owns a tree lock.
        self._wait_stores(self.config.deadlines.store_ms / 1000 + 1 if self._stores else 0)
        for job in self._stores.values():
            job.node = None
        super().reset()
        for handle in list(self._promises) + list(self._lookups):
            self._drop(handle, abort=True)
        self._stores.clear()

    def evict(self, params):
        self._drain_stores()
        return super().evict(params)

    # ---------------------------------------------------------------- helpers

    def _next_id(self, handle) -> str:
        with self._id_lock:
            self._ids += 1
            n = self._ids
        rid, attempt = getattr(handle, "rid", handle), getattr(handle, "attempt_id", 0)
        return f"{rid}#{attempt}.{n}"

    @staticmethod
    def _handle(req):
        return getattr(req, "cache_request_handle", None) or req.rid

    @staticmethod
    def _salt(extra_key, cache_salt) -> str:
        # Both namespace the tree, so both namespace the daemon's keys.
        if not extra_key and not cache_salt:
            return ""
        return f"{extra_key or ''}\x1f{cache_salt or ''}"

    def _timed(self, fn, *args, **kwargs):
        """Run a call that may wait on the daemon, timing the scheduler thread's wait
        (`daemon_wait_s`, and `loadback_scheduler_wait_seconds` in the metrics)."""
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            waited = time.perf_counter() - start
            self.daemon_wait_s.append(waited)
            if self.orch.metrics is not None:
                self.orch.metrics.observe_scheduler_wait(waited)

    def _path_len(self, node) -> int:
        n = 0
        while node is not None and node is not self.root_node:
            n += len(node.key)
            node = node.parent
        return n

    def _drop(self, handle, *, abort: bool) -> Promise | None:
        p = self._promises.pop(handle, None)
        job = self._stores.get(handle)
        if job is not None and self._store_worker.finish_after(job):
            return p  # the session ends behind the store in flight
        lookup = self._lookups.pop(handle, None)
        if lookup is not None:
            if not self._worker.abandon(lookup):
                return p  # the worker releases a LOOKUP still in flight itself
            p = p or lookup.record
        if p is not None:
            try:
                (self.orch.abort if abort else self.orch.finish)(p.request_id)
            except Exception:
                log.exception("releasing %s failed", p.request_id)
        return p

    # ------------------------------------------------------------ match_prefix

    def match_prefix(self, params: MatchPrefixParams):
        self._drain_stores()
        base = super().match_prefix(params)
        req, key = params.req, params.key
        if req is None or self.disable or not key or key.is_bigram:
            return base
        key = key.page_aligned(self.page_size)
        if len(key) == 0:
            return base
        try:
            tokens = self._promise_for(req, key, self.shim.device_len(base))
        except Exception:  # never into the scheduler: recompute instead
            log.exception("match_prefix for %s failed; recomputing", req.rid)
            tokens = 0
        return self.shim.with_host_hit(base, tokens) if tokens > 0 else base

    def _promise_for(self, req, key, device_len: int) -> int:
        handle = self._handle(req)
        ids = key.raw_token_ids()[: len(key)]
        salt = self._salt(key.extra_key, key.cache_salt)
        job = self._lookups.get(handle)
        if job is not None:  # 0.5.23: answered (or timed out) in check_prefetch_progress
            tokens = self._worker.answer(job)
            if tokens is None:
                return 0
            self._lookups.pop(handle)
            job.record.tokens = tokens
            self._promises[handle] = job.record
            self._checked(handle, job.record)
        p = self._promises.get(handle)
        if p is None:
            self._drop_other_attempts(handle)
        same_key = p is not None and p.salt == salt and p.token_ids == array("q", ids)
        if p is not None and not same_key:
            self._drop(handle, abort=True)  # the key changed: this promise is void
            p = None
        if p is None:
            if self._worker is not None:
                return 0  # 0.5.23 looks up only from prefetch_from_storage
            return self._lookup_now(handle, key, ids, salt, device_len)
        if device_len == p.local_tokens or (p.tokens == 0 and device_len > p.local_tokens):
            return p.tokens
        return self._rederive(handle, p, key, device_len)

    def _drop_other_attempts(self, handle) -> None:
        """A retracted request comes back under a new attempt id: its old promise is void."""
        rid = getattr(handle, "rid", None)
        if rid is None:
            return
        for other in [h for h in list(self._promises) + list(self._lookups)
                      if h != handle and getattr(h, "rid", None) == rid]:
            self._drop(other, abort=True)

    def _lookup_now(self, handle, key, ids, salt: str, device_len: int) -> int:
        p = Promise(self._next_id(handle), array("q", ids), salt, device_len,
                     key=RadixKey(array("q", ids), key.extra_key, cache_salt=key.cache_salt))
        if len(ids) - device_len >= self.chunk_size:
            p.tokens = self._timed(self.orch.match, p.request_id, p.token_ids,
                                   local_hit_tokens=device_len, cache_salt=salt).tokens
        self._promises[handle] = p
        return self._checked(handle, p)

    def _checked(self, handle, p: Promise) -> int:
        # Whole pages inside the key, or nothing: anything else would corrupt the tree.
        if p.tokens and (p.tokens % self.page_size or
                         p.local_tokens + p.tokens > len(p.token_ids)):
            log.error("promise of %d tokens for %s is not whole pages of its key; recomputing",
                      p.tokens, p.request_id)
            self.orch.abort(p.request_id)
            p.tokens = 0
        return p.tokens

    def _rederive(self, handle, p: Promise, key, device_len: int) -> int:
        """The radix hit moved since the promise: void it and look up again (bounded)."""
        relookups = p.relookups + 1
        self._drop(handle, abort=True)
        if self._worker is not None or relookups > 3:
            # 0.5.23 must not block here, and a churning hit must not LOOKUP forever.
            q = Promise(self._next_id(handle), p.token_ids, p.salt, device_len,
                         relookups=relookups)
            self._promises[handle] = q
            return 0
        tokens = self._lookup_now(handle, key, p.token_ids, p.salt, device_len)
        self._promises[handle].relookups = relookups
        return tokens

    # ---------------------------------------------------------- init_load_back

    def init_load_back(self, params):
        node = params.best_match_node
        req = params.req
        if req is None:
            return self.shim.recompute(node)
        handle = self._handle(req)
        p = self._promises.get(handle)
        if p is None or p.tokens <= 0:
            return self.shim.recompute(node)
        try:
            return self._load(p, node, params.host_hit_length)
        except Exception:  # never into the scheduler: recompute instead
            log.exception("init_load_back for %s failed; recomputing", req.rid)
            self.orch.abort(p.request_id)
            p.tokens = 0
            return self.shim.recompute(node)

    def _load(self, p: Promise, node, host_hit_length: int):
        n, local = p.tokens, p.local_tokens
        new_key = p.key[local: local + n]
        if (host_hit_length != n or self._path_len(node) != local
                or new_key.child_key(self.page_size) in node.children):
            # The scheduler's view moved since the promise (or another load attached this
            # span first): loading now would not fit the tree. Declined through load_back,
            # which every TP rank joins whatever its own tree says.
            self._timed(self.orch.load_back, p.request_id, None, decline=DegradeReason.ABORTED)
            p.tokens = 0
            return self.shim.recompute(node)
        alloc = self.token_to_kv_pool_allocator
        if alloc.available_size() < n:
            self.evict(EvictParams(num_tokens=n))
        slots = alloc.alloc(n)
        if slots is None:
            self._timed(self.orch.load_back, p.request_id, None)  # degrades: alloc_failed
            p.tokens = 0
            return self.shim.recompute(node)
        try:
            result = self._timed(self.orch.load_back, p.request_id, slots)
        except BaseException:
            alloc.free(slots)
            raise
        p.tokens = 0
        if result.loaded_tokens != n:
            alloc.free(slots)
            return self.shim.recompute(node)
        p.loaded = n
        if result.ready is not None:
            # A GPU copy still in flight: the forward pass reads these slots after it.
            torch.cuda.current_stream().wait_event(result.ready)
        new_node = TreeNode(priority=node.priority)
        new_node.key = new_key
        new_node.value = slots.to(torch.int64)
        new_node.parent = node
        node.children[new_key.child_key(self.page_size)] = new_node
        self.evictable_size_ += n
        self._update_leaf_status(node)
        self._update_leaf_status(new_node)
        self.kv_events.record_store(node)
        self.kv_events.record_store(new_node)
        return self.shim.loaded(new_node.value, new_node)

    # ------------------------------------------------------ finish and abort

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self._drop(self._handle(req), abort=not checkpointed)

    def release_aborted_request(self, handle) -> None:
        """Aborted (either version): release the daemon's locks and session."""
        self._drop(handle, abort=True)
