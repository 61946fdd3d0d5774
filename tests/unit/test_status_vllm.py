"""`loadback status` of vLLM's /metrics, where every process (the scheduler, each worker rank)
ships a snapshot of its series and the API server exposes them side by side, labelled
`loadback_process` (engines/vllm/stats.py, through metrics/snapshots.py as here): one set of
lines per process, never their sum (summed, two open breakers read `breaker 4.0`)."""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry, generate_latest

from lmcache_loadback.cli import main
from lmcache_loadback.metrics import start_metrics_server
from lmcache_loadback.metrics.snapshots import PROCESS_LABEL, families, snapshot
from lmcache_loadback.orchestrator import status
from lmcache_loadback.orchestrator.instruments import product_metrics

NOW = 1_700_000_000.0
#: what vLLM's scheduler process ships (a part of engines/vllm/stats.SCHEDULER_FAMILIES)
SCHEDULER_SHIPS = frozenset({"loadback_lookups", "loadback_breaker_state", "loadback_daemon_up",
                             "loadback_registered_epoch",
                             "loadback_last_skipped_timestamp_seconds"})


class Exposed:
    """A collector exposing snapshots as vLLM's API server does (`LoadBackPromMetrics`)."""

    def __init__(self, latest) -> None:
        self.latest = latest

    def describe(self):
        return []

    def collect(self):
        return families(self.latest)


def rank(epoch: int, *, up: bool, breaker: str):
    m = product_metrics()
    m.daemon_info("tcp://10.0.0.7:5555", "auto")
    m.set_daemon_up(up)
    m.breaker(breaker)
    m.transfer_mode("pickle")
    m.watch(pending_debts=lambda: 0, fences_dropped=lambda: 0, registered_epoch=lambda: epoch)
    return m


def vllm_text(engines=("0",)) -> str:
    """The loadback_* part of vLLM's /metrics during an outage seen by every process: the
    scheduler's breaker open with 3 LOOKUPs skipped, rank0 and rank1 down with their breakers
    open; rank1 shipped 30 s before the others (an idle process ships nothing)."""
    sched = rank(1, up=False, breaker="open")
    sched.wall_clock = lambda: NOW - 2
    for _ in range(3):
        sched.observe_lookup(None, "skipped")
    latest = []
    for engine in engines:
        base = {"model_name": "tiny", "engine": engine}
        latest += [
            (base | {PROCESS_LABEL: "scheduler"},
             snapshot(sched.registry, SCHEDULER_SHIPS, taken_at=NOW - 1)),
            (base | {PROCESS_LABEL: "rank1"},
             snapshot(rank(1, up=False, breaker="open").registry, taken_at=NOW - 31)),
            (base | {PROCESS_LABEL: "rank0"},
             snapshot(rank(1, up=False, breaker="open").registry, taken_at=NOW - 1)),
        ]
    reg = CollectorRegistry()
    reg.register(Exposed(latest))
    return generate_latest(reg).decode()


def test_each_process_reads_apart_never_summed():
    st = status.report(status.parse(vllm_text()), url="u", now=NOW)
    assert list(st["processes"]) == ["scheduler", "rank0", "rank1"]
    for name in ("rank0", "rank1"):
        p = st["processes"][name]
        assert p["breaker"] == "open" and p["registration_epoch"] == 1
        assert p["daemon"]["up"] is False and p["transfer_mode"] == "pickle"
    sched = st["processes"]["scheduler"]
    assert sched["breaker"] == "open" and sched["daemon"]["up"] is False
    assert sched["registration_epoch"] == 1 and sched["live_prefixes"] is None  # not shipped
    assert sched["last_refusal"] == {"reason": "skipped", "at": NOW - 2, "ago_s": 2.0,
                                     "count": 3}
    assert st["processes"]["rank1"]["snapshot_age_s"] == 31.0
    assert sched["snapshot_age_s"] == 1.0


def test_the_table_has_one_set_of_lines_per_process():
    table = status.render(status.report(status.parse(vllm_text()), url="u", now=NOW))
    lines = table.splitlines()
    assert lines[0] == "loadback status of u" and lines[1] == f"  {status.PER_PROCESS_SAYS}"
    heads = [i for i, line in enumerate(lines) if line.startswith("  process ")]
    assert [lines[i] for i in heads] == ["  process scheduler", "  process rank0",
                                         "  process rank1"]
    rank1 = lines[heads[2] + 1:]
    assert "    breaker         open" in rank1 and "    registration    epoch 1" in rank1
    assert "    daemon          tcp://10.0.0.7:5555 (DOWN; transfer setting auto)" in rank1
    assert "    snapshot        31 s old" in rank1
    assert "4.0" not in table and "epoch 2" not in table, table


def test_several_engines_name_each_process_with_its_engine():
    st = status.report(status.parse(vllm_text(engines=("0", "1"))), url="u", now=NOW)
    assert list(st["processes"]) == [
        "scheduler (engine 0)", "rank0 (engine 0)", "rank1 (engine 0)",
        "scheduler (engine 1)", "rank0 (engine 1)", "rank1 (engine 1)"]
    assert all(p["breaker"] == "open" for p in st["processes"].values())


def test_an_endpoint_of_one_process_keeps_one_set_of_lines():
    m = rank(3, up=True, breaker="closed")
    st = status.report(status.parse(generate_latest(m.registry).decode()), url="u")
    assert "processes" not in st and st["registration_epoch"] == 3
    assert st["snapshot_age_s"] is None
    table = status.render(st)
    assert "process" not in table and "snapshot" not in table


def test_json_output_is_per_process(capsys):
    reg = CollectorRegistry()
    reg.register(Exposed([({PROCESS_LABEL: "rank0"},
                           snapshot(rank(2, up=True, breaker="closed").registry))]))
    with start_metrics_server(registry=reg) as srv:
        code = main(["status", "--url", srv.url, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["url"] == srv.url
    assert out["processes"]["rank0"]["registration_epoch"] == 2
    assert out["processes"]["rank0"]["breaker"] == "closed"
