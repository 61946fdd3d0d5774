"""Class-level tests of the vLLM connector (`lmcache_loadback.engines.vllm`) on vLLM's classes.

Run in the vLLM venv (`make vllm-env`):

    .venv-vllm/bin/python -m pytest tests/vllm -m "not e2e" -q

What is real: vLLM 0.32's VllmConfig (ModelConfig of harness/vllm/model), KVTransferConfig,
KVCacheConfig/FullAttentionSpec, Request, KVCacheBlocks, NewRequestData, SchedulerOutput,
KVConnectorOutput and KVConnectorRole; both connector roles, one instance each, as vLLM
makes them; a KV cache in vLLM's CPU layout (`[num_blocks, num_kv_heads, block_size,
2*head_size]` per layer, all layers views of one allocation); the lmcache 0.5.6 daemon (a
subprocess on a free loopback port, stopped by PID). What `MiniEngine` plays: vLLM's scheduler
and model runner calling the connector in their order (tests/vllm/mini_engine.py).
"""

from __future__ import annotations

import os

import pytest

from lmcache_loadback.connectors.telemetry import quiet_telemetry

quiet_telemetry()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

from lmcache_loadback.testing.daemon import DaemonProcess  # noqa: E402

CHUNK = 64   # two vLLM blocks of 32


@pytest.fixture(scope="session")
def model_config():
    """vLLM's ModelConfig of the tiny Llama (about 15 s: imports vLLM, reads the config)."""
    from vllm.config import ModelConfig

    from lmcache_loadback.harness.vllm.server import MODEL_DIR

    return ModelConfig(model=str(MODEL_DIR), dtype="bfloat16", max_model_len=2048,
                       skip_tokenizer_init=True)


@pytest.fixture
def daemon():
    d = DaemonProcess(chunk_size=CHUNK, http=True).start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def yaml_for(tmp_path):
    """A loadback YAML for a daemon port, with test-friendly deadlines and heartbeat."""
    def make(port: int, **deadlines) -> str:
        dl = {"lookup_ms": 200, "retrieve_max_ms": 2000, **deadlines}
        path = tmp_path / f"loadback-{port}.yaml"
        path.write_text(
            f"mp_host: 127.0.0.1\nmp_port: {port}\nchunk_size: {CHUNK}\n"
            f"deadlines: {{{', '.join(f'{k}: {v}' for k, v in dl.items())}}}\n"
            "heartbeat: {interval_ms: 100}\n"
            "breaker: {cooldown_ms: 100, cooldown_max_ms: 200}\n")
        return str(path)
    return make
