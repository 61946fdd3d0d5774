"""mode: ip: LMCache's own server inside this process, selected by YAML alone."""

from __future__ import annotations

import pytest
import torch

from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.orchestrator import LoadBackConfig, PrefixState
from lmcache_loadback.orchestrator.factory import create_orchestrator
from tests.conftest import kv_of, make_pool, same_kv

pytestmark = pytest.mark.timeout(120)


def test_ip_mode_from_yaml_loads_byte_exact(tmp_path):
    f = tmp_path / "ip.yaml"
    f.write_text("mode: ip\nip:\n  chunk_size: 16\n  l1_size_gb: 0.1\nheartbeat:\n  interval_ms: 50\n")
    cfg = LoadBackConfig.from_yaml(f)
    layout = KVLayout(num_layers=2, num_heads=2, head_dim=16, dtype=torch.bfloat16, chunk_size=16)
    pool = make_pool(layout, 512)
    orch = create_orchestrator(cfg, layout=layout, kv_pool=pool)
    try:
        assert orch.wait_registered(20)
        toks = list(range(5000, 5096))
        assert orch.store("s", toks, torch.arange(96))
        orch.finish("s")
        assert orch.match("r", toks).tokens == 96
        dst = torch.arange(200, 296)
        res = orch.load_back("r", dst)
        assert res.state == PrefixState.LOADED and res.loaded_tokens == 96
        assert same_kv(kv_of(pool, torch.arange(96)), kv_of(pool, dst))
        orch.finish("r")
    finally:
        orch.close()


def test_layout_chunk_mismatch_is_a_clear_error():
    cfg = LoadBackConfig.from_dict({"mode": "mp", "chunk_size": 256})
    layout = KVLayout(num_layers=1, num_heads=1, head_dim=8, dtype=torch.float16, chunk_size=16)
    with pytest.raises(ValueError, match="chunk_size 16 differs from the config's chunk_size"):
        create_orchestrator(cfg, layout=layout, kv_pool=make_pool(layout, 64))


def test_metrics_enabled_in_yaml_serves_metrics_on_loopback(tmp_path):
    import urllib.request

    cfg = LoadBackConfig.from_dict({"mode": "ip", "ip": {"chunk_size": 16, "l1_size_gb": 0.1},
                                    "metrics": {"enabled": True, "port": 0}})
    layout = KVLayout(num_layers=1, num_heads=2, head_dim=8, dtype=torch.float16, chunk_size=16)
    orch = create_orchestrator(cfg, layout=layout, kv_pool=make_pool(layout, 64))
    try:
        assert orch.metrics_server.host == "127.0.0.1"
        body = urllib.request.urlopen(orch.metrics_server.url, timeout=5).read().decode()
        assert "loadback_config_generation 1.0" in body
    finally:
        orch.close()
