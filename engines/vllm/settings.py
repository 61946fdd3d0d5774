"""The connector's settings from vLLM's config: the product's YAML, LMCache's `lmcache.mp.*`
keys, the KV geometry from vLLM's KV cache config, and the start-up refusals.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from lmcache_loadback.connectors.errors import UnsupportedKVPool
from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.orchestrator import LoadBackConfig

log = logging.getLogger("loadback.vllm")

CONFIG_KEY = "loadback.config_file"
STAGING_KEY = "loadback.staging_tokens"
SCHED_METRICS_KEY = "loadback.scheduler_metrics_port"
FIX = "start vLLM without --kv-transfer-config (or with another kv_connector)"
#: The share of the GPU memory left free after vLLM allocated its KV cache that the CUDA
#: store region may take; the rest stays for vLLM's CUDA graphs and the copies' temporaries.
FREE_SHARE = 0.5


@dataclass(frozen=True)
class Settings:
    config: LoadBackConfig
    layout: KVLayout          # what the daemon registers (layers, KV heads, head size, dtype)
    block_size: int           # vLLM's --block-size
    staging_tokens: int       # the most tokens one load or store moves (whole chunks)
    failure_policy: str       # vLLM's kv_load_failure_policy
    source: str               # where the config came from, for log lines
    tp_size: int = 1          # vLLM's --tensor-parallel-size: one KV rank per TP rank
    #: where the scheduler process serves its own loadback_* series (None: not served)
    scheduler_metrics_port: int | None = None
    #: `loadback.staging_tokens` was set (else it is --max-model-len)
    staging_set: bool = False
    #: vLLM's --model: the cache's model name unless the YAML sets model_name
    model: str | None = None

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size


def read_config(extra: dict[str, Any]) -> tuple[LoadBackConfig, str]:
    """The product's YAML (`loadback.config_file`), else the defaults; LMCache's own
    `lmcache.mp.host` / `lmcache.mp.port` keys override the daemon's address."""
    path = extra.get(CONFIG_KEY)
    cfg = LoadBackConfig.from_yaml(path) if path else LoadBackConfig()
    changes: dict[str, Any] = {}
    host = extra.get("lmcache.mp.host")
    if host:
        changes["mp_host"] = str(host).removeprefix("tcp://")
    port = extra.get("lmcache.mp.port")
    if port not in (None, ""):
        changes["mp_port"] = int(port)
    if changes:
        cfg = LoadBackConfig.from_dict(
            {**msgspec.to_builtins(cfg), **changes}, source=f"{path or '<defaults>'} + "
            "kv_connector_extra_config")
    return cfg, str(path or "built-in defaults")


def from_vllm(vllm_config, kv_cache_config) -> Settings:
    """Settings for this engine; UnsupportedKVPool / ValueError (one line naming the fix) for
    what this connector does not serve. Both sides (scheduler and worker) derive the same
    values from the same vLLM config, so what the scheduler promises is what the worker can
    load (chunk alignment, staging size)."""
    ktc = vllm_config.kv_transfer_config
    extra = dict(ktc.kv_connector_extra_config or {})
    par = vllm_config.parallel_config
    tp, pp = int(par.tensor_parallel_size), int(par.pipeline_parallel_size)
    dcp = int(getattr(par, "decode_context_parallel_size", 1) or 1)
    if pp != 1 or dcp != 1:
        raise ValueError(
            f"loadback: the vLLM connector supports --pipeline-parallel-size 1 and "
            f"--decode-context-parallel-size 1 only (got {pp} and {dcp}); start with both at "
            f"1 (tensor parallelism is supported), or {FIX}")
    cfg, source = read_config(extra)
    if cfg.mode != "mp":
        raise ValueError(f"loadback: {source}: mode {cfg.mode!r} is not supported by the vLLM "
                         "connector; set mode: mp (the LMCache daemon over ZMQ)")
    block_size = int(vllm_config.cache_config.block_size)
    layout = layout_of(kv_cache_config, cfg.chunk_size)
    if cfg.chunk_size % block_size:
        raise ValueError(
            f"loadback: chunk_size {cfg.chunk_size} ({source}, the daemon's --chunk-size) is "
            f"not a multiple of vLLM's --block-size {block_size}; use a chunk size that is")
    staging = int(extra.get(STAGING_KEY) or vllm_config.model_config.max_model_len)
    staging = staging // cfg.chunk_size * cfg.chunk_size
    if staging <= 0:
        raise ValueError(f"loadback: {STAGING_KEY} ({staging}) must hold at least one chunk "
                         f"({cfg.chunk_size} tokens)")
    sched_port = extra.get(SCHED_METRICS_KEY)
    return Settings(cfg, layout, block_size, staging, str(ktc.kv_load_failure_policy), source,
                    tp, None if sched_port in (None, "") else int(sched_port),
                    staging_set=bool(extra.get(STAGING_KEY)),
                    model=getattr(vllm_config.model_config, "model", None))


def store_tokens_for(settings: Settings, free_bytes: int, device: str = "cuda") -> int:
    """The CUDA store region's tokens, given the bytes `device` has free once vLLM allocated
    its KV cache (`torch.cuda.mem_get_info` at register_kv_caches): memory outside
    --gpu-memory-utilization. Each token costs twice its KV bytes (the region, and a store's
    chunks gathered on the device) and all of it may take `FREE_SHARE` of what is free. The
    default (--max-model-len) is bounded by that, with a WARNING; an explicit
    `loadback.staging_tokens` that does not fit, or less than one chunk, is refused: one
    ERROR line naming the figures and the key, then ValueError."""
    c, per = settings.chunk_size, 2 * settings.layout.bytes_per_token
    want, fits = settings.staging_tokens, int(free_bytes * FREE_SHARE) // per // c * c
    if want <= fits:
        return want
    gib = 2**30
    why = (f"loadback: a store region of {want} tokens ({STAGING_KEY}"
           f"{'' if settings.staging_set else ', by default --max-model-len'}) needs "
           f"{want * per / gib:.1f} GiB on {device} outside --gpu-memory-utilization (2 x "
           f"{settings.layout.bytes_per_token // 1024} KiB per token), {free_bytes / gib:.1f} "
           f"GiB are free after vLLM's KV cache and it may take {FREE_SHARE:.0%} of them")
    if settings.staging_set or fits < c:
        msg = (f"{why}: set {STAGING_KEY} to at most {fits} (whole chunks of {c})" if fits >= c
               else f"{why}, less than one chunk ({c} tokens): lower --gpu-memory-utilization "
                    f"to leave GPU memory free, or {FIX}")
        log.error(msg)
        raise ValueError(msg)
    log.warning("%s: the store region holds %d tokens, a prompt of more is not stored (set "
                "%s to choose)", why, fits, STAGING_KEY)
    return fits


def layout_of(kv_cache_config, chunk_size: int) -> KVLayout:
    """The chunk layout from vLLM's KV cache config: one full-attention group, K and V of one
    head size, no quantized KV; anything else refused at start-up."""
    groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
    if len(groups) != 1:
        raise UnsupportedKVPool(
            f"loadback: the model has {len(groups)} KV cache groups (hybrid attention); the "
            f"vLLM connector serves one full-attention group only; {FIX}")
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    quant = getattr(spec, "kv_quant_mode", None)
    if (kind != "FullAttentionSpec" or getattr(spec, "sliding_window", None)
            or getattr(spec, "attention_chunk_size", None)
            or (quant is not None and getattr(quant, "value", quant) != 0)
            or getattr(spec, "head_size_v", spec.head_size) != spec.head_size):
        raise UnsupportedKVPool(
            f"loadback: KV cache spec {kind} is not full attention with K and V of one head "
            f"size; the vLLM connector serves full-attention MHA/GQA only; {FIX}")
    dtype = spec.dtype
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedKVPool(f"loadback: KV cache dtype {dtype!r} is not a torch dtype; {FIX}")
    return KVLayout(len(groups[0].layer_names), int(spec.num_kv_heads), int(spec.head_size),
                    dtype, chunk_size)


def warn_failure_policy(settings: Settings) -> None:
    """vLLM's default kv_load_failure_policy fails the request when a load fails."""
    if settings.failure_policy == "fail":
        log.warning(
            "loadback: kv_load_failure_policy is 'fail': a load the LMCache daemon fails "
            "(daemon down, killed or restarted between LOOKUP and RETRIEVE) fails that request "
            "(HTTP 500) instead of recomputing it; add \"kv_load_failure_policy\": \"recompute\" "
            "to --kv-transfer-config to recompute instead")
