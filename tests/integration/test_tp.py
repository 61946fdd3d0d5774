"""Invariant 5 the daemon's way: two TP ranks (gloo, two processes) against ONE real daemon.

The leader (rank 0) sends each request's one LOOKUP for the group (`worker_id=None`,
`world_size` 2); each rank retrieves its own shard under its own `worker_id`, byte-exact
against what that rank stored. Faults that hit one rank only come from a fault proxy in
front of each rank (lost replies: the daemon served the call, the rank never heard); a
SIGSTOP of the daemon hits both. After every step the daemon must hold no read lock and,
once the requests finished, no session: asked of the daemon itself (its /status).
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
import urllib.request

import pytest
import torch
import torch.distributed as dist

from lmcache_loadback.testing.daemon import (CLIENT_HOLDS, DaemonProcess, free_port,
                                             held_in_status, stop_process)
from tests.ranks import run_ranks

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(300)]

TOKENS = list(range(1000, 1128))
LOCAL = 20  # the engine's own hit: the load skips it (retrieve_from 16)


def _held(status_url: str) -> dict:
    """Every kind of hold the daemon reports (`CLIENT_HOLDS`)."""
    with urllib.request.urlopen(status_url, timeout=5) as resp:
        held = held_in_status(json.loads(resp.read()))
    return {k: held[k] for k in CLIENT_HOLDS}


def _settle(orch, status_url: str, limit_s: float = 15.0) -> dict:
    """Pay what this rank owes, then wait (bounded) for the daemon to hold nothing."""
    end = time.monotonic() + limit_s
    held = {}
    while time.monotonic() < end:
        orch.link.pay()
        held = _held(status_url)
        if orch.pending_debts() == 0 and not any(held.values()):
            break
        time.sleep(0.05)
    return held


def _rank_main(rank: int, world: int, dist_port: int, endpoint: str, daemon_pid: int,
               status_url: str, transfer: str, out) -> None:
    try:
        from lmcache_loadback.testing.fault_proxy import FaultProxy, FaultRule
        from lmcache_loadback.connectors.kv_layout import KVLayout
        from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
        from lmcache_loadback.orchestrator import LoadBackConfig, LoadBackOrchestrator
        from lmcache_loadback.orchestrator.states import DegradeReason
        from tests.conftest import kv_of, make_pool, same_kv

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}",
                                rank=rank, world_size=world)
        torch.manual_seed(100 + rank)  # each rank's shard holds different bytes
        layout = KVLayout(num_layers=2, num_heads=2, head_dim=16, dtype=torch.float16,
                          chunk_size=16)
        pool = make_pool(layout, 1024)
        proxy = FaultProxy(endpoint, layout=layout, seed=rank).start()
        cfg = LoadBackConfig.from_dict({
            "mp_port": proxy.port, "chunk_size": 16, "transfer": transfer,
            "prepare_at_match": transfer == "shm",
            "deadlines": {"lookup_ms": 300, "retrieve_base_ms": 400, "retrieve_max_ms": 400,
                          "retrieve_per_ki_token_ms": 0, "control_ms": 200},
            "heartbeat": {"interval_ms": 50},
            "breaker": {"consecutive_failures": 100}})
        conn = LMCacheMPConnector(proxy.endpoint, layout, world_size=world, kv_rank=rank,
                                  transfer=transfer)
        orch = LoadBackOrchestrator(cfg, conn, kv_pool=pool, tp_group=dist.group.WORLD)
        assert orch.wait_registered(30)
        src = torch.arange(0, 128)
        assert orch.store("stored", TOKENS, src)
        orch.finish("stored")
        dist.barrier()  # every rank's shard is in the daemon before anyone looks up
        results: dict = {"lookups_sent": 0}
        real_lookup = conn.lookup

        def counting_lookup(key, timeout_s):
            results["lookups_sent"] += 1
            return real_lookup(key, timeout_s)

        conn.lookup = counting_lookup

        def step(name: str, *, fault: str | None = None) -> None:
            rid = f"req-{name}"
            rule = None
            if fault == "leader_status_lost" and rank == 0:
                rule = proxy.add_rule(FaultRule("drop", op="query_prefetch_status"))
            if fault == "peer_prepare_lost" and rank == 1:
                rule = proxy.add_rule(FaultRule("drop", op="prepare_retrieve", count=1))
            if fault == "daemon_stopped" and rank == 0:
                stop_process(daemon_pid)
            dist.barrier()
            m = orch.match(rid, TOKENS, local_hit_tokens=LOCAL)
            if fault == "daemon_stopped" and rank == 0:
                os.kill(daemon_pid, signal.SIGCONT)
            dst = torch.arange(256, 256 + max(m.tokens, 1))[:m.tokens]
            decline = None
            if fault == "peer_alloc_fails" and rank == 1:
                dst = None
            if fault == "peer_declines" and rank == 1:
                decline = DegradeReason.ABORTED
            t0 = time.monotonic()
            res = orch.load_back(rid, dst, decline=decline) if m.tokens else None
            took = time.monotonic() - t0
            if rule is not None:
                proxy.clear()
            final = res if res else m
            exact = bool(res and res.loaded_tokens == 128 - LOCAL and same_kv(
                kv_of(pool, src[LOCAL:]), kv_of(pool, dst)))
            orch.finish(rid)
            dist.barrier()
            results[name] = {
                "match": m.tokens, "loaded": res.loaded_tokens if res else 0,
                "state": final.state.value if final.state else None,
                "reason": final.reason.value if final.reason else None,
                "load_s": took, "exact": exact,
                "held_after": _settle(orch, status_url) if rank == 0 else None,
            }
            dist.barrier()
            assert orch.wait_registered(30)
            dist.barrier()

        step("healthy")
        step("leader_status_lost", fault="leader_status_lost")
        step("peer_prepare_lost", fault="peer_prepare_lost")
        step("peer_alloc_fails", fault="peer_alloc_fails")
        step("peer_declines", fault="peer_declines")
        step("daemon_stopped", fault="daemon_stopped")
        step("recovered")
        end = time.monotonic() + 15  # this rank's releaser may still be paying the last step
        while orch.pending_debts() and time.monotonic() < end:
            orch.link.pay()
            time.sleep(0.05)
        results["debts_left"] = orch.pending_debts()
        orch.close()
        proxy.close()
        dist.destroy_process_group()
        out.put((rank, results))
    except Exception:
        out.put((rank, {"error": traceback.format_exc()}))


def _run_ranks(daemon: DaemonProcess, transfer: str) -> tuple[dict, dict]:
    status_url = f"http://{daemon.host}:{daemon.http_port}/status"
    r0, r1 = run_ranks(_rank_main, 2, free_port(), daemon.endpoint, daemon.pid, status_url,
                       transfer)
    return r0, r1


@pytest.fixture(scope="module", params=["pickle", "shm"])
def shared_daemon(request):
    shm = f"lbtp{os.getpid()}" if request.param == "shm" else None
    d = DaemonProcess(chunk_size=16, http=True, shm_name=shm)
    d.start()
    try:
        yield d, request.param
    finally:
        d.resume()
        d.stop()


def test_two_ranks_share_one_daemon_and_agree_on_every_path(shared_daemon):
    daemon, transfer = shared_daemon
    r0, r1 = _run_ranks(daemon, transfer)
    promised = 128 - LOCAL
    # One LOOKUP per request for the group, sent by the leader only.
    steps = 7
    assert r1["lookups_sent"] == 0
    assert r0["lookups_sent"] == steps
    # Healthy and after recovery: each rank loads ITS OWN shard, byte-exact.
    for name in ("healthy", "recovered"):
        assert r0[name]["loaded"] == r1[name]["loaded"] == promised, (name, r0[name], r1[name])
        assert r0[name]["exact"] and r1[name]["exact"], name
    # The leader's prefetch status reply is lost: nobody promises anything.
    assert r0["leader_status_lost"]["match"] == r1["leader_status_lost"]["match"] == 0
    assert r0["leader_status_lost"]["reason"] == "lookup_timeout"
    assert r1["leader_status_lost"]["reason"] == "tp_peer_failed"
    # Rank 1's prepare_retrieve answer is lost (at match with shm, at load with pickle):
    # rank 0 prepared or loaded its shard, yet both degrade and nothing is reported loaded.
    lost0, lost1 = r0["peer_prepare_lost"], r1["peer_prepare_lost"]
    assert lost0["match"] == lost1["match"]
    assert lost0["loaded"] == lost1["loaded"] == 0
    assert lost0["state"] == lost1["state"] == "degraded"
    assert lost1["reason"] == "retrieve_timeout"
    assert lost0["reason"] == "tp_peer_failed"
    # Rank 1 could not allocate, or its engine declined: both degrade, in bounded time.
    for name, why in (("peer_alloc_fails", "alloc_failed"), ("peer_declines", "aborted")):
        assert r0[name]["match"] == r1[name]["match"] == promised
        assert r0[name]["loaded"] == r1[name]["loaded"] == 0
        assert r1[name]["reason"] == why
        assert r0[name]["reason"] == "tp_peer_failed"
        assert max(r0[name]["load_s"], r1[name]["load_s"]) < 0.4 + 0.5
    # The daemon stopped during the LOOKUP: both recompute.
    assert r0["daemon_stopped"]["match"] == r1["daemon_stopped"]["match"] == 0
    assert r0["daemon_stopped"]["reason"] == "lookup_timeout"
    assert r1["daemon_stopped"]["reason"] == "tp_peer_failed"
    # After every step, once the releases were paid, the daemon held nothing for us.
    for name in ("healthy", "leader_status_lost", "peer_prepare_lost", "peer_alloc_fails",
                 "peer_declines", "daemon_stopped", "recovered"):
        assert r0[name]["held_after"] == dict.fromkeys(CLIENT_HOLDS, 0), name
    assert r0["debts_left"] == r1["debts_left"] == 0
