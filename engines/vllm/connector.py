"""`LoadBackConnector`: vLLM's KV connector v1 class, one instance per role and process, handing
each call to its side (`scheduler.py`, `worker.py`)."""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from . import settings as _settings
from . import stats as _stats
from .meta import LoadBackMeta

log = logging.getLogger("loadback.vllm")


def _log_through_vllm() -> None:
    """The product's `loadback` loggers write through vLLM's own handler (its format, its
    process prefix) at INFO, unless the application configured them already."""
    ours = logging.getLogger("loadback")
    if ours.handlers:
        return
    handlers = logging.getLogger("vllm").handlers
    for h in handlers:
        ours.addHandler(h)
    if handlers and ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)


class LoadBackConnector(KVConnectorBase_V1):
    """vLLM calls only the methods of the process's own role: the scheduler role's in
    EngineCore (`self.scheduler`), the worker role's in each Worker (`self.worker`); the other
    side is None."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        self.settings = _settings.from_vllm(vllm_config, kv_cache_config)
        self.scheduler = self.worker = None
        self._failed_now: set[str] = set()
        self._shipper = None  # this process's loadback_* snapshots for vLLM's /metrics
        if role == KVConnectorRole.SCHEDULER:
            from .scheduler import SchedulerSide

            _settings.warn_failure_policy(self.settings)
            self.scheduler = SchedulerSide(self.settings)
            self._shipper = _stats.Shipper("scheduler", _registry(self.scheduler.orch),
                                           _stats.SCHEDULER_FAMILIES)
        else:
            from .worker import WorkerSide

            self.worker = WorkerSide(self.settings,
                                     kv_cache_config.kv_cache_groups[0].layer_names)
        log.info("loadback: vLLM connector (%s) for daemon %s (config: %s)", role.name,
                 self.settings.config.endpoint, self.settings.source)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss

    # ------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict) -> None:
        group, rank = None, 0
        if self.settings.tp_size > 1:
            from vllm.distributed.parallel_state import get_tp_group

            tp = get_tp_group()
            group, rank = tp.cpu_group, tp.rank_in_group
        self.worker.register(kv_caches, tp_group=group, rank=rank)
        self._shipper = _stats.Shipper(f"rank{rank}", _registry(self.worker.orch))

    def _meta(self) -> LoadBackMeta | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, LoadBackMeta) else None

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._meta()
        self._failed_now = self.worker.start_load(meta) if meta and meta.loads else set()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole before the forward starts

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # stores run once per step, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._meta()
        if meta and meta.stores:
            self.worker.save(meta, self._failed_now)
        self._failed_now = set()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    # ------------------------------------------------------ vLLM's /metrics

    def get_kv_connector_stats(self):
        return self._shipper.take() if self._shipper is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return _stats.LoadBackStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return _stats.LoadBackPromMetrics(vllm_config, metric_types, labelnames,
                                          per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_errors() if self.worker is not None else set()

    # ---------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def shutdown(self) -> None:
        for side in (self.scheduler, self.worker):
            if side is not None:
                side.close()


def _registry(orch):
    """The registry to ship, or None in prometheus_client's multiprocess mode (vLLM with
    several API servers), where vLLM's /metrics reads only the processes' mmap files."""
    m = orch.metrics
    return None if m.multiprocess else m.registry
