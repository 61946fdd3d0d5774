"""A short subset of the chaos scenarios, in the suite: real daemon, real faults, every
invariant judged (`loadback chaos run --scenario all` runs them in full)."""

from __future__ import annotations

import pytest

from orchestrator.tools.chaos import _leaks, load_scenarios, run_scenario

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(300)]


@pytest.mark.parametrize("name, requests", [
    ("restart", 200), ("hang", 150), ("lost_replies", 150), ("corrupt_kv", 150),
    ("rogue_pickle", 100),
])
def test_scenario_keeps_every_invariant(name, requests):
    (scn,) = load_scenarios(name)
    r = run_scenario(scn, requests)
    assert r.requests == requests
    assert r.hung == 0, r
    assert r.leaked == 0, r.leaks
    assert r.wrong_bytes == 0
    assert r.counters_ok, r.counter_mismatches
    assert r.loaded > 0  # the run really loaded KV, before and after the fault
    if name == "restart":
        assert r.recovery_s is not None
    if name in ("corrupt_kv", "lost_replies"):
        assert sum(r.degraded.values()) > 0  # the fault really bit


def test_unknown_scenario_names_the_known_ones():
    with pytest.raises(SystemExit, match="known: .*baseline"):
        load_scenarios("nope")


def test_leak_check_inspects_only_after_the_daemon_served_everything_sent_to_it():
    """A call still queued on the daemon re-creates a session once served: a check that
    looks before that reports 0. Scripted stand-ins (the timing is the point, not I/O)."""

    class Daemon:
        proc = type("P", (), {"poll": staticmethod(lambda: None)})()
        served = False

        def held(self):
            return {"read_locks": 0, "sessions": 1 if self.served else 0}

    daemon = Daemon()

    class Conn:
        left = 3  # answers still to come

        def unanswered(self, request_id=None):
            if self.left:
                self.left -= 1
                daemon.served = not self.left  # the last one re-creates the session
            return self.left

    class Orch:
        def wake(self): pass
        def live_prefixes(self): return 0
        def pending_debts(self): return 0

    slots = type("S", (), {"outstanding": 0})()
    live = _leaks(Orch(), None, daemon, slots, Conn(), settle_s=2.0)
    assert live["sessions"] == 1 and live["unanswered_calls"] == 0
