"""The L2 canary in an engine environment without lmcache: one WARNING that names the fix,
every check counted `unchecked`, never an exception per check."""

from __future__ import annotations

import logging
import sys

import pytest
from prometheus_client import CollectorRegistry

from lmcache_loadback.orchestrator import LoadBackConfig
from lmcache_loadback.orchestrator import l2_canary, l2_marker
from lmcache_loadback.orchestrator.instruments import product_metrics


@pytest.fixture
def no_lmcache(monkeypatch):
    """lmcache's key resolver cannot be imported (None in sys.modules raises ImportError)."""
    monkeypatch.setitem(sys.modules, "lmcache.v1.multiprocess.cache_control.key_resolver", None)


def test_keys_without_lmcache_name_the_install_and_the_off_switch(no_lmcache):
    with pytest.raises(l2_marker.KeysUnavailable) as info:
        l2_marker.object_keys("m", list(range(32)), "", 16, "blake3")
    assert "pip install --no-deps lmcache==0.5.6" in str(info.value)
    assert "l2.canary_interval_ms: 0" in str(info.value)


def test_a_lasting_cause_is_logged_once_and_each_check_counted(no_lmcache, monkeypatch, caplog):
    cfg = LoadBackConfig.from_dict({"mp_http_port": 1})
    canary = l2_canary.L2Canary(lambda: cfg, product_metrics(CollectorRegistry()),
                                background=False)

    def keys_first(_cfg):  # the check as far as its keys: the daemon's part is not under test
        l2_marker.object_keys("m", list(range(32)), "", 16, "blake3")

    monkeypatch.setattr(canary, "_check", keys_first)
    with caplog.at_level(logging.DEBUG, logger=canary.log.name):
        assert [canary.check() for _ in range(3)] == ["unchecked"] * 3
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "lmcache" in warned[0].getMessage(), warned
    assert not any(r.exc_info for r in caplog.records)
    snap = canary.metrics.snapshot()
    assert snap['loadback_l2_canary_checks_total{result=unchecked}'] == 3, snap
