"""How long a LOOKUP waits for the daemon's L2 store (`policies.L2Wait`), and when the
store counts as stalled (`l2.L2Health`'s bookkeeping of what LOOKUPs saw). Pure policy and
counting, on an injected clock; the probe and the whole path against a real daemon and a
real redis-server are tests/integration/test_l2_health.py. The debts an abandoned LOOKUP
leaves are held, untried, while the store is stalled (the link's in-memory connector stands
for the daemon: only its epoch is read)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from lmcache_loadback.connectors.errors import DaemonTimeout, PrefetchPending
from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.orchestrator import LoadBackConfig
from lmcache_loadback.orchestrator.config import ConfigError
from lmcache_loadback.orchestrator.debts import Debt
from lmcache_loadback.orchestrator.failures import LookupAbandoned, classify
from lmcache_loadback.orchestrator.instruments import product_metrics
from lmcache_loadback.orchestrator.l2 import L2Health
from lmcache_loadback.orchestrator.link import DaemonLink
from lmcache_loadback.orchestrator.policies import BreakEvenGuard, CircuitBreaker, L2Wait
from lmcache_loadback.orchestrator.state_log import StateLog
from lmcache_loadback.orchestrator.states import DegradeReason
from lmcache_loadback.testing.memory import InMemoryConnector

CHUNK = 256
CHUNK_BYTES = 512 * 1024  # 2 KiB a token, as the L2 measurements' layout
LOOKUP_S = 0.05


def _wait(l2: dict | None = None, prefill_tokens_per_s: float = 0.0,
          per_chunk_s: float | None = 0.001) -> L2Wait:
    """An L2Wait whose store was measured at `per_chunk_s` (None: nothing measured yet)."""
    cfg = LoadBackConfig.from_dict({"l2": l2 or {}, "break_even": {
        "prefill_tokens_per_s": prefill_tokens_per_s, "initial_bandwidth_gbps": 1.0}})
    w = L2Wait(cfg.l2, CHUNK, BreakEvenGuard(cfg.break_even, CHUNK_BYTES // CHUNK))
    if per_chunk_s is not None:
        w.answered(64, 64 * per_chunk_s)  # the first answered LOOKUP sets the estimate
    return w


def test_the_wait_is_slack_times_the_expected_fetch_within_lookup_and_the_cap():
    w = _wait()  # 1 ms a chunk measured
    assert w.wait_s(64 * CHUNK, 0, LOOKUP_S) == pytest.approx(3 * 64 * 0.001)  # 192 ms
    assert w.wait_s(4 * CHUNK, 0, LOOKUP_S) == LOOKUP_S  # 12 ms expected x 3: under lookup
    assert _wait({"max_wait_ms": 120}).wait_s(64 * CHUNK, 0, LOOKUP_S) == pytest.approx(0.12)
    # a cap at or under lookup_ms is a fixed deadline, whatever the prefix
    assert _wait({"max_wait_ms": 50}).wait_s(64 * CHUNK, 0, LOOKUP_S) == LOOKUP_S


def test_until_the_store_is_measured_only_the_cap_and_break_even_bound_the_wait():
    unmeasured = _wait(per_chunk_s=None)
    assert unmeasured.fetch_s(64) is None
    assert unmeasured.wait_s(4 * CHUNK, 0, LOOKUP_S) == pytest.approx(0.5)  # the cap
    paying = _wait(prefill_tokens_per_s=100_000, per_chunk_s=None)
    assert paying.wait_s(16384, 0, LOOKUP_S) == pytest.approx(16384 / 100_000 - 16384 * 2048 / 1e9)
    assert unmeasured.outlived(64, 0.06) is True  # cut only by the cap: evidence
    assert unmeasured.per_chunk_s is None  # a lower bound alone (a hung store) is no rate


def test_the_wait_ends_where_loading_stops_beating_recomputing():
    # 16k tokens at 100k tokens/s: recompute 164 ms; loading 32 MiB at 1 GB/s: 34 ms;
    # fetching 64 chunks at the measured 1 ms a chunk is expected to take 64 ms
    w = _wait(prefill_tokens_per_s=100_000)
    recompute, load = 16384 / 100_000, 16384 * 2048 / 1e9
    assert w.fetch_s(64) < recompute - load < 3 * w.fetch_s(64)
    assert w.wait_s(16384, 0, LOOKUP_S) == pytest.approx(recompute - load)
    # the engine's own hit is not recomputed either way: only the rest counts
    assert w.wait_s(16384, 12288, LOOKUP_S) == LOOKUP_S


def test_no_wait_for_l2_when_the_expected_fetch_alone_costs_more_than_recomputing():
    w = _wait(prefill_tokens_per_s=100_000, per_chunk_s=0.05)  # 50 ms a chunk measured
    assert w.fetch_s(64) > 16384 / 100_000
    assert w.wait_s(16384, 0, LOOKUP_S) == LOOKUP_S


def test_the_estimate_follows_slower_answers_faster_than_quicker_ones():
    w = _wait({"fetch_ema_alpha": 0.2})
    start = w.per_chunk_s
    assert start == pytest.approx(0.001)  # the first answer set it
    w.answered(64, 64 * 2 * start)  # a slower sample weighs 0.2
    assert w.per_chunk_s == pytest.approx(1.2 * start)
    up = w.per_chunk_s
    w.answered(64, 64 * 0.0)  # no time: no sample
    w.answered(0, 0.5)  # a miss says nothing of the fetch per chunk
    assert w.per_chunk_s == up
    w.answered(64, 64 * 0.1 * up)  # a quicker one (the daemon's memory held it) weighs 0.05
    assert w.per_chunk_s == pytest.approx(up - 0.05 * 0.9 * up)


def test_a_prefetch_outliving_its_wait_raises_the_estimate_and_is_evidence_only_past_the_fetch():
    w = _wait()
    expected = w.fetch_s(64)
    assert w.outlived(64, 2 * expected) is True  # waited past what the store usually takes
    assert w.per_chunk_s > expected / 64  # a lower bound above the estimate lifts it
    before = w.per_chunk_s
    assert w.outlived(64, 0.5 * w.fetch_s(64)) is False  # cut short by break-even or the cap
    assert w.per_chunk_s == before  # a lower bound under the estimate teaches nothing
    assert w.outlived(0, 1.0) is False


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _health(**l2) -> tuple[L2Health, Clock]:
    clock = Clock()
    health = L2Health(_wait(l2), product_metrics(),
                      StateLog(logging.getLogger("loadback"), clock=clock), clock,
                      "tcp://127.0.0.1:1")
    return health, clock


def test_stall_after_lookups_in_a_row_past_their_fetch_stalls_once_and_says_so(caplog):
    caplog.set_level(logging.WARNING, logger="loadback")
    health, clock = _health(stall_after=2, probe_interval_ms=500)
    woken = []
    health.on_stall = lambda: woken.append(clock.now)
    long = 3 * health.wait.fetch_s(64)
    health.observe_pending(64, long)
    health.observe_answer(64, health.wait.fetch_s(64))  # the store delivered: not in a row
    health.observe_pending(64, long)
    assert not health.stalled and health.probe_in() is None
    health.observe_pending(64, 3 * health.wait.fetch_s(64))
    assert health.stalled and woken == [100.0]
    assert health.probe_in() == pytest.approx(0.5)
    health.observe_pending(64, 3 * health.wait.fetch_s(64))  # already stalled: one stall
    snap = health.metrics.snapshot()
    assert snap["loadback_l2_state"] == 1 and snap["loadback_l2_stalls_total"] == 1
    assert snap["loadback_l2_fetch_seconds_per_chunk"] == pytest.approx(health.wait.per_chunk_s)
    lines = [r for r in caplog.records if "L2 store" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.WARNING] and "stalled" in lines[0].getMessage()
    clock.now += 0.5
    assert health.probe_in() == 0.0


def test_prefetches_cut_short_by_the_cap_never_stall_the_store():
    health, _ = _health(stall_after=1)
    for _ in range(5):
        health.observe_pending(64, 0.5 * health.wait.fetch_s(64))
    assert not health.stalled


def test_a_prefetch_outliving_its_wait_is_a_lookup_timeout_the_breaker_never_hears():
    out = classify("lookup", LookupAbandoned(PrefetchPending("query_prefetch_status", 0.05)))
    assert (out.reason, out.timeout_op, out.breaker_ok, out.suspect) == (
        DegradeReason.LOOKUP_TIMEOUT, "lookup", True, False)
    hung = classify("lookup", LookupAbandoned(DaemonTimeout("lookup", 0.05)))
    assert (hung.breaker_ok, hung.suspect) == (False, True)  # a daemon that did not answer


def _link() -> DaemonLink:
    layout = KVLayout(num_layers=1, num_heads=2, head_dim=8, dtype=torch.float16, chunk_size=16)
    cfg = LoadBackConfig.from_dict({"chunk_size": 16})
    return DaemonLink(InMemoryConnector(layout), cfg, CircuitBreaker(cfg.breaker),
                      product_metrics(), background=False)


def test_a_debt_held_for_a_stalled_store_spends_no_try_and_is_paid_once_it_ends():
    link = _link()
    stalled, paid = [True], []

    def run(_timeout_s: float) -> bool:
        paid.append(1)
        return True

    d = Debt("abandon_lookup", "r1", link.connector.epoch, run, True, hold=lambda: stalled[0])
    after = Debt("end_session", "r1", link.connector.epoch, run)
    link._queue(d)
    link._queue(after)
    for _ in range(30):  # more passes than its tries
        link.pay()
    assert paid == [] and d.tries == 0 and link.pending("r1") == 2  # in order, untried
    stalled[0] = False
    link.pay()
    assert paid == [1, 1] and link.pending() == 0


@pytest.mark.parametrize("section, key", [
    ({"wait_slack": 0.5}, "l2.wait_slack"),
    ({"max_wait_ms": 0}, "l2.max_wait_ms"),
    ({"stall_after": 0}, "l2.stall_after"),
    ({"fetch_ema_alpha": math.inf}, "l2.fetch_ema_alpha"),
    ({"probe_every_ms": 10}, "l2.probe_every_ms"),
])
def test_bad_l2_keys_are_refused_naming_the_key(section, key):
    with pytest.raises(ConfigError) as err:
        LoadBackConfig.from_dict({"l2": section})
    assert key in str(err.value)
