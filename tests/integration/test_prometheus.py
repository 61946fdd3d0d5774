"""Integration: promtool checks the alert rules, and a real Prometheus server scrapes the
product's /metrics endpoint, loads the alert rules and answers the dashboard's queries.

Prometheus comes from PATH; `make test` installs Debian's package first when it is missing.
Without it these tests fail with the install command, never skip.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from lmcache_loadback.metrics import start_metrics_server
from lmcache_loadback.orchestrator.instruments import product_metrics
import tests.prometheus_server as prometheus_server
from tests.prometheus_server import PrometheusServer, PrometheusUnavailable, find_prometheus

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
RULES = {"LoadbackDaemonDown", "LoadbackBreakerOpen", "LoadbackDegradeRatioHigh",
         "LoadbackRetrieveP99NearDeadline", "LoadbackStoreQueueFull",
         "LoadbackSchedulerWaitHigh", "LoadbackFencesDropped", "LoadbackL2CanaryFailing"}


@pytest.fixture(scope="module")
def tools():
    try:
        return find_prometheus()
    except PrometheusUnavailable as e:
        pytest.fail(str(e), pytrace=False)


def test_missing_prometheus_names_the_install_command(monkeypatch):
    monkeypatch.setattr(prometheus_server, "_which", lambda: (None, "/usr/bin/promtool"))
    with pytest.raises(PrometheusUnavailable) as ei:
        find_prometheus()
    msg = str(ei.value)
    assert msg.startswith("prometheus not found") and "promtool" not in msg.split(";")[0]
    assert "make test" in msg and "apt-get install -y --no-install-recommends prometheus" in msg


def _promtool(tools, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tools.promtool, *args], cwd=CONFIGS, capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(180)
def test_promtool_checks_and_unit_tests_alert_rules(tools):
    for args in (("check", "rules", "alerts.yaml"), ("test", "rules", "alerts_test.yaml"),
                 ("check", "config", "prometheus.yml")):
        r = _promtool(tools, *args)
        assert r.returncode == 0, f"promtool {' '.join(args)}:\n{r.stdout}\n{r.stderr}"
    assert f"SUCCESS: {len(RULES)} rules found" in _promtool(tools, "check", "rules", "alerts.yaml").stdout


def _values(prom: PrometheusServer, expected: dict[str, float]) -> dict[str, list[float]]:
    return {q: [v for _, v in prom.query(q)] for q in expected}


@pytest.mark.timeout(180)
def test_prometheus_scrapes_loadback_metrics(tools):
    m = product_metrics()
    for _ in range(3):
        m.transition("matched", "marked")
        m.outcome("loaded", "none", 100, 100, 4096)
    m.outcome("degraded", "retrieve_timeout", 50)
    for s in (0.002, 0.2, 0.4):
        m.observe_retrieve(s)
    m.observe_lookup(0.001, "hit")
    m.set_daemon_up(True)
    m.breaker("open")
    m.set_live("marked", 4)
    m.queue_depth("store", 3)
    m.observe_scheduler_wait(0.02)
    m.watch(pending_debts=lambda: 2, fences_dropped=lambda: 1, registered_epoch=lambda: 1)

    srv = start_metrics_server(host="127.0.0.1", port=0, registry=m)
    try:
        t0 = time.monotonic()
        with PrometheusServer(tools.prometheus, [f"127.0.0.1:{srv.port}"], scrape_interval="1s",
                              rule_files=[str(CONFIGS / "alerts.yaml")]) as prom:
            started = time.monotonic() - t0
            expected = {
                'up{job="loadback"}': 1,
                'loadback_prefix_outcomes_total{state="loaded",reason="none"}': 3,
                'loadback_prefix_outcomes_total{state="degraded",reason="retrieve_timeout"}': 1,
                'loadback_prefix_outcomes_total{state="degraded",reason="aborted"}': 0,  # pre-created
                'loadback_recomputed_tokens_total{reason="retrieve_timeout"}': 50,
                "loadback_promised_tokens_total": 350,
                "loadback_loaded_bytes_total": 3 * 4096,
                "loadback_daemon_up": 1,
                "loadback_breaker_state": 2,
                'loadback_live_prefixes{state="marked"}': 4,
                "loadback_retrieve_duration_seconds_count": 3,
                "loadback_store_queue_depth": 3,
                "loadback_scheduler_wait_seconds_count": 1,
                "loadback_owed_releases": 2,
                "loadback_fences_dropped_total": 1,
                "loadback_registered_epoch": 1,
            }
            want = {q: [float(v)] for q, v in expected.items()}
            try:
                scraped = prom.wait_for(lambda: _values(prom, expected) == want, 60, "expected series")
            except TimeoutError as e:
                raise AssertionError(f"{e}: got {_values(prom, expected)}\n{prom.log_tail()}") from None
            print(f"\nprometheus ready in {started:.1f}s; expected values after {scraped:.1f}s more")

            # A live change reaches Prometheus on a later scrape.
            m.outcome("loaded", "none", 10, 10, 40)
            prom.wait_for(lambda: _values(prom, {"loadback_loaded_tokens_total": 0})
                          == {"loadback_loaded_tokens_total": [310.0]}, 30, "second scrape")

            # The real server loads the alert rules.
            groups = prom.api("rules")["groups"]
            assert [g["name"] for g in groups] == ["loadback"]
            assert {r["name"] for r in groups[0]["rules"]} == RULES
            assert all(r["health"] != "err" for r in groups[0]["rules"]), groups[0]["rules"]

            # Every dashboard query is valid PromQL for this server (errors raise).
            dash = json.loads((CONFIGS / "grafana_dashboard.json").read_text())
            for p in dash["panels"]:
                for t in p["targets"]:
                    expr = t["expr"].replace("$__rate_interval", "1m").replace("$instance", ".*")
                    prom.query(expr)

            # Alerts evaluate against scraped data: breaker open and then daemon down go pending.
            m.set_daemon_up(False)

            def pending() -> set[str]:
                return {a["labels"]["alertname"] for a in prom.api("alerts")["alerts"]
                        if a["state"] in ("pending", "firing")}
            prom.wait_for(lambda: {"LoadbackBreakerOpen", "LoadbackDaemonDown"} <= pending(), 60,
                          "alerts pending")
            assert "LoadbackDegradeRatioHigh" not in pending()  # needs 10m of history
            pid = prom.proc.pid
        assert prom.proc.poll() is not None, f"prometheus pid {pid} still running"
    finally:
        srv.close()
