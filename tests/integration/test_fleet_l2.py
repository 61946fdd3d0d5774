"""Daemons sharing KV through LMCache's L2 on a real redis-server: a prefix stored through
one is a byte-exact hit through another, and `loadback fleet check` tells a sharing pair
from one that does not share, naming why.

Real parts only: Debian's redis-server (one node, and a 3-shard cluster for the valkey
adapter), real lmcache 0.5.6 daemons started with `--l2-adapter`. Daemons are shared at
module scope and started side by side (each takes seconds to start)."""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from prometheus_client import CollectorRegistry

from lmcache_loadback.cli import main as loadback
from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.harness import fleet
from lmcache_loadback.orchestrator import LoadBackConfig, LoadBackOrchestrator
from lmcache_loadback.orchestrator.instruments import product_metrics
from lmcache_loadback.orchestrator.exit_codes import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
)
from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.testing.redis import RedisCluster, RedisServer
from tests.conftest import require_redis

pytestmark = pytest.mark.daemon

require_redis()

HAS_GLIDE = importlib.util.find_spec("glide_sync") is not None
LAYOUT = KVLayout(num_layers=2, num_heads=2, head_dim=32, dtype=torch.bfloat16, chunk_size=16)


def _start_all(daemons: list[DaemonProcess]) -> None:
    with ThreadPoolExecutor(len(daemons)) as ex:
        errors = [f.exception() for f in [ex.submit(d.start) for d in daemons]]
    if any(errors):
        _stop_all(daemons)
        raise next(e for e in errors if e)


def _stop_all(daemons: list[DaemonProcess]) -> None:
    with ThreadPoolExecutor(len(daemons)) as ex:
        list(ex.map(DaemonProcess.stop, daemons))


def _admin(d: DaemonProcess) -> str:
    return f"{d.host}:{d.http_port}"


def _addr(d: DaemonProcess) -> str:
    return f"{d.host}:{d.port}"


def _assert_idle(*daemons: DaemonProcess) -> None:
    for d in daemons:
        held = d.held()
        assert {k: held[k] for k in ("read_locks", "write_locks", "sessions", "prefetch_jobs",
                                     "registered")} == dict.fromkeys(
            ("read_locks", "write_locks", "sessions", "prefetch_jobs", "registered"), 0), held


@pytest.fixture(scope="module")
def fleet_one_redis():
    """Daemons A and B on one redis (resp adapter), C on another redis, D with another chunk
    size on the first."""
    with RedisServer() as shared, RedisServer() as other:
        a = DaemonProcess(http=True, l2_adapter=shared.l2_adapter("resp"))
        b = DaemonProcess(http=True, l2_adapter=shared.l2_adapter("resp"))
        c = DaemonProcess(http=True, l2_adapter=other.l2_adapter("resp"))
        d = DaemonProcess(http=True, chunk_size=2 * a.chunk_size,
                          l2_adapter=shared.l2_adapter("resp"))
        _start_all([a, b, c, d])
        try:
            yield shared, a, b, c, d
        finally:
            _stop_all([a, b, c, d])


def test_prefix_stored_through_one_daemon_is_a_byte_exact_hit_through_another(fleet_one_redis):
    shared, a, b, _, _ = fleet_one_redis
    n = 4 * LAYOUT.chunk_size
    g = torch.Generator().manual_seed(7)
    bufs = [torch.randn(2 * n, 2, 32, generator=g).to(torch.bfloat16) for _ in range(4)]
    pool = KVPool(bufs[:2], bufs[2:])
    toks = torch.randint(0, 50000, (n,), generator=g).tolist()
    ca = LMCacheMPConnector(a.endpoint, LAYOUT, transfer="pickle")
    cb = LMCacheMPConnector(b.endpoint, LAYOUT, transfer="pickle")
    try:
        ca.register(5)
        cb.register(5)
        assert ca.store_from(toks, "st", pool, torch.arange(n), timeout_s=10)
        ca.end_session("st", 5)
        assert b.held()["objects"] == 0  # B's L1 is empty: a hit can only come from L2
        deadline, tries, hit = time.monotonic() + 10, 0, 0
        while True:  # the L2 write starts after STORE returns
            tries += 1
            rid = f"ld{tries}"
            hit = cb.lookup_hit_tokens(toks, rid, timeout_s=5)
            if hit == n or time.monotonic() > deadline:
                break
            cb.free_locks(toks, rid, 0, hit, 5)
            cb.end_session(rid, 5)
            time.sleep(0.02)
        assert hit == n, f"B hit {hit}/{n} after {tries} LOOKUPs; redis holds {shared.dbsize()} keys"
        got = cb.retrieve_into(toks, rid, pool, torch.arange(n, 2 * n), start=0, end=n,
                               timeout_s=10)
        if got.commit is not None:
            got.commit(5)
        cb.end_session(rid, 5)
        for t in bufs:
            assert torch.equal(t[:n], t[n:])
        assert shared.dbsize() >= n // LAYOUT.chunk_size
    finally:
        for c in (ca, cb):
            c.unregister(5)
            c.close()
    _assert_idle(a, b)


def test_fleet_check_passes_on_a_pair_sharing_one_redis(fleet_one_redis, capsys):
    _, a, b, _, _ = fleet_one_redis
    rc = loadback(["fleet", "check", _addr(a), _addr(b), "--admin-a", _admin(a),
                   "--admin-b", _admin(b)])
    out = capsys.readouterr().out
    assert rc == EXIT_OK, out
    assert "FAIL" not in out and "byte-exact" in out and "one L2 store: resp" in out
    assert "ok   stores through A reach its L2" in out and "ok   stores through B reach" in out
    _assert_idle(a, b)


def test_fleet_check_passes_on_daemons_with_shared_memory_pools(capsys):
    """The fleet's recommended daemons (`--shm-name`) answer a pickled load with slots: the
    check loads its marker through their pool (before: `undecodable tensor-list payload`,
    exit 69)."""
    with RedisServer(maxmemory="64mb") as redis:
        a, b = (DaemonProcess(http=True, shm_name=f"lbfc{n}{os.getpid()}",
                              l2_adapter=redis.l2_adapter("resp")) for n in "ab")
        try:
            with ThreadPoolExecutor(2) as ex:
                for f in [ex.submit(d.start) for d in (a, b)]:
                    f.result()
            rc = loadback(["fleet", "check", _addr(a), _addr(b), "--admin-a", _admin(a),
                           "--admin-b", _admin(b)])
            out = capsys.readouterr().out
            assert rc == EXIT_OK, out
            assert "FAIL" not in out and "loaded it byte-exact" in out
            _assert_idle(a, b)
        finally:
            for d in (a, b):
                d.stop()


def test_fleet_check_fails_naming_different_redis_servers(fleet_one_redis):
    shared, a, _, c, _ = fleet_one_redis
    by_config = fleet.check(_addr(a), _addr(c), admins=(_admin(a), _admin(c)))
    assert [(f.ok, f.code) for f in by_config if not f.ok] == [(False, EXIT_FAILED)]
    assert "different L2 stores" in str(by_config[-1])
    assert f"127.0.0.1:{shared.port}" in str(by_config[-1])
    # Without the admin API only the marker can tell: stored through A, never seen by C.
    by_marker = fleet.check(_addr(a), _addr(c), wait_s=0.5)
    assert not by_marker[-1].ok and by_marker[-1].code == EXIT_FAILED
    assert "no sharing" in by_marker[-1].line and "found 0/" in by_marker[-1].line
    _assert_idle(a, c)


def test_fleet_check_names_an_l2_server_that_does_not_answer(fleet_one_redis, capsys):
    shared, a, b, _, _ = fleet_one_redis
    shared.pause()
    try:
        rc = loadback(["fleet", "check", _addr(a), _addr(b), "--admin-a", _admin(a),
                       "--admin-b", _admin(b), "--timeout-s", "0.5"])
    finally:
        shared.resume()
    out = capsys.readouterr().out
    assert rc == EXIT_UNAVAILABLE, out
    assert f"FAIL L2 unreachable: 127.0.0.1:{shared.port} (resp)" in out
    _assert_idle(a, b)


def test_fleet_check_refuses_daemons_of_another_chunk_size_before_storing(fleet_one_redis):
    shared, a, _, _, d = fleet_one_redis
    keys = shared.dbsize()
    findings = fleet.check(_addr(a), _addr(d))
    assert [(f.ok, f.code) for f in findings if not f.ok] == [(False, EXIT_FAILED)]
    assert findings[-1].line.startswith(f"chunk size: A {a.chunk_size}, B {d.chunk_size}:")
    assert shared.dbsize() == keys  # nothing was stored


def _engine(d: DaemonProcess, layout: KVLayout, model: str, **l2) -> LoadBackOrchestrator:
    """An orchestrator on `d` (its admin API named), registered by hand (`tick`)."""
    cfg = LoadBackConfig.from_dict({"mp_port": d.port, "mp_http_port": d.http_port,
                                    "chunk_size": d.chunk_size, "model_name": model,
                                    "l2": {"canary_interval_ms": 0, **l2}})
    conn = LMCacheMPConnector(d.endpoint, layout, model_name=model, transfer="pickle")
    return LoadBackOrchestrator(cfg, conn, metrics=product_metrics(CollectorRegistry()),
                                start_heartbeat=False)


def test_an_engine_of_another_layout_under_the_fleets_model_name_is_refused(
        fleet_one_redis, caplog):
    shared, a, b, _, _ = fleet_one_redis
    model = f"fleet-model-{time.monotonic_ns()}"
    fp16 = KVLayout(num_layers=2, num_heads=2, head_dim=32, dtype=torch.float16,
                    chunk_size=LAYOUT.chunk_size)
    first, other, same = _engine(a, LAYOUT, model), _engine(b, fp16, model), _engine(b, LAYOUT, model)
    try:
        keys = shared.dbsize()
        first.tick()  # the first engine of this model name records its layout in L2
        assert first.link.registered() and first.link.refused is None
        deadline = time.monotonic() + 5
        while shared.dbsize() == keys and time.monotonic() < deadline:  # L2 writes are async
            time.sleep(0.01)
        with caplog.at_level(logging.ERROR, logger="loadback"):
            other.tick()  # another dtype under that name, on another daemon of the fleet
        assert not other.link.registered()
        assert other.link.refused.startswith(f"model_name {model!r} (world size 1) is used in "
                                             "this fleet's L2 for a KV layout of 2 layers x 2 "
                                             "heads x 32 dim bfloat16")
        assert "this engine's is 2 layers x 2 heads x 32 dim float16" in other.link.refused
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "give this engine a model_name of its own" in errors[0]
        assert other.metrics.snapshot()["loadback_daemon_refused{reason=model_name}"] == 1
        same.tick()  # the fleet's layout on that daemon is accepted
        assert same.link.registered()
    finally:
        for o in (first, other, same):
            o.close()
    _assert_idle(a, b)


def test_a_daemon_hashing_otherwise_than_the_fleet_is_refused(fleet_one_redis):
    _, a, _, _, _ = fleet_one_redis
    orch = _engine(a, LAYOUT, "loadback", hash_algorithm="sha256_cbor")
    try:
        orch.tick()
        assert not orch.link.registered()
        assert orch.link.refused.startswith(
            f"daemon {a.endpoint} --hash-algorithm blake3, the fleet's (l2.hash_algorithm) "
            "sha256_cbor: its chunks get other L2 keys")
        assert orch.metrics.snapshot()["loadback_daemon_refused{reason=hash_algorithm}"] == 1
    finally:
        orch.close()
    _assert_idle(a)


def test_an_identity_lookup_outliving_its_check_is_released_once_the_store_answers(
        fleet_one_redis):
    """The identity check's LOOKUP of the fleet's record waits on the L2 store (lmcache
    0.5.6 checks the store for every chunk, those in its own memory too). The store hung
    past the check's budget: the check gives up, and the daemon still runs the LOOKUP's
    prefetch (its job, its session, the read lock on the record's chunk), which it keeps
    with no TTL on the job until its status is read. Once the store answers, the link pays
    what it owes for it: the daemon holds nothing."""
    shared, a, _, _, _ = fleet_one_redis
    orch = _engine(a, LAYOUT, f"fleet-slow-{time.monotonic_ns()}", canary_deadline_ms=300)
    try:
        keys = shared.dbsize()
        orch.tick()  # the first engine of this model name records its layout
        assert orch.link.registered() and orch.link.refused is None
        end = time.monotonic() + 5
        while shared.dbsize() == keys and time.monotonic() < end:  # L2 writes are async
            time.sleep(0.01)
        assert shared.dbsize() > keys, "the identity record never reached redis"
        shared.pause()
        try:
            orch.link.suspect()
            orch.tick()  # re-registers: the check's LOOKUP outlives its 300 ms on the hung store
            assert orch.link.registered()  # an unchecked identity never blocks a registration
            held = a.held()
            assert (held["prefetch_jobs"], held["sessions"]) == (1, 1), held
            for _ in range(40):  # the releaser passes whenever a debt is queued
                orch.link.pay()
            assert orch.link.pending() == 2  # its abandon, then its session's end
        finally:
            shared.resume()
        end = time.monotonic() + 15
        while orch.link.pending() and time.monotonic() < end:
            orch.tick()
            time.sleep(0.05)
        held = a.held()
        assert {k: held[k] for k in ("read_locks", "sessions", "prefetch_jobs")} == {
            "read_locks": 0, "sessions": 0, "prefetch_jobs": 0}, held
        assert not any(v for k, v in orch.metrics.snapshot().items()
                       if k.startswith("loadback_releases_failed_total"))
    finally:
        orch.close()
    _assert_idle(a)  # the identity's registration too, ended at close


def test_fleet_check_names_stores_that_never_reach_l2(fleet_one_redis, capsys):
    # Last of the module's users: the shared redis restarts, and resp never reconnects.
    shared, a, b, _, _ = fleet_one_redis
    shared.restart()
    rc = loadback(["fleet", "check", _addr(a), _addr(b), "--admin-a", _admin(a),
                   "--admin-b", _admin(b)])
    out = capsys.readouterr().out
    assert rc == EXIT_FAILED, out
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 2 and fails[0].startswith("FAIL stores through A do not reach its L2 "
                                                   "(lost)"), out
    assert fails[1].startswith("FAIL stores through B do not reach its L2 (lost)"), out
    # Without the admin APIs only B's miss shows, and the line names this cause among others.
    by_marker = fleet.check(_addr(a), _addr(b), wait_s=0.5)
    assert not by_marker[-1].ok and "what A stores does not reach it" in by_marker[-1].line
    _assert_idle(a, b)


def test_fleet_check_refuses_engines_naming_the_model_differently_before_any_call(capsys):
    # no daemon at these ports: the refusal comes before anything is sent
    rc = loadback(["fleet", "check", "127.0.0.1:1", "127.0.0.1:2", "--model-name", "llama",
                   "--model-name", "llama-70b"])
    assert rc == EXIT_FAILED
    assert "FAIL model name: A's engines use 'llama', B's 'llama-70b'" in capsys.readouterr().out
    assert loadback(["fleet", "check", "127.0.0.1:1", "nowhere", "--timeout-s", "0.2"]) == EXIT_USAGE


@pytest.mark.skipif(not HAS_GLIDE, reason="the valkey adapter needs valkey-glide-sync "
                    "(the test extra installs it)")
def test_three_shard_cluster_with_valkey_adapter_shares_byte_exact():
    with RedisCluster(shards=3) as cluster:
        a = DaemonProcess(http=True, l2_adapter=cluster.l2_adapter())
        b = DaemonProcess(http=True, l2_adapter=cluster.l2_adapter())
        # C forgot cluster_mode: one shard taken for a whole server
        c = DaemonProcess(http=True, l2_adapter={"type": "valkey", "request_timeout": 0.5,
                                                 "startup_nodes": cluster.nodes[0].address})
        try:
            _start_all([a, b, c])
            findings = fleet.check(_addr(a), _addr(b), admins=(_admin(a), _admin(b)))
            assert all(f.ok for f in findings), "\n".join(map(str, findings))
            assert "one L2 store: valkey cluster" in "\n".join(map(str, findings))
            assert findings[-1].line.startswith(f"B hit {2 * a.chunk_size}/")
            # the marker's chunks sit in the cluster, on whichever shards their slots map to
            assert cluster.dbsize() >= fleet.MARKER_CHUNKS
            forgot = fleet.check(_addr(a), _addr(c), admins=(_admin(a), _admin(c)))
            fails = [f for f in forgot if not f.ok]
            assert [(f.code, f.line.split(":")[0]) for f in fails] == [
                (EXIT_FAILED, "cluster_mode forgotten")], "\n".join(map(str, forgot))
            assert f"daemon B's valkey adapter" in fails[0].line
            assert '"cluster_mode": true' in fails[0].line
            _assert_idle(a, b, c)
        finally:
            _stop_all([a, b, c])
