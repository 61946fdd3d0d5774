"""vLLM backend: `LoadBackConnector`, a KV connector (vLLM's KV connector v1 API, vLLM 0.32).

Loaded by vLLM itself (`kv_connector_module_path`), in the EngineCore process (scheduler side)
and in each Worker process (worker side):

    --kv-transfer-config '{"kv_connector": "LoadBackConnector",
        "kv_connector_module_path": "lmcache_loadback.engines.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"loadback.config_file": "loadback.yaml"}}'

The class is imported on first use (PEP 562): importing this package does not import vLLM.
"""

from __future__ import annotations

__all__ = ["LoadBackConnector"]


def __getattr__(name: str):
    if name == "LoadBackConnector":
        from .connector import LoadBackConnector

        globals()[name] = LoadBackConnector
        return LoadBackConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
