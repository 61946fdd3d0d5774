"""The orchestrator's own logic over the in-process connector: no sockets, injected clock."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_loadback.connectors.errors import DaemonTimeout, DaemonUnavailable, ProtocolError
from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.testing.memory import InMemoryConnector
from lmcache_loadback.orchestrator import (
    DegradeReason,
    LoadBackConfig,
    LoadBackOrchestrator,
    MatchResult,
    PrefixState,
)
from lmcache_loadback.orchestrator.policies import BreakerState, CircuitBreaker
from lmcache_loadback.orchestrator.states import (
    MACHINE,
    TRANSITIONS,
    MachineError,
    fire,
    fire_with_machine,
    mermaid,
)
from tests.conftest import kv_of, make_pool, same_kv

C = 16


class FakeClock:
    """The orchestrator's one clock: read it, and sleeping advances it (no real wait)."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def make(**over):
    layout = KVLayout(num_layers=1, num_heads=2, head_dim=8, dtype=torch.float16, chunk_size=C)
    conn = InMemoryConnector(layout)
    pool = make_pool(layout, 2048)
    cfg = LoadBackConfig.from_dict({"chunk_size": C, **over})
    clock = FakeClock()
    orch = LoadBackOrchestrator(cfg, conn, kv_pool=pool, clock=clock, sleep=clock.sleep,
                                start_heartbeat=False)
    orch.tick()  # registers
    return orch, conn, pool, clock


def store(orch, toks, slots, rid="s"):
    assert orch.store(rid, toks, slots)
    orch.finish(rid)


def snap(orch, name):
    return orch.metrics.snapshot().get(name, 0.0)


def test_table_defines_the_five_states_and_draws_itself():
    names = {s.value for s in PrefixState}
    assert {"matched", "marked", "retrieving", "loaded", "degraded"} <= names
    diagram = mermaid()
    for trigger, src, dst in TRANSITIONS:
        for s in src:
            assert f"{s.value} --> {dst.value}: {trigger}" in diagram


def test_fire_agrees_with_transitions():
    class P:
        pass
    for state in PrefixState:
        for trigger in MACHINE.events:
            a, b = P(), P()
            a.state = b.state = state.value
            try:
                want = fire_with_machine(a, trigger)
            except MachineError:
                with pytest.raises(MachineError):
                    fire(b, trigger)
                continue
            assert fire(b, trigger) == want


def test_terminal_states_accept_no_trigger():
    class P:
        pass
    for terminal in ("loaded", "degraded"):
        for trigger in MACHINE.events:
            p = P()
            p.state = terminal
            with pytest.raises(MachineError):
                fire(p, trigger)


def test_hit_loads_byte_exact_and_metrics_reconcile():
    orch, conn, pool, _ = make()
    toks = list(range(100, 100 + 64))
    store(orch, toks, torch.arange(0, 64))
    assert orch.match("r", toks).tokens == 64
    dst = torch.arange(500, 564)
    res = orch.load_back("r", dst)
    assert res.loaded_tokens == 64 and res.state == PrefixState.LOADED
    assert same_kv(kv_of(pool, torch.arange(0, 64)), kv_of(pool, dst))
    orch.finish("r")
    assert conn.held_locks() == 0 and not conn.sessions
    assert snap(orch, 'loadback_prefix_outcomes_total{reason=none,state=loaded}') == 1
    assert snap(orch, "loadback_loaded_tokens_total") == 64


def test_repeated_match_answers_from_the_marker_without_a_second_lookup():
    orch, conn, _, _ = make()
    toks = list(range(64))
    store(orch, toks, torch.arange(64))
    assert orch.match("r", toks).tokens == 64
    assert orch.match("r", toks).tokens == 64
    assert conn.calls["lookup"] == 1


def test_lookup_timeout_degrades_with_reason_and_owes_the_release():
    orch, conn, _, _ = make()
    toks = list(range(64))
    store(orch, toks, torch.arange(64))
    conn.fail_next["lookup"].append(DaemonTimeout("lookup", 0.05))
    assert orch.match("r", toks) == MatchResult(0, PrefixState.DEGRADED,
                                                DegradeReason.LOOKUP_TIMEOUT)
    assert orch.state_of("r") == PrefixState.DEGRADED
    # The lost LOOKUP took locks daemon-side: settled (inline without background threads).
    assert conn.calls["abandon_lookup"] == 1
    assert conn.held_locks() == 0 and orch.pending_debts() == 0


def test_unavailable_lookup_is_retried_inside_the_deadline():
    orch, conn, _, _ = make()
    toks = list(range(64))
    store(orch, toks, torch.arange(64))
    conn.fail_next["lookup"].append(DaemonUnavailable("down"))
    assert orch.match("r", toks).tokens == 64
    assert conn.calls["lookup"] == 2
    assert snap(orch, 'loadback_retries_total{op=lookup}') == 1


def test_retrieve_retry_looks_up_again_first_and_loads():
    orch, conn, pool, _ = make()
    toks = list(range(64))
    store(orch, toks, torch.arange(64))
    assert orch.match("r", toks).tokens == 64
    conn.fail_next["retrieve"].append(DaemonTimeout("prep", 0.1))
    res = orch.load_back("r", torch.arange(900, 964))
    assert res.loaded_tokens == 64
    assert conn.calls["lookup"] == 2 and conn.calls["retrieve"] == 2
    orch.finish("r")
    assert conn.held_locks() == 0


def test_corrupt_reply_degrades_without_retry_and_leaves_slots_untouched():
    orch, conn, pool, _ = make(retries={"max_attempts": 2})
    toks = list(range(64))
    store(orch, toks, torch.arange(64))
    assert orch.match("r", toks).tokens == 64
    for _ in range(2):
        conn.fail_next["retrieve"].append(ProtocolError("garbled"))
    dst = torch.arange(900, 964)
    before = kv_of(pool, dst)
    res = orch.load_back("r", dst)
    assert (res.loaded_tokens, res.reason) == (0, DegradeReason.CORRUPT_DATA)
    assert conn.calls["retrieve"] == 1  # ProtocolError.retry_safe is False: never repeated
    assert same_kv(before, kv_of(pool, dst))
    assert snap(orch, 'loadback_recomputed_tokens_total{reason=corrupt_data}') == 64


def test_break_even_floor_skips_small_loads():
    orch, conn, _, _ = make(break_even={"min_tokens": 128})
    toks = list(range(64))
    store(orch, toks, torch.arange(64))
    assert orch.match("r", toks).tokens == 0
    assert conn.calls["lookup"] == 0


def test_break_even_time_test_degrades_when_recompute_is_faster():
    # 1 GB/s assumed, 64 tokens of 64 B each: load ~4 us; recompute at 1e9 tok/s: 64 ns.
    orch, conn, _, _ = make(break_even={"prefill_tokens_per_s": 1e9})
    toks = list(range(64))
    store(orch, toks, torch.arange(64))
    assert orch.match("r", toks) == MatchResult(0, PrefixState.DEGRADED,
                                                DegradeReason.BELOW_BREAK_EVEN)
    orch.finish("r")
    assert conn.held_locks() == 0


def test_breaker_opens_answers_without_the_socket_and_recovers_by_probe():
    orch, conn, _, clock = make(breaker={"consecutive_failures": 2, "cooldown_ms": 100})
    toks = list(range(64))
    store(orch, toks, torch.arange(64))
    boom = DaemonTimeout("lookup", 0.05)
    conn.fail_next["lookup"].extend([boom, boom])
    orch.match("a", toks)
    orch.match("b", toks)
    assert orch.breaker.state == BreakerState.OPEN
    calls = conn.calls["lookup"]
    assert orch.match("c", toks).tokens == 0 and conn.calls["lookup"] == calls
    clock.t += 0.2
    orch.tick()  # half-open probe (ping) succeeds -> closed
    assert orch.breaker.state == BreakerState.CLOSED
    assert orch.match("d", toks).tokens == 64


def test_breaker_cooldown_doubles_to_its_cap():
    clock = FakeClock()
    cfg = LoadBackConfig.from_dict({"breaker": {"consecutive_failures": 1, "cooldown_ms": 100,
                                                "cooldown_max_ms": 300}})
    b = CircuitBreaker(cfg.breaker, clock=clock)
    b.record(False)
    seen = []
    for _ in range(4):
        seen.append(round(b.cooldown_s, 3))
        clock.t += b.cooldown_s + 0.001
        assert b.probe_due()
        b.record(False)
    assert seen == [0.1, 0.2, 0.3, 0.3]


def test_abort_releases_locks_and_session():
    orch, conn, _, _ = make()
    toks = list(range(64))
    store(orch, toks, torch.arange(64))
    assert orch.match("r", toks).tokens == 64
    assert conn.held_locks() == 4
    orch.abort("r")
    assert conn.held_locks() == 0 and "r" not in conn.sessions
    assert orch.state_of("r") is None


class PrefixLifecycle(RuleBasedStateMachine):
    """Random engine call sequences: never an undefined transition, one terminal each,
    nothing held at the end, metrics equal to outcomes."""

    def __init__(self) -> None:
        super().__init__()
        self.orch, self.conn, self.pool, self.clock = make()
        self.toks = {i: list(range(i * 1000, i * 1000 + 48)) for i in range(3)}
        for i, t in self.toks.items():
            store(self.orch, t, torch.arange(i * 48, i * 48 + 48), rid=f"s{i}")
        self.promised: dict[str, int] = {}  # request -> tokens match promised (live ones)
        self.terminal: dict[str, str] = {}
        self.n = 0

    @rule(which=st.integers(0, 3), fail=st.sampled_from(["", "lookup", "retrieve"]))
    def match(self, which, fail):
        self.n += 1
        rid = f"r{self.n}"
        toks = self.toks.get(which, list(range(7, 55)))
        if fail:
            self.conn.fail_next[fail].append(
                DaemonTimeout(fail, 0.01))
        got = self.orch.match(rid, toks)
        assert got.state == self.orch.state_of(rid)
        if got.state is not None:
            self.promised[rid] = got.tokens

    @rule(data=st.data())
    def load_back(self, data):
        live = [r for r in self.promised if self.orch.state_of(r) == PrefixState.MARKED]
        if live:
            rid = data.draw(st.sampled_from(live))
            n = self.promised[rid]
            res = self.orch.load_back(rid, torch.arange(1000, 1000 + n))
            assert res.loaded_tokens in (0, n) and res.state.terminal

    @rule(data=st.data(), how=st.sampled_from(["finish", "abort"]))
    def release(self, data, how):
        if self.promised:
            rid = data.draw(st.sampled_from(sorted(self.promised)))
            del self.promised[rid]
            getattr(self.orch, how)(rid)
            assert self.orch.state_of(rid) is None
            assert rid not in self.terminal
            self.terminal[rid] = how

    @precondition(lambda self: True)
    @invariant()
    def outcomes_reconcile(self):
        s = self.orch.metrics.snapshot()
        settled = sum(v for k, v in s.items() if k.startswith("loadback_prefix_outcomes_total"))
        live_terminal = sum(1 for r in self.promised if self.orch.state_of(r).terminal)
        assert settled == len(self.terminal) + live_terminal

    def teardown(self):
        for rid in list(self.promised):
            self.orch.finish(rid)
        self.clock.t += 120  # past any breaker cooldown: the probe closes it, debts are paid
        self.orch.tick()
        self.orch.tick()
        assert self.conn.held_locks() == 0
        self.orch.close()


TestPrefixLifecycle = PrefixLifecycle.TestCase
TestPrefixLifecycle.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


def test_failed_relookup_settles_that_lookup_and_stops_retrying():
    orch, conn, _, _ = make(retries={"max_attempts": 3})
    toks = list(range(64))
    store(orch, toks, torch.arange(64))
    assert orch.match("r", toks).tokens == 64
    conn.fail_next["retrieve"].append(DaemonTimeout("prep", 0.1))
    conn.fail_next["lookup"].append(DaemonTimeout("lookup", 0.1))  # the re-lookup's answer is lost
    res = orch.load_back("r", torch.arange(900, 964))
    assert res.loaded_tokens == 0 and res.reason == DegradeReason.RETRIEVE_TIMEOUT
    assert conn.calls["retrieve"] == 1 and conn.calls["lookup"] == 2
    assert conn.calls["abandon_lookup"] == 1
    orch.finish("r")
    assert conn.held_locks() == 0 and orch.pending_debts() == 0
