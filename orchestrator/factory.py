"""Build an orchestrator from a config: `mode: mp` (external daemon) or `mode: ip`
(LMCache's server inside this process). One path serves both; the mode is YAML, never code."""

from __future__ import annotations

import logging

from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector

from .config import LoadBackConfig
from .core import LoadBackOrchestrator

log = logging.getLogger("loadback")


def create_orchestrator(config: LoadBackConfig, *, layout: KVLayout, kv_pool, metrics=None,
                        tp_group=None, kv_rank: int = 0, world_size: int = 1,
                        metrics_offset: int | None = None,
                        engine_model: str | None = None) -> LoadBackOrchestrator:
    """`engine_model`: the engine's model (SGLang's --model-path, vLLM's --model), the cache's
    model name unless the YAML sets `model_name`.
    `kv_rank`/`world_size`: this process's TP rank and the TP size. With a sharded (MHA)
    layout each rank is its own KV rank; with an MLA layout see `kv_geometry`.
    `metrics_offset`: with `metrics.enabled`, this process serves on `metrics.port` + it
    (default `kv_rank`; unique per process of the engine, e.g. SGLang's DP replicas)."""
    if layout.chunk_size != (config.ip.chunk_size if config.mode == "ip" else config.chunk_size):
        raise ValueError(
            f"KV layout chunk_size {layout.chunk_size} differs from the config's "
            f"{'ip.chunk_size' if config.mode == 'ip' else 'chunk_size'}; they must match the "
            "daemon's --chunk-size")
    owned = None
    endpoint = config.endpoint
    if config.mode == "ip":
        from .inprocess import InProcessDaemon

        owned = InProcessDaemon(config.ip).start()
        endpoint = owned.endpoint
    kv_world, kv_worker, readers, writer = kv_geometry(layout, kv_rank, world_size)
    connector = LMCacheMPConnector(
        endpoint, layout, model_name=config.cache_model(engine_model), world_size=kv_world,
        kv_rank=kv_worker, num_kv_readers=readers, writer=writer, transfer=config.transfer,
        connect_timeout_s=config.deadlines.connect_ms / 1000,
        # a CUDA pool: page-lock the daemon's segment at registration, not at the first load
        device=_pool_device(kv_pool))
    orch = LoadBackOrchestrator(config, connector, metrics=metrics, tp_group=tp_group,
                                kv_pool=kv_pool)
    watch_daemon(orch, endpoint, config.transfer)
    if owned is not None:
        orch.on_close(owned.close)
    # One canary per engine: its rank 0 that holds KV (vLLM's scheduler process holds none);
    # it idles while l2.canary_interval_ms or mp_http_port is 0 (both reload live).
    if config.mode == "mp" and kv_rank == 0 and kv_pool is not None:
        from .l2_canary import start_l2_canary

        start_l2_canary(orch)
    if config.metrics.enabled:
        serve_metrics(orch, config, kv_rank if metrics_offset is None else metrics_offset)
    return orch


def serve_metrics(orch: LoadBackOrchestrator, config: LoadBackConfig, offset: int) -> None:
    """One exposition server per process, on `metrics.port + offset` (0: a free port). A
    port that cannot be bound is one ERROR naming it and the key to set, and the engine
    runs without it: metrics never stop an engine from starting."""
    from lmcache_loadback.metrics import start_metrics_server

    port = config.metrics.port + offset if config.metrics.port else 0
    try:
        server = start_metrics_server(config.metrics.host, port, registry=orch.metrics)
    except OSError as exc:
        log.error("loadback metrics server not started, running without it: %s (this "
                  "process serves on metrics.port + %d = %d; set metrics.port to the first "
                  "of a free range, metrics.port: 0 for a free one, or metrics.enabled: "
                  "false)", exc, offset, port)
        return
    orch.metrics_server = server
    orch.on_close(server.close)


def watch_daemon(orch: LoadBackOrchestrator, endpoint: str, transfer: str) -> None:
    """What `loadback status` reads that the orchestrator's parts own: the daemon's address
    (`loadback_daemon_info`, set here at build time), and, read at every scrape and
    heartbeat, the owed releases, the registration epoch (the daemon link's) and the
    transport's dropped fences (timed-out sockets closed before their fence answered)."""
    link, connector = orch.link, orch.connector
    orch.metrics.daemon_info(endpoint, transfer)
    orch.metrics.watch(
        pending_debts=orch.pending_debts,
        registered_epoch=lambda: link.registered_epoch,
        fences_dropped=lambda: connector.fences_dropped)


def kv_geometry(layout: KVLayout, tp_rank: int, tp_size: int) -> tuple[int, int, int, bool]:
    """(KV world size, worker id, readers per object, writer) the daemon sees for a TP rank.

    Sharded KV (MHA): one KV rank per TP rank, one reader each, every rank writes its shard.
    TP-replicated MLA (every rank holds the same latent KV), as lmcache 0.5.6's SGLang MP
    connector does it (`_resolve_kv_geometry` with mla_only, PP 1): one KV object for the
    group (world size 1, every rank worker 0), read-locked once per TP rank, stored by TP
    rank 0 alone."""
    if layout.mla:
        return 1, 0, tp_size, tp_rank == 0
    return tp_size, tp_rank, 1, True


def _pool_device(kv_pool):
    try:
        dev = kv_pool.k_buffer[0].device
    except (AttributeError, IndexError, TypeError):
        return None
    return dev if dev.type == "cuda" else None
