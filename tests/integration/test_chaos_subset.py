"""A short subset of the chaos scenarios, in the suite: real daemon, real faults, every
invariant judged (`loadback chaos run --scenario all` runs them in full)."""

from __future__ import annotations

import importlib.util
import time

import pytest

from lmcache_loadback.harness import chaos
from lmcache_loadback.harness.chaos import load_scenarios, run_scenario
from lmcache_loadback.harness.chaos_judge import count_leaks
from lmcache_loadback.testing.redis import INSTALL_HINT, RedisUnavailable, find_redis

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(300)]


def hung_report(r) -> str:
    """The worst call in full (pytest would cut a repr short): where its time went."""
    d = {k: round(v, 2) if isinstance(v, float) else v for k, v in r.worst_judged_detail.items()}
    return (f"{r.name}: {r.hung} hung; worst {r.worst_overshoot_ms:.1f} ms past; the call "
            f"judged most late: {d}")


#: engine processes per scenario (rounds x ENGINES requests)
ENGINES = 2


@pytest.mark.parametrize("name, requests", [
    ("restart", 200), ("hang", 150), ("lost_replies", 150), ("corrupt_kv", 150),
    ("rogue_pickle", 100),
])
def test_scenario_keeps_every_invariant(name, requests):
    """Two engine processes, as production runs them: the fault proxy then runs in this
    process, never on an engine's interpreter lock (one engine on a thread here shared it: a
    load_back once waited 2.3 s while the proxy thread held the lock, which judged the run
    hung for the harness's CPU, not the product's)."""
    (scn,) = load_scenarios(name)
    r = run_scenario(scn, requests, engines=ENGINES)
    assert r.requests == requests * ENGINES
    assert r.hung == 0, hung_report(r)
    assert r.leaked == 0, r.leaks
    assert r.wrong_bytes == 0
    assert r.counters_ok, r.counter_mismatches
    assert r.loaded > 0  # the run really loaded KV, before and after the fault
    if name == "restart":
        assert r.recovery_s is not None
    if name in ("corrupt_kv", "lost_replies"):
        assert sum(r.degraded.values()) > 0  # the fault really bit


@pytest.mark.parametrize("name", ["kill", "lost_replies"])
def test_engines_sharing_one_daemon_in_bursts_keep_every_invariant(name):
    """Three engines (own connectors, orchestrators, registries, pools, request names) share
    one daemon, all three issuing a request at the same instant each round, under the fault.
    Engines that named their requests alike collide on the daemon's request-keyed LOOKUPs:
    read locks leak (and loads go wrong), which this test reports."""
    (scn,) = load_scenarios(name)
    rounds = 60
    r = run_scenario(scn, rounds, engines=3)
    assert r.engines == 3 and r.extra["rounds"] == rounds
    per_engine = r.extra["per_engine"]
    assert [e["requests"] for e in per_engine] == [rounds] * 3, per_engine
    assert r.requests == 3 * rounds
    assert r.hung == 0, hung_report(r)
    assert r.leaked == 0, (r.leaks, per_engine)
    assert r.wrong_bytes == 0
    assert r.counters_ok, r.counter_mismatches
    assert r.dead_threads == []
    assert r.ok
    assert r.loaded > 0 and r.recovery_s is not None
    assert r.loaded_from_others > 0  # one engine loaded KV that another stored


def stuck_engine(lane, barrier, prompt, local, phase):
    """e1's third request never returns until the harness gave up on the round (its
    barrier broken), bounded."""
    if lane.name == "e1" and lane.rounds_done == 2:
        end = time.monotonic() + 30
        while not barrier.broken and time.monotonic() < end:
            time.sleep(0.01)  # poll interval of the condition, not an ordering sleep
        return
    lane.engine.request(prompt, local, phase=phase)


def crashing_engine(lane, barrier, prompt, local, phase):
    """e1's third request raises: an engine bug."""
    if lane.name == "e1" and lane.rounds_done == 2:
        raise RuntimeError("engine bug")
    lane.engine.request(prompt, local, phase=phase)


@pytest.mark.parametrize("trouble", ["stuck", "crash"])
def test_a_stuck_or_dead_engine_ends_the_run_and_fails_it(trouble, monkeypatch):
    """An engine (its own process) stuck inside a round breaks the barrier (hung, the run
    ends at once); one whose loop died is named in dead_threads. Either way the run returns
    and is not ok."""
    # Short, yet above what a healthy round takes on a loaded host: at 1 s, and once at 4 s
    # (a fresh-clone make test with other test runs beside it on the 2 cores), an earlier
    # round broke first, and nobody could be named.
    monkeypatch.setattr(chaos, "ROUND_TIMEOUT_S", 8.0)
    (scn,) = load_scenarios("baseline")
    t0 = time.monotonic()
    r = run_scenario(scn, 20, engines=2,
                     request_hook=stuck_engine if trouble == "stuck" else crashing_engine)
    assert time.monotonic() - t0 < 120
    assert not r.ok and r.extra["rounds"] < 20
    if trouble == "stuck":
        assert r.extra["hung_engines"] == ["e1"] and r.hung >= 1 and r.dead_threads == [], (
            f"e1 sticks in round 3; the barrier broke after {r.extra['rounds']} round(s)")
    else:
        assert r.dead_threads == ["chaos-engine-1"] and "engine bug" in r.extra["engine_errors"]["e1"]


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

    lane = type("Lane", (), {"orch": Orch(), "conn": Conn(),
                             "slots": type("S", (), {"outstanding": 0})()})()
    live, (by_engine,) = count_leaks([lane], daemon, settle_s=2.0)
    assert live["sessions"] == 1 and live["unanswered_calls"] == 0
    assert by_engine["unanswered_calls"] == 0


def _l2_missing() -> str:
    """Why the L2 scenarios cannot run here ("" when they can)."""
    try:
        find_redis()
    except RedisUnavailable:
        return f"needs redis-server: {INSTALL_HINT}"
    if importlib.util.find_spec("glide_sync") is None:
        return "needs valkey-glide-sync for the valkey adapter (the test extra installs it)"
    return ""


@pytest.mark.skipif(bool(_l2_missing()), reason=_l2_missing())
@pytest.mark.parametrize("name, requests", [("l2_kill", 200), ("l2_restart", 200)])
def test_l2_store_broken_under_the_daemon_keeps_every_invariant_and_serves_hits_again(
        name, requests):
    """The daemon's L2 store (a real redis-server, valkey adapter) broken while the daemon
    runs. The engines' prompts were stored through a second daemon on the same store, so
    their hits came from L2: none hangs, nothing leaks, every load is byte-exact, and once
    the store is back a hit is served from it again."""
    (scn,) = load_scenarios(name)
    r = run_scenario(scn, requests)
    assert r.hung == 0, hung_report(r)
    assert r.leaked == 0, r.leaks
    assert r.wrong_bytes == 0
    assert r.counters_ok, r.counter_mismatches
    assert r.loaded_from_others > 0  # prompts only the other daemon stored: loaded from L2
    assert r.l2.reads["before"] > 0, r.l2.reads  # the store served hits before the fault
    assert r.l2.recovery_s is not None, r.l2.reads
    assert r.ok
