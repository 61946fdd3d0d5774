"""The cache's model name: by default the engine's model, so engines of two models on one daemon
never read each other's KV; one explicit `model_name` shares it.

Before, every engine keyed its chunks under `loadback` unless its YAML said otherwise: a
second model whose chunks have the same size (two fine-tunes of one base) loaded the first
one's KV as its own, byte for byte, and counted it a hit. Real daemon, engines built the way
SGLang's backend and vLLM's connector build them (`create_orchestrator` with the engine's
model)."""

from __future__ import annotations

import pytest
import torch

from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.orchestrator import LoadBackConfig, PrefixState
from lmcache_loadback.orchestrator.factory import create_orchestrator
from tests.conftest import CHUNK, kv_of, make_pool, same_kv

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(120)]

LAYOUT = KVLayout(num_layers=2, num_heads=2, head_dim=16, dtype=torch.bfloat16, chunk_size=CHUNK)


def _engine(daemon, model: str, yaml_model: str | None = None):
    cfg = LoadBackConfig.from_dict({"mp_port": daemon.port, "chunk_size": CHUNK,
                                    **({"model_name": yaml_model} if yaml_model else {})})
    pool = make_pool(LAYOUT, 512)
    orch = create_orchestrator(cfg, layout=LAYOUT, kv_pool=pool, engine_model=model)
    assert orch.wait_registered(20)
    return orch, pool


def _stored(orch, pool, toks) -> None:
    assert orch.store("s", toks, torch.arange(len(toks)))
    orch.finish("s")


def _loaded(orch, pool, src_pool, toks) -> int:
    """Tokens loaded for `toks` (byte-exact against what `src_pool` stored, when any)."""
    m = orch.match("r", toks)
    try:
        if m.tokens == 0:
            return 0
        dst = torch.arange(200, 200 + m.tokens)
        res = orch.load_back("r", dst)
        assert res.state == PrefixState.LOADED
        assert same_kv(kv_of(src_pool, torch.arange(m.tokens)), kv_of(pool, dst))
        return res.loaded_tokens
    finally:
        orch.finish("r")


def test_engines_of_two_models_do_not_read_each_others_kv_by_default(daemon):
    toks = list(range(7000, 7000 + 4 * CHUNK))
    a, pool_a = _engine(daemon, "/models/llama-8b-chat")
    b, pool_b = _engine(daemon, "/models/llama-8b-code")  # same layout, another model
    a2, pool_a2 = _engine(daemon, "/models/llama-8b-chat")  # a second engine of A's model
    try:
        _stored(a, pool_a, toks)
        assert _loaded(b, pool_b, pool_a, toks) == 0  # before: 64 tokens of A's KV, a "hit"
        assert _loaded(a2, pool_a2, pool_a, toks) == len(toks)
        assert a.connector.model_name == "/models/llama-8b-chat"
    finally:
        for o in (a, b, a2):
            o.close()


def test_one_model_name_in_the_yaml_shares_kv_across_model_paths(daemon):
    toks = list(range(9000, 9000 + 4 * CHUNK))
    a, pool_a = _engine(daemon, "/mnt/a/llama", yaml_model="llama-8b")
    b, pool_b = _engine(daemon, "/mnt/b/llama", yaml_model="llama-8b")
    try:
        assert b.connector.model_name == "llama-8b"
        _stored(a, pool_a, toks)
        assert _loaded(b, pool_b, pool_a, toks) == len(toks)
    finally:
        a.close()
        b.close()


def test_no_engine_model_and_no_yaml_name_keep_the_fallback():
    assert LoadBackConfig().cache_model() == "loadback"
    assert LoadBackConfig().cache_model("/m") == "/m"
    assert LoadBackConfig.from_dict({"model_name": "x"}).cache_model("/m") == "x"
