"""`MiniEngine`: vLLM's scheduler and model runner, reduced to the calls they make on a KV
connector, in their order (vllm/v1/core/sched/scheduler.py, kv_connector_model_runner_mixin.py).

One instance holds both roles' connectors (vLLM makes one per process), a KV cache in vLLM's
CPU layout and a block allocator. `step()` schedules requests like vLLM does for a whole
prefill: ask the connector (polling while it answers None, bounded), allocate blocks, tell the
connector, build the step's metadata, then on the worker side: load, "forward" (the blocks it
computes get KV that is a function of (token, position, layer)), save, collect load errors and
hand them back to the scheduler side.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from lmcache_loadback.engines.vllm import LoadBackConnector

BLOCK = 32
LAYERS, HEADS, HEAD = 4, 2, 64   # the tiny Llama's (harness/vllm/model/config.json)
DTYPE = torch.bfloat16


def vllm_config(model_config, extra: dict, policy: str = "recompute") -> VllmConfig:
    ktc = KVTransferConfig(kv_connector="LoadBackConnector",
                           kv_connector_module_path="lmcache_loadback.engines.vllm",
                           kv_role="kv_both", kv_connector_extra_config=extra,
                           kv_load_failure_policy=policy)
    return VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=BLOCK),
                      kv_transfer_config=ktc)


def kv_cache_config(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def kv_value(token: int, pos: int, layer: int) -> float:
    return float((token * 31 + pos * 7 + layer * 3) % 251) / 8.0


@dataclass
class StepResult:
    hits: dict[str, int] = field(default_factory=dict)     # rid -> external tokens promised
    load_errors: set[int] = field(default_factory=set)
    blocks: dict[str, list[int]] = field(default_factory=dict)


class MiniEngine:
    def __init__(self, model_config, extra: dict, *, num_blocks: int = 128,
                 policy: str = "recompute") -> None:
        cfg = vllm_config(model_config, extra, policy)
        kcc = kv_cache_config(num_blocks)
        self.worker = LoadBackConnector(cfg, KVConnectorRole.WORKER, kcc)
        self.sched = LoadBackConnector(cfg, KVConnectorRole.SCHEDULER, kcc)
        # one allocation, layer-major, each layer [blocks, heads, block, 2*head] (vLLM CPU)
        per = num_blocks * HEADS * BLOCK * 2 * HEAD
        self.raw = torch.zeros(LAYERS * per, dtype=DTYPE)
        self.layers = [self.raw[i * per:(i + 1) * per].view(num_blocks, HEADS, BLOCK, 2 * HEAD)
                       for i in range(LAYERS)]
        names = kcc.kv_cache_groups[0].layer_names
        self.worker.register_kv_caches(dict(zip(names, self.layers)))
        self.free = list(range(num_blocks))
        self.requests: dict[str, Request] = {}
        self.req_blocks: dict[str, list[int]] = {}

    # ----------------------------------------------------------- helpers

    def wait_registered(self, timeout_s: float = 30.0) -> bool:
        return all(side.orch.wait_registered(timeout_s)
                   for side in (self.sched.scheduler, self.worker.worker))

    def request(self, rid: str, prompt: list[int], **kwargs) -> Request:
        r = Request(rid, list(prompt), SamplingParams(max_tokens=1), None, **kwargs)
        self.requests[rid] = r
        return r

    def ask(self, req: Request, computed: int = 0, timeout_s: float = 10.0
            ) -> tuple[int, float, int]:
        """(tokens, seconds from the first ask to the answer, passes answered None)."""
        start = time.monotonic()
        nones = 0
        while True:
            n, is_async = self.sched.get_num_new_matched_tokens(req, computed)
            assert is_async is False
            if n is not None:
                return n, time.monotonic() - start, nones
            nones += 1
            if time.monotonic() - start > timeout_s:
                raise AssertionError(f"{req.request_id}: still None after {timeout_s} s")
            time.sleep(0.001)  # vLLM re-polls within ~2 ms

    def alloc(self, n_blocks: int, *, from_end: bool = False) -> list[int]:
        take = self.free[-n_blocks:] if from_end else self.free[:n_blocks]
        for b in take:
            self.free.remove(b)
        return take

    def forward(self, rid: str, start: int, end: int) -> None:
        """Compute KV for prompt tokens [start, end) into the request's blocks."""
        toks, blocks = self.requests[rid].prompt_token_ids, self.req_blocks[rid]
        for pos in range(start, end):
            b, off = divmod(pos, BLOCK)
            for li, layer in enumerate(self.layers):
                val = kv_value(toks[pos], pos, li)
                kernel = layer.view(-1, HEADS, 2, BLOCK, HEAD)  # how CPU_ATTN reads it
                kernel[blocks[b], :, 0, off] = val               # K row of this token
                kernel[blocks[b], :, 1, off] = -val              # V row

    def token_kv(self, rid: str, pos: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, off = divmod(pos, BLOCK)
        kernel = self.layers[layer].view(-1, HEADS, 2, BLOCK, HEAD)
        blk = self.req_blocks[rid][b]
        return kernel[blk, :, 0, off], kernel[blk, :, 1, off]

    def block_bytes(self, block: int) -> list[torch.Tensor]:
        return [layer[block].clone() for layer in self.layers]

    # ------------------------------------------------------------- a step

    def prefill(self, req: Request, *, computed: int = 0, ask: tuple | None = None,
                from_end: bool = False, before_load=None, drain: bool = True) -> StepResult:
        """Schedule `req`'s whole prompt in one step, as vLLM does for a short prompt."""
        rid = req.request_id
        ext = (ask or self.ask(req, computed))[0]
        n_tok = len(req.prompt_token_ids)
        blocks = self.alloc(-(-n_tok // BLOCK), from_end=from_end)
        self.req_blocks[rid] = blocks
        kvb = KVCacheBlocks(([KVCacheBlock(b) for b in blocks],))
        self.sched.update_state_after_alloc(req, kvb, ext)
        req.num_computed_tokens = computed + ext
        new = NewRequestData.from_request(req, (blocks,))
        so = SchedulerOutput(
            scheduled_new_reqs=[new], scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens={rid: n_tok - computed - ext},
            total_num_scheduled_tokens=n_tok - computed - ext, scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
            has_sync_kv_loads=ext > 0)
        meta = self.sched.build_connector_meta(so)
        if before_load is not None:
            before_load()
        errors = self.worker_step(meta, lambda: self.forward(rid, computed + ext, n_tok),
                                  drain=drain)
        return StepResult({rid: ext}, errors, {rid: blocks})

    def prefill_in_two(self, req: Request, first: int) -> tuple[StepResult, StepResult]:
        """A miss prefilled in two steps (chunked prefill): `first` tokens, then the rest,
        the second step as a cached request with its new blocks."""
        rid = req.request_id
        assert self.ask(req)[0] == 0
        n_tok = len(req.prompt_token_ids)
        head = self.alloc(-(-first // BLOCK))
        self.req_blocks[rid] = list(head)
        self.sched.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(b) for b in head],)), 0)
        so = SchedulerOutput(
            scheduled_new_reqs=[NewRequestData.from_request(req, (list(head),))],
            scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens={rid: first}, total_num_scheduled_tokens=first,
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            finished_req_ids=set(), free_encoder_mm_hashes=[])
        meta1 = self.sched.build_connector_meta(so)
        r1 = StepResult({rid: 0}, self.worker_step(meta1, lambda: self.forward(rid, 0, first)),
                        {rid: list(head)})
        req.num_computed_tokens = first
        tail = self.alloc(-(-n_tok // BLOCK) - len(head))
        self.req_blocks[rid] += tail
        cached = CachedRequestData(
            req_ids=[rid], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
            new_block_ids=[(list(tail),)], num_computed_tokens=[first], num_output_tokens=[0])
        so = SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=cached,
            num_scheduled_tokens={rid: n_tok - first}, total_num_scheduled_tokens=n_tok - first,
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            finished_req_ids=set(), free_encoder_mm_hashes=[])
        meta2 = self.sched.build_connector_meta(so)
        r2 = StepResult({}, self.worker_step(meta2, lambda: self.forward(rid, first, n_tok)),
                        {rid: list(self.req_blocks[rid])})
        req.num_computed_tokens = n_tok
        return r1, r2

    def preempt(self, req: Request) -> None:
        """vLLM preempts a running request: its blocks are freed, it waits again from 0."""
        rid = req.request_id
        self.free.extend(self.req_blocks.pop(rid, []))
        req.num_computed_tokens = 0
        so = SchedulerOutput.make_empty()
        so.preempted_req_ids = {rid}
        self.worker_step(self.sched.build_connector_meta(so))

    def worker_step(self, meta, forward=None, *, drain: bool = True) -> set[int]:
        """The model runner's connector calls for one step; the load errors it reported
        (handed back to the scheduler side, as vLLM's KVConnectorOutput does). `drain`: wait
        (bounded) for the step's stores, which run on the connector's store thread."""
        w = self.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        if forward is not None:
            forward()
        t0 = time.monotonic()
        w.wait_for_save()
        self.last_save_s = time.monotonic() - t0
        if drain:
            assert w.worker.drain(10.0), "stores still running after 10 s"

        w.get_finished(set())
        errors = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        self.sched.update_connector_output(KVConnectorOutput(invalid_block_ids=set(errors)))
        return errors

    def idle_step(self) -> set[int]:
        """A step with nothing scheduled (vLLM still builds and binds metadata)."""
        return self.worker_step(self.sched.build_connector_meta(SchedulerOutput.make_empty()))

    def finish(self, req: Request) -> None:
        rid = req.request_id
        self.sched.request_finished(req, self.req_blocks.get(rid, []))
        self.free.extend(self.req_blocks.pop(rid, []))

    def close(self) -> None:
        self.sched.shutdown()
        self.worker.shutdown()
