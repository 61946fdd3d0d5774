"""`mode: ip`: LMCache's own MP cache server, run inside the engine process (the cache lives and
dies with the engine), reached over ZMQ on loopback like the external daemon, so the same
orchestrator path serves both modes.
"""

from __future__ import annotations

import threading

from lmcache_loadback.connectors.telemetry import quiet_telemetry

from .config import InProcess


class InProcessUnavailable(RuntimeError):
    pass


class InProcessDaemon:
    """Start with `start()`, stop with `close()`; `endpoint` is where it listens.

    lmcache 0.5.6 builds its ZMQ server as `tcp://{host}:{port}` (build_zmq_request_server),
    so an `inproc://` or `ipc://` endpoint is not available: the server binds 127.0.0.1 on a
    free port instead, which stays on loopback."""

    _lock = threading.Lock()

    def __init__(self, settings: InProcess, host: str = "127.0.0.1", port: int = 0) -> None:
        from lmcache_loadback.connectors.ports import free_port

        self.settings = settings
        self.host = host
        self.port = port or free_port(host)
        self._server = None
        self._engine = None

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def start(self) -> "InProcessDaemon":
        quiet_telemetry()
        try:
            import argparse

            from lmcache.v1.distributed.config import (
                add_storage_manager_args,
                parse_args_to_config,
            )
            from lmcache.v1.mp_observability.config import (
                add_observability_args,
                parse_args_to_observability_config,
            )
            from lmcache.v1.multiprocess.config import (
                add_mp_server_args,
                parse_args_to_mp_server_config,
            )
            from lmcache.v1.multiprocess.server import run_cache_server
        except ImportError as exc:
            raise InProcessUnavailable(
                f"mode: ip needs lmcache==0.5.6 importable in the engine process ({exc}); "
                "install it (pip install 'lmcache-loadback[daemon]') or use mode: mp"
            ) from exc
        parser = argparse.ArgumentParser()
        add_mp_server_args(parser)
        add_storage_manager_args(parser)
        add_observability_args(parser)
        args = parser.parse_args([
            "--host", self.host, "--port", str(self.port),
            "--chunk-size", str(self.settings.chunk_size),
            "--l1-size-gb", str(self.settings.l1_size_gb), "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto", "--disable-metrics", "--no-l1-use-lazy",
        ])
        with self._lock:
            self._server, self._engine = run_cache_server(
                mp_config=parse_args_to_mp_server_config(args),
                storage_manager_config=parse_args_to_config(args),
                obs_config=parse_args_to_observability_config(args),
                return_engine=True,
                start_prometheus_http_server=False,
            )
        return self

    def close(self) -> None:
        with self._lock:
            server, engine, self._server, self._engine = self._server, self._engine, None, None
        if server is not None:
            server.close()
        if engine is not None:
            engine.close()
