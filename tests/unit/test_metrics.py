"""Unit tests for metrics/: pre-created children, exact series movement, closed label sets,
the /metrics server, multiprocess mode, and that configs/ only query exposed metric names."""
from __future__ import annotations

import ast
import enum
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from lmcache_loadback.metrics import LoadbackMetrics, MetricsServerBindError, UnknownLabelError, start_metrics_server
from lmcache_loadback.metrics.instruments import DURATION_BUCKETS
from lmcache_loadback.orchestrator.instruments import label_sets, product_metrics

ROOT = Path(__file__).resolve().parents[2]
# The label sets production uses, from the one function the orchestrator builds its metrics with.
LABELS = label_sets()
STATES, REASONS, OPS, TRANSITIONS = (LABELS[k] for k in ("states", "reasons", "ops", "transitions"))


#: The wall clock `make()` pins (loadback_last_degraded_timestamp_seconds reads it).
NOW = 1_700_000_000.0


def make(**kw) -> LoadbackMetrics:
    m = LoadbackMetrics(**{**LABELS, **kw})
    m.wall_clock = lambda: NOW
    return m


def diff(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    assert set(before) == set(after), f"series appeared/vanished: {set(before) ^ set(after)}"
    return {k: round(after[k] - before[k], 9) for k in after if after[k] != before[k]}


def exposition(m: LoadbackMetrics) -> str:
    return generate_latest(m.registry).decode()


# ---- pre-created children ----

def test_fresh_instance_exposes_every_child_at_zero():
    m = make()
    text = exposition(m)
    assert 'loadback_prefix_outcomes_total{reason="retrieve_timeout",state="degraded"} 0.0' in text
    assert 'loadback_prefix_outcomes_total{reason="none",state="loaded"} 0.0' in text
    for r in REASONS:
        assert f'loadback_prefix_outcomes_total{{reason="{r}",state="degraded"}} 0.0' in text
        assert f'loadback_recomputed_tokens_total{{reason="{r}"}} 0.0' in text
    for src, dst in TRANSITIONS:
        assert f'loadback_prefix_transitions_total{{dst="{dst}",src="{src}"}} 0.0' in text
    assert text.count("loadback_prefix_transitions_total{") == len(TRANSITIONS)
    for res in ("hit", "miss", "error", "skipped"):
        assert f'loadback_lookups_total{{result="{res}"}} 0.0' in text
    for op in OPS:
        assert f'loadback_retries_total{{op="{op}"}} 0.0' in text
        assert f'loadback_timeouts_total{{op="{op}"}} 0.0' in text
    for to in ("closed", "half_open", "open"):
        assert f'loadback_breaker_transitions_total{{to="{to}"}} 0.0' in text
    for s in STATES:
        assert f'loadback_live_prefixes{{state="{s}"}} 0.0' in text
    for r in REASONS:
        assert f'loadback_last_degraded_timestamp_seconds{{reason="{r}"}} 0.0' in text
    snap = m.snapshot()
    # Two start non-zero: the store queue's bound, and "not registered yet" (-1).
    starts = {"loadback_store_queue_limit": 64.0, "loadback_registered_epoch": -1.0}
    assert {k: v for k, v in snap.items() if v} == starts
    for name in ("loadback_loaded_tokens_total", "loadback_loaded_bytes_total", "loadback_promised_tokens_total",
                 "loadback_breaker_state", "loadback_daemon_up",
                 "loadback_reregistrations_total", "loadback_late_replies_total", "loadback_config_generation",
                 "loadback_config_reload_failures_total", "loadback_lookup_duration_seconds_count",
                 "loadback_retrieve_duration_seconds_count", "loadback_lookup_queue_depth",
                 "loadback_store_queue_depth", "loadback_stores_skipped_total",
                 "loadback_scheduler_wait_seconds_count", "loadback_owed_releases",
                 "loadback_fences_dropped_total"):
        assert name in snap
    # Outcomes: one loaded child and one per degrade reason, nothing else.
    assert sum(k.startswith("loadback_prefix_outcomes_total{") for k in snap) == 1 + len(REASONS)


def test_daemon_calls_are_the_wire_operations():
    """Every operation the connector sends has its pre-created series, and no other."""
    from lmcache_loadback.connectors.wire import OP_PLACES
    from lmcache_loadback.metrics.labels import DAEMON_CALLS

    assert DAEMON_CALLS == tuple(OP_PLACES)
    snap = make().snapshot()
    counts = {k for k in snap if k.startswith("loadback_daemon_call_duration_seconds_count{")}
    assert counts == {f"loadback_daemon_call_duration_seconds_count{{op={op}}}" for op in OP_PLACES}


def test_label_sets_come_from_the_state_table_and_enums():
    from lmcache_loadback.orchestrator.states import DegradeReason, PrefixState, transition_pairs

    assert set(STATES) == {s.value for s in PrefixState}
    assert set(REASONS) == {r.value for r in DegradeReason}
    assert set(TRANSITIONS) == set(transition_pairs())
    snap = make().snapshot()
    for r in DegradeReason:  # a reason added to the enum is pre-created with no other edit
        assert snap[f"loadback_prefix_outcomes_total{{reason={r.value},state=degraded}}"] == 0


def test_orchestrator_default_metrics_are_the_product_label_sets():
    import torch

    from lmcache_loadback.connectors.kv_layout import KVLayout
    from lmcache_loadback.testing.memory import InMemoryConnector
    from lmcache_loadback.orchestrator import LoadBackConfig, LoadBackOrchestrator

    layout = KVLayout(num_layers=1, num_heads=2, head_dim=8, dtype=torch.float16, chunk_size=16)
    orch = LoadBackOrchestrator(LoadBackConfig.from_dict({"chunk_size": 16}), InMemoryConnector(layout),
                                start_heartbeat=False)
    try:
        assert set(orch.metrics.snapshot()) == set(product_metrics().snapshot())
    finally:
        orch.close()


def test_histogram_buckets_log_spaced_0_1ms_to_60s():
    assert DURATION_BUCKETS[0] == 0.0001 and DURATION_BUCKETS[-1] == 60
    for b in (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60):
        assert b in DURATION_BUCKETS
    assert 18 <= len(DURATION_BUCKETS) <= 22 and list(DURATION_BUCKETS) == sorted(DURATION_BUCKETS)
    snap = make().snapshot()
    les = [k for k in snap if k.startswith("loadback_retrieve_duration_seconds_bucket{")]
    assert len(les) == len(DURATION_BUCKETS) + 1  # + le=+Inf


def test_transitions_argument_limits_precreated_pairs():
    m = make(transitions=[("matched", "marked"), ("marked", "retrieving")])
    snap = m.snapshot()
    keys = [k for k in snap if k.startswith("loadback_prefix_transitions_total{")]
    assert sorted(keys) == ["loadback_prefix_transitions_total{dst=marked,src=matched}",
                            "loadback_prefix_transitions_total{dst=retrieving,src=marked}"]
    with pytest.raises(UnknownLabelError):
        m.transition("matched", "loaded")
    with pytest.raises(UnknownLabelError):
        make(transitions=[("matched", "nowhere")])


# ---- each method moves exactly the intended series ----

def _lookup_delta(seconds: float, result: str) -> dict[str, float]:
    d = {f"loadback_lookups_total{{result={result}}}": 1,
         "loadback_lookup_duration_seconds_count": 1, "loadback_lookup_duration_seconds_sum": seconds,
         "loadback_lookup_duration_seconds_bucket{le=+Inf}": 1}
    for b in DURATION_BUCKETS:
        if b >= seconds:
            d[f"loadback_lookup_duration_seconds_bucket{{le={float(b)}}}"] = 1
    return d


CASES = [
    ("transition", lambda m: m.transition("matched", "marked"),
     {"loadback_prefix_transitions_total{dst=marked,src=matched}": 1}),
    ("outcome loaded", lambda m: m.outcome("loaded", "none", 128, 128, 4096),
     {"loadback_prefix_outcomes_total{reason=none,state=loaded}": 1, "loadback_promised_tokens_total": 128,
      "loadback_loaded_tokens_total": 128, "loadback_loaded_bytes_total": 4096}),
    ("outcome loaded reason None", lambda m: m.outcome("loaded", None, 16, 16, 64),
     {"loadback_prefix_outcomes_total{reason=none,state=loaded}": 1, "loadback_promised_tokens_total": 16,
      "loadback_loaded_tokens_total": 16, "loadback_loaded_bytes_total": 64}),
    ("outcome degraded after promise", lambda m: m.outcome("degraded", "retrieve_timeout", 64),
     {"loadback_prefix_outcomes_total{reason=retrieve_timeout,state=degraded}": 1,
      "loadback_promised_tokens_total": 64, "loadback_recomputed_tokens_total{reason=retrieve_timeout}": 64,
      "loadback_last_degraded_timestamp_seconds{reason=retrieve_timeout}": NOW}),
    ("outcome degraded before promise", lambda m: m.outcome("degraded", "breaker_open"),
     {"loadback_prefix_outcomes_total{reason=breaker_open,state=degraded}": 1,
      "loadback_last_degraded_timestamp_seconds{reason=breaker_open}": NOW}),
    ("lookup hit", lambda m: m.observe_lookup(0.003, "hit"), _lookup_delta(0.003, "hit")),
    ("lookup skipped is not timed", lambda m: m.observe_lookup(0.0, "skipped"),
     {"loadback_lookups_total{result=skipped}": 1,
      "loadback_last_skipped_timestamp_seconds": NOW}),
    ("retrieve", lambda m: m.observe_retrieve(0.7),
     {"loadback_retrieve_duration_seconds_count": 1, "loadback_retrieve_duration_seconds_sum": 0.7,
      **{f"loadback_retrieve_duration_seconds_bucket{{le={float(b)}}}": 1 for b in DURATION_BUCKETS if b >= 0.7},
      "loadback_retrieve_duration_seconds_bucket{le=+Inf}": 1}),
    ("daemon call", lambda m: m.daemon_call("prepare_retrieve", 0.003),
     {"loadback_daemon_call_duration_seconds_count{op=prepare_retrieve}": 1,
      "loadback_daemon_call_duration_seconds_sum{op=prepare_retrieve}": 0.003,
      **{f"loadback_daemon_call_duration_seconds_bucket{{le={float(b)},op=prepare_retrieve}}": 1
         for b in DURATION_BUCKETS if b >= 0.003},
      "loadback_daemon_call_duration_seconds_bucket{le=+Inf,op=prepare_retrieve}": 1}),
    ("retry", lambda m: m.retry("retrieve"), {"loadback_retries_total{op=retrieve}": 1}),
    ("timeout", lambda m: m.timeout("lookup"), {"loadback_timeouts_total{op=lookup}": 1}),
    ("breaker open", lambda m: m.breaker("open"),
     {"loadback_breaker_state": 2, "loadback_breaker_transitions_total{to=open}": 1}),
    ("breaker closed again is no transition", lambda m: m.breaker("closed"), {}),
    ("daemon up", lambda m: m.set_daemon_up(True), {"loadback_daemon_up": 1}),
    ("set live", lambda m: m.set_live("marked", 3), {"loadback_live_prefixes{state=marked}": 3}),
    ("live delta", lambda m: m.live_delta("retrieving", -1), {"loadback_live_prefixes{state=retrieving}": -1}),
    ("reregistered", lambda m: m.reregistered(), {"loadback_reregistrations_total": 1}),
    ("late reply", lambda m: m.late_reply(3), {"loadback_late_replies_total": 3}),
    ("late reply default", lambda m: m.late_reply(), {"loadback_late_replies_total": 1}),
    ("config generation", lambda m: m.config_generation(4), {"loadback_config_generation": 4}),
    ("config reload failed", lambda m: m.config_reload_failed(), {"loadback_config_reload_failures_total": 1}),
    ("lookup queue depth", lambda m: m.queue_depth("lookup", 3), {"loadback_lookup_queue_depth": 3}),
    ("store queue depth", lambda m: m.queue_depth("store", 5), {"loadback_store_queue_depth": 5}),
    ("store skipped", lambda m: m.store_skipped(), {"loadback_stores_skipped_total": 1}),
    ("scheduler wait", lambda m: m.observe_scheduler_wait(0.03),
     {"loadback_scheduler_wait_seconds_count": 1, "loadback_scheduler_wait_seconds_sum": 0.03,
      **{f"loadback_scheduler_wait_seconds_bucket{{le={float(b)}}}": 1 for b in DURATION_BUCKETS if b >= 0.03},
      "loadback_scheduler_wait_seconds_bucket{le=+Inf}": 1}),
    ("daemon info", lambda m: m.daemon_info("tcp://127.0.0.1:5555", "auto"), None),
    ("watch", lambda m: m.watch(pending_debts=lambda: 4, fences_dropped=lambda: 2,
                                registered_epoch=lambda: 3),
     {"loadback_owed_releases": 4, "loadback_fences_dropped_total": 2,
      "loadback_registered_epoch": 4}),  # -1 -> 3
]


@pytest.mark.parametrize("call,expected", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_method_moves_exactly_intended_series(call, expected):
    m = make()
    before = m.snapshot()
    call(m)
    after = m.snapshot()
    if expected is None:  # an info series: one new child at 1, nothing else moves
        new = {k: v for k, v in after.items() if k not in before}
        assert new == {"loadback_daemon_info{endpoint=tcp://127.0.0.1:5555,transfer=auto}": 1}
        after = {k: v for k, v in after.items() if k in before}
        expected = {}
    assert diff(before, after) == pytest.approx(expected)


def test_watched_values_are_read_at_every_scrape_and_heartbeat():
    """Owed releases, registration epoch and dropped fences belong to the daemon link and
    the transport: read when /metrics is scraped and when the heartbeat reports
    (set_daemon_up), the fence count only ever added to (a counter)."""
    m = make()
    state = {"debts": 2, "fences": 1, "epoch": None}
    m.watch(pending_debts=lambda: state["debts"], fences_dropped=lambda: state["fences"],
            registered_epoch=lambda: state["epoch"])
    assert "loadback_owed_releases 2.0" in exposition(m)
    state.update(debts=0, fences=5, epoch=7)
    text = exposition(m)  # a scrape reads them
    assert "loadback_owed_releases 0.0" in text and "loadback_registered_epoch 7.0" in text
    assert "loadback_fences_dropped_total 5.0" in text
    state.update(fences=6, epoch=None)
    m.set_daemon_up(True)  # a heartbeat reads them too
    snap = m.snapshot()
    assert snap["loadback_fences_dropped_total"] == 6 and snap["loadback_registered_epoch"] == -1
    def closed():  # an owner that cannot answer keeps the last value, never raises
        raise RuntimeError("closed")
    m.watch(pending_debts=closed)
    assert m.snapshot()["loadback_owed_releases"] == 0


def test_unknown_queue_raises():
    with pytest.raises(UnknownLabelError):
        make().queue_depth("prefetch", 1)


def test_breaker_sequence_counts_each_change_once():
    m = make()
    for s in ("open", "open", "half_open", "open", "half_open", "closed", "closed"):
        m.breaker(s)
    snap = m.snapshot()
    assert snap["loadback_breaker_state"] == 0
    assert snap["loadback_breaker_transitions_total{to=open}"] == 2
    assert snap["loadback_breaker_transitions_total{to=half_open}"] == 2
    assert snap["loadback_breaker_transitions_total{to=closed}"] == 1


def test_promised_reconciles_with_loaded_plus_recomputed():
    m = make()
    m.outcome("loaded", "none", 100, 100, 1000)
    m.outcome("degraded", "short_read", 30)
    m.outcome("degraded", "aborted", 20)
    m.outcome("degraded", "below_break_even")
    s = m.snapshot()
    recomputed = sum(v for k, v in s.items() if k.startswith("loadback_recomputed_tokens_total{"))
    assert s["loadback_promised_tokens_total"] == s["loadback_loaded_tokens_total"] + recomputed == 150
    assert sum(v for k, v in s.items() if k.startswith("loadback_prefix_outcomes_total{")) == 4


# ---- closed label sets ----

UNKNOWN = [
    ("transition", lambda m: m.transition("matched", "bogus")),
    ("outcome reason", lambda m: m.outcome("degraded", "cosmic_ray", 5)),
    ("outcome state", lambda m: m.outcome("finished", "none")),
    ("loaded with a degrade reason", lambda m: m.outcome("loaded", "retrieve_timeout")),
    ("degraded without reason", lambda m: m.outcome("degraded", "none", 5)),
    ("lookup result", lambda m: m.observe_lookup(0.1, "maybe")),
    ("retry op", lambda m: m.retry("evict")),
    ("timeout op", lambda m: m.timeout("evict")),
    ("daemon call", lambda m: m.daemon_call("evict", 0.001)),
    ("breaker", lambda m: m.breaker("ajar")),
    ("set_live", lambda m: m.set_live("zombie", 1)),
    ("live_delta", lambda m: m.live_delta("zombie", 1)),
]


@pytest.mark.parametrize("call", [u[1] for u in UNKNOWN], ids=[u[0] for u in UNKNOWN])
def test_unknown_label_value_raises_and_creates_no_series(call):
    m = make()
    before = m.snapshot()
    with pytest.raises(UnknownLabelError) as ei:
        call(m)
    assert isinstance(ei.value, KeyError) and isinstance(ei.value, ValueError)
    assert "known" in str(ei.value)
    assert m.snapshot() == before


def test_enum_label_values_are_accepted():
    class S(enum.Enum):
        MATCHED = "matched"
        MARKED = "marked"
        DEGRADED = "degraded"
        LOADED = "loaded"

    class R(str, enum.Enum):
        TIMEOUT = "retrieve_timeout"

    m = LoadbackMetrics(states=list(S), reasons=list(R), ops=OPS)
    m.transition(S.MATCHED, S.MARKED)
    m.outcome(S.DEGRADED, R.TIMEOUT, 8)
    m.outcome(S.LOADED, None, 4, 4, 16)
    m.live_delta(S.MARKED, 1)
    s = m.snapshot()
    assert s["loadback_prefix_transitions_total{dst=marked,src=matched}"] == 1
    assert s["loadback_prefix_outcomes_total{reason=retrieve_timeout,state=degraded}"] == 1
    assert s["loadback_recomputed_tokens_total{reason=retrieve_timeout}"] == 8
    assert s["loadback_prefix_outcomes_total{reason=none,state=loaded}"] == 1
    assert s["loadback_live_prefixes{state=marked}"] == 1


def test_instances_use_private_registries_unless_given_one():
    a, b = make(), make()  # no "Duplicated timeseries" error
    a.reregistered()
    assert a.snapshot()["loadback_reregistrations_total"] == 1
    assert b.snapshot()["loadback_reregistrations_total"] == 0
    reg = CollectorRegistry()
    c = make(registry=reg)
    assert c.registry is reg and "loadback_daemon_up" in generate_latest(reg).decode()


def test_metrics_package_never_imports_orchestrator():
    for path in (ROOT / "metrics").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(m.split(".")[0] == "orchestrator" for m in mods), path


# ---- the /metrics server ----

def test_server_serves_metrics_on_loopback_port_0_and_closes():
    assert inspect.signature(start_metrics_server).parameters["host"].default == "127.0.0.1"
    m = make()
    m.outcome("degraded", "retrieve_timeout", 9)
    srv = start_metrics_server(port=0, registry=m)
    try:
        assert srv.port > 0 and srv.url == f"http://127.0.0.1:{srv.port}/metrics"
        with urllib.request.urlopen(srv.url, timeout=5) as r:
            body = r.read().decode()
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        assert 'loadback_recomputed_tokens_total{reason="retrieve_timeout"} 9.0' in body
    finally:
        srv.close()
    srv.close()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(srv.url, timeout=2)


def test_serve_shortcut_and_plain_registry():
    m = make()
    with m.serve() as srv, start_metrics_server(registry=m.registry) as srv2:
        for s in (srv, srv2):
            with urllib.request.urlopen(s.url, timeout=5) as r:
                assert b"loadback_daemon_up 0.0" in r.read()


def test_port_in_use_gives_clear_oserror():
    with start_metrics_server(registry=make()) as first:
        with pytest.raises(MetricsServerBindError) as ei:
            start_metrics_server(port=first.port, registry=make())
    err = ei.value
    assert isinstance(err, OSError)
    msg = str(err)
    assert f"127.0.0.1:{first.port}" in msg and "already in use" in msg
    assert "pick another port" in msg and "0" in msg


def test_an_address_this_host_lacks_names_the_fix():
    with pytest.raises(MetricsServerBindError) as ei:
        start_metrics_server(host="192.0.2.1", registry=make())  # TEST-NET-1: never local
    msg = str(ei.value)
    assert "192.0.2.1:0" in msg and "not an address of this machine" in msg and "127.0.0.1" in msg


MP_WORKER = textwrap.dedent("""
    import json, sys, urllib.request
    from lmcache_loadback.metrics import start_metrics_server
    from lmcache_loadback.orchestrator.instruments import product_metrics
    role = sys.argv[1]
    m = product_metrics()
    assert m.multiprocess
    m.outcome("loaded", "none", 10, 10, 100)
    m.outcome("degraded", "retrieve_timeout", 5)
    m.observe_retrieve(0.2)
    m.set_live("marked", 2)
    m.set_daemon_up(role == "rank0")
    m.breaker("open" if role == "rank0" else "closed")
    m.queue_depth("lookup", 1)
    m.queue_depth("store", 7 if role == "rank0" else 2)
    m.observe_scheduler_wait(0.01)
    m.watch(pending_debts=lambda: 3, fences_dropped=lambda: 1,
            registered_epoch=lambda: 1 if role == "rank0" else None)
    m.daemon_info("tcp://127.0.0.1:5555", "auto")
    if role == "reader":
        with start_metrics_server(port=0) as srv:  # registry=None: MultiProcessCollector
            body = urllib.request.urlopen(srv.url, timeout=5).read().decode()
        print(json.dumps({"snapshot": m.snapshot(), "body": body}))
""")


def test_multiprocess_mode_aggregates_through_multiprocesscollector(tmp_path):
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mp_dir), PYTHONPATH=str(ROOT))
    run = lambda role: subprocess.run([sys.executable, "-c", MP_WORKER, role], env=env, cwd=ROOT,
                                      capture_output=True, text=True, timeout=60)
    r0 = run("rank0")
    assert r0.returncode == 0, r0.stderr
    assert list(mp_dir.glob("*.db")), "multiprocess mode wrote no mmap files"
    r1 = run("reader")
    assert r1.returncode == 0, r1.stderr
    out = json.loads(r1.stdout)
    snap, body = out["snapshot"], out["body"]
    # Counters sum over both processes; gauges aggregate by their multiprocess_mode.
    assert snap["loadback_prefix_outcomes_total{reason=none,state=loaded}"] == 2
    assert snap["loadback_recomputed_tokens_total{reason=retrieve_timeout}"] == 10
    assert snap["loadback_prefix_outcomes_total{reason=retrieve_timeout,state=degraded}"] == 2
    assert snap["loadback_retrieve_duration_seconds_count"] == 2
    assert snap["loadback_live_prefixes{state=marked}"] == 4  # livesum
    assert snap["loadback_daemon_up"] == 0                     # livemin: one rank is cut off
    assert snap["loadback_breaker_state"] == 2                 # livemax: the worst breaker shows
    assert snap["loadback_prefix_transitions_total{dst=loaded,src=retrieving}"] == 0  # pre-created
    assert snap["loadback_lookup_queue_depth"] == 2                # livesum
    assert snap["loadback_store_queue_depth"] == 7                 # livemax: the fullest rank
    assert snap["loadback_owed_releases"] == 6                     # livesum
    assert snap["loadback_registered_epoch"] == -1                 # livemin: one not registered
    assert snap["loadback_fences_dropped_total"] == 2
    assert snap["loadback_scheduler_wait_seconds_count"] == 2
    assert snap["loadback_daemon_info{endpoint=tcp://127.0.0.1:5555,transfer=auto}"] == 1
    assert 'loadback_prefix_outcomes_total{reason="none",state="loaded"} 2.0' in body
    assert "loadback_daemon_up 0.0" in body and 'pid="' not in body


# ---- configs query only exposed names ----

PROMQL_FUNCS = {"sum", "min", "max", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
                "clamp_min", "abs", "topk", "min_over_time", "max_over_time", "label_values", "vector"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                "offset", "bool", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    e = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)        # string literals (label values, $vars)
    e = re.sub(r"\{[^}]*\}", "", e)                      # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                     # range selectors
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    e = re.sub(r"\b\d+(\.\d+)?(e[+-]?\d+)?\b", "", e)    # numbers
    names = set()
    for mt in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        tok = mt.group(0)
        if e[mt.end():].lstrip().startswith("("):
            assert tok in PROMQL_FUNCS, f"unknown function {tok!r} in {expr}"
        elif tok.lower() not in PROMQL_WORDS:
            names.add(tok)
    return names


def exposed_names() -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in exposition(make()).splitlines()
            if line and not line.startswith("#")}


def test_promql_name_extractor_catches_typos():
    assert promql_metric_names('sum by (le) (rate(loadback_x_bucket{a="b"}[$__rate_interval])) > 0.64') \
        == {"loadback_x_bucket"}
    assert "loadback_daemon_upp" not in exposed_names()


def test_alerts_reference_only_exposed_metrics():
    doc = yaml.safe_load((ROOT / "configs/alerts.yaml").read_text())
    (group,) = doc["groups"]
    assert group["name"] == "loadback"
    rules = {r["alert"]: r for r in group["rules"]}
    assert set(rules) == {"LoadbackDaemonDown", "LoadbackBreakerOpen", "LoadbackDegradeRatioHigh",
                          "LoadbackRetrieveP99NearDeadline", "LoadbackStoreQueueFull",
                          "LoadbackSchedulerWaitHigh", "LoadbackFencesDropped",
                          "LoadbackL2CanaryFailing"}
    exposed = exposed_names()
    for name, r in rules.items():
        assert r["labels"]["severity"] in ("critical", "warning", "info"), name
        assert r["annotations"]["summary"] and len(r["annotations"]["description"]) > 80, name
        used = promql_metric_names(r["expr"])
        assert used and used <= exposed, (name, used - exposed)


def test_grafana_dashboard_parses_and_queries_only_exposed_metrics():
    dash = json.loads((ROOT / "configs/grafana_dashboard.json").read_text())
    assert 36 <= dash["schemaVersion"] <= 41
    assert any(i["name"] == "DS_PROMETHEUS" and i["pluginId"] == "prometheus" for i in dash["__inputs"])
    exposed = exposed_names()
    # Grafana's label_values(metric, label): only its first argument is a metric.
    exprs = [re.sub(r"label_values\(([^,]+),\s*\w+\)", r"label_values(\1)", v["definition"])
             for v in dash["templating"]["list"]]
    titles = []
    for p in dash["panels"]:
        titles.append(p["title"].lower())
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}" and p["targets"], p["title"]
        exprs += [t["expr"] for t in p["targets"]]
    for expr in exprs:
        used = promql_metric_names(expr)
        assert used and used <= exposed, (expr, used - exposed)
    for want in ("loaded vs recomputed", "outcomes by reason", "lookup latency", "retrieve latency",
                 "breaker state", "daemon up", "live prefixes", "late replies",
                 "re-registrations", "worker queue depths", "scheduler wait", "owed releases",
                 "fences dropped", "daemon call latency"):
        assert any(want in t for t in titles), want
    all_exprs = " ".join(exprs)
    assert "histogram_quantile(0.5" in all_exprs and "histogram_quantile(0.99" in all_exprs
