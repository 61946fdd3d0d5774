"""Test-only SGLang plugin: scheduler-thread time spent inside a radix-cache backend, per request.

Found by SGLang's `load_plugins()` only when this folder is on PYTHONPATH (the dist-info beside
it declares the entry point; nothing is installed); active with LOADBACK_SCHED_PROBE_FILE set.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time

HOOKS = ("prefetch_from_storage", "check_prefetch_progress", "pop_prefetch_loaded_span",
         "match_prefix", "init_load_back", "checkpoint", "on_release", "cache_finished_req",
         "cache_unfinished_req", "release_aborted_request", "check_hicache_events", "evict")
FINAL = ("on_release", "cache_finished_req", "release_aborted_request")


def _rid(args):
    for a in args:
        for obj in (a, getattr(a, "req", None)):
            rid = getattr(obj, "rid", None)
            if isinstance(rid, str):
                return rid
    return None


class _Probe:
    """Times a cache's scheduler-facing hooks. Each finished or aborted request appends one
    JSON line: its rid, the seconds the scheduler thread spent in the hooks for it (outermost
    calls only) and the slowest single call. Hooks with no request (e.g.
    `check_hicache_events`) are summed under "unattributed"."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.local = threading.local()
        self.per_rid: dict[str, list] = {}  # rid -> [total_s, max_s, calls, slowest hook]
        self.unattributed = 0.0

    def wrap(self, cache) -> None:
        for name in HOOKS:
            fn = getattr(cache, name, None)
            if callable(fn):
                setattr(cache, name, self._timed(name, fn))

    def _timed(self, name, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            depth = getattr(self.local, "depth", 0)
            self.local.depth = depth + 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.local.depth = depth
                if depth == 0:
                    self._record(name, _rid(args), time.perf_counter() - t0)
        return timed

    def _record(self, name, rid, dt) -> None:
        if rid is None:
            self.unattributed += dt
            return
        rec = self.per_rid.setdefault(rid, [0.0, 0.0, 0, None])
        rec[0] += dt
        if dt > rec[1]:
            rec[1], rec[3] = dt, name
        rec[2] += 1
        if name in FINAL:
            total, longest, calls, slowest = self.per_rid.pop(rid)
            with open(self.path, "a") as f:
                f.write(json.dumps({"rid": rid, "hook": name, "total_s": total,
                                    "max_call_s": longest, "slowest_hook": slowest,
                                    "calls": calls, "unattributed_s": self.unattributed}) + "\n")


def register() -> None:
    """Register two backends that build the real ones unchanged and time their hooks:
    `probe-loadback` (this product's `loadback`) and `probe-upstream` (SGLang's own choice
    under `--enable-lmcache`, upstream's LMCacheUnifiedRadixCache)."""
    path = os.environ.get("LOADBACK_SCHED_PROBE_FILE")
    if not path:
        return
    from sglang.srt.mem_cache.registry import (
        default_radix_cache_factory,
        get_radix_cache_factory,
        register_radix_cache_backend,
    )

    probe = _Probe(path)

    def build(inner_name):
        def factory(ctx):
            inner = (default_radix_cache_factory if inner_name is None
                     else get_radix_cache_factory(inner_name))
            if inner is None:
                raise RuntimeError(f"probe: backend {inner_name!r} is not registered")
            cache = inner(ctx)
            probe.wrap(cache)
            return cache
        return factory

    for name, inner in (("probe-loadback", "loadback"), ("probe-upstream", None)):
        if get_radix_cache_factory(name) is None:
            register_radix_cache_backend(name, build(inner))
