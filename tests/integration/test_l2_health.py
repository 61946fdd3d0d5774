"""A LOOKUP waits for the daemon's L2 store only as long as it pays, and a stalled store is
not a dead daemon: real lmcache 0.5.6 daemons sharing one real redis-server (`resp`
adapter), the store made slow or hung by SIGSTOP to its PID.

Two daemons, A (stores) and B (loads), 256-token chunks and a 2 KiB-per-token layout as in
the L2 measurements (a 16k prefix is 64 chunks, 32 MiB), shared by the module's tests.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator import DegradeReason, LoadBackConfig, LoadBackOrchestrator
from lmcache_loadback.orchestrator import PrefixState
from lmcache_loadback.orchestrator.policies import BreakerState
from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.testing.redis import RedisServer
from tests.conftest import kv_of, make_pool, require_redis, same_kv

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(240)]

require_redis()

CHUNK = 256
LAYOUT = KVLayout(num_layers=4, num_heads=2, head_dim=64, dtype=torch.bfloat16,
                  chunk_size=CHUNK)
WAIT_S = 15  # the bound on every wait for the system under test


@pytest.fixture(scope="module")
def fleet():
    """redis (resp) shared by daemons A and B; both with the admin API (what they hold)."""
    with RedisServer(maxmemory="256mb") as redis:
        a, b = (DaemonProcess(chunk_size=CHUNK, http=True, shm_name=f"lbl2{name}{os.getpid()}",
                              l2_adapter=redis.l2_adapter("resp")) for name in "ab")
        with ThreadPoolExecutor(2) as ex:
            errors = [f.exception() for f in [ex.submit(d.start) for d in (a, b)]]
        try:
            if any(errors):
                raise next(e for e in errors if e)
            yield redis, a, b
        finally:
            redis.resume()
            for d in (a, b):
                d.stop()


@pytest.fixture
def redis(fleet):
    r = fleet[0]
    yield r
    r.resume()  # a failed test never leaves the store paused for the next


def _orch(d: DaemonProcess, *, background: bool = False, **sections) -> LoadBackOrchestrator:
    """An orchestrator on `d`; `background`: its heartbeat and releaser threads run (else
    the test ticks it)."""
    cfg = LoadBackConfig.from_dict({"mp_port": d.port, "chunk_size": CHUNK,
                                    "deadlines": {"store_ms": 10000, **sections.pop("deadlines", {})},
                                    **sections})
    conn = LMCacheMPConnector(d.endpoint, LAYOUT, model_name=cfg.cache_model())
    orch = LoadBackOrchestrator(cfg, conn, kv_pool=make_pool(LAYOUT, 2 * 16384),
                                start_heartbeat=background)
    if not background:
        orch.tick()
    assert orch.wait_registered(WAIT_S)
    return orch


def _until(cond, what: str, bound_s: float = WAIT_S) -> None:
    end = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < end, f"not within {bound_s} s: {what}"
        time.sleep(0.01)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 50000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _store_in_l2(redis: RedisServer, orch: LoadBackOrchestrator, toks: list[int]) -> None:
    """STORE through `orch`'s daemon, then wait until redis holds every chunk (the daemon
    writes to L2 after STORE returns)."""
    before = redis.dbsize()
    assert orch.store(f"st{toks[0]}", toks, torch.arange(len(toks)))
    orch.finish(f"st{toks[0]}")
    _until(lambda: redis.dbsize() >= before + len(toks) // CHUNK, "the prefix in redis")


def _idle(*daemons: DaemonProcess) -> None:
    for d in daemons:
        _until(lambda: {k: v for k, v in d.held().items() if k != "objects"} ==
               dict.fromkeys(("read_locks", "write_locks", "sessions", "registered",
                              "prefetch_jobs"), 0), f"{d.endpoint} holds nothing")


class PendingPast:
    """Wraps the connector's status poll (the real call is made) to tell when the daemon
    has said "still fetching" later than `after_s` into the LOOKUP: the moment a fixed
    deadline of `after_s` would have given up."""

    def __init__(self, conn: LMCacheMPConnector, after_s: float) -> None:
        self.seen = threading.Event()
        self.started = 0.0
        inner_lookup, inner_query = conn.lookup, conn.query_prefetch_status

        def lookup(key, timeout_s):
            self.started = time.monotonic()
            return inner_lookup(key, timeout_s)

        def query(request_id, timeout_s):
            chunks = inner_query(request_id, timeout_s)
            if chunks is None and time.monotonic() - self.started > after_s:
                self.seen.set()
            return chunks

        conn.lookup, conn.query_prefetch_status = lookup, query


def test_break_even_wait_loads_a_16k_l2_prefix_that_a_fixed_50ms_deadline_misses(fleet, redis):
    """A 16k prefix stored through A is only in L2 for B. With the store slow (paused)
    past 50 ms into the LOOKUP, the fixed 50 ms deadline misses it (lookup_timeout, the
    breaker untouched: the daemon answered), while the break-even wait (nothing measured
    yet: the 2 s cap, under the break-even point at 4000 tokens/s; room for a loaded
    machine) rides it out and loads it byte-exact."""
    _, a, b = fleet
    n = 16384
    toks = _tokens(n, 16)
    writer = _orch(a)
    fixed = _orch(b, deadlines={"lookup_ms": 50}, l2={"max_wait_ms": 50})
    waits = _orch(b, deadlines={"lookup_ms": 50},
                  l2={"max_wait_ms": 2000}, break_even={"prefill_tokens_per_s": 4000})
    try:
        _store_in_l2(redis, writer, toks)
        assert fixed.lookup_wait_s(n) == pytest.approx(0.05)
        # nothing measured on this orchestrator yet: the 2 s cap, under the 4.1 s recompute
        assert waits.lookup_wait_s(n) == pytest.approx(2.0)

        redis.pause()
        t0 = time.monotonic()
        missed = fixed.match("fixed", toks)
        took = time.monotonic() - t0
        assert (missed.tokens, missed.reason) == (0, DegradeReason.LOOKUP_TIMEOUT)
        assert 0.05 <= took < 0.05 + 1.0  # its deadline, not the store's pause
        assert fixed.breaker.state == BreakerState.CLOSED

        spy = PendingPast(waits.connector, 0.05)
        found = {}
        t = threading.Thread(target=lambda: found.update(r=waits.match("wait", toks)))
        t.start()
        assert spy.seen.wait(WAIT_S), "the LOOKUP was never pending past 50 ms"
        redis.resume()
        t.join(WAIT_S)
        assert found["r"].tokens == n, found["r"]
        dst = torch.arange(n, 2 * n)
        assert waits.load_back("wait", dst).state == PrefixState.LOADED
        assert same_kv(kv_of(writer.kv_pool, torch.arange(n)), kv_of(waits.kv_pool, dst))
        waits.finish("wait")
        fixed.finish("fixed")
    finally:
        redis.resume()
        for o in (writer, fixed, waits):
            o.close()
    _idle(a, b)


def test_stalled_l2_makes_lookups_fast_misses_while_the_daemon_answers(fleet, redis, caplog):
    """SIGSTOP to redis: LOOKUPs on B, hits in its own memory included, outlive their wait
    while B answers every poll; after `stall_after` (2) of them the store is stalled and a
    LOOKUP is a miss at once (l2_stalled), not sent. B's ping answers and the breaker stays
    closed; a prefix found before the stall still loads. After SIGCONT a probe sees the
    store answer, hits come back, and B holds nothing once the orchestrator closes."""
    _, _, b = fleet
    caplog.set_level(logging.WARNING, logger="loadback")
    orch = _orch(b, background=True, heartbeat={"interval_ms": 200},
                 l2={"max_wait_ms": 300, "probe_interval_ms": 100, "probe_timeout_ms": 100})
    n = 4 * CHUNK
    m = orch.metrics
    try:
        kept, other = _tokens(n, 1), _tokens(n, 2)
        for toks in (kept, other):
            _store_in_l2(redis, orch, toks)
        assert orch.match("found", kept).tokens == n  # promised before the stall
        redis.pause()

        outcomes = []
        for i in range(orch.config.l2.stall_after + 1):
            wait_s = orch.lookup_wait_s(n)
            t0 = time.monotonic()
            r = orch.match(f"s{i}", other)
            outcomes.append((r.reason, time.monotonic() - t0, wait_s))
        sent = outcomes[:-1]
        assert [r for r, _, _ in sent] == [DegradeReason.LOOKUP_TIMEOUT] * len(sent), outcomes
        assert all(w <= took < w + 1.0 for _, took, w in sent), outcomes  # each its own wait
        assert outcomes[-1][0] == DegradeReason.L2_STALLED, outcomes
        assert orch.link.l2.stalled
        skipped = m._lookups["skipped"]._value.get()
        assert orch.match("again", other).reason == DegradeReason.L2_STALLED
        assert m._lookups["skipped"]._value.get() == skipped + 1  # answered without a LOOKUP
        snap = m.snapshot()
        assert snap["loadback_l2_state"] == 1 and snap["loadback_l2_stalls_total"] == 1
        assert snap["loadback_l2_fast_misses_total"] == 2
        assert orch.connector.ping(1.0)  # the daemon itself answers
        assert orch.breaker.state == BreakerState.CLOSED

        dst = torch.arange(n, 2 * n)
        assert orch.load_back("found", dst).state == PrefixState.LOADED
        assert same_kv(kv_of(orch.kv_pool, torch.arange(n)), kv_of(orch.kv_pool, dst))
        orch.finish("found")

        redis.resume()
        _until(lambda: not orch.link.l2.stalled, "a probe sees the store again")
        assert m.snapshot()["loadback_l2_state"] == 0
        assert orch.match("back", other).tokens == n
        assert orch.load_back("back", dst).state == PrefixState.LOADED
        orch.finish("back")
        for i in range(len(outcomes)):
            orch.finish(f"s{i}")
        orch.finish("again")
    finally:
        redis.resume()
        orch.close()
    changes = [r.getMessage() for r in caplog.records if "L2 store" in r.getMessage()]
    assert len(changes) == 2 and "stalled" in changes[0] and "answers again" in changes[1], \
        changes
    _idle(b)
