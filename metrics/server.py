"""The /metrics exposition server: prometheus_client's own (a daemon thread), with a clear bind
error. The `loadback` CLI and the SGLang hook call `start_metrics_server(port=...)` (or
`LoadbackMetrics.serve()`) once per process; this module picks the registry, turns a failed
bind into an error naming host, port and fix, and stops the server (`.close()`).
"""
from __future__ import annotations

import errno
import socket
import threading

from prometheus_client import REGISTRY, CollectorRegistry, multiprocess, start_http_server

from lmcache_loadback.metrics.instruments import multiprocess_enabled

__all__ = ["MetricsServer", "MetricsServerBindError", "start_metrics_server"]


class MetricsServerBindError(OSError):
    """The metrics server could not bind host:port (in use, or not an address of this host)."""


class MetricsServer:
    """A running /metrics server; `.port` is the bound port, `.close()` stops it."""

    def __init__(self, httpd, thread: threading.Thread, host: str, registry) -> None:
        self._httpd = httpd
        self._thread = thread
        self.host = host
        self.port: int = httpd.server_address[1]
        self.registry = registry
        self._closed = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _resolve_registry(registry):
    if registry is not None:
        # A LoadbackMetrics (or anything holding .registry) serves its own registry.
        return getattr(registry, "registry", registry)
    if multiprocess_enabled():
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        return reg
    return REGISTRY


def start_metrics_server(host: str = "127.0.0.1", port: int = 0, registry=None) -> MetricsServer:
    """Serve `registry` on http://host:port/metrics in a daemon thread.

    registry: a CollectorRegistry or a LoadbackMetrics; None serves the MultiProcessCollector
    view in multiprocess mode, else prometheus_client's global REGISTRY. port=0 picks a free
    port (read `.port`). The default host is loopback: exposing metrics is an operator's choice.
    Raises MetricsServerBindError (an OSError) naming host:port and the fix.
    """
    reg = _resolve_registry(registry)
    try:
        httpd, thread = start_http_server(port, addr=host, registry=reg)
    except socket.gaierror as e:
        raise MetricsServerBindError(
            errno.EADDRNOTAVAIL, f"metrics server cannot resolve host {host!r} ({e}); "
            "use an address of this machine such as 127.0.0.1") from e
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            why, fix = "not an address of this machine", "use one it has, such as 127.0.0.1"
        else:
            why = "address already in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
            fix = "pick another port, or 0 for a free one"
        raise MetricsServerBindError(
            e.errno, f"metrics server cannot bind {host}:{port}: {why}; {fix}") from e
    return MetricsServer(httpd, thread, host, reg)
