"""MLA (DeepSeek-style latent KV) through the `loadback` backend, and the pools it refuses.

What is real: SGLang's MLATokenToKVPool (one latent buffer per layer, [slots + page, 1,
kv_lora_rank + qk_rope_head_dim], bf16 here), its allocator and RadixCache; the lmcache 0.5.6
daemon (registered with use_mla, chunks [num_layers, chunk, latent]). KV values are a function
of (token, position, layer), so a loaded prefix and a recomputed one are byte-identical.
Refusals use SGLang's own pool classes where they build on CPU (SWAKVPool,
NoOpMHATokenToKVPool, MHATokenToKOnlyPool, MLATokenToKVPool with the DSA flag); the hybrid
SSM pool (HybridLinearKVPool needs a mamba state pool) is refused through SGLang's
`is_hybrid_ssm` build flag and, for the pool check alone, a stand-in class of that name.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import traceback
from types import SimpleNamespace

import pytest
import torch

from lmcache_loadback.connectors.errors import UnsupportedKVPool

from .conftest import (
    CHUNK,
    Sched,
    fresh_ids,
    kv_matches,
    make_config,
    make_params,
    page_sizes,
    tree_consistent,
    wait_for,
)

FIX = "start without --radix-cache-backend loadback"


def ready(cache, timeout_s: float = 30.0) -> None:
    assert cache.orch.wait_registered(timeout_s), "never registered with the daemon"


def idle(daemon, cache) -> None:
    """The daemon holds nothing for us: every kind of hold (`CLIENT_HOLDS`)."""
    def empty() -> bool:
        cache.orch.link.pay()
        return not daemon.client_holds()
    wait_for(empty, 15, "the daemon to hold no lock or session")
    assert cache.orch.pending_debts() == 0


@pytest.mark.daemon
@pytest.mark.parametrize("page", page_sizes())
def test_mla_stored_prefix_flushed_then_loaded_back_byte_exact(live_daemon, make_cache, page):
    cache = make_cache(page, make_config(live_daemon.port), mla=True)
    conn = cache.orch.connector
    assert conn.layout.mla and conn.layout.chunk_shape == (2, CHUNK, 80)
    assert (conn.world_size, conn.kv_rank, conn.num_kv_readers, conn.writer) == (1, 0, 1, True)
    ready(cache)
    s = Sched(cache)
    ids = fresh_ids(5 * CHUNK + 3)            # 5 whole chunks and a tail
    objects = live_daemon.held()["objects"]
    a = s.new_req("a", ids)
    assert s.admit(a)["loaded"] == 0
    s.finish(a)
    # One MLA object per chunk (not one per K/V or per rank).
    wait_for(lambda: live_daemon.held()["objects"] == objects + 5, 10, "5 chunks stored")
    s.flush()
    assert cache.evictable_size() == 0
    free_before = cache.token_to_kv_pool_allocator.available_size()
    b = s.new_req("b", ids + [7, 8, 9])
    got = s.admit(b)
    assert got["host_hit"] == 5 * CHUNK and got["loaded"] == 5 * CHUNK
    assert kv_matches(s.pool, got["loaded_slots"], ids[:5 * CHUNK], 0)
    tree_consistent(cache)
    s.finish(b)
    tree_consistent(cache, idle=True)
    assert cache.token_to_kv_pool_allocator.available_size() + cache.evictable_size() \
        == free_before
    assert cache.orch.live_prefixes() == 0
    idle(live_daemon, cache)


@pytest.mark.daemon
@pytest.mark.parametrize("page", page_sizes())
def test_mla_daemon_stopped_at_lookup_recomputes_then_loads_again(live_daemon, make_cache,
                                                                   page):
    cache = make_cache(page, make_config(live_daemon.port), mla=True)
    ready(cache)
    s = Sched(cache)
    ids = fresh_ids(4 * CHUNK)
    a = s.new_req("a", ids)
    s.admit(a)
    s.finish(a)
    s.flush()
    free0 = cache.token_to_kv_pool_allocator.available_size()
    live_daemon.pause()
    try:
        b = s.new_req("b", ids + [5])
        t0 = time.monotonic()
        got = s.admit(b)
        took = time.monotonic() - t0
        s.finish(b)
        s.flush()
    finally:
        live_daemon.resume()
    assert got["loaded"] == 0 and took < 0.3 + 1.0   # lookup deadline + slack
    # The recomputed KV is the same bytes a load would have given.
    tree_consistent(cache, idle=True)
    assert cache.token_to_kv_pool_allocator.available_size() == free0
    ready(cache)
    idle(live_daemon, cache)

    def loads_again() -> bool:
        c = s.new_req(f"c-{time.monotonic()}", ids + [6])
        got = s.admit(c)
        ok = got["loaded"] == 4 * CHUNK and kv_matches(s.pool, got["loaded_slots"], ids, 0)
        s.finish(c)
        s.flush()
        return ok
    wait_for(loads_again, 30, "MLA hits to resume after the stopped LOOKUP")
    tree_consistent(cache, idle=True)
    idle(live_daemon, cache)


# ---------------------------------------------------------------- TP 2, one writer


def _mla_rank(rank: int, dist_port: int, daemon_port: int, daemon_pid: int, out) -> None:
    try:
        import torch.distributed as dist

        from tests.sglang.conftest import Sched, load_outcome, make_config, make_params

        from lmcache_loadback.engines.sglang.radix_cache import LoadBackRadixCache

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}",
                                rank=rank, world_size=2)
        cache = LoadBackRadixCache(make_params(16, 2048, mla=True), config=make_config(
            daemon_port), tp_size=2, tp_rank=rank, tp_group=dist.group.WORLD)
        conn = cache.orch.connector
        res: dict = {"geometry": (conn.world_size, conn.kv_rank, conn.num_kv_readers,
                                  conn.writer)}
        # The commit_stores this rank sends, counted at the connector's one call path (the
        # daemon logs "Stored N tokens" only after a prepare_store, and a pickled STORE
        # sends commit_store alone).
        sent: list[str] = []
        call = conn._call

        def counting_call(op, *args, **kw):
            if op == "commit_store":
                sent.append(op)
            return call(op, *args, **kw)
        conn._call = counting_call
        assert cache.orch.wait_registered(30)
        dist.barrier()
        s = Sched(cache)
        ids = list(range(9000, 9000 + 160))

        def admit(name: str, rid: str) -> None:
            req = s.new_req(rid, ids + [1])
            t0 = time.monotonic()
            got = s.admit(req)
            res[name] = load_outcome(s.pool, got, ids, time.monotonic() - t0)
            s.finish(req)
            s.settle()
            dist.barrier()

        admit("first", "m-first")          # computed on both ranks; stored by rank 0 only
        res["stores"] = len(sent)          # settle drained both ranks' stores before the barrier
        s.flush()
        admit("hit", "m-hit")              # both ranks load rank 0's latent KV
        s.flush()
        if rank == 0:
            os.kill(daemon_pid, signal.SIGSTOP)
        dist.barrier()
        admit("stopped", "m-stopped")      # the daemon stopped at the LOOKUP: both recompute
        if rank == 0:
            os.kill(daemon_pid, signal.SIGCONT)
        assert cache.orch.wait_registered(30)
        dist.barrier()
        s.flush()
        admit("after", "m-after")
        s.flush()
        cache.close()
        dist.destroy_process_group()
        out.put((rank, res))
    except Exception:
        out.put((rank, {"error": traceback.format_exc()}))


@pytest.mark.daemon
@pytest.mark.timeout(300)
def test_mla_tp2_one_writer_every_rank_reads(daemon):
    from lmcache_loadback.testing.daemon import free_port
    from tests.ranks import run_ranks

    daemon.resume()
    r0, r1 = run_ranks(_mla_rank, free_port(), daemon.port, daemon.pid)
    assert (r0["stores"], r1["stores"]) == (1, 0)      # one commit_store: rank 0's
    # lmcache's replicated-MLA geometry: KV world 1, worker 0 on every rank, TP-size readers.
    assert r0["geometry"] == (1, 0, 2, True) and r1["geometry"] == (1, 0, 2, False)
    assert r0["first"]["loaded"] == r1["first"]["loaded"] == 0
    for r in (r0, r1):
        assert r["hit"]["host_hit"] == r["hit"]["loaded"] == 160 and r["hit"]["exact"]
        assert r["stopped"]["loaded"] == 0 and r["stopped"]["took_s"] < 2.0
        assert r["after"]["loaded"] == 160 and r["after"]["exact"]

    def empty() -> bool:
        return not daemon.client_holds()
    wait_for(empty, 15, "the daemon to hold no lock or session after both ranks")


# ---------------------------------------------------------------- refusals


def _build_context(params, **flags):
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    values = {f.name: None for f in dataclasses.fields(TreeCacheBuildContext)}
    values.update(server_args=SimpleNamespace(lmcache_config_file="/nonexistent.yaml"),
                  params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
                  enable_hierarchical_cache=False, disable_radix_cache=False,
                  tp_size=1, tp_rank=0)
    values.update(flags)
    if "is_dsa" in flags and not any(f.name == "is_dsa"
                                     for f in dataclasses.fields(TreeCacheBuildContext)):
        ctx = TreeCacheBuildContext(**{k: v for k, v in values.items() if k != "is_dsa"})
        ctx.is_dsa = flags["is_dsa"]           # 0.5.20's context has no is_dsa field
        return ctx
    return TreeCacheBuildContext(**values)


def _swa_pool():
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    return SWAKVPool(256, 256, 16, torch.float16, 2, 16, [0], [1], "cpu",
                     enable_memory_saver=False)


def _one_line(exc: pytest.ExceptionInfo, *parts: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("loadback: ")
    for p in parts + ("MHA and MLA pools only", FIX):
        assert p in msg, msg


def test_hybrid_swa_pool_refused_at_start(tmp_path):
    from lmcache_loadback.engines.sglang import build_cache
    from lmcache_loadback.engines.sglang.radix_cache import LoadBackRadixCache

    params = make_params(16, kv=_swa_pool())
    with pytest.raises(UnsupportedKVPool) as exc:
        build_cache(_build_context(params, is_hybrid_swa=True))
    _one_line(exc, "sliding-window attention (hybrid SWA pool SWAKVPool)")
    with pytest.raises(UnsupportedKVPool) as exc:   # the pool alone says it too
        LoadBackRadixCache(params, config=make_config(1))
    _one_line(exc, "hybrid SWA pool SWAKVPool")


def test_hybrid_ssm_and_dsa_refused_at_start():
    from lmcache_loadback.engines.sglang import build_cache
    from lmcache_loadback.engines.sglang.pools import pool_kind

    with pytest.raises(UnsupportedKVPool) as exc:
        build_cache(_build_context(make_params(16), is_hybrid_ssm=True))
    _one_line(exc, "state-space / linear-attention layers (hybrid SSM pool")
    stand_in = type("HybridLinearKVPool", (), {})()   # HybridLinearKVPool needs a mamba pool
    with pytest.raises(UnsupportedKVPool) as exc:
        pool_kind(stand_in)
    _one_line(exc, "hybrid SSM pool HybridLinearKVPool")
    with pytest.raises(UnsupportedKVPool) as exc:
        build_cache(_build_context(make_params(16, mla=True), is_dsa=True))
    _one_line(exc, "DeepSeek sparse attention (DSA pool MLATokenToKVPool)")


@pytest.mark.parametrize("cls", ["NoOpMHATokenToKVPool", "MHATokenToKOnlyPool"])
def test_unknown_pool_refused_at_start(cls):
    from sglang.srt.mem_cache import memory_pool

    from lmcache_loadback.engines.sglang.radix_cache import LoadBackRadixCache

    make_params(16)  # publishes the server args the pools read
    kv = getattr(memory_pool, cls)(256, page_size=16, dtype=torch.float16, head_num=2,
                                   head_dim=16, layer_num=2, device="cpu",
                                   enable_memory_saver=False)
    with pytest.raises(UnsupportedKVPool) as exc:
        LoadBackRadixCache(make_params(16, kv=kv), config=make_config(1))
    msg = str(exc.value)
    assert "\n" not in msg and f"KV pool {cls} is not one this backend knows" in msg
    assert FIX in msg


def test_mla_pool_on_cuda_refused_at_construction():
    """The GPU data path moves K/V pools only: an MLA pool on CUDA is refused at once (the
    check runs before any CUDA call, so it is tested on CPU hosts too)."""
    from lmcache_loadback.connectors.kv_layout import KVLayout
    from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector

    layout = KVLayout(2, 1, 80, torch.bfloat16, CHUNK, mla=True)
    with pytest.raises(UnsupportedKVPool, match="MLA KV pool on CUDA") as exc:
        LMCacheMPConnector("tcp://127.0.0.1:1", layout, device="cuda")
    assert FIX in str(exc.value)


def test_mla_build_context_builds(tmp_path):
    """SGLang's factory path with an MLA pool: built, its connector registers use_mla."""
    from lmcache_loadback.engines.sglang import build_cache

    cfg = tmp_path / "loadback.yaml"
    cfg.write_text("mp_host: 127.0.0.1\nmp_port: 1\nchunk_size: 16\n")
    ctx = _build_context(make_params(16, mla=True), server_args=SimpleNamespace(
        lmcache_config_file=str(cfg)))
    cache = build_cache(ctx)       # no daemon there: a degraded start, never a crash
    try:
        assert cache.orch.connector.layout.mla
    finally:
        cache.close()
