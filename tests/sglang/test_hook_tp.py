"""The `loadback` backend at TP 2: two processes, each SGLang's real pools and cache, one daemon.

Each rank plays the scheduler's calls in the same order (SGLang's scheduler is SPMD across TP
ranks); the leader's LOOKUP serves both, each rank loads its own shard. Paths walked: a
prompt stored, flushed from both trees and sent again (a storage hit on both ranks,
byte-exact); one rank cannot allocate the slots (both recompute, nobody hangs); the daemon
stopped at the LOOKUP (both recompute within the deadline); then hits resume. After each step
the daemon is asked what it still holds for us: no read lock, no session.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
import urllib.request

import pytest
import torch.distributed as dist

from lmcache_loadback.testing.daemon import CLIENT_HOLDS, free_port, held_in_status, stop_process
from tests.ranks import run_ranks

pytestmark = [pytest.mark.timeout(300)]


def _held(status_url: str) -> dict:
    with urllib.request.urlopen(status_url, timeout=5) as resp:
        st = json.loads(resp.read())
    held = held_in_status(st)
    return {k: held[k] for k in CLIENT_HOLDS}


def _rank_main(rank: int, dist_port: int, daemon_port: int, daemon_pid: int,
               status_url: str, out) -> None:
    try:
        from tests.sglang.conftest import Sched, load_outcome, make_config, make_params

        from lmcache_loadback.engines.sglang.radix_cache import LoadBackRadixCache

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}",
                                rank=rank, world_size=2)
        cfg = make_config(daemon_port)
        cache = LoadBackRadixCache(make_params(16, 2048), config=cfg, tp_size=2, tp_rank=rank,
                                   tp_group=dist.group.WORLD)
        assert cache.orch.wait_registered(30)
        dist.barrier()
        s = Sched(cache)
        ids = list(range(7000, 7000 + 160))
        res: dict = {}

        def settle_all(name: str) -> None:
            s.settle()
            dist.barrier()
            held = {}
            if rank == 0:
                end = time.monotonic() + 15
                while time.monotonic() < end:
                    cache.orch.link.pay()
                    held = _held(status_url)
                    if not any(held.values()) and cache.orch.pending_debts() == 0:
                        break
                    time.sleep(0.05)
            res[name + "_held"] = held
            dist.barrier()

        def admit(name: str, rid: str):
            req = s.new_req(rid, ids)
            t0 = time.monotonic()
            got = s.admit(req)
            res[name] = load_outcome(s.pool, got, ids, time.monotonic() - t0)
            s.finish(req)
            return req

        admit("first", "r-first")          # a miss: prefilled, then stored by each rank
        settle_all("first")
        s.flush()
        admit("hit", "r-hit")              # both ranks: the daemon's hit, loaded
        settle_all("hit")
        s.flush()
        if rank == 1:  # rank 1's allocator refuses the load's slots once (memory pressure)
            alloc = cache.token_to_kv_pool_allocator
            real_alloc = alloc.alloc

            def refuse_once(n, *a, **kw):
                alloc.alloc = real_alloc
                return None

            alloc.alloc = refuse_once
        admit("alloc", "r-alloc")
        settle_all("alloc")
        s.flush()
        if rank == 0:
            stop_process(daemon_pid)       # the daemon stops: the LOOKUP cannot answer
        dist.barrier()
        admit("stopped", "r-stopped")
        dist.barrier()
        if rank == 0:
            os.kill(daemon_pid, signal.SIGCONT)
        assert cache.orch.wait_registered(30)
        dist.barrier()
        settle_all("stopped")
        s.flush()
        admit("after", "r-after")
        settle_all("after")
        cache.close()
        dist.destroy_process_group()
        out.put((rank, res))
    except Exception:
        out.put((rank, {"error": traceback.format_exc()}))


def test_two_ranks_share_one_daemon_through_the_real_cache(daemon):
    daemon.resume()
    status_url = f"http://{daemon.host}:{daemon.http_port}/status"
    r0, r1 = run_ranks(_rank_main, free_port(), daemon.port, daemon.pid, status_url)
    assert r0["first"]["loaded"] == r1["first"]["loaded"] == 0
    # Stored, flushed, sent again: a storage hit on both ranks, each byte-exact.
    assert r0["hit"]["host_hit"] == r1["hit"]["host_hit"] == 160
    assert r0["hit"]["loaded"] == r1["hit"]["loaded"] == 160
    assert r0["hit"]["exact"] and r1["hit"]["exact"]
    # Rank 1 could not allocate: both were promised the hit, both recompute.
    assert r0["alloc"]["host_hit"] == r1["alloc"]["host_hit"] == 160
    assert r0["alloc"]["loaded"] == r1["alloc"]["loaded"] == 0
    # The daemon stopped at the LOOKUP: both recompute within the lookup deadline (300 ms).
    assert r0["stopped"]["loaded"] == r1["stopped"]["loaded"] == 0
    assert max(r0["stopped"]["took_s"], r1["stopped"]["took_s"]) < 2.0
    # Hits resume by themselves.
    assert r0["after"]["loaded"] == r1["after"]["loaded"] == 160
    assert r0["after"]["exact"] and r1["after"]["exact"]
    for name in ("first", "hit", "alloc", "stopped", "after"):
        assert r0[name + "_held"] == dict.fromkeys(CLIENT_HOLDS, 0), name
