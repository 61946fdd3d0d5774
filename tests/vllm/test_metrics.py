"""The loadback_* series on vLLM's /metrics: both sides' snapshots through vLLM's own KV
connector stats path (`KVConnectorProm`, built as vLLM's Prometheus stat logger builds it),
after a real store and load against the real daemon, and `loadback status` reading them per
process."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

from lmcache_loadback.engines.vllm import stats
from lmcache_loadback.orchestrator import status

from .mini_engine import MiniEngine
from .test_connector import HIT, PROMPT, stored

pytestmark = pytest.mark.daemon


def exposed() -> dict[tuple[str, frozenset], float]:
    """What prometheus_client's global registry (vLLM's /metrics) exposes now."""
    out = {}
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(seen: dict, name: str, **labels) -> float:
    want = {(k, str(v)) for k, v in labels.items()}
    return sum(v for (n, ls), v in seen.items() if n == name and want <= ls)


def test_both_sides_series_reach_vllms_registry(model_config, daemon, yaml_for, monkeypatch):
    monkeypatch.setattr(stats, "SHIP_EVERY_S", 0.0)
    eng = MiniEngine(model_config, {"loadback.config_file": yaml_for(daemon.port)})
    try:
        assert eng.wait_registered()
        prom = KVConnectorProm(eng.sched._vllm_config, ["model_name", "engine"],
                               {0: ["tiny", "0"]})
        stored(eng)
        dst = eng.request("dst", PROMPT)
        ask = eng.ask(dst)
        assert ask[0] == HIT
        assert not eng.prefill(dst, ask=ask, from_end=True).load_errors
        # vLLM's order: the worker's stats come with its output, the scheduler's are
        # aggregated onto them, the dict goes to the API server's stat logger.
        got = eng.worker.get_kv_connector_stats().aggregate(eng.sched.get_kv_connector_stats())
        prom.observe(got.to_dict(), 0)
        seen = exposed()
        base = {"model_name": "tiny", "engine": "0"}
        assert value(seen, "loadback_prefix_outcomes_total", state="loaded",
                     loadback_process="rank0", **base) == 1
        assert value(seen, "loadback_loaded_tokens_total", loadback_process="rank0") == HIT
        assert value(seen, "loadback_lookups_total", result="hit",
                     loadback_process="scheduler", **base) >= 1
        assert value(seen, "loadback_daemon_up", loadback_process="rank0") == 1
        # the scheduler's prefixes (all `unused` once handed off) are not shipped
        assert value(seen, "loadback_prefix_outcomes_total", loadback_process="scheduler") == 0
        # vLLM's log line for the interval
        assert got.reduce().get("prefixes_loaded") == 1
        # `loadback status` of that /metrics: one set of lines per process, never summed
        st = status.report(status.parse(generate_latest(REGISTRY).decode()), url="vllm")
        assert list(st["processes"]) == ["scheduler", "rank0"], st
        for process in st["processes"].values():
            assert process["breaker"] == "closed" and process["daemon"]["up"] is True
            assert process["registration_epoch"] == 0 and process["snapshot_age_s"] < 60
        assert st["processes"]["rank0"]["live_prefixes"] is not None
        assert st["processes"]["scheduler"]["live_prefixes"] is None  # its prefixes: unused
        print(status.render(st))
        # one snapshot per SHIP_EVERY_S and process
        monkeypatch.setattr(stats, "SHIP_EVERY_S", 60.0)
        for side in (eng.worker, eng.sched):
            assert side.get_kv_connector_stats() is not None   # its interval was 0 before
            assert side.get_kv_connector_stats() is None
    finally:
        eng.close()
        old = stats.LoadBackPromMetrics._current
        if old is not None:
            REGISTRY.unregister(old)
            stats.LoadBackPromMetrics._current = None
