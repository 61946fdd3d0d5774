"""A fleet: two real SGLang 0.5.23 servers (`--radix-cache-backend loadback`), each with its
own lmcache 0.5.6 daemon, both daemons on one real redis-server through LMCache's L2 (the
`valkey` adapter: its calls are bounded by `request_timeout` and it reconnects to a restarted
server; `resp` has no timeout and never reconnects, lmcache-l2.md).

- Prompts computed on A are a hit on B's first request: B's daemon held nothing (its L1 was
  empty), so the load came from Redis; B's /metrics counts it loaded; B's output is A's (a
  recompute, greedy).
- Redis SIGSTOPped, then SIGCONTed; then SIGKILLed and restarted (empty): every request on
  either server completes within REQUEST_BOUND_S with the recomputed output, and once Redis
  serves again a prompt computed on A is a hit on B within RECOVERY_BOUND_S.
- Idle after each step, neither daemon holds a read or write lock, a session or a prefetch
  job (`DaemonProcess.client_holds()`), and neither server holds a live prefix or an owed
  release.

One pair of servers for the module (a start is 14-60 s here); every request carries a client
deadline and every loop a bound.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from lmcache_loadback.testing.redis import RedisServer
from tests.conftest import require_redis

from .conftest import report
from .helpers import CHUNK, PROMPT_LEN, loaded_tokens, prompt, wait_until
from .test_loadback_server import EXPECTED_HIT, RECOVERY_BOUND_S, assert_within_bound

pytestmark = [pytest.mark.timeout(900)]

require_redis()

try:
    import glide_sync  # noqa: F401  the daemons' valkey adapter imports it
    NO_GLIDE = ""
except ImportError:
    NO_GLIDE = ("the valkey L2 adapter needs valkey-glide-sync in this venv: rebuild it with "
                "`make sglang-envs` (tests/sglang/requirements-0.5.23.txt pins it)")


@pytest.fixture(scope="module", autouse=True)
def _glide_installed():
    """Fails this module's tests, before any server starts, without a collection error that
    would stop every other test of the run."""
    if NO_GLIDE:
        pytest.fail(NO_GLIDE, pytrace=False)

CHUNKS = PROMPT_LEN // CHUNK  # whole chunks a finished prompt stores
LOADED = 'loadback_prefix_outcomes_total{reason="none",state="loaded"}'
#: requests per server while Redis is hung or dead: each a stored prompt and a new one
FAULT_ROUNDS = 2


class Fleet:
    """Redis, and stacks A and B (server + daemon each) whose daemons share it; `stored`:
    prompts computed on A before B was ever asked."""

    def __init__(self, redis: RedisServer, a, b) -> None:
        self.redis, self.a, self.b = redis, a, b
        self.reference: dict[tuple[int, ...], list[int]] = {}  # prompt -> recomputed output
        self.stored: list[list[int]] = []

    def compute_on_a(self, ids: list[int], *, redis_wait_s: float = 10.0) -> bool:
        """A new prompt computed on A (the recompute reference) and stored by A's daemon;
        whether its chunks reached Redis within `redis_wait_s` (the daemon's L2 write starts
        after the STORE returns)."""
        keys = self.redis.dbsize()
        ref = self.a.cold(ids)
        assert ref.ok and self.a.stored, (ref.error, "A's daemon did not store the prompt")
        assert_within_bound([ref], "A computing a new prompt")
        self.reference[tuple(ids)] = ref.output_ids
        try:
            wait_until(lambda: self.redis.dbsize() >= keys + CHUNKS, redis_wait_s, "in Redis")
            return True
        except AssertionError:
            return False

    def same_as_recompute(self, gen) -> None:
        assert gen.ok, gen.error
        assert gen.output_ids == self.reference[tuple(gen.prompt)], (
            "the output differs from the recompute's")


def _loaded(stack) -> float:
    return sum(stack.metric(LOADED))


def _assert_idle(fleet: Fleet, what: str) -> None:
    """Nothing held once nothing runs (bounded settle): every kind of client hold on both
    daemons (`client_holds()`), live prefixes and owed releases on both servers."""
    for name, st in (("A", fleet.a), ("B", fleet.b)):
        try:
            wait_until(lambda: not st.daemon.client_holds(), 15, "")
        except AssertionError:
            raise AssertionError(f"{what}: daemon {name} still holds "
                                 f"{st.daemon.client_holds()}") from None
        wait_until(lambda: not sum(st.metric("loadback_live_prefixes"))
                   and not sum(st.metric("loadback_owed_releases")), 15,
                   f"{what}: server {name} idle (live prefixes, owed releases)")


def _b_hits_within(fleet: Fleet, bound_s: float) -> tuple[float, int]:
    """New prompts computed on A, then sent to B, until B loads one whole from LMCache:
    (seconds taken, prompts tried); every request within its bound with the recompute's
    output."""
    t0, tried = time.monotonic(), 0
    while time.monotonic() - t0 < bound_s:
        tried += 1
        ids = prompt(fleet.a.new_seed())  # one seed counter: A and B share prompts
        in_redis = fleet.compute_on_a(ids, redis_wait_s=2.0)
        got = fleet.b.generate(ids)
        fleet.same_as_recompute(got)
        assert_within_bound([got], "B after Redis came back")
        if in_redis and loaded_tokens(got) == EXPECTED_HIT:
            return time.monotonic() - t0, tried
    raise AssertionError(f"B did not hit a prompt computed on A within {bound_s} s "
                         f"({tried} prompts)")


def _traffic_while(fleet: Fleet, what: str) -> list:
    """FAULT_ROUNDS rounds on both servers: a prompt stored before (device tree flushed, so
    only LMCache could serve it), and a new prompt computed on A, then sent to B. Every
    request within its bound, every output but the reference's the recompute's."""
    gens = []
    for r in range(FAULT_ROUNDS):
        old = fleet.stored[r % len(fleet.stored)]
        for st in (fleet.a, fleet.b):
            assert st.server.flush_cache(), f"{what}: /flush_cache refused"
            gens.append(st.generate(old))
            fleet.same_as_recompute(gens[-1])
        new_ids = prompt(fleet.a.new_seed())
        gens.append(fleet.a.generate(new_ids))
        assert gens[-1].ok, f"{what}: {gens[-1].error}"
        fleet.reference[tuple(new_ids)] = gens[-1].output_ids
        gens.append(fleet.b.generate(new_ids))
        fleet.same_as_recompute(gens[-1])
    assert_within_bound(gens, what)
    return gens


@pytest.fixture(scope="module")
def fleet(make_stack):
    """Both stacks on one Redis; three prompts computed on A, B never asked."""
    redis = RedisServer().start()
    stacks = []
    try:
        l2 = redis.l2_adapter("valkey")
        for _ in range(2):
            stacks.append(make_stack("loadback", metrics=True, l2_adapter=l2, start=False))
        with ThreadPoolExecutor(2) as ex:  # side by side: a start is mostly waiting here
            list(ex.map(lambda st: st.server.start(), stacks))
        fl = Fleet(redis, *stacks)
        fl.stored = [prompt(fl.a.new_seed()) for _ in range(3)]
        for ids in fl.stored:
            assert fl.compute_on_a(ids), f"A's chunks not in Redis ({redis.dbsize()} keys)"
        yield fl
    finally:
        for st in stacks:  # before Redis: a daemon then stops without waiting on its L2
            st.close()
        redis.stop()


def test_prompts_computed_on_a_hit_on_bs_first_request_with_the_same_output(fleet):
    b = fleet.b
    assert b.objects() == 0 and not b.log, "B must start cold: its L1 empty, never asked"
    loaded0 = _loaded(b)
    firsts = []
    for ids in fleet.stored:
        got = b.generate(ids)
        firsts.append(got)
        fleet.same_as_recompute(got)
        details = got.meta.get("cached_tokens_details") or {}
        assert details.get("storage") == EXPECTED_HIT, f"B did not load it from LMCache: {details}"
    assert_within_bound(firsts, "B's first requests")
    wait_until(lambda: _loaded(b) - loaded0 >= len(fleet.stored), 10, "B's loads on /metrics")
    assert _loaded(b) - loaded0 == len(fleet.stored)
    assert b.objects() >= CHUNKS, "B's daemon copied nothing from Redis into its L1"
    _assert_idle(fleet, "after the cross-server hits")
    report("fleet_cross_server_hit", redis_keys=fleet.redis.dbsize(),
           a_start_s=round(fleet.a.server.start_s, 1), b_start_s=round(b.server.start_s, 1),
           b_first_latencies_s=[round(g.latency_s, 3) for g in firsts],
           a_recompute_latencies_s=[round(g.latency_s, 3) for g in fleet.a.log[:3]])


def _through(fleet: Fleet, what: str, fault, recover) -> dict:
    """`fault` Redis, traffic on both servers, `recover` it; then B hits a prompt computed on
    A within RECOVERY_BOUND_S and nothing is held. The figures for the report."""
    fault()
    try:
        during = _traffic_while(fleet, what)
    finally:
        recover()
    took, tried = _b_hits_within(fleet, RECOVERY_BOUND_S)
    _assert_idle(fleet, f"after {what}")
    return {"latencies_s": [round(g.latency_s, 3) for g in during],
            "loaded_during": sum(loaded_tokens(g) > 0 for g in during),
            "b_hit_after_recovery_s": round(took, 2), "prompts_tried": tried}


def test_redis_hung_then_resumed_every_request_within_bound(fleet):
    report("fleet_redis_hung", **_through(fleet, "Redis hung", fleet.redis.pause,
                                          fleet.redis.resume))


def test_redis_killed_then_restarted_every_request_within_bound(fleet):
    report("fleet_redis_killed", **_through(fleet, "Redis dead", fleet.redis.kill,
                                            fleet.redis.restart))
