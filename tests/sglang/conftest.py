"""Class-level tests of the `loadback` radix-cache backend on SGLang's real classes.

Run (each supported sglang has its own venv, built by the Makefile):

    PYTHONPATH=harness/sglang/stubs HF_HUB_OFFLINE=1 \
        .venv-sglang-0.5.20/bin/python -m pytest tests/sglang -m "not e2e" -q
    PYTHONPATH=harness/sglang/stubs HF_HUB_OFFLINE=1 \
        .venv-sglang-0.5.23/bin/python -m pytest tests/sglang -m "not e2e" -q

What is real: SGLang's ReqToTokenPool, MHATokenToKVPool, (Paged)TokenToKVPoolAllocator,
RadixCache, Req and its own `release_kv_cache`; the lmcache 0.5.6 daemon (a subprocess on a
free loopback port, stopped by PID). What `Sched` plays: the scheduler's calls, in its order
(prefetch/poll on 0.5.23, match_prefix, init_load_back, then the prefill that writes KV).
KV values are a function of (token, position, layer): a recomputed prefix and a loaded one
must be byte-identical.
"""

from __future__ import annotations

import os
import time
from array import array
from pathlib import Path

import pytest

from lmcache_loadback.connectors.telemetry import quiet_telemetry

quiet_telemetry()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import sglang  # noqa: E402  (a missing sglang fails the run: never a silent skip)
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from lmcache_loadback.harness.sglang.server import TINY_MODEL_DIR as MODEL_DIR  # noqa: E402
from lmcache_loadback.orchestrator.config import LoadBackConfig  # noqa: E402

CHUNK = 16
SGLANG_VERSION = sglang.__version__
NEW_API = tuple(int(x) for x in SGLANG_VERSION.split(".")[:3]) >= (0, 5, 21)

_published = False


def publish(page_size: int) -> None:
    global _published
    if not _published:
        runtime_context.publish(
            ServerArgs(model_path=str(MODEL_DIR), skip_tokenizer_init=True, device="cpu",
                       page_size=page_size), role="scheduler")
        _published = True


def page_sizes() -> list[int]:
    return [16] if NEW_API else [1, 16]


# `daemon` and `live_daemon` come from tests/conftest.py (same chunk size, admin API on).


def make_config(port: int, **over) -> LoadBackConfig:
    base = {
        "mp_port": port, "chunk_size": CHUNK,
        "deadlines": {"lookup_ms": 300, "retrieve_base_ms": 500, "retrieve_max_ms": 1000,
                      "control_ms": 300, "store_ms": 1000, "connect_ms": 200},
        "heartbeat": {"interval_ms": 100},
        "breaker": {"cooldown_ms": 100, "cooldown_max_ms": 200},
    }
    for k, v in over.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    return LoadBackConfig.from_dict(base)


def _planes(pool) -> tuple:
    """Per-layer buffers per plane: (K, V) of an MHA pool, (latent KV,) of an MLA pool."""
    return (pool.k_buffer, pool.v_buffer) if hasattr(pool, "k_buffer") else (pool.kv_buffer,)


def _values(buf, plane: int, layer: int, ids, start: int) -> torch.Tensor:
    pos = torch.arange(start, start + len(ids), dtype=torch.float32)
    tok = torch.tensor(list(ids), dtype=torch.float32)
    base = (tok * 0.013 + pos * 0.0007 + layer * 0.5)[:, None, None]
    grid = torch.arange(buf.shape[1] * buf.shape[2], dtype=torch.float32).view(
        1, buf.shape[1], buf.shape[2])
    wave = torch.sin(base + grid * 0.01) if plane == 0 else torch.cos(base - grid * 0.02)
    return wave.to(buf.dtype)


def fill(pool, slots: torch.Tensor, ids, start: int) -> None:
    """The KV a prefill computes: a function of (token, position, layer) (MHA: K and V; MLA:
    the latent KV)."""
    for plane, bufs in enumerate(_planes(pool)):
        for layer, buf in enumerate(bufs):
            buf[slots.long()] = _values(buf, plane, layer, ids, start)


def kv_matches(pool, slots: torch.Tensor, ids, start: int) -> bool:
    return all(torch.equal(buf[slots.long()], _values(buf, plane, layer, ids, start))
               for plane, bufs in enumerate(_planes(pool)) for layer, buf in enumerate(bufs))


def load_outcome(pool, got: dict, ids, took_s: float) -> dict:
    """One admit as a TP rank reports it: the hit, what loaded, byte-exact, how long."""
    dev, n = got["device"], got["loaded"]
    return {"host_hit": got["host_hit"], "loaded": n,
            "exact": bool(n) and kv_matches(pool, got["loaded_slots"], ids[dev:dev + n], dev),
            "took_s": took_s}


class Sched:
    """Plays SGLang's scheduler against one cache: the calls, in the scheduler's order."""

    def __init__(self, cache, *, poll_limit_s: float = 5.0) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self.cache = cache
        self.MatchPrefixParams, self.InitLoadBackParams, self.RadixKey = (
            MatchPrefixParams, InitLoadBackParams, RadixKey)
        self.poll_limit_s = poll_limit_s
        self.pool = cache.token_to_kv_pool_allocator.get_kvcache()
        self.calls: list[tuple[str, float]] = []   # (method, seconds) on the "scheduler thread"

    def _t(self, name, fn, *a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            self.calls.append((name, time.perf_counter() - t0))

    def new_req(self, rid: str, ids, *, extra_key=None, cache_salt=None):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array("q", ids), SamplingParams(max_new_tokens=1))
        if extra_key is not None:
            req.extra_key = extra_key
        if cache_salt is not None:
            req.cache_salt = cache_salt
        return req

    def key(self, req):
        return self.RadixKey(array("q", req.origin_input_ids), req.extra_key,
                             cache_salt=req.cache_salt)

    def prefetch(self, req) -> None:
        """0.5.23: `_prefetch_kvcache` at queueing, then poll until ready (bounded)."""
        if not NEW_API:
            return
        base = self.cache.match_prefix(self.MatchPrefixParams(key=self.key(req)))
        local = self.cache.shim.device_len(base)
        ids = list(req.origin_input_ids)
        self._t("prefetch_from_storage", self.cache.prefetch_from_storage,
                req.cache_request_handle, base.last_device_node, ids[local:],
                matched_prefix_tokens=ids[:local], extra_key=req.extra_key,
                cache_salt=req.cache_salt)

    def poll(self, req) -> int:
        """Passes until check_prefetch_progress says ready (0.5.23); 0 on 0.5.20."""
        if not NEW_API:
            return 0
        passes, limit = 0, time.monotonic() + self.poll_limit_s
        while not self._t("check_prefetch_progress", self.cache.check_prefetch_progress,
                          req.cache_request_handle):
            passes += 1
            assert time.monotonic() < limit, "check_prefetch_progress never became ready"
            time.sleep(0.002)  # the scheduler's next pass
        return passes

    def match(self, req):
        return self._t("match_prefix", self.cache.match_prefix,
                       self.MatchPrefixParams(key=self.key(req), req=req))

    def admit(self, req, *, prefetch: bool = True) -> dict:
        """Queue (0.5.23 prefetch), match, load back, prefill the rest; returns what happened."""
        if prefetch:
            self.prefetch(req)
        self.poll(req)
        res = self.match(req)
        cache = self.cache
        device_len = cache.shim.device_len(res)
        prefix = cache.shim.path_indices(cache, res)[:device_len]
        node = res.last_device_node
        loaded_slots = torch.empty((0,), dtype=torch.int64)
        if res.host_hit_length > 0:
            lock = cache.inc_lock_ref(node)  # the scheduler's _lock_node around the load
            try:
                answer = self._t("init_load_back", cache.init_load_back, self.InitLoadBackParams(
                    best_match_node=res.best_match_node, host_hit_length=res.host_hit_length,
                    req=req))
            finally:
                cache.dec_lock_ref(node, lock.to_dec_params() if hasattr(lock, "to_dec_params") else None)
            got, new_node = answer
            n = int(got) if isinstance(got, int) else len(got)
            assert n in (0, res.host_hit_length), "a partial load reached the scheduler"
            if n:
                node = new_node
                loaded_slots = cache.path_device_indices(node)[device_len:device_len + n] \
                    if NEW_API else got
        prefix = torch.cat([prefix.to(torch.int64), loaded_slots.to(torch.int64)])
        ids = list(req.origin_input_ids)
        rest = len(ids) - len(prefix)
        alloc = cache.token_to_kv_pool_allocator
        new = alloc.alloc(-(-rest // cache.page_size) * cache.page_size)
        assert new is not None, "test pool too small"
        new = new[:rest] if rest else new[:0]
        fill(self.pool, new, ids[len(prefix):], len(prefix))
        row = cache.req_to_token_pool.alloc([req])
        assert row is not None
        req.kv.req_pool_idx = row[0] if isinstance(row, list) else row
        cache.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, len(ids))),
                                      torch.cat([prefix, new.to(torch.int64)]).to(torch.int32))
        req.kv.kv_committed_len = req.kv.kv_allocated_len = len(ids)
        req.kv.cache_protected_len = len(prefix)
        req.last_node = node
        if NEW_API:
            req.prefix_len = len(prefix)
            req.lock = cache.lock(node)
        else:
            req.prefix_indices = prefix
            cache.inc_lock_ref(node)
        return {"device": device_len, "host_hit": res.host_hit_length,
                "loaded": len(loaded_slots), "loaded_slots": loaded_slots, "prefix": prefix}

    def finish(self, req) -> None:
        """The request finished (one output token never computed): SGLang's release_kv_cache."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.common import release_kv_cache

        req.finished_reason = FINISH_LENGTH(length=0)
        t0 = time.perf_counter()
        if NEW_API:
            release_kv_cache(req, self.cache, checkpoint=True)
        else:
            release_kv_cache(req, self.cache)
        self.calls.append(("finish", time.perf_counter() - t0))
        self.settle()

    def settle(self, limit_s: float = 10.0) -> None:
        """Scheduler passes until the cache has nothing in flight (the STORE runs off the
        scheduler thread; its tree lock is dropped at a pass)."""
        limit = time.monotonic() + limit_s
        while True:
            self._t("check_hicache_events", self.cache.check_hicache_events)
            if not self.cache.has_pending_cache_operations():
                return
            assert time.monotonic() < limit, "cache operations still pending"
            time.sleep(0.002)

    def abort(self, req) -> None:
        self._t("release_aborted_request", self.cache.release_aborted_request,
                req.cache_request_handle)

    def flush(self) -> None:
        """Evict the whole device tree (what /flush_cache or memory pressure does)."""
        self.cache.evict(_evict_params(self.cache.total_size() + 10 ** 6))


def _evict_params(n: int):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    return EvictParams(num_tokens=n)


def pool_conserved(cache) -> None:
    """SGLang's idle pool invariant: available + evictable + protected == total."""
    alloc = cache.token_to_kv_pool_allocator
    total = alloc.available_size() + cache.evictable_size() + cache.protected_size()
    assert total == alloc.size, (alloc.available_size(), cache.evictable_size(),
                                 cache.protected_size(), alloc.size)


def tree_consistent(cache, *, idle: bool = False) -> None:
    """evictable + protected sizes equal the tree's own sums; lock refs never negative; when
    no request holds KV (`idle`), SGLang's pool invariant holds too."""
    if idle:
        pool_conserved(cache)
    evictable = protected = 0
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        assert node.lock_ref >= 0, "negative lock_ref"
        if node is not cache.root_node:
            if node.lock_ref > 0:
                protected += len(node.value)
            else:
                evictable += len(node.value)
        stack.extend(node.children.values())
    assert cache.evictable_size() == evictable, (cache.evictable_size(), evictable)
    assert cache.protected_size() == protected, (cache.protected_size(), protected)


def make_params(page_size: int, slots: int = 1024, *, mla: bool = False, kv=None):
    """SGLang's real pools and allocator, as the scheduler builds them (CPU). `mla`: the
    MLATokenToKVPool of a DeepSeek-V2-style model (latent 64 + rope 16, bf16); `kv`: a KV
    pool built by the caller."""
    from sglang.srt.mem_cache.allocator import (
        PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator,
    )
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import (
        MHATokenToKVPool,
        MLATokenToKVPool,
        ReqToTokenPool,
    )

    publish(page_size)
    if kv is None and mla:
        kv = MLATokenToKVPool(slots, page_size=page_size, dtype=torch.bfloat16,
                              kv_lora_rank=64, qk_rope_head_dim=16, layer_num=2,
                              device="cpu", enable_memory_saver=False)
    elif kv is None:
        kv = MHATokenToKVPool(slots, page_size=page_size, dtype=torch.float16, head_num=2,
                              head_dim=16, layer_num=2, device="cpu", enable_memory_saver=False)
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(slots, torch.float16, "cpu", kv, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(slots, page_size, torch.float16, "cpu", kv,
                                            need_sort=False)
    r2t = ReqToTokenPool(16, 2048, "cpu", False)
    return CacheInitParams(disable=False, req_to_token_pool=r2t,
                           token_to_kv_pool_allocator=alloc, page_size=page_size)


@pytest.fixture
def make_cache(request):
    """Build LoadBackRadixCache on SGLang's real pools; closed after the test."""
    made = []

    def build(page_size: int, config: LoadBackConfig, *, slots: int = 1024, mla: bool = False,
              **kw):
        from lmcache_loadback.engines.sglang.radix_cache import LoadBackRadixCache

        cache = LoadBackRadixCache(make_params(page_size, slots, mla=mla), config=config, **kw)
        made.append(cache)
        return cache

    yield build
    for c in made:
        c.close()


_next_token = [1000]


def fresh_ids(n: int) -> list[int]:
    """Token ids no other test stored: the module's daemon outlives each test."""
    start = _next_token[0]
    _next_token[0] += n + 1
    return list(range(start, start + n))


def wait_for(pred, timeout_s: float, what: str, step_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(step_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
