"""The core's contracts over the strict in-memory daemon: leases, owed releases tied to a
daemon incarnation, deferred session ends, landed loads, one retry source, one clock, TP."""

from __future__ import annotations

import time

import pytest
import torch

from lmcache_loadback.connectors.base import Connector
from lmcache_loadback.connectors.errors import (
    ConnectorError,
    DaemonRejected,
    DaemonTimeout,
    DaemonUnavailable,
    ProtocolError,
    ShortRead,
)
from lmcache_loadback.testing.memory import InMemoryConnector, LeaseViolation
from lmcache_loadback.orchestrator import DegradeReason, LoadBackConfig, PrefixState
from lmcache_loadback.orchestrator.failures import FAILURES, LookupAbandoned, classify
from lmcache_loadback.orchestrator.leases import Lease, RequestKey
from lmcache_loadback.orchestrator.policies import retry_safe, run_with_retries
from lmcache_loadback.harness.bench.core import NullConnector
from tests.conftest import kv_of, same_kv
from tests.unit.test_orchestrator_unit import FakeClock, make, snap, store

R = DegradeReason
TOKS = list(range(64))


def stored(**over):
    orch, conn, pool, clock = make(**over)
    store(orch, TOKS, torch.arange(64))
    return orch, conn, pool, clock


# -- the strict fake -------------------------------------------------------------


def test_strict_fake_refuses_a_double_release():
    _, conn, _, _ = stored()
    assert conn.lookup_hit_tokens(TOKS, "r", 1.0) == 64
    conn.free_locks(TOKS, "r", 0, 64, 1.0)
    with pytest.raises(LeaseViolation, match="does not hold"):
        conn.free_locks(TOKS, "r", 0, 64, 1.0)  # the second free of the same range
    with pytest.raises(LeaseViolation):
        conn.free_locks(TOKS, "never-looked-up", 0, 16, 1.0)


def test_both_fakes_satisfy_the_connector_protocol():
    layout = make()[1].layout
    assert isinstance(InMemoryConnector(layout), Connector)
    assert isinstance(NullConnector(), Connector)


# -- leases ----------------------------------------------------------------------


def test_lease_frees_each_range_once_and_nothing_once_forfeited():
    lease = Lease(RequestKey.of("r", TOKS), epoch=0, start=0, end=64)
    assert lease.give_back(48, 80) == (48, 64)    # clipped to what is held
    assert lease.give_back(48, 64) is None         # never twice
    assert lease.give_back(0, 16) == (0, 16)
    with pytest.raises(ValueError, match="middle"):
        lease.give_back(24, 32)
    assert lease.held == (16, 48)
    lease.forfeit()
    assert lease.held is None and lease.give_back(16, 48) is None


def test_lost_retrieve_reply_leaves_its_locks_to_the_daemon():
    orch, conn, _, _ = stored(retries={"max_attempts": 1})
    assert orch.match("r", TOKS).tokens == 64
    conn.fail_next["retrieve"].append(DaemonTimeout("prepare_retrieve", 0.1))  # served, unanswered
    res = orch.load_back("r", torch.arange(700, 764))
    assert res.reason == R.RETRIEVE_TIMEOUT
    orch.finish("r")  # freeing the range again would raise LeaseViolation in the strict fake
    assert conn.calls["free_locks"] == 0 and conn.held_locks() == 0


def test_abort_after_a_partial_release_frees_only_what_is_still_held():
    orch, conn, _, _ = stored()
    assert orch.match("r", TOKS, local_hit_tokens=32).tokens == 32  # [0, 32) freed at match
    orch.abort("r")  # the strict fake raises on any chunk freed twice
    assert conn.held_locks() == 0


# -- item 1: a landed load is LOADED whatever happens to its commit ---------------


def test_commit_never_answered_still_reports_loaded_and_is_paid_off_path():
    orch, conn, pool, _ = stored()
    conn.fail_next["commit"].append(DaemonTimeout("commit_retrieve", 0.1))
    assert orch.match("r", TOKS).tokens == 64
    dst = torch.arange(700, 764)
    res = orch.load_back("r", dst)
    assert (res.loaded_tokens, res.state, res.reason) == (64, PrefixState.LOADED, None)
    assert same_kv(kv_of(pool, torch.arange(64)), kv_of(pool, dst))
    assert conn.calls["commit"] == 1  # attempted once; a commit that may have landed is not resent
    assert snap(orch, "loadback_prefix_outcomes_total{reason=none,state=loaded}") == 1


def test_commit_waits_until_the_copy_is_ready():
    orch, conn, _, _ = stored()
    ready = _Event()
    _with_event(conn, ready)
    assert orch.match("r", TOKS).tokens == 64
    assert orch.load_back("r", torch.arange(700, 764)).state == PrefixState.LOADED
    orch.tick()
    assert conn.calls["commit"] == 0 and orch.pending_debts() == 1
    ready.done = True
    orch.tick()
    assert conn.calls["commit"] == 1 and conn.held_locks() == 0


class _Event:
    """Stands in for the torch.cuda.Event a GPU copy records after its last scatter."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


def _with_event(conn, event):
    real = conn.retrieve_into

    def retrieve_into(*a, **k):
        got = real(*a, **k)
        got.ready = event
        return got

    conn.retrieve_into = retrieve_into


def test_a_landed_load_hands_the_engine_its_completion_event():
    orch, conn, _, _ = stored()
    event = _Event()
    _with_event(conn, event)
    assert orch.match("r", TOKS).tokens == 64
    res = orch.load_back("r", torch.arange(700, 764))
    assert res.state == PrefixState.LOADED and res.ready is event
    assert not event.waited  # load_back itself never waits for the copy


def test_a_load_that_landed_here_but_failed_on_a_peer_waits_for_its_copy():
    class PeerFailsAfterRetrieve:
        """TP vote where every peer agrees except on the post-retrieve decision."""

        def __init__(self) -> None:
            self.votes = 0

        def min(self, value: int) -> int:
            self.votes += 1
            return 0 if self.votes == 2 else value

    orch, conn, _, _ = stored()
    event = _Event()
    _with_event(conn, event)
    assert orch.match("r", TOKS).tokens == 64
    orch.tp = PeerFailsAfterRetrieve()
    res = orch.load_back("r", torch.arange(700, 764))
    assert res.state == PrefixState.DEGRADED and res.reason == R.TP_PEER_FAILED
    assert res.loaded_tokens == 0 and res.ready is None
    # The engine gets these slots back to recompute into: the copy has finished first.
    assert event.waited


def test_failure_after_prepare_answered_pays_the_owed_commit():
    orch, conn, _, _ = stored()
    paid = []
    real = conn.retrieve_into

    def retrieve_into(*a, **k):
        real(*a, **k)  # prepare answered and pinned (its retrieval owes the commit)
        exc = ShortRead("3 of 4 chunks")  # then the data is refused
        paid.append(exc)
        raise exc

    conn.retrieve_into = retrieve_into
    assert orch.match("r", TOKS).tokens == 64
    res = orch.load_back("r", torch.arange(700, 764))
    assert (res.loaded_tokens, res.reason) == (0, R.SHORT_READ)
    orch.finish("r")
    assert conn.calls["commit"] == 1 and conn.held_locks() == 0


# -- item 2: releases owed to a daemon that restarted are dropped -----------------


def test_release_owed_to_a_restarted_daemon_is_dropped_and_counted():
    orch, conn, _, _ = stored()
    conn.fail_next["lookup"].append(DaemonTimeout("lookup", 0.05))
    conn.fail_next["abandon_lookup"].append(DaemonUnavailable("down"))  # not sent: stays owed
    assert orch.match("r", TOKS).reason == R.LOOKUP_TIMEOUT
    assert orch.pending_debts() == 1
    conn.restart()
    orch.tick()  # re-registers with the new daemon and pays what it may
    assert conn.calls["abandon_lookup"] == 1  # only the attempt on the old daemon
    assert orch.pending_debts() == 0
    assert orch.link.stale_dropped == 1
    assert snap(orch, "loadback_stale_releases_dropped_total") == 1
    ends = conn.calls["end_session"]
    orch.finish("r")  # its session was on the old daemon too: nothing is sent
    assert conn.calls["end_session"] == ends and orch.link.stale_dropped == 2


# -- item 3: end_session waits until the daemon answered every call ---------------


def test_end_session_waits_for_the_unanswered_retrieve():
    orch, conn, _, _ = stored(retries={"max_attempts": 1})
    assert orch.match("r", TOKS).tokens == 64
    conn.hold_next["retrieve"] = 1  # queued on the daemon, served later
    res = orch.load_back("r", torch.arange(700, 764))
    assert res.reason == R.RETRIEVE_TIMEOUT
    assert conn.unanswered("r") >= 1
    ends = conn.calls["end_session"]
    orch.finish("r")
    orch.tick()
    assert conn.calls["end_session"] == ends  # not while a call may re-create the session
    conn.serve_held()  # the daemon serves the abandoned calls: the session is back
    assert "r" in conn.sessions
    orch.tick()
    assert conn.calls["end_session"] == ends + 1
    assert "r" not in conn.sessions and orch.pending_debts() == 0


# -- one source of retries, one clock ------------------------------------------------


@pytest.mark.parametrize("exc", [ProtocolError("garbled"), DaemonRejected("no")])
def test_errors_flagged_unsafe_are_not_retried(exc):
    orch, conn, _, _ = stored(retries={"max_attempts": 3})
    assert orch.match("r", TOKS).tokens == 64
    conn.fail_next["retrieve"].append(exc)
    assert orch.load_back("r", torch.arange(700, 764)).loaded_tokens == 0
    assert conn.calls["retrieve"] == 1 and snap(orch, "loadback_retries_total{op=retrieve}") == 0


def test_retry_policy_reads_the_class_flags():
    class Flaky(ProtocolError):
        retry_safe = True

    assert retry_safe(Flaky("x")) and retry_safe(DaemonTimeout("op", 1))
    assert not retry_safe(ProtocolError("x")) and not retry_safe(ValueError("x"))
    assert not retry_safe(LookupAbandoned(DaemonTimeout("lookup", 1)))


def test_retries_and_deadline_run_on_the_injected_clock(monkeypatch):
    def no_real_sleep(_s):
        raise AssertionError("slept in real time")

    monkeypatch.setattr(time, "sleep", no_real_sleep)
    clock = FakeClock()
    policy = LoadBackConfig.from_dict({"retries": {
        "max_attempts": 10, "backoff_initial_ms": 10, "backoff_max_ms": 40,
        "jitter_ms": 0}}).retries
    calls = []

    def down():
        calls.append(clock.t)
        raise DaemonUnavailable("down")

    with pytest.raises(DaemonUnavailable):
        run_with_retries(down, policy, 0.1, clock=clock, sleep=clock.sleep)
    # Backoff 10, 20, 40, 40 ms: a fifth attempt would start at 110 ms, past the 100 ms budget.
    assert [round(s * 1000) for s in clock.slept] == [10, 20, 40]
    assert [round((t - 1000.0) * 1000) for t in calls] == [0, 10, 30, 70]


def test_lookup_deadline_is_kept_on_the_fake_clock(monkeypatch):
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail("slept in real time"))
    orch, conn, _, clock = stored(deadlines={"lookup_ms": 5}, retries={
        "max_attempts": 5, "backoff_initial_ms": 2, "jitter_ms": 0})
    for _ in range(5):
        conn.fail_next["lookup"].append(DaemonUnavailable("down"))
    got = orch.match("r", TOKS)
    assert got.reason == R.LOOKUP_ERROR
    assert conn.calls["lookup"] == 2  # at 0 and 2 ms; the next would start at 6 ms > 5 ms


# -- the failure table ------------------------------------------------------------------


def test_failure_table_maps_each_phase_and_class():
    want = {
        ("lookup", DaemonTimeout("lookup", 1)): (R.LOOKUP_TIMEOUT, "lookup"),
        ("lookup", LookupAbandoned(ProtocolError("x"))): (R.LOOKUP_ERROR, None),
        ("retrieve", DaemonTimeout("prep", 1)): (R.RETRIEVE_TIMEOUT, "retrieve"),
        ("retrieve", ShortRead("x")): (R.SHORT_READ, None),
        ("retrieve", ProtocolError("x")): (R.CORRUPT_DATA, None),
        ("retrieve", DaemonRejected("x")): (R.RETRIEVE_ERROR, None),
        ("store", DaemonTimeout("store", 1)): (None, "store"),
        ("store", DaemonUnavailable("x")): (None, None),
    }
    for (phase, exc), (reason, timeout_op) in want.items():
        out = classify(phase, exc)
        assert (out.reason, out.timeout_op, out.breaker_ok) == (reason, timeout_op, False)
    assert {phase for phase, _, _ in FAILURES} == {"lookup", "retrieve", "store"}
    for phase in ("lookup", "retrieve", "store"):  # every phase ends in a catch-all row
        assert [cls for p, cls, _ in FAILURES if p == phase][-1] is ConnectorError


# -- finish vs abort ------------------------------------------------------------------


def test_finish_of_an_unused_promise_is_told_apart_from_abort():
    orch, conn, _, _ = stored()
    assert orch.match("f", TOKS).tokens == 64
    assert orch.match("a", TOKS).tokens == 64
    orch.finish("f")
    orch.abort("a")
    assert snap(orch, "loadback_prefix_outcomes_total{reason=unused,state=degraded}") == 1
    assert snap(orch, "loadback_prefix_outcomes_total{reason=aborted,state=degraded}") == 1
    assert conn.held_locks() == 0


# -- TP: the same collectives on every path -----------------------------------------------


class RecordingTP:
    """Stands in for the TP group: records each collective; a peer contributes `peer`."""

    def __init__(self, peer: int = 1 << 30) -> None:
        self.peer = peer
        self.calls: list[int] = []

    def min(self, value: int) -> int:
        self.calls.append(value)
        return min(value, self.peer)


@pytest.mark.parametrize("slots", [None, torch.empty(0, dtype=torch.int64)])
def test_failed_allocation_still_joins_the_tp_decision(slots):
    orch, conn, _, _ = stored()
    assert orch.match("r", TOKS).tokens == 64
    orch.tp = RecordingTP()
    res = orch.load_back("r", slots)
    assert (res.state, res.reason) == (PrefixState.DEGRADED, R.ALLOC_FAILED)
    assert orch.tp.calls == [0]  # the peer learns "cannot" from the same one collective
    orch.finish("r")
    assert conn.held_locks() == 0


def test_wrong_slot_count_joins_the_tp_decision_then_raises():
    orch, _, _, _ = stored()
    assert orch.match("r", TOKS).tokens == 64
    orch.tp = RecordingTP()
    with pytest.raises(ValueError, match="got 5 KV slots for 64 promised tokens"):
        orch.load_back("r", torch.arange(5))
    assert orch.tp.calls == [0] and orch.state_of("r") == PrefixState.DEGRADED


def test_a_peer_that_cannot_load_degrades_this_rank_after_the_same_collectives():
    orch, conn, _, _ = stored()
    assert orch.match("r", TOKS).tokens == 64
    orch.tp = RecordingTP(peer=0)
    res = orch.load_back("r", torch.arange(700, 764))
    assert (res.state, res.reason) == (PrefixState.DEGRADED, R.TP_PEER_FAILED)
    assert orch.tp.calls == [1]
    assert conn.calls["retrieve"] == 0
