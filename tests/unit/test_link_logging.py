"""What the daemon link tells an operator: a daemon of another lmcache version is a WARNING
(an operator must act), at most once a minute; other heartbeat failures stay at DEBUG."""

from __future__ import annotations

import logging

from connectors.errors import DaemonUnavailable, VersionSkew
from tests.unit.test_orchestrator_unit import make


def _heartbeat_records(caplog):
    return [r for r in caplog.records if r.name == "loadback" and "heartbeat failed" in r.message]


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


def test_a_daemon_that_is_down_stays_at_debug(caplog):
    orch, conn, _, _ = make()
    caplog.set_level(logging.DEBUG, logger="loadback")
    conn.fail_next["ping"].append(DaemonUnavailable("down"))
    orch.tick()
    recs = _heartbeat_records(caplog)
    assert [r.levelno for r in recs] == [logging.DEBUG]
    orch.close()
