"""The `loadback_*` series on vLLM's own /metrics, through vLLM's KV connector stats: each
process (the scheduler side, every worker rank) ships a snapshot of its registry at most once a
second while vLLM runs steps; vLLM carries it to the API server, which exposes the latest
snapshot of each process with vLLM's labels and `loadback_process` (docs/vllm.md, "Metrics"),
and when it was taken (`loadback_snapshot_timestamp_seconds`: an idle server ships none).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from lmcache_loadback.metrics.snapshots import PROCESS_LABEL, Snapshot, families, snapshot

#: at most one snapshot per process this often (seconds)
SHIP_EVERY_S = 1.0
#: families the scheduler process ships: its LOOKUPs, their queue and its view of the daemon
#: (what `loadback status` shows of it). Its prefixes all end `unused` once their load is
#: handed to the worker ranks, which count the loads.
SCHEDULER_FAMILIES = frozenset({
    "loadback_lookups", "loadback_lookup_duration_seconds", "loadback_timeouts",
    "loadback_daemon_call_duration_seconds",
    "loadback_retries", "loadback_breaker_state", "loadback_breaker_transitions",
    "loadback_daemon_up", "loadback_reregistrations", "loadback_late_replies",
    "loadback_stale_releases_dropped", "loadback_transfer_mode", "loadback_releases_failed",
    "loadback_daemon_info", "loadback_daemon_refused", "loadback_registered_epoch",
    "loadback_last_skipped_timestamp_seconds", "loadback_lookup_queue_depth",
    "loadback_owed_releases", "loadback_fences_dropped", "loadback_worker_thread_restarts",
})


class Shipper:
    """One process's snapshots for `get_kv_connector_stats` (called every step): the first
    call ships, later ones every `SHIP_EVERY_S`; None in between. A snapshot costs ~0.6 ms
    and ~14 KB through vLLM's queues: shipped per step, it slowed a loaded hit measurably on
    2 cores."""

    def __init__(self, process: str, registry, families: frozenset[str] | None = None) -> None:
        self.process = process
        self._registry = registry
        self._families = families
        self._next = 0.0

    def take(self, now: float | None = None) -> "LoadBackStats | None":
        now = time.monotonic() if now is None else now
        if self._registry is None or now < self._next:
            return None
        self._next = now + SHIP_EVERY_S
        return LoadBackStats(data={self.process: snapshot(self._registry, self._families,
                                                          taken_at=time.time())})


class LoadBackStats(KVConnectorStats):
    """`data`: process name -> its latest snapshot. Aggregating keeps the newer per process."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "LoadBackStats":
        return LoadBackStats(data={**self.data, **(other.data or {})})

    def reduce(self) -> dict[str, int | float]:
        """What vLLM's periodic log line shows: the prefixes each outcome ended with, summed
        over the processes that count them."""
        out: dict[str, int | float] = {}
        for fams in self.data.values():
            for name, _typ, _doc, samples in fams:
                if name != "loadback_prefix_outcomes":
                    continue
                for sample, labels, value in samples:
                    if sample.endswith("_total"):
                        key = f"prefixes_{labels.get('state')}"
                        out[key] = out.get(key, 0) + int(value)
        return out

    def is_empty(self) -> bool:
        return not self.data


class LoadBackPromMetrics(KVConnectorPromMetrics):
    """In vLLM's API server: a collector in prometheus_client's global registry (the one
    vLLM's /metrics serves with one API server) exposing the latest snapshot of every
    (engine, process)."""

    _current: "LoadBackPromMetrics | None" = None
    _lock = threading.Lock()

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._latest: dict[tuple[int, str], Snapshot] = {}
        with LoadBackPromMetrics._lock:
            old, LoadBackPromMetrics._current = LoadBackPromMetrics._current, self
            if old is not None:
                REGISTRY.unregister(old)
            REGISTRY.register(self)

    def describe(self) -> list:
        return []  # no fixed names: the families come with the snapshots

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        with LoadBackPromMetrics._lock:
            for process, fams in (transfer_stats_data or {}).items():
                self._latest[(engine_idx, str(process))] = fams

    def collect(self):
        with LoadBackPromMetrics._lock:
            latest = sorted(self._latest.items())
        return families((dict(zip(self._labelnames, map(str, self.per_engine_labelvalues.get(
            engine_idx, [])))) | {PROCESS_LABEL: process}, fams)
            for (engine_idx, process), fams in latest)
