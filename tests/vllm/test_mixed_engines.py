"""A vLLM engine (its own classes, both connector roles) and an SGLang engine's token pool on one
real daemon load each other's KV byte for byte: the vLLM side here is `LoadBackConnector` as
vLLM drives it (the scheduler's LOOKUP handed to the worker, stores on the store thread);
the SGLang side is the backend's `mha_layout` over MHATokenToKVPool-shaped buffers, as in
tests/integration/test_mixed_engines.py (SGLang itself is not in this venv).

Run: .venv-vllm/bin/python -m pytest tests/vllm/test_mixed_engines.py -q
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_mixed_engines import MODEL, PROMPT, SglangPool, differing, prompt_kv

from .conftest import CHUNK
from .mini_engine import BLOCK, LAYERS, MiniEngine

pytestmark = pytest.mark.daemon


@pytest.fixture
def engine(model_config, daemon, yaml_for):
    """The vLLM engine under the model name the SGLang side uses (one YAML for both)."""
    path = yaml_for(daemon.port, lookup_ms=5000, retrieve_max_ms=10000)  # a busy 2-core box
    with open(path, "a") as f:
        f.write(f"model_name: {MODEL}\n")
    eng = MiniEngine(model_config, {"loadback.config_file": path})
    try:
        assert eng.wait_registered(), "connector never registered with the daemon"
        yield eng
    finally:
        eng.close()


@pytest.fixture
def sglang(daemon):
    sg = SglangPool(daemon, "auto")
    try:
        assert sg.orch.wait_registered(10)
        yield sg
    finally:
        sg.close()


def vllm_kv(eng: MiniEngine, rid: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[layers, tokens, heads, head]` of `rid`'s first `n` tokens, where vLLM's CPU
    attention reads them."""
    kv = [[eng.token_kv(rid, pos, li) for pos in range(n)] for li in range(LAYERS)]
    return (torch.stack([torch.stack([k for k, _ in row]) for row in kv]),
            torch.stack([torch.stack([v for _, v in row]) for row in kv]))


def test_sglang_loads_what_vllm_stored(engine, sglang):
    assert CHUNK == 64 and BLOCK == 32
    toks, k, v = prompt_kv(5)

    def forward(rid: str, start: int, end: int) -> None:
        """The model's forward: a K and a V of their own for every head and dim."""
        blocks = engine.req_blocks[rid]
        for pos in range(start, min(end, PROMPT)):
            b, off = divmod(pos, BLOCK)
            for li, layer in enumerate(engine.layers):
                kernel = layer.view(-1, k.shape[2], 2, BLOCK, k.shape[3])  # CPU_ATTN's reading
                kernel[blocks[b], :, 0, off] = k[li, pos]
                kernel[blocks[b], :, 1, off] = v[li, pos]

    engine.forward = forward
    res = engine.prefill(engine.request("src", toks + [11]))  # its whole chunks are stored
    assert res.hits == {"src": 0} and not res.load_errors
    assert engine.worker.worker.stores_done == 1
    slots = sglang.place(PROMPT)
    assert sglang.load("sglang-load", toks[:PROMPT], slots) == PROMPT
    assert differing(k, v, *sglang.read(slots)) == []


def test_vllm_loads_what_sglang_stored(engine, sglang):
    toks, k, v = prompt_kv(6)
    slots = sglang.place(PROMPT)
    sglang.compute(slots, k, v)
    assert sglang.store("sglang-store", toks, slots)
    req = engine.request("dst", toks + [11])   # vLLM leaves the last token to compute
    res = engine.prefill(req)
    assert res.hits == {"dst": PROMPT} and not res.load_errors
    assert engine.worker.worker.loads_done == 1
    assert differing(k, v, *vllm_kv(engine, "dst", PROMPT)) == []
