"""Promises re-derived between passes, key namespaces, start-up checks, registration."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from array import array
from pathlib import Path

import pytest
import torch

from lmcache_loadback.engines.sglang import compat
from lmcache_loadback.harness.sglang.server import STUBS_DIR

from .conftest import (
    CHUNK,
    NEW_API,
    Sched,
    fill,
    fresh_ids,
    kv_matches,
    make_config,
    page_sizes,
    tree_consistent,
    wait_for,
)
from .test_hook_faults import ready, store


def insert_computed(s: Sched, ids) -> None:
    """Another request's prefill put `ids` into the device tree (SGLang's own insert)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache = s.cache
    slots = cache.token_to_kv_pool_allocator.alloc(len(ids))
    fill(s.pool, slots, ids, 0)
    cache.insert(InsertParams(key=RadixKey(array("q", ids)), value=slots.to(torch.int64)))


@pytest.mark.daemon
@pytest.mark.parametrize("page", page_sizes())
# "on_scheduler_thread": what TP > 1 runs on 0.5.23 (and what 0.5.20 always runs).
@pytest.mark.parametrize("lookups", ["default"] + (["on_scheduler_thread"] if NEW_API else []))
def test_grown_radix_hit_rederives_the_promise(live_daemon, make_cache, page, lookups):
    kw = {} if lookups == "default" else {"async_lookups": False}
    cache = make_cache(page, make_config(live_daemon.port), **kw)
    ready(cache)
    s = Sched(cache)
    ids = fresh_ids(4 * CHUNK)
    store(s, ids)
    b = s.new_req("b", ids + [5])
    s.prefetch(b)
    s.poll(b)
    assert s.match(b).host_hit_length == 4 * CHUNK
    insert_computed(s, ids[: 2 * CHUNK])           # the radix hit grows between passes
    # The next pass: 0.5.23 polls first (the request waits while the promise is derived
    # again off the scheduler thread), then matches.
    assert s.poll(b) >= (1 if NEW_API and not kw else 0)
    res = s.match(b)
    assert cache.shim.device_len(res) == 2 * CHUNK
    assert res.host_hit_length == 2 * CHUNK         # never stale: only what is still missing
    got = s.admit(b, prefetch=False)
    assert got["loaded"] == got["host_hit"] == res.host_hit_length
    if got["loaded"]:
        assert kv_matches(s.pool, got["loaded_slots"], ids[2 * CHUNK:], 2 * CHUNK)
    s.finish(b)
    tree_consistent(cache, idle=True)
    wait_for(lambda: not live_daemon.client_holds(), 10, "nothing left behind")
    assert cache.orch.live_prefixes() == 0


@pytest.mark.daemon
@pytest.mark.skipif(NEW_API, reason="0.5.23 looks up only at prefetch; the key is fixed then")
@pytest.mark.parametrize("page", page_sizes())
def test_changed_key_voids_the_promise(live_daemon, make_cache, page):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache = make_cache(page, make_config(live_daemon.port))
    ready(cache)
    s = Sched(cache)
    ids = fresh_ids(4 * CHUNK)
    store(s, ids)
    b = s.new_req("b", ids + [5])
    assert s.match(b).host_hit_length == 4 * CHUNK
    other = ids[:CHUNK] + fresh_ids(3 * CHUNK)      # the same request, another key
    res = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", other)), req=b))
    assert res.host_hit_length == CHUNK
    s.abort(b)
    wait_for(lambda: not live_daemon.client_holds(), 10, "the first promise's holds freed")
    assert cache.orch.live_prefixes() == 0


@pytest.mark.daemon
@pytest.mark.parametrize("field", ["extra_key", "cache_salt"])
def test_extra_key_and_cache_salt_separate_keys(live_daemon, make_cache, field):
    cache = make_cache(16, make_config(live_daemon.port))
    ready(cache)
    s = Sched(cache)
    ids = fresh_ids(3 * CHUNK)
    a = s.new_req("a", ids, **{field: "tenant-1"})
    s.admit(a)
    s.finish(a)
    s.flush()
    for rid, ns, hit in (("b", "tenant-2", 0), ("c", None, 0), ("d", "tenant-1", 3 * CHUNK)):
        r = s.new_req(rid, ids + [1], **{field: ns})
        got = s.admit(r)
        assert got["loaded"] == hit, (rid, ns, got["loaded"])
        s.finish(r)
        s.flush()
    tree_consistent(cache, idle=True)


def test_chunk_size_not_a_multiple_of_page_size_names_both_flags(make_cache):
    with pytest.raises(ValueError) as err:
        make_cache(32, make_config(1))              # chunk 16, page 32
    msg = str(err.value)
    assert "chunk_size 16" in msg and "--page-size 32" in msg and "--chunk-size" in msg


def test_untested_sglang_fails_at_start_unless_opted_in(monkeypatch):
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(compat.UnsupportedSGLang) as err:
        compat.check_version("0.5.22", allowed=compat.allow_untested(make_config(1)))
    assert "0.5.22" in str(err.value) and "0.5.20, 0.5.23" in str(err.value)
    assert compat.ALLOW_UNTESTED_ENV in str(err.value)
    # The operator's opt-in: a key in the YAML, or the environment.
    compat.check_version("0.5.22", allowed=compat.allow_untested(
        make_config(1, sglang={"allow_untested": True})))
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    compat.check_version("0.5.22", allowed=compat.allow_untested(make_config(1)))
    compat.check_version(compat.sglang_version(), allowed=False)   # the installed one passes


def test_sglang_load_plugins_registers_the_backend():
    """The entry point as SGLang itself runs it, in a fresh process."""
    code = (
        "from sglang.srt.plugins import load_plugins\n"
        "from sglang.srt.mem_cache.registry import get_radix_cache_factory\n"
        "load_plugins()\n"
        "import lmcache_loadback.engines.sglang as h\n"
        "assert get_radix_cache_factory('loadback') is h.build_cache, 'not registered'\n"
        "print('registered')\n")
    stubs = str(STUBS_DIR)  # run from / : no checkout on sys.path
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240, cwd="/", env={**os.environ, "PYTHONPATH": stubs})
    assert out.returncode == 0 and "registered" in out.stdout, out.stderr[-2000:]


def test_import_orchestrator_without_sglang():
    code = ("import sys; sys.modules['sglang'] = None\n"
            "import orchestrator, lmcache_loadback.engines.sglang\n"
            "print(lmcache_loadback.engines.sglang.SUPPORTED_SGLANG)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.daemon
def test_scheduler_thread_wait_on_daemon_per_request(live_daemon, make_cache, capsys):
    """Time the scheduler thread spends in calls that reach the daemon, per request."""
    cache = make_cache(16, make_config(live_daemon.port))
    ready(cache)
    s = Sched(cache)
    per_request = []
    for i in range(20):
        ids = fresh_ids(8 * CHUNK)
        store(s, ids)
        s.calls.clear()
        r = s.new_req(f"w{i}", ids + [1])
        got = s.admit(r)
        assert got["loaded"] == 8 * CHUNK
        s.finish(r)
        s.flush()
        per_request.append(sum(t for _, t in s.calls))
    per_request.sort()
    p50 = statistics.median(per_request)
    p99 = per_request[min(len(per_request) - 1, int(0.99 * len(per_request)))]
    with capsys.disabled():
        print(f"\nscheduler-thread wait per request (sglang {compat.sglang_version()}, "
              f"{8 * CHUNK}-token hit): p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms")
    assert p99 < 1.5  # lookup + retrieve deadlines bound it


def build_context(config_file, model_path="/models/tiny-llama"):
    """SGLang's own TreeCacheBuildContext, as create_tree_cache hands it to the factory."""
    import dataclasses
    from types import SimpleNamespace

    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    from .conftest import make_params

    values = {f.name: None for f in dataclasses.fields(TreeCacheBuildContext)}
    values.update(server_args=SimpleNamespace(lmcache_config_file=config_file,
                                              model_path=model_path),
                  params=make_params(16), is_hybrid_swa=False, is_hybrid_ssm=False,
                  enable_hierarchical_cache=False, disable_radix_cache=False,
                  tp_size=1, tp_rank=0)
    return TreeCacheBuildContext(**values)


def test_factory_builds_from_sglang_build_context(tmp_path, monkeypatch):
    from lmcache_loadback.engines.sglang import build_cache
    from lmcache_loadback.engines.sglang.radix_cache import LoadBackRadixCache

    with pytest.raises(ValueError, match="--lmcache-config-file"):
        build_cache(build_context(None))
    cfg = tmp_path / "loadback.yaml"
    cfg.write_text("mp_host: 127.0.0.1\nmp_port: 1\nchunk_size: 16\n")
    cache = build_cache(build_context(str(cfg)))   # no daemon there: a degraded start
    try:
        assert isinstance(cache, LoadBackRadixCache)
        # the daemon keys its chunks by SGLang's --model-path (the YAML sets no model_name)
        assert cache.orch.connector.model_name == "/models/tiny-llama"
    finally:
        cache.close()
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(compat, "sglang_version", lambda: "0.5.99")
    with pytest.raises(compat.UnsupportedSGLang, match="0.5.99"):
        build_cache(build_context(str(cfg)))
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    build_cache(build_context(str(cfg))).close()


def test_metrics_reach_sglang_multiprocess_collector(tmp_path):
    """With --enable-metrics SGLang sets PROMETHEUS_MULTIPROC_DIR and serves /metrics through
    a MultiProcessCollector: the scheduler process's loadback_* series must show up there."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "from tests.sglang.conftest import make_params, make_config, Sched, fresh_ids\n"
        "from lmcache_loadback.engines.sglang.radix_cache import LoadBackRadixCache\n"
        "cache = LoadBackRadixCache(make_params(16), config=make_config(1))\n"
        "s = Sched(cache)\n"
        "r = s.new_req('m', fresh_ids(64))\n"
        "s.admit(r); s.finish(r)\n"
        "cache.close()\n" % str(Path(__file__).parents[2]))
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp_dir),
           "PYTHONPATH": str(STUBS_DIR)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(mp_dir))
    text = generate_latest(registry).decode()
    assert 'loadback_lookups_total{result="skipped"} 1.0' in text, text[:2000]
    assert "loadback_daemon_up" in text


def test_lookup_answered_after_its_deadline_stays_a_miss():
    """0.5.23: a LOOKUP resolved as a miss at its deadline is never promised afterwards, even
    once its answer arrives; the worker releases that late answer (abort)."""
    import threading

    from lmcache_loadback.orchestrator.lookups import AsyncLookups

    asked, answer = threading.Event(), threading.Event()
    aborted = []

    from lmcache_loadback.orchestrator.results import MatchResult

    class SlowOrchestrator:
        metrics = None  # exports nothing

        def match(self, request_id, token_ids, *, local_hit_tokens, cache_salt):
            asked.set()
            answer.wait(10)
            return MatchResult(64)

        def abort(self, request_id):
            aborted.append(request_id)

    worker = AsyncLookups(SlowOrchestrator())
    try:
        # A deadline still ahead when the worker dequeues it (a job already past its deadline
        # is never sent); the scheduler's passes below are at and after it.
        job = worker.submit("r#0.1", array("q", range(64)), 0, "",
                            deadline=time.monotonic() + 60)
        assert asked.wait(10)                             # the LOOKUP is in flight
        assert worker.answer(job, now=job.deadline) == 0  # at its deadline: a miss
        answer.set()
        assert job.done.wait(10)
        wait_for(lambda: aborted == ["r#0.1"], 10, "the late answer released")
        assert worker.answer(job, now=job.deadline + 1) == 0  # still a miss, never 64
    finally:
        worker.close()


@pytest.mark.daemon
def test_hook_exports_scheduler_wait_and_worker_queue_depths(live_daemon, make_cache):
    """The scheduler thread's waits on the daemon land in loadback_scheduler_wait_seconds
    (one observation per timed call), and both worker queues set their depth gauges when a
    job is queued and when it settles, back to 0 when idle."""
    cache = make_cache(16, make_config(live_daemon.port))
    ready(cache)
    m = cache.orch.metrics
    depths = []
    real = m.queue_depth
    m.queue_depth = lambda which, n: (depths.append((which, n)), real(which, n))[1]
    s = Sched(cache)
    ids = fresh_ids(4 * CHUNK)
    store(s, ids)
    wait_for(lambda: cache.store_queue_depth == 0, 10, "the store went through")
    r = s.new_req("q", ids + [1])
    got = s.admit(r)
    assert got["loaded"] == 4 * CHUNK
    s.finish(r)
    s.flush()
    wait_for(lambda: cache.store_queue_depth == cache.lookup_queue_depth == 0, 10, "idle")
    snap = m.snapshot()
    waits = list(cache.daemon_wait_s)
    assert waits, "load_back ran on the scheduler thread and was timed"
    assert snap["loadback_scheduler_wait_seconds_count"] == len(waits)
    assert snap["loadback_scheduler_wait_seconds_sum"] == pytest.approx(sum(waits))
    assert ("store", 1) in depths
    assert [d for d in depths if d[0] == "store"][-1] == ("store", 0)
    if cache._worker is not None:  # 0.5.23: the LOOKUP went through the worker
        assert ("lookup", 1) in depths and [d for d in depths if d[0] == "lookup"][-1] == ("lookup", 0)
    assert snap["loadback_store_queue_depth"] == snap["loadback_lookup_queue_depth"] == 0
    assert snap["loadback_store_queue_limit"] == cache._store_worker.max_queued
