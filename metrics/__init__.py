"""Prometheus instruments and the /metrics server; never imports `orchestrator`."""
from lmcache_loadback.metrics.instruments import LoadbackMetrics, UnknownLabelError
from lmcache_loadback.metrics.server import MetricsServer, MetricsServerBindError, start_metrics_server

__all__ = [
    "LoadbackMetrics",
    "MetricsServer",
    "MetricsServerBindError",
    "UnknownLabelError",
    "start_metrics_server",
]
