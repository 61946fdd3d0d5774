"""Fixtures of the GPU tests (skipped where no CUDA device exists)."""

from __future__ import annotations

import pytest
import torch

from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector

T = 30.0


@pytest.fixture
def conns():
    """make(daemon, layout, **kw): a connector on CUDA device 0, registered; all closed after
    the test."""
    made = []

    def make(d, layout, **kw):
        c = LMCacheMPConnector(d.endpoint, layout, device=torch.device("cuda", 0), **kw)
        c.register(T)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
