"""The LMCache 0.5.6 client against the real daemon: bytes, deadlines and the protocol's traps."""

from __future__ import annotations

import os
import threading
import time

import msgspec
import pytest
import torch

from lmcache_loadback.testing.os_delay import OsDelay
from lmcache_loadback.connectors import wire
from lmcache_loadback.testing.daemon import DaemonProcess, free_port
from lmcache_loadback.connectors.errors import DaemonRejected, DaemonTimeout, DaemonUnavailable, SlotsError
from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.connectors.transport import ZmqTransport
from tests.conftest import kv_of, make_pool, same_kv

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def daemons():
    """One real daemon per chunk size, plus one serving its L1 pool through /dev/shm."""
    ds = {
        16: DaemonProcess(chunk_size=16, http=True),
        256: DaemonProcess(chunk_size=256, l1_size_gb=0.5),
        "shm": DaemonProcess(chunk_size=16, shm_name=f"lbtest{os.getpid()}"),
    }
    try:
        for d in ds.values():
            d.start()
        yield ds
    finally:
        for d in ds.values():
            d.stop()


def round_trip(d: DaemonProcess, layout: KVLayout, n_tokens: int, transfer="pickle"):
    pool = make_pool(layout, 2 * n_tokens + 64)
    perm = torch.randperm(2 * n_tokens + 64)
    src, dst = perm[:n_tokens], perm[n_tokens:2 * n_tokens]
    c = LMCacheMPConnector(d.endpoint, layout, transfer=transfer)
    try:
        c.register(5)
        toks = torch.randint(0, 50000, (n_tokens,)).tolist()
        assert c.store_from(toks, "store-1", pool, src, timeout_s=10)
        c.end_session("store-1", 1)
        assert c.lookup_hit_tokens(toks, "load-1", 5) == n_tokens
        landed = c.retrieve_into(toks, "load-1", pool, dst, start=0, end=n_tokens, timeout_s=10)
        assert landed.commit(1) is True
        c.end_session("load-1", 1)
        assert landed.nbytes == n_tokens * layout.bytes_per_token
        return pool, src, dst
    finally:
        c.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_layers", [1, 4])
@pytest.mark.parametrize("chunk", [16, 256])
def test_store_then_retrieve_into_other_slots_is_byte_exact(daemons, dtype, num_layers, chunk):
    layout = KVLayout(num_layers=num_layers, num_heads=4, head_dim=32, dtype=dtype,
                      chunk_size=chunk)
    pool, src, dst = round_trip(daemons[chunk], layout, 2048)
    for a, b in zip(kv_of(pool, src), kv_of(pool, dst)):
        assert torch.equal(a, b)



def test_a_pickled_store_on_a_daemon_with_a_pool_is_kept(daemons, layout):
    """A daemon with a pool reserves its slots at any prepare_store, which a pickled commit
    cannot write (lmcache 0.5.6 then answers true and keeps nothing): the pickled STORE sends
    its commit alone, and the chunks load back through the pool byte for byte."""
    d = daemons["shm"]
    pool = make_pool(layout, 128)
    src, dst = torch.arange(0, 64), torch.arange(64, 128)
    toks = torch.randint(0, 50000, (64,)).tolist()
    pickled = LMCacheMPConnector(d.endpoint, layout, transfer="pickle")
    shm = LMCacheMPConnector(d.endpoint, layout, transfer="shm")
    try:
        pickled.register(5)
        shm.register(5)
        assert pickled.store_from(toks, "pickled-store", pool, src, timeout_s=10)
        pickled.end_session("pickled-store", 1)
        assert shm.lookup_hit_tokens(toks, "shm-load", 5) == 64
        landed = shm.retrieve_into(toks, "shm-load", pool, dst, start=0, end=64, timeout_s=10)
        assert landed.commit(1) is True
        shm.end_session("shm-load", 1)
        assert same_kv(kv_of(pool, src), kv_of(pool, dst))
    finally:
        pickled.close()
        shm.close()

def test_shared_memory_mode_is_byte_exact_without_pickle(daemons, monkeypatch):
    import lmcache_loadback.connectors.mp_retrieve as retrieve
    import lmcache_loadback.connectors.mp_store as store

    def refuse(*a, **k):
        raise AssertionError("shm mode must not unpickle")

    monkeypatch.setattr(retrieve, "load_tensor_list", refuse)
    monkeypatch.setattr(store, "dump_tensor_list", refuse)
    layout = KVLayout(num_layers=2, num_heads=4, head_dim=32, dtype=torch.bfloat16, chunk_size=16)
    pool, src, dst = round_trip(daemons["shm"], layout, 1024, transfer="shm")
    assert same_kv(kv_of(pool, src), kv_of(pool, dst))


def test_shm_mode_against_a_daemon_without_shm_says_how_to_fix(daemons, layout):
    c = LMCacheMPConnector(daemons[16].endpoint, layout, transfer="shm")
    try:
        with pytest.raises(DaemonRejected, match="--shm-name NAME --no-l1-use-lazy"):
            c.register(5)
    finally:
        c.close()


def test_handler_that_raises_gets_no_reply_and_the_caller_times_out_on_time(daemons, layout):
    c = LMCacheMPConnector(daemons[16].endpoint, layout)  # never registered: handler raises
    try:
        key = c.key(list(range(32)), "nobody")
        with OsDelay() as delay, pytest.raises(DaemonTimeout):
            c._call("prepare_retrieve", [key, c.instance_id], 0.15)
        assert 0.15 <= delay.took_s < 0.15 + 0.05 + delay.seconds, delay.describe()
    finally:
        c.close()


def test_late_reply_is_never_handed_to_a_later_call(daemons):
    d = daemons[16]
    t = ZmqTransport(d.endpoint)
    try:
        t.call("noop", [], 2)  # connected: a hung daemon now accepts bytes and says nothing
        d.pause()
        with pytest.raises(DaemonTimeout):
            t.call("noop", [], 0.1)
        d.resume()
        # The resumed daemon answers the abandoned noop ("OK"); this call must get its own int.
        frame = t.call("get_chunk_size", [], 2)
        assert wire.DECODERS["get_chunk_size"].decode(frame) == 16
        assert t.sockets_replaced == 1
    finally:
        d.resume()
        t.close()


def test_requests_made_while_down_are_not_replayed_to_a_restarted_daemon(layout):
    d = DaemonProcess(chunk_size=16, http=True).start()
    c = LMCacheMPConnector(d.endpoint, layout, connect_timeout_s=0.2)
    try:
        c.register(5)
        d.kill()
        toks = list(range(64))
        with OsDelay() as delay:
            for i in range(5):
                with pytest.raises(DaemonUnavailable):
                    c.lookup(c.key(toks, f"stale-{i}", lookup=True), 0.1)
        assert delay.took_s < 5 * 0.1 + 0.1 + delay.seconds, delay.describe()
        # A request the daemon accepted but never answered, then the daemon dies.
        d.start()
        deadline = time.monotonic() + 10
        while True:  # calls fail at once until the client's connection is accepted again
            try:
                c.register(5)
                break
            except DaemonUnavailable:
                assert time.monotonic() < deadline, "never reconnected to the new daemon"
                time.sleep(0.005)
        d.pause()
        with pytest.raises(DaemonTimeout):
            c.lookup(c.key(toks, "hung", lookup=True), 0.1)
        d.restart()
        # Watch the new daemon for a while: no stale request may ever show up in it.
        watch_until = time.monotonic() + 0.5
        while time.monotonic() < watch_until:
            held = d.held()
            assert held["sessions"] == 0 and held["prefetch_jobs"] == 0
            assert held["read_locks"] == 0
    finally:
        c.close()
        d.stop()


def test_absent_daemon_is_an_immediate_typed_error_not_the_os_connect_timeout(layout):
    c = LMCacheMPConnector(f"tcp://127.0.0.1:{free_port()}", layout, connect_timeout_s=0.2)
    try:
        with OsDelay() as delay, pytest.raises(DaemonUnavailable, match="no connection"):
            c.register(0.3)
        assert delay.took_s < 0.3 + 0.05 + delay.seconds, delay.describe()
    finally:
        c.close()


def test_one_stuck_call_does_not_stall_another_thread(daemons):
    d = daemons[16]
    t = ZmqTransport(d.endpoint)
    stuck_done = threading.Event()

    def stuck():
        try:  # bad arity: the daemon's handler raises and never replies
            t.call("lookup", [wire.encode("x")], 2.0)
        except DaemonTimeout:
            pass
        stuck_done.set()

    th = threading.Thread(target=stuck)
    th.start()
    try:
        times = []
        for _ in range(30):
            t0 = time.monotonic()
            t.call("noop", [], 0.5)
            times.append(time.monotonic() - t0)
        assert not stuck_done.is_set()
        assert sorted(times)[-2] < 0.05
    finally:
        th.join()
        t.close()


def test_wrong_slot_count_is_a_clear_error(daemons, layout):
    pool = make_pool(layout, 256)
    c = LMCacheMPConnector(daemons[16].endpoint, layout)
    try:
        c.register(5)
        with pytest.raises(SlotsError, match="expected 64 slots"):
            c.store_from(list(range(64)), "s", pool, torch.arange(10), timeout_s=2)
    finally:
        c.close()


def test_wire_types_decode_as_lmcache_s_own():
    from lmcache.v1.multiprocess.custom_types import (
        IPCCacheServerKey,
        PrepareRetrieveResponse,
        RegisterEngineDrivenContextPayload,
    )

    key = wire.CacheKey(model_name="m", world_size=2, worker_id=1, token_ids=(1, 2, 3),
                        start=0, end=3, request_id="r", cache_salt="s")
    theirs = msgspec.msgpack.decode(wire.encode(key), type=IPCCacheServerKey)
    assert theirs == IPCCacheServerKey.from_token_ids("m", 2, 1, [1, 2, 3], 0, 3, "r", "s")
    assert theirs.num_kv_readers == 1 and theirs.request_id == "r"
    reg = wire.RegisterPayload(instance_id=7, model_name="m", world_size=1, block_size=1,
                               num_layers=2, hidden_dim_size=64, dtype_str="float16",
                               use_mla=False, num_physical_slots=16)
    assert msgspec.msgpack.decode(wire.encode(reg), type=RegisterEngineDrivenContextPayload) \
        == RegisterEngineDrivenContextPayload(7, "m", 1, 1, 2, 64, "float16", False, 16)
    resp = msgspec.msgpack.encode(PrepareRetrieveResponse(success=True, data=b"xyz",
                                                          context={"slots": []}))
    ours = wire.DECODERS["prepare_retrieve"].decode(resp)
    assert ours.success and bytes(ours.data) == b"xyz" and ours.context.slots == []
