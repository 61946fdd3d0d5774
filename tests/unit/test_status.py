"""`loadback status`: parsing a deployment's /metrics into the operator's fields, the table
and --json, exit 69 with one line naming the URL and the fix, and no torch or SGLang import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from lmcache_loadback.metrics import start_metrics_server
from lmcache_loadback.orchestrator import status
from lmcache_loadback.cli import DEFAULT_STATUS_URL, main
from lmcache_loadback.orchestrator.config import LoadBackConfig
from lmcache_loadback.orchestrator.exit_codes import EXIT_UNAVAILABLE
from lmcache_loadback.orchestrator.instruments import product_metrics

ROOT = Path(__file__).resolve().parents[2]
URL = "http://127.0.0.1:1/metrics"  # nothing listens on port 1


def busy_metrics(now: float = 1_700_000_000.0):
    m = product_metrics()
    clock = iter([now - 40, now - 30, now - 5])
    m.wall_clock = lambda: next(clock)
    m.daemon_info("tcp://10.0.0.7:5555", "auto")
    m.set_daemon_up(True)
    m.transfer_mode("shm")
    m.breaker("half_open")
    m.live_delta("marked", 2)
    m.live_delta("retrieving", 1)
    m.queue_depth("lookup", 4)
    m.queue_depth("store", 9)
    m.store_skipped()
    m.observe_scheduler_wait(0.010)
    m.observe_scheduler_wait(0.030)
    m.outcome("degraded", "lookup_timeout", 16)   # 40 s ago
    m.outcome("degraded", "lookup_timeout", 0)    # 30 s ago: the more frequent reason
    m.outcome("degraded", "retrieve_error", 32)   # 5 s ago: the last one
    m.watch(pending_debts=lambda: 3, fences_dropped=lambda: 2, registered_epoch=lambda: 4)
    return m


def test_summarize_reads_every_field():
    now = 1_700_000_000.0
    m = busy_metrics(now)
    st = status.summarize(status.parse(generate_latest(m.registry).decode()), url="u", now=now)
    assert st["daemon"] == {"endpoint": "tcp://10.0.0.7:5555", "transfer_setting": "auto",
                            "up": True, "refused": []}
    assert st["registration_epoch"] == 4
    assert st["breaker"] == "half_open"
    assert st["transfer_mode"] == "shm"
    assert st["live_prefixes"]["total"] == 3
    assert st["live_prefixes"]["by_state"]["marked"] == 2
    assert st["owed_releases"] == 3
    assert st["queues"] == {"lookup": 4, "store": 9, "store_limit": 64, "stores_skipped": 1}
    assert st["fences_dropped"] == 2
    assert st["scheduler_wait"] == {"calls": 2, "mean_ms": 20.0}
    # The latest degrade, not the most frequent one.
    assert st["last_refusal"]["reason"] == "retrieve_error"
    assert st["last_refusal"]["ago_s"] == 5.0 and st["last_refusal"]["count"] == 1
    table = status.render(st)
    for line in ("daemon          tcp://10.0.0.7:5555 (up; transfer setting auto)",
                 "registration    epoch 4", "breaker         half_open",
                 "transfer mode   shm", "live prefixes   3 (marked 2, retrieving 1)",
                 "owed releases   3", "lookup queue    4",
                 "store queue     9 of 64 (1 skipped at the bound)", "fences dropped  2",
                 "scheduler wait  2 calls, mean 20.0 ms",
                 "last refusal    retrieve_error (5 s ago; 1 so far)"):
        assert f"\n  {line}" in table, (line, table)


def test_a_fresh_deployment_reads_not_registered_and_no_refusal():
    m = product_metrics()
    st = status.summarize(status.parse(generate_latest(m.registry).decode()), url="u")
    assert st["registration_epoch"] == -1 and st["last_refusal"] is None
    table = status.render(st)
    assert "registration    not registered" in table
    assert "transfer mode   not chosen yet" in table
    assert "last refusal    none" in table and "daemon          n/a (DOWN)" in table


def test_an_older_deployment_without_the_new_series_prints_n_a():
    reg = CollectorRegistry()
    Counter("loadback_lookups_total", "x", ["result"], registry=reg).labels(result="hit").inc()
    st = status.summarize(status.parse(generate_latest(reg).decode()), url="u")
    table = status.render(st)
    for field in ("daemon", "registration", "breaker", "owed releases", "lookup queue",
                  "fences dropped", "last refusal"):
        assert any(l.split()[:len(field.split())] == field.split() and l.rstrip().endswith("n/a")
                   for l in table.splitlines()), (field, table)


def test_sglang_multiprocess_exposition_with_other_series_parses():
    text = ("# HELP sglang:num_running_reqs x\n# TYPE sglang:num_running_reqs gauge\n"
            'sglang:num_running_reqs{model_name="m"} 2.0\n'
            + generate_latest(busy_metrics().registry).decode())
    assert status.parse(text)["loadback_owed_releases"] == [({}, 3.0)]
    assert "sglang:num_running_reqs" not in status.parse(text)


def test_unreadable_endpoint_exits_69_with_one_line_naming_url_and_fix(capsys):
    code = main(["status", "--url", URL, "--timeout-s", "2"])
    err = capsys.readouterr().err
    assert code == EXIT_UNAVAILABLE == 69
    assert err.count("\n") == 1 and URL in err and "Traceback" not in err
    assert "metrics: {enabled: true}" in err and "--enable-metrics" in err and "--url" in err


def test_an_endpoint_without_loadback_series_exits_69(capsys):
    reg = CollectorRegistry()
    Counter("other_total", "x", registry=reg).inc()
    with start_metrics_server(registry=reg) as srv:
        code = main(["status", "--url", srv.url])
    err = capsys.readouterr().err
    assert code == 69 and "no loadback_* series" in err and srv.url in err


def test_json_output_is_the_summary(capsys):
    with start_metrics_server(registry=busy_metrics()) as srv:
        code = main(["status", "--url", srv.url, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["url"] == srv.url and out["owed_releases"] == 3
    assert out["queues"]["store"] == 9 and out["last_refusal"]["reason"] == "retrieve_error"


def test_default_url_is_metrics_port_default():
    assert DEFAULT_STATUS_URL == status.DEFAULT_URL
    assert DEFAULT_STATUS_URL == f"http://127.0.0.1:{LoadBackConfig().metrics.port}/metrics"


LIGHT = """
import sys
from lmcache_loadback.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in sys.modules if m in ("torch", "lmcache") or m.startswith((
    "torch.", "sglang", "lmcache.", "lmcache_loadback.harness", "lmcache_loadback.orchestrator.core")))
print("HEAVY", heavy, file=sys.stderr)
sys.exit(code if not heavy else 99)
"""


@pytest.mark.parametrize("served", [False, True])
def test_status_imports_neither_torch_nor_sglang(served):
    if served:
        srv = start_metrics_server(registry=busy_metrics())
        url = srv.url
    else:
        srv, url = None, URL
    try:
        r = subprocess.run([sys.executable, "-c", LIGHT, "status", "--url", url], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    finally:
        if srv:
            srv.close()
    assert r.returncode == (0 if served else 69), r.stderr[-2000:]
    assert "HEAVY []" in r.stderr


def test_a_daemon_refused_at_registration_shows_on_the_daemon_line():
    m = busy_metrics()
    m.daemon_refused("chunk_size", True)
    st = status.summarize(status.parse(generate_latest(m.registry).decode()), url="u")
    assert st["daemon"]["refused"] == ["chunk_size"]
    assert "(up; REFUSED at registration: chunk_size; transfer setting auto)" in status.render(st)


def test_the_l2_canary_line_says_off_ok_or_failing():
    now = 1_700_000_000.0
    m = product_metrics()
    m.wall_clock = lambda: now - 30

    def line() -> str:
        st = status.summarize(status.parse(generate_latest(m.registry).decode()), url="u",
                              now=now)
        return next(l for l in status.render(st).splitlines() if l.startswith("  l2 canary"))

    assert line().split(None, 2)[2] == ("off (l2.canary_interval_ms 0, no mp_http_port, or a "
                                        "daemon without --l2-adapter)")
    m.l2_canary_running(60)
    m.l2_canary_checked("unchecked")
    assert line().endswith("no check made yet (1 unchecked)")
    m.l2_canary_checked("ok")
    assert line().endswith("ok 30 s ago (every 60 s; 1 ok, 0 failed)")
    m.l2_canary_checked("lost")
    m.l2_canary_checked("timeout")
    assert line().endswith("FAILING: 2 checks in a row (last ok 30 s ago); 1 lost, 1 timeout "
                           "so far: stores may not reach L2")
