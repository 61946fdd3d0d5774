"""What the daemon link tells an operator: one WARNING per change of the relationship with the
daemon (down, breaker open / half-open / closed, re-registered), each kind at most once per
STATE_LOG_INTERVAL_S with the changes suppressed meanwhile counted in its next line; a daemon of
another lmcache version is a WARNING at most once a minute; the heartbeat's own failures and
request-scoped detail stay at DEBUG, naming the request. And an open breaker's probe is a
registration."""

from __future__ import annotations

import logging

from lmcache_loadback.connectors.errors import DaemonTimeout, DaemonUnavailable, VersionSkew
from lmcache_loadback.orchestrator.state_log import STATE_LOG_INTERVAL_S
from tests.unit.test_orchestrator_unit import make


def _heartbeat_records(caplog):
    return [r for r in caplog.records if r.name == "loadback" and "heartbeat failed" in r.message]


def _warnings(caplog, text=""):
    return [r.getMessage() for r in caplog.records
            if r.name == "loadback" and r.levelno == logging.WARNING and text in r.getMessage()]


def test_version_skew_is_a_warning_once_a_minute(caplog):
    orch, conn, _, _ = make()
    orch.link.registered_epoch = None  # the next tick registers
    caplog.set_level(logging.DEBUG, logger="loadback")
    for _ in range(3):
        conn.fail_next["register"].append(VersionSkew("daemon speaks another version"))
        orch.tick()
    recs = _heartbeat_records(caplog)
    assert [r.levelno for r in recs] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert "another version" in recs[0].message
    orch.close()


def test_a_daemon_going_down_is_one_warning_per_change(caplog):
    """The first failed heartbeat after the daemon answered is one WARNING naming it and the
    error; the failures after it are not (their own lines stay at DEBUG)."""
    orch, conn, _, clock = make(breaker={"consecutive_failures": 100})
    caplog.set_level(logging.DEBUG, logger="loadback")
    for _ in range(3):
        conn.fail_next["ping"].append(DaemonUnavailable("connection refused"))
        orch.tick()
    assert [r.levelno for r in _heartbeat_records(caplog)] == [logging.DEBUG] * 3
    down = _warnings(caplog, " down")
    assert down == ["daemon in-memory down: connection refused; requests recompute until it "
                    "answers"]
    orch.tick()  # answers again
    clock.t += STATE_LOG_INTERVAL_S
    conn.fail_next["ping"].append(DaemonUnavailable("refused again"))
    orch.tick()
    assert len(_warnings(caplog, " down")) == 2 and "refused again" in _warnings(caplog)[-1]
    orch.close()


def test_breaker_open_half_open_closed_each_one_warning(caplog):
    orch, conn, _, clock = make(breaker={"consecutive_failures": 2, "cooldown_ms": 100})
    caplog.set_level(logging.DEBUG, logger="loadback")
    for _ in range(2):
        conn.fail_next["ping"].append(DaemonTimeout("ping", 0.2))
        orch.tick()
    assert orch.breaker.state == "open"
    assert len(_warnings(caplog, "circuit breaker open")) == 1
    assert "first probe in 0.1 s" in _warnings(caplog, "circuit breaker open")[0]
    clock.t += 0.2
    orch.tick()  # half-open, the probe answers: closed
    assert orch.breaker.state == "closed"
    assert len(_warnings(caplog, "circuit breaker half-open")) == 1
    assert len(_warnings(caplog, "circuit breaker closed, loads resume")) == 1


def test_state_changes_are_rate_limited_and_the_suppressed_ones_counted(caplog):
    """The breaker flapping: one line per kind per interval; the next line after the interval
    says how many changes were not logged."""
    orch, conn, _, clock = make(breaker={"consecutive_failures": 1, "cooldown_ms": 100})
    caplog.set_level(logging.DEBUG, logger="loadback")
    # a ping fails: open; then twice the probe (a registration) fails: half-open -> open
    for op in ("ping", "register", "register"):
        conn.fail_next[op].append(DaemonTimeout(op, 0.2))
        orch.tick()
        clock.t += 1.0
    assert orch.breaker.state == "open"
    opened = _warnings(caplog, "circuit breaker open")
    assert len(opened) == 1 and len(_warnings(caplog, "half-open")) == 1
    clock.t += STATE_LOG_INTERVAL_S
    orch.tick()  # the probe answers: half-open and closed, each logged
    clock.t += STATE_LOG_INTERVAL_S
    conn.fail_next["ping"].append(DaemonTimeout("ping", 0.2))
    orch.tick()  # opens again: logged, with the two opens it did not log
    opened = _warnings(caplog, "circuit breaker open")
    assert len(opened) == 2
    assert opened[1].endswith("(2 earlier breaker_open changes not logged: at most one line "
                              f"per {STATE_LOG_INTERVAL_S:g} s)")
    assert "earlier breaker_half_open change not logged" in _warnings(caplog, "half-open")[-1]
    orch.close()


def test_a_new_daemon_incarnation_is_one_warning_naming_both_epochs(caplog):
    orch, conn, _, clock = make()
    caplog.set_level(logging.DEBUG, logger="loadback")
    conn.restart()
    orch.tick()
    assert _warnings(caplog, "re-registered") == [
        "daemon in-memory: re-registered with a new incarnation (epoch 0 -> 1); what was owed "
        "to the old one is dropped"]
    orch.close()


def test_request_detail_is_debug_naming_the_request(caplog):
    orch, conn, _, _ = make(retries={"max_attempts": 1})
    caplog.set_level(logging.DEBUG, logger="loadback")
    conn.fail_next["lookup"].append(DaemonTimeout("lookup", 0.05))
    orch.match("req-42", list(range(64)))
    about = [r for r in caplog.records if "req-42" in r.getMessage()]
    assert about and all(r.levelno == logging.DEBUG for r in about)
    assert any("degraded (lookup_timeout)" in r.getMessage() for r in about)
    orch.close()


def test_a_refused_daemon_is_asked_again_only_every_recheck_interval_and_logged_once(caplog):
    """Behind a proxy a daemon's restart may not change the connection's epoch: a refused
    daemon is asked its chunk size again every REFUSED_RECHECK_S (one ERROR for the same
    refusal), and accepted once it answers the config's size."""
    from lmcache_loadback.orchestrator.link import REFUSED_RECHECK_S

    orch, conn, _, clock = make()
    caplog.set_level(logging.DEBUG, logger="loadback")
    asked = []
    theirs = [4 * conn.chunk_size]
    conn.get_chunk_size = lambda timeout_s: asked.append(timeout_s) or theirs[0]
    conn.restart()
    orch.tick()
    assert orch.link.refused is not None and not orch.link.registered()
    for _ in range(3):
        orch.tick()
    assert len(asked) == 1
    assert orch.match("r-refused", list(range(8 * conn.chunk_size))).tokens == 0
    clock.t += REFUSED_RECHECK_S
    orch.tick()
    assert len(asked) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [f"daemon refused, every request recomputes until one with the right "
                      f"chunk size registers: daemon in-memory --chunk-size {theirs[0]}, this "
                      f"config chunk_size {conn.chunk_size}: start the daemon with --chunk-size "
                      f"{conn.chunk_size} or set chunk_size: {theirs[0]}"]
    assert orch.metrics.snapshot()["loadback_daemon_refused{reason=chunk_size}"] == 1
    theirs[0] = conn.chunk_size
    clock.t += REFUSED_RECHECK_S
    orch.tick()
    assert orch.link.refused is None and orch.link.registered()
    assert orch.metrics.snapshot()["loadback_daemon_refused{reason=chunk_size}"] == 0
    assert len(_warnings(caplog, "accepted: its chunk size")) == 1
    orch.close()


def test_an_open_breaker_still_refreshes_what_the_operator_reads():
    """While an open breaker waits for its probe the heartbeat returns early; the owed releases
    an operator reads (loadback_owed_releases) must still follow the debts, each tick."""
    orch, conn, _, _ = make(breaker={"consecutive_failures": 1, "cooldown_ms": 60_000,
                                     "cooldown_max_ms": 60_000})
    owed = [0]
    orch.metrics.watch(pending_debts=lambda: owed[0])
    orch.breaker.trip()
    owed[0] = 3
    orch.tick()
    # Read the gauge itself: a scrape (snapshot) would refresh it on its own, and multiprocess
    # mode (SGLang's /metrics) has no such scrape hook: the heartbeat is all it gets.
    assert orch.metrics.pending_debts._value.get() == 3
    orch.close()


def test_an_open_breakers_probe_registers_again_on_the_same_epoch():
    """Pings unanswered, then the daemon answers again on the same connection (a hang that
    ended, or a new daemon behind a proxy, which answers a ping but drops the calls of an
    instance it never registered): the probe registers, so a store after it is not dropped."""
    orch, conn, _, clock = make(breaker={"consecutive_failures": 1, "cooldown_ms": 100})
    registered = conn.calls["register"]
    conn.fail_next["ping"].append(DaemonTimeout("ping", 0.2))
    orch.tick()
    assert orch.breaker.state == "open" and conn.calls["register"] == registered
    clock.t += 0.2
    orch.tick()  # the probe
    assert orch.breaker.state == "closed"
    assert conn.calls["register"] == registered + 1 and orch.link.registered()
    orch.tick()  # closed again: a ping, not a registration
    assert conn.calls["register"] == registered + 1
    orch.close()
