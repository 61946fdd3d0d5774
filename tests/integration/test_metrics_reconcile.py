"""Invariant 7: after a scripted mix of hits, misses and injected failures against the real
daemon, every counter equals the outcomes the orchestrator returned, exactly."""

from __future__ import annotations

import pytest
import torch

from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.connectors.errors import SlotsError
from lmcache_loadback.testing.fault_proxy import FaultProxy, FaultRule
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator import LoadBackConfig, LoadBackOrchestrator, PrefixState
from tests.conftest import CHUNK, make_pool

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(120)]


def test_counters_equal_outcomes_exactly(layout):
    d = DaemonProcess(chunk_size=CHUNK, http=True).start()
    proxy = FaultProxy(d.endpoint, layout=layout, seed=1).start()
    pool = make_pool(layout, 4096)
    cfg = LoadBackConfig.from_dict({
        "mp_port": int(proxy.endpoint.rsplit(":", 1)[1]), "chunk_size": CHUNK,
        "deadlines": {"lookup_ms": 100, "retrieve_base_ms": 200, "retrieve_max_ms": 200,
                      "retrieve_per_ki_token_ms": 0, "control_ms": 100},
        "heartbeat": {"interval_ms": 50}, "breaker": {"consecutive_failures": 100}})
    orch = LoadBackOrchestrator(cfg, LMCacheMPConnector(proxy.endpoint, layout), kv_pool=pool)
    seen = {"loaded": 0, "loaded_tokens": 0, "promised": 0, "degraded": {}}
    nxt = iter(range(100, 4096, 64 * 2))

    def note(res, promised):
        seen["promised"] += promised
        if res.state == PrefixState.LOADED:
            seen["loaded"] += 1
            seen["loaded_tokens"] += res.loaded_tokens
        else:
            seen["degraded"][res.reason.value] = seen["degraded"].get(res.reason.value, 0) + 1

    try:
        assert orch.wait_registered(20)
        prompts = [list(range(i * 1000, i * 1000 + 64)) for i in range(4)]
        for i, p in enumerate(prompts):
            assert orch.store(f"s{i}", p, torch.arange(i * 64, i * 64 + 64))
            orch.finish(f"s{i}")
        # 3 hits that load
        for i in range(3):
            n = orch.match(f"hit{i}", prompts[i]).tokens
            note(orch.load_back(f"hit{i}", torch.arange(next(nxt), next(nxt) + n)[:n]), n)
            orch.finish(f"hit{i}")
        # 2 misses: no machine, no outcome
        for i in range(2):
            assert orch.match(f"miss{i}", list(range(90000 + i * 100, 90000 + i * 100 + 64))).tokens == 0
            orch.finish(f"miss{i}")
        # a lost LOOKUP reply: degraded lookup_timeout at match time
        rule = proxy.add_rule(FaultRule("drop", op="lookup", direction="reply", count=1))
        assert orch.match("lost", prompts[3]).tokens == 0
        assert proxy.fired(rule) == 1
        seen["degraded"]["lookup_timeout"] = 1
        orch.finish("lost")
        # a corrupt KV reply on every attempt: degraded at load_back, slots untouched
        proxy.add_rule(FaultRule("truncate_kv", op="prepare_retrieve", count=1))
        n = orch.match("corrupt", prompts[0]).tokens
        note(orch.load_back("corrupt", torch.arange(3000, 3000 + n)), n)
        orch.finish("corrupt")
        proxy.clear()
        # promised then aborted
        n = orch.match("aborted", prompts[1]).tokens
        seen["promised"] += n
        orch.abort("aborted")
        seen["degraded"]["aborted"] = seen["degraded"].get("aborted", 0) + 1
        # wrong slot count: a clear error, and the prefix is settled as bad_slots
        n = orch.match("bad", prompts[2]).tokens
        seen["promised"] += n
        with pytest.raises(SlotsError):
            orch.load_back("bad", torch.arange(5))
        seen["degraded"]["bad_slots"] = 1
        orch.finish("bad")

        s = orch.metrics.snapshot()
        assert s["loadback_prefix_outcomes_total{reason=none,state=loaded}"] == seen["loaded"] == 3
        for reason, count in seen["degraded"].items():
            assert s[f"loadback_prefix_outcomes_total{{reason={reason},state=degraded}}"] == count
        degraded_total = sum(v for k, v in s.items()
                             if k.startswith("loadback_prefix_outcomes_total") and "degraded" in k)
        assert degraded_total == sum(seen["degraded"].values())
        assert s["loadback_loaded_tokens_total"] == seen["loaded_tokens"] == 3 * 64
        assert s["loadback_promised_tokens_total"] == seen["promised"]
        recomputed = sum(v for k, v in s.items() if k.startswith("loadback_recomputed_tokens_total"))
        assert recomputed == seen["promised"] - seen["loaded_tokens"]
        assert s["loadback_lookups_total{result=miss}"] == 2
        assert s["loadback_lookups_total{result=error}"] == 1
        assert s["loadback_lookups_total{result=hit}"] == 6
        assert s["loadback_timeouts_total{op=lookup}"] == 1
        assert s["loadback_retries_total{op=retrieve}"] == 0  # corrupt data is not retry-safe
        assert s["loadback_prefix_transitions_total{dst=loaded,src=retrieving}"] == 3
        assert s["loadback_loaded_bytes_total"] == 3 * 64 * layout.bytes_per_token
    finally:
        orch.close()
        proxy.close()
        d.stop()
