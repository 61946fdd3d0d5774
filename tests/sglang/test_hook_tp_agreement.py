"""What TP ranks must decide alike, on SGLang's real cache at TP 2 (two gloo processes, one
real daemon): a live config reload, and the store queue's admission at its bound.

SGLang's scheduler is SPMD: every rank makes the same calls in the same order, and the
backend's collectives must line up. These tests play the scheduler's passes in lockstep
(`_settle`: one `check_hicache_events` per pass on every rank) and step the one thing that
differs per rank: when a rank's watcher sees the new file; where a rank's store thread is.
A collective that does not line up fails at the group's timeout (20 s) instead of hanging.
"""

from __future__ import annotations

import datetime
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import yaml

from lmcache_loadback.testing.daemon import free_port
from tests.ranks import run_ranks

pytestmark = [pytest.mark.timeout(300)]


def _group(rank: int, dist_port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=20))


def _settle(cache, passes: int = 400) -> int:
    """Scheduler passes in lockstep until no rank has a store in flight (bounded); the
    stores still pending on this rank after them."""
    pending = 0
    for _ in range(passes):
        cache.check_hicache_events()
        pending = int(cache.has_pending_cache_operations())
        flag = torch.tensor([pending], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag.item()):
            return 0
        time.sleep(0.005)
    return len(cache._stores)


def _finish(cache, req) -> None:
    """SGLang's release of a finished request (the STORE is handed to the store thread);
    no pass runs here."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import release_kv_cache

    from tests.sglang.conftest import NEW_API

    req.finished_reason = FINISH_LENGTH(length=0)
    if NEW_API:
        release_kv_cache(req, cache, checkpoint=True)
    else:
        release_kv_cache(req, cache)


def _rank_main(rank: int, dist_port: int, daemon_port: int, cfg_dir: str, out) -> None:
    """Both scenarios in one pair of processes (a spawn imports SGLang: tens of seconds
    here); each reports its own error, the store scenario first (it leaves the group's
    collectives aligned even when its admission diverges)."""
    res: dict = {}
    try:
        _group(rank, dist_port)
        try:
            res["admission"] = _admission_steps(rank, daemon_port)
        except Exception:
            res["admission"] = {"error": traceback.format_exc()}
        dist.barrier()
        try:
            res["reload"] = _reload_steps(rank, daemon_port, cfg_dir)
        except Exception:
            res["reload"] = {"error": traceback.format_exc()}
        dist.destroy_process_group()
    except Exception:
        res = {"error": traceback.format_exc()}
    out.put((rank, res))


@pytest.fixture(scope="module")
def two_ranks(daemon, tmp_path_factory):
    daemon.resume()
    return run_ranks(_rank_main, free_port(), daemon.port,
                     str(tmp_path_factory.mktemp("tp-reload")))


# ---------------------------------------------------------------- live reload


def _reload_steps(rank: int, daemon_port: int, cfg_dir: str) -> dict:
    from tests.sglang.conftest import Sched, make_config, make_params

    from lmcache_loadback.engines.sglang.radix_cache import LoadBackRadixCache

    cfg = make_config(daemon_port)
    path = f"{cfg_dir}/rank{rank}.yaml"  # each rank its own copy: one sees it first
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f)
    cache = LoadBackRadixCache(make_params(16, 2048), config=cfg, tp_size=2, tp_rank=rank,
                               tp_group=dist.group.WORLD, config_path=path)
    watcher = cache.config_watcher
    watcher.clock = lambda: 0.0  # the heartbeat never looks: the test says when
    watcher._checked_at = 0.0
    assert cache.orch.wait_registered(30)
    dist.barrier()
    new = cfg.to_dict()
    new["break_even"]["min_tokens"] = 100000      # match returns before any collective
    new["prepare_at_match"] = False               # one agreement fewer per match
    new["deadlines"]["lookup_ms"] = 301.0         # a key that does not change them
    sees_it_at = {0: 2, 1: 4}[rank]
    s = Sched(cache)
    ids = list(range(9000, 9160))
    steps = []
    req = s.new_req("r-first", ids)
    s.admit(req)
    _finish(cache, req)
    _settle(cache)
    for step in range(1, 7):
        s.flush()
        if step == sees_it_at:
            with open(path, "w") as f:
                yaml.safe_dump(new, f)
            watcher.check(force=True)
        force = cache.orch.config
        req = s.new_req(f"r{step}", ids)
        got = s.admit(req)
        _finish(cache, req)
        left = _settle(cache)
        steps.append({"host_hit": got["host_hit"], "loaded": got["loaded"],
                      "min_tokens": force.break_even.min_tokens,
                      "prepare_at_match": force.prepare_at_match,
                      "lookup_ms": force.deadlines.lookup_ms, "stores_left": left})
    res = {"steps": steps, "backend_min_tokens": cache.config.break_even.min_tokens}
    cache.close()
    return res


def test_reload_seen_by_one_rank_first_applies_at_one_step_on_both(two_ranks):
    r0, r1 = (r["reload"] for r in two_ranks)
    assert "error" not in r0 and "error" not in r1, f"{r0.get('error')}\n{r1.get('error')}"
    decisions = [[(s["host_hit"], s["loaded"], s["min_tokens"], s["prepare_at_match"])
                  for s in r["steps"]] for r in (r0, r1)]
    assert decisions[0] == decisions[1], decisions
    # Rank 0 saw the file at step 2, rank 1 at step 4: the keys that shape the ranks'
    # collectives apply on both after the pass both held them, and the hits stop together.
    assert [s["min_tokens"] for s in r0["steps"]] == [0, 0, 0, 0, 100000, 100000]
    assert [s["prepare_at_match"] for s in r0["steps"]] == [True] * 4 + [False] * 2
    assert [s["loaded"] for s in r0["steps"]] == [160] * 4 + [0] * 2
    # Every other key applies on each rank as soon as that rank reads the file.
    assert [s["lookup_ms"] for s in r0["steps"]] == [300.0] + [301.0] * 5
    assert [s["lookup_ms"] for s in r1["steps"]] == [300.0] * 3 + [301.0] * 3
    assert r0["backend_min_tokens"] == r1["backend_min_tokens"] == 100000
    assert all(s["stores_left"] == 0 for r in (r0, r1) for s in r["steps"])


# ------------------------------------------------------- store queue admission


def _admission_steps(rank: int, daemon_port: int) -> dict:
    from tests.sglang.conftest import Sched, make_config, make_params

    from lmcache_loadback.engines.sglang.radix_cache import LoadBackRadixCache

    cache = LoadBackRadixCache(make_params(16, 2048), config=make_config(daemon_port),
                               tp_size=2, tp_rank=rank, tp_group=dist.group.WORLD)
    assert cache.orch.wait_registered(30)
    worker = cache._store_worker
    bound = worker.max_queued
    inside, go = threading.Event(), threading.Event()
    calls = [0]
    real_completed = worker._completed

    def completed():
        real_completed()
        calls[0] += 1
        if rank == 0 and calls[0] == bound:
            # Rank 0's store thread: the last store's depth is down, its job not yet
            # on the completed queue.
            inside.set()
            assert go.wait(60)

    worker._completed = completed
    dist.barrier()
    s = Sched(cache)
    for i in range(bound):
        req = s.new_req(f"fill{i}", list(range(20000 + 32 * i, 20000 + 32 * i + 16)))
        s.admit(req)
        _finish(cache, req)
    end = time.monotonic() + 30
    if rank == 0:
        assert inside.wait(30), "the store thread never reached the last completion"
    else:
        while worker.completed.qsize() < bound and time.monotonic() < end:
            time.sleep(0.005)
    dist.barrier()
    # The same request on both ranks (SPMD), with every store through or nearly.
    req = s.new_req("over", list(range(40000, 40016)))
    s.admit(req)
    _finish(cache, req)
    res = {"admitted": cache._handle(req) in cache._stores, "skipped": worker.skipped}
    go.set()
    res["stores_left"] = _settle(cache)
    cache.close()
    return res


def test_store_admission_at_the_bound_is_the_same_on_every_rank(two_ranks):
    r0, r1 = (r["admission"] for r in two_ranks)
    assert "error" not in r0 and "error" not in r1, f"{r0.get('error')}\n{r1.get('error')}"
    # Both ranks hold the bound of stores (one rank's last one between its thread's two
    # steps): the next store is refused on both, and both drain every store.
    assert (r0["admitted"], r0["skipped"]) == (r1["admitted"], r1["skipped"]), (r0, r1)
    assert not r0["admitted"] and r0["skipped"] == 1
    assert r0["stores_left"] == r1["stores_left"] == 0
