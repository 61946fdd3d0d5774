"""The vLLM connector's CUDA store region lives outside --gpu-memory-utilization: its size is
bounded by the GPU memory vLLM left free (injected here as a figure), and what cannot fit is
refused at start-up with one ERROR line naming the figures and the key to set."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.engines.vllm.settings import FREE_SHARE, STAGING_KEY, Settings, \
    store_tokens_for
from lmcache_loadback.orchestrator import LoadBackConfig

GIB = 2**30
#: An 8B Llama: 32 layers x 8 KV heads x 128 x K,V bf16 = 128 KiB a token.
LLAMA_8B = KVLayout(32, 8, 128, torch.bfloat16, 256)


def settings(staging: int, staging_set: bool = False) -> Settings:
    return Settings(LoadBackConfig(), LLAMA_8B, 16, staging, "recompute", "test",
                    staging_set=staging_set)


def test_a_128k_default_is_bounded_by_what_vllm_left_free(caplog):
    """--max-model-len 131072 by default needs 2 x 16 GiB; with 20 GiB free the region takes
    what half of it holds, in whole chunks, and says so once."""
    s = settings(131072)
    with caplog.at_level(logging.WARNING, logger="loadback.vllm"):
        got = store_tokens_for(s, 20 * GIB, "cuda:0")
    assert got == int(20 * GIB * FREE_SHARE) // (2 * 131072) // 256 * 256 == 40960
    assert 2 * got * LLAMA_8B.bytes_per_token <= 20 * GIB * FREE_SHARE
    (rec,) = caplog.records
    assert rec.levelname == "WARNING" and "\n" not in rec.getMessage()
    assert "131072 tokens" in rec.getMessage() and "32.0 GiB" in rec.getMessage()
    assert "20.0 GiB are free" in rec.getMessage() and STAGING_KEY in rec.getMessage()


def test_what_fits_is_kept_and_nothing_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="loadback.vllm"):
        assert store_tokens_for(settings(8192), 40 * GIB) == 8192
        assert store_tokens_for(settings(8192, staging_set=True), 40 * GIB) == 8192
    assert caplog.records == []


def test_an_explicit_size_that_does_not_fit_is_refused_naming_the_key(caplog):
    with caplog.at_level(logging.ERROR, logger="loadback.vllm"), \
            pytest.raises(ValueError) as exc:
        store_tokens_for(settings(131072, staging_set=True), 20 * GIB, "cuda:1")
    msg = str(exc.value)
    assert "\n" not in msg and f"set {STAGING_KEY} to at most 40960" in msg
    assert "cuda:1" in msg and "32.0 GiB" in msg and "20.0 GiB are free" in msg
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert caplog.records[0].getMessage() == msg


def test_less_than_one_chunk_free_is_refused_even_by_default(caplog):
    s = settings(131072)
    with caplog.at_level(logging.ERROR, logger="loadback.vllm"), \
            pytest.raises(ValueError, match="less than one chunk .* --gpu-memory-utilization"):
        store_tokens_for(s, 2 * 256 * LLAMA_8B.bytes_per_token - 1)
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    # exactly one chunk's worth at FREE_SHARE fits
    assert store_tokens_for(dataclasses.replace(s), 2 * 2 * 256 * LLAMA_8B.bytes_per_token) == 256
