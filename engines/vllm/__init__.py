"""vLLM backend: `LoadBackConnector`, a KV connector (vLLM's KV connector v1 API, vLLM 0.32),
loaded by vLLM itself (`kv_connector_module_path`) in its EngineCore and Worker processes;
docs/vllm.md has the --kv-transfer-config.
"""

from __future__ import annotations

__all__ = ["LoadBackConnector"]


def __getattr__(name: str):
    """`LoadBackConnector`, imported on first use (PEP 562): importing this package does not
    import vLLM."""
    if name == "LoadBackConnector":
        from .connector import LoadBackConnector

        globals()[name] = LoadBackConnector
        return LoadBackConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
