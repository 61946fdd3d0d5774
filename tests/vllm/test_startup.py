"""Start-up: what the connector refuses, warns about and reads from vLLM's config (no daemon)."""

from __future__ import annotations

import logging

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from lmcache_loadback.connectors.ports import free_port
from lmcache_loadback.engines.vllm import LoadBackConnector
from lmcache_loadback.engines.vllm.settings import read_config

from .mini_engine import kv_cache_config, vllm_config


def test_fail_policy_logs_how_to_recompute(model_config, yaml_for, caplog):
    cfg = vllm_config(model_config, {"loadback.config_file": yaml_for(free_port())},
                      policy="fail")
    with caplog.at_level(logging.WARNING, logger="loadback.vllm"):
        conn = LoadBackConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(64))
    conn.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
             and "kv_load_failure_policy" in r.getMessage()]
    assert len(lines) == 1 and '"kv_load_failure_policy": "recompute"' in lines[0]


def test_recompute_policy_logs_no_warning(model_config, yaml_for, caplog):
    cfg = vllm_config(model_config, {"loadback.config_file": yaml_for(free_port())})
    with caplog.at_level(logging.WARNING, logger="loadback.vllm"):
        LoadBackConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(64)).shutdown()
    assert not [r for r in caplog.records if "kv_load_failure_policy" in r.getMessage()]


def test_pipeline_parallel_is_refused_naming_the_fix(model_config, yaml_for):
    cfg = vllm_config(model_config, {"loadback.config_file": yaml_for(free_port())})
    cfg.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ValueError, match="--pipeline-parallel-size 1"):
        LoadBackConnector(cfg, KVConnectorRole.WORKER, kv_cache_config(64))


def test_chunk_size_must_be_whole_blocks(model_config, tmp_path):
    path = tmp_path / "odd.yaml"
    path.write_text(f"mp_port: {free_port()}\nchunk_size: 48\n")
    cfg = vllm_config(model_config, {"loadback.config_file": str(path)})
    with pytest.raises(ValueError, match="not a multiple of vLLM's --block-size 32"):
        LoadBackConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(64))


def test_lmcache_mp_keys_override_the_daemon_address(yaml_for):
    cfg, _ = read_config({"loadback.config_file": yaml_for(5555),
                          "lmcache.mp.host": "tcp://127.0.0.2", "lmcache.mp.port": 6001})
    assert (cfg.mp_host, cfg.mp_port, cfg.chunk_size) == ("127.0.0.2", 6001, 64)
    cfg, _ = read_config({"lmcache.mp.host": "localhost", "lmcache.mp.port": "6002"})
    assert (cfg.mp_host, cfg.mp_port) == ("localhost", 6002)
