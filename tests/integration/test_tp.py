"""Invariant 5: one decision per prefix across tensor-parallel ranks (gloo, two processes).

Each rank has its own daemon here, so a fault can hit one rank only: a daemon that answers
rank 0 but hangs on rank 1 must degrade both.
"""

from __future__ import annotations

import os
import signal
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from connectors.daemon import DaemonProcess, free_port, stop_process

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(240)]


def _rank_main(rank: int, world: int, dist_port: int, endpoints: list[str], pids: list[int],
               out) -> None:
    try:
        from connectors.kv_layout import KVLayout
        from connectors.lmcache_mp import LMCacheMPConnector
        from orchestrator import LoadBackConfig, LoadBackOrchestrator
        from tests.conftest import kv_of, make_pool, same_kv

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}",
                                rank=rank, world_size=world)
        layout = KVLayout(num_layers=2, num_heads=2, head_dim=16, dtype=torch.float16,
                          chunk_size=16)
        pool = make_pool(layout, 1024)
        port = int(endpoints[rank].rsplit(":", 1)[1])
        cfg = LoadBackConfig.from_dict({
            "mp_port": port, "chunk_size": 16,
            "deadlines": {"lookup_ms": 150, "retrieve_base_ms": 300, "retrieve_max_ms": 300,
                          "retrieve_per_ki_token_ms": 0, "control_ms": 100},
            "heartbeat": {"interval_ms": 50},
            "breaker": {"consecutive_failures": 100}})
        conn = LMCacheMPConnector(endpoints[rank], layout)
        orch = LoadBackOrchestrator(cfg, conn, kv_pool=pool, tp_group=dist.group.WORLD)
        assert orch.wait_registered(20)
        toks = list(range(1000, 1128))
        src = torch.arange(0, 128)
        assert orch.store("s", toks, src)
        orch.finish("s")
        results = {}

        def step(name, pause_at):
            rid = f"{name}-{rank}"
            if pause_at == "match" and rank == 1:
                stop_process(pids[1])
            m = orch.match(rid, toks)
            got = m.tokens
            if pause_at == "load" and rank == 1:
                stop_process(pids[1])
            dst = torch.arange(256, 256 + max(got, 1))[:got]
            if pause_at == "alloc" and rank == 1:
                dst = None  # this rank's engine could not allocate the slots
            t0 = time.monotonic()
            res = orch.load_back(rid, dst) if got else None
            took = time.monotonic() - t0
            if rank == 1:
                os.kill(pids[1], signal.SIGCONT)
            final = res if res else m
            results[name] = {
                "match": got,
                "loaded": res.loaded_tokens if res else 0,
                "state": final.state.value if final.state else None,
                "reason": final.reason.value if final.reason else None,
                "load_s": took,
                "exact": bool(res and res.loaded_tokens == 128
                              and same_kv(kv_of(pool, src), kv_of(pool, dst))),
            }
            orch.finish(rid)
            dist.barrier()

        step("healthy", None)
        step("hang_at_match", "match")
        assert orch.wait_registered(10)
        dist.barrier()
        step("hang_at_load", "load")
        assert orch.wait_registered(10)
        dist.barrier()
        step("alloc_fails", "alloc")
        orch.close()
        dist.destroy_process_group()
        out.put((rank, results))
    except Exception:
        out.put((rank, {"error": traceback.format_exc()}))


@pytest.fixture(scope="module")
def two_daemons():
    ds = [DaemonProcess(chunk_size=16), DaemonProcess(chunk_size=16)]
    try:
        for d in ds:
            d.start()
        yield ds
    finally:
        for d in ds:
            d.resume()
            d.stop()


def test_ranks_agree_on_every_prefix_and_one_failing_rank_degrades_all(two_daemons):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = (2, free_port(), [d.endpoint for d in two_daemons], [d.pid for d in two_daemons], out)
    procs = [ctx.Process(target=_rank_main, args=(r, *args)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=200) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank in (0, 1):
        assert "error" not in results[rank], results[rank]["error"]
    r0, r1 = results[0], results[1]
    # Healthy: both load every token, byte-exact.
    assert r0["healthy"]["loaded"] == r1["healthy"]["loaded"] == 128
    assert r0["healthy"]["exact"] and r1["healthy"]["exact"]
    # Rank 1's daemon hangs during LOOKUP: neither rank promises anything.
    assert r0["hang_at_match"]["match"] == r1["hang_at_match"]["match"] == 0
    assert r1["hang_at_match"]["reason"] == "lookup_timeout"
    assert r0["hang_at_match"]["reason"] == "tp_peer_failed"
    # Rank 1's daemon hangs during RETRIEVE: rank 0 loaded locally but must degrade too.
    assert r0["hang_at_load"]["match"] == r1["hang_at_load"]["match"] == 128
    assert r0["hang_at_load"]["loaded"] == r1["hang_at_load"]["loaded"] == 0
    assert r1["hang_at_load"]["reason"] == "retrieve_timeout"
    assert r0["hang_at_load"]["reason"] == "tp_peer_failed"
    assert r0["hang_at_load"]["state"] == r1["hang_at_load"]["state"] == "degraded"
    # Rank 1 could not allocate slots: both ranks still meet in the one decision, return
    # within the retrieve deadline, and degrade (rank 0 without retrieving).
    assert r0["alloc_fails"]["match"] == r1["alloc_fails"]["match"] == 128
    assert r1["alloc_fails"]["reason"] == "alloc_failed"
    assert r0["alloc_fails"]["reason"] == "tp_peer_failed"
    assert r0["alloc_fails"]["loaded"] == r1["alloc_fails"]["loaded"] == 0
    assert max(r0["alloc_fails"]["load_s"], r1["alloc_fails"]["load_s"]) < 0.3 + 0.5
