"""Tensor parallel (TP 2) on vLLM's own distributed state (gloo), against the real daemon.

Two spawned processes are vLLM's two worker ranks, each holding its KV heads (one of the tiny
Llama's two) in vLLM's CPU layout; rank 0's process also holds the scheduler role and sends each
step's metadata to rank 1 (as EngineCore sends it to every worker). The scheduler's LOOKUP
is the request's only one and serves both ranks; each rank stores and loads its own shard byte-exact; a daemon killed between
LOOKUP and RETRIEVE fails the load on both ranks, which report the same blocks, with no rank
waiting on the other; nothing is left held on the daemon.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
import urllib.request

import pytest

from lmcache_loadback.connectors.ports import free_port

from ..ranks import run_ranks
from .conftest import CHUNK

pytestmark = pytest.mark.daemon

PROMPT = [5 + (i * 17) % 4000 for i in range(200)]
HIT = (len(PROMPT) - 1) // CHUNK * CHUNK
BLOCK, LAYERS, HEAD = 32, 4, 64


def _held(http_port: int) -> tuple[int, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=5) as r:
        st = json.loads(r.read())
    return (int(st["storage_manager"]["l1_manager"]["read_locked_count"]),
            int(st["active_sessions"]))


def _rank(rank: int, dist_port: int, yaml: str, daemon_pid: int, http_port: int, out) -> None:
    try:
        out.put((rank, _rank_body(rank, dist_port, yaml, daemon_pid, http_port)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, {"error": f"rank {rank}:\n{traceback.format_exc()}"}))


def _rank_body(rank, dist_port, yaml, daemon_pid, http_port) -> dict:
    import torch
    import torch.distributed as dist
    from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, VllmConfig
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from lmcache_loadback.engines.vllm import LoadBackConnector

    ktc = KVTransferConfig(kv_connector="LoadBackConnector",
                           kv_connector_module_path="lmcache_loadback.engines.vllm",
                           kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"loadback.config_file": yaml,
                                                      "loadback.staging_tokens": 1024})
    cfg = VllmConfig(cache_config=CacheConfig(block_size=BLOCK), kv_transfer_config=ktc)
    cfg.parallel_config.tensor_parallel_size = 2
    report: dict = {}
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=2, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{dist_port}")
        initialize_model_parallel(tensor_model_parallel_size=2)
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=HEAD,
                                 dtype=torch.bfloat16)   # one of the two KV heads per rank
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(names, spec)])
        worker = LoadBackConnector(cfg, KVConnectorRole.WORKER, kcc)
        layers = [torch.zeros(64, 1, BLOCK, 2 * HEAD, dtype=torch.bfloat16) for _ in names]
        worker.register_kv_caches(dict(zip(names, layers)))
        sched = LoadBackConnector(cfg, KVConnectorRole.SCHEDULER, kcc) if rank == 0 else None
        assert worker.worker.orch.wait_registered(30)
        if sched is not None:
            assert sched.scheduler.orch.wait_registered(30)
        reqs: dict[str, Request] = {}

        def ask(rid):  # rank 0 only: poll like vLLM until the answer is known
            req = reqs.setdefault(rid, Request(rid, list(PROMPT), SamplingParams(max_tokens=1),
                                               None))
            deadline = time.monotonic() + 10
            while True:
                n, _ = sched.get_num_new_matched_tokens(req, 0)
                if n is not None:
                    return n
                assert time.monotonic() < deadline
                time.sleep(0.001)

        def step(rid, blocks, before_load=None):
            """Rank 0 plans `rid`'s prefill into `blocks`; every rank runs it. Returns the
            load errors of every rank."""
            meta = None
            if rank == 0:
                req = reqs[rid]
                ext = ask(rid)
                sched.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(b) for b in
                                                                    blocks],)), ext)
                req.num_computed_tokens = ext
                so = SchedulerOutput(
                    scheduled_new_reqs=[NewRequestData.from_request(req, (blocks,))],
                    scheduled_cached_reqs=CachedRequestData.make_empty(),
                    num_scheduled_tokens={rid: len(PROMPT) - ext},
                    total_num_scheduled_tokens=len(PROMPT) - ext,
                    scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                    finished_req_ids=set(), free_encoder_mm_hashes=[], has_sync_kv_loads=ext > 0)
                meta = sched.build_connector_meta(so)
                if before_load is not None:
                    before_load()
            box = [meta]
            dist.broadcast_object_list(box, src=0)    # EngineCore -> every worker
            meta = box[0]
            computed = max((op.end for op in meta.loads.values()), default=0)
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            for pos in range(computed, len(PROMPT)):  # the forward: this rank's head
                b, off = divmod(pos, BLOCK)
                for li, layer in enumerate(layers):
                    kernel = layer.view(64, 1, 2, BLOCK, HEAD)
                    val = float((PROMPT[pos] * 31 + pos * 7 + li * 3 + rank * 101) % 251) / 8
                    kernel[blocks[b], 0, 0, off] = val
                    kernel[blocks[b], 0, 1, off] = -val
            worker.wait_for_save()
            assert worker.worker.drain(10)   # the store thread finished this step's stores
            errors = worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
            every = [None, None]
            dist.all_gather_object(every, sorted(errors))
            if rank == 0:
                sched.update_connector_output(KVConnectorOutput(
                    invalid_block_ids=set().union(*map(set, every))))
            return every

        src = list(range(0, 7))
        reqs_init = ["src", "dst", "victim"] if rank == 0 else []
        for rid in reqs_init:
            reqs[rid] = Request(rid, list(PROMPT), SamplingParams(max_tokens=1), None)
        report["store_errors"] = step("src", src)
        report["stores"] = worker.worker.stores_done
        dst = list(range(20, 27))
        report["load_errors"] = step("dst", dst)
        report["loads"] = worker.worker.loads_done
        # the scheduler's LOOKUP was the request's only one: no rank sent its own
        report["worker_lookups"] = sum(int(c._value.get()) for r, c in
                                       worker.worker.orch.metrics._lookups.items()
                                       if r != "skipped")
        report["exact"] = all(torch.equal(layer[src[j]].view(torch.int16),
                                          layer[dst[j]].view(torch.int16))
                              for j in range(HIT // BLOCK) for layer in layers)
        if rank == 0:
            for rid in ("src", "dst"):
                sched.request_finished(reqs[rid], [])
            deadline = time.monotonic() + 15
            while _held(http_port) != (0, 0):
                assert time.monotonic() < deadline, f"daemon still holds {_held(http_port)}"
                time.sleep(0.02)
            report["hit"] = ask("victim")
        victim = list(range(40, 47))
        t0 = time.monotonic()
        report["victim_errors"] = step("victim", victim,
                                       lambda: os.kill(daemon_pid, signal.SIGKILL))
        report["victim_secs"] = time.monotonic() - t0
        if rank == 0:
            report["again"] = sched.get_num_new_matched_tokens(reqs["victim"], 0)
            sched.shutdown()
        worker.shutdown()
    return report


def test_tp2_one_lookup_each_rank_its_shard(daemon, yaml_for):
    reports = run_ranks(_rank, free_port(), yaml_for(daemon.port), daemon.pid,
                        daemon.http_port, world=2, timeout_s=240)
    for r in reports:
        assert r["store_errors"] == [[], []] and r["stores"] == 1
        assert r["load_errors"] == [[], []] and r["loads"] == 1
        assert r["worker_lookups"] == 0                      # the scheduler's LOOKUP served
        assert r["exact"]                                    # each rank's own head, bit for bit
    assert reports[0]["hit"] == HIT
    victim = [list(range(40, 40 + HIT // BLOCK))] * 2
    for r in reports:
        assert r["victim_errors"] == victim                  # both ranks, the same blocks
        assert r["victim_secs"] < 0.2 + 2.0 + 1.0            # nobody waited on a peer
    assert reports[0]["again"] == (0, False)                 # never promised again
