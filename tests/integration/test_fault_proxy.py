"""FaultProxy against a real lmcache 0.5.6 daemon: each fault reaches the client as the
error the hierarchy promises, and a bad KV reply never touches the destination slots."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from lmcache_loadback.testing.os_delay import OsDelay
from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.connectors.errors import DaemonTimeout, ProtocolError, VersionSkew
from lmcache_loadback.testing.fault_proxy import FaultProxy, FaultRule
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.connectors.retrieval import Retrieval
from lmcache_loadback.connectors.transport import ZmqTransport
from tests.conftest import CHUNK, kv_of, make_pool, same_kv

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(60)]

TOKENS = list(range(1000, 1064))  # 64 tokens: 4 whole chunks
SRC = torch.arange(0, 64)
DST = torch.randperm(1024)[:64] + 2048  # scattered slots far from the source ones


def wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def upstream():
    d = DaemonProcess(chunk_size=CHUNK).start()
    yield d
    d.stop()


@pytest.fixture
def proxy(upstream, layout):
    with FaultProxy(upstream.endpoint, layout=layout, seed=7) as p:
        yield p


@pytest.fixture
def transport(proxy):
    t = ZmqTransport(proxy.endpoint)
    yield t
    t.close()


@pytest.fixture
def connector(proxy, layout):
    c = LMCacheMPConnector(proxy.endpoint, layout)
    yield c
    c.close()


@pytest.fixture
def stored(connector, layout):
    """A registered connector whose daemon holds TOKENS; returns (connector, pool)."""
    pool = make_pool(layout)
    connector.register(5.0)
    assert connector.store_from(TOKENS, "store-" + uuid.uuid4().hex, pool, SRC, timeout_s=5.0)
    return connector, pool


def lookup(connector) -> str:
    rid = "r-" + uuid.uuid4().hex
    assert connector.lookup_hit_tokens(TOKENS, rid, 5.0) == 64
    return rid


def test_transparent_proxy_round_trips_kv_byte_exact(stored, proxy):
    connector, pool = stored
    rid = lookup(connector)
    assert not same_kv(kv_of(pool, SRC), kv_of(pool, DST))
    landed = connector.retrieve_into(TOKENS, rid, pool, DST, start=0, end=64, timeout_s=5.0)
    assert landed.nbytes == 4 * connector.layout.chunk_bytes
    landed.commit(5.0)
    assert same_kv(kv_of(pool, SRC), kv_of(pool, DST))
    st = proxy.stats
    assert st["requests"]["prepare_retrieve"] == st["replies"]["prepare_retrieve"] == 1
    assert st["requests"]["commit_store"] == 1
    assert not {"drop", "internal_errors", "orphan_replies"} & st.keys()


def test_colliding_client_uids_are_routed_back_to_their_callers(proxy, upstream):
    transports = [ZmqTransport(proxy.endpoint) for _ in range(3)]  # all count uids from 1
    errors: list[BaseException] = []

    def worker(t: ZmqTransport, op: str, want) -> None:
        try:
            for _ in range(30):
                got = t.call(op, [], 5.0)
                assert bytes(got) == want, (op, bytes(got))
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    ops = [("noop", b"\xa2OK"), ("get_chunk_size", b"\x10")]
    threads = [threading.Thread(target=worker, args=(t, *ops[(i + j) % 2]))
               for i, t in enumerate(transports) for j in range(2)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    finally:
        for t in transports:
            t.close()
    assert not errors, errors[0]
    assert sum(t.late_replies for t in transports) == 0
    st = proxy.stats
    assert st["replies"]["noop"] == st["replies"]["get_chunk_size"] == 90


def test_dropped_reply_times_out_on_the_callers_deadline(proxy, transport):
    # count=1: the fence the transport sends behind a timed-out call is a noop too, re-sent
    # after 100 ms; dropping every noop counted it as well on a slow host
    proxy.add_rule(FaultRule("drop", op="noop", count=1))
    with OsDelay() as delay, pytest.raises(DaemonTimeout):
        transport.call("noop", [], 0.2)
    assert delay.took_s < 0.2 + 0.02 + delay.seconds, delay.describe()
    assert proxy.stats["drop"] == 1


def test_late_reply_is_never_handed_to_the_next_call(proxy, connector):
    proxy.add_rule(FaultRule("delay", op="noop", delay_s=0.3))
    with pytest.raises(DaemonTimeout):
        connector.noop(0.1)
    assert connector.get_chunk_size(2.0) == CHUNK
    wait_for(lambda: proxy.stats.get("released", 0) >= 1)  # the late noop reply went out
    assert connector.get_chunk_size(2.0) == CHUNK
    assert proxy.stats["replies"]["noop"] == 1


def test_delayed_request_still_answers_within_deadline(proxy, transport):
    proxy.add_rule(FaultRule("delay", op="noop", direction="request", delay_s=0.05))
    start = time.monotonic()
    assert bytes(transport.call("noop", [], 2.0)) == b"\xa2OK"
    assert time.monotonic() - start >= 0.05


def test_duplicate_reply_is_dropped_and_counted_late(proxy, transport):
    proxy.add_rule(FaultRule("duplicate", op="noop", count=1))
    assert bytes(transport.call("noop", [], 2.0)) == b"\xa2OK"
    wait_for(lambda: proxy.stats["replies"].get("noop", 0) == 2)
    before = transport.late_replies
    assert bytes(transport.call("noop", [], 2.0)) == b"\xa2OK"
    assert transport.late_replies == before + 1


def test_garbled_result_is_a_protocol_error(proxy, connector):
    proxy.add_rule(FaultRule("garble", op="get_chunk_size"))
    proxy.add_rule(FaultRule("garble", op="end_session"))  # no result: its op echo is garbled
    with pytest.raises(ProtocolError):
        connector.get_chunk_size(2.0)
    with pytest.raises(ProtocolError):
        connector.end_session("no-such-session", 2.0)
    assert proxy.stats["garble"] == 2


def test_garbled_request_payload_gets_no_answer(proxy, connector):
    proxy.add_rule(FaultRule("garble", op="ping", direction="request"))
    with pytest.raises(DaemonTimeout):
        connector.ping(0.3)
    assert connector.noop(2.0) == "OK"  # the daemon survived it


def test_wrong_op_echo_is_a_protocol_error(proxy, connector):
    proxy.add_rule(FaultRule("wrong_op", op="noop"))
    with pytest.raises(ProtocolError):
        connector.noop(2.0)


@pytest.mark.parametrize("action", ["truncate_kv", "reshape_kv", "retype_kv"])
def test_corrupt_kv_reply_leaves_destination_slots_unchanged(stored, proxy, action):
    connector, pool = stored
    rid = lookup(connector)
    before = kv_of(pool, DST)
    proxy.add_rule(FaultRule(action, op="prepare_retrieve"))
    r = Retrieval(connector.epoch, 0, 64)
    with pytest.raises(ProtocolError):
        connector.retrieve_into(TOKENS, rid, pool, DST, start=0, end=64, timeout_s=5.0,
                                retrieval=r)
    assert proxy.stats[action] == 1
    assert same_kv(kv_of(pool, DST), before)
    assert r.owes  # prepare_retrieve answered: its commit is owed
    assert r.release(2.0) is True
    connector.free_locks(TOKENS, rid, 0, 64, 2.0)


def test_rogue_pickle_is_refused_and_never_runs(stored, proxy, tmp_path):
    connector, pool = stored
    marker = tmp_path / "pwned"
    rid = lookup(connector)
    before = kv_of(pool, DST)
    proxy.add_rule(FaultRule("rogue_pickle", op="prepare_retrieve", payload_path=str(marker)))
    with pytest.raises(ProtocolError):
        connector.retrieve_into(TOKENS, rid, pool, DST, start=0, end=64, timeout_s=5.0)
    assert proxy.stats["rogue_pickle"] == 1
    assert not marker.exists()
    assert same_kv(kv_of(pool, DST), before)
    connector.free_locks(TOKENS, rid, 0, 64, 2.0)


def test_silent_registration_is_reported_as_version_skew(proxy, connector):
    proxy.add_rule(FaultRule("silence", op="register_kv_cache_engine_driven_context"))
    with pytest.raises(VersionSkew, match=r"lmcache==0\.5\.6"):
        connector.register(0.3)
    assert proxy.stats["silence"] == 1
    assert proxy.stats["requests"].get("register_kv_cache_engine_driven_context", 0) == 0


def test_register_against_a_silent_daemon_keeps_its_deadline(proxy, connector):
    proxy.add_rule(FaultRule("silence"))  # hung: answers nothing, not even noop
    with OsDelay() as delay, pytest.raises(DaemonTimeout):
        connector.register(0.3)
    assert delay.took_s < 0.3 + 0.02 + delay.seconds, delay.describe()


def test_rules_are_seeded_counted_and_clearable(upstream):
    def pattern(seed: int) -> list[bool]:
        with FaultProxy(upstream.endpoint, seed=seed) as p:
            t = ZmqTransport(p.endpoint)
            p.add_rule(FaultRule("drop", op="noop", probability=0.5))
            out = []
            for _ in range(12):
                try:
                    t.call("noop", [], 0.1)
                    out.append(True)
                except DaemonTimeout:
                    out.append(False)
            t.close()
            return out

    a = pattern(3)
    assert a == pattern(3) and True in a and False in a

    with FaultProxy(upstream.endpoint) as p:
        t = ZmqTransport(p.endpoint)
        rule = p.add_rule(FaultRule("drop", op="noop", count=1))
        with pytest.raises(DaemonTimeout):
            t.call("noop", [], 0.1)
        assert bytes(t.call("noop", [], 2.0)) == b"\xa2OK"  # count exhausted
        assert p.fired(rule) == 1
        p.add_rule(FaultRule("drop"))
        p.clear()
        assert bytes(t.call("noop", [], 2.0)) == b"\xa2OK"
        t.close()


def test_close_is_prompt_with_messages_still_held(upstream):
    p = FaultProxy(upstream.endpoint).start()
    t = ZmqTransport(p.endpoint)
    p.add_rule(FaultRule("delay", op="noop", delay_s=30))
    with pytest.raises(DaemonTimeout):
        t.call("noop", [], 0.05)
    start = time.monotonic()
    p.close()
    assert time.monotonic() - start < 1.0
    t.close()


def test_rule_validation_refuses_nonsense():
    with pytest.raises(ValueError):
        FaultRule("explode")
    with pytest.raises(ValueError):
        FaultRule("duplicate", direction="request")
    with pytest.raises(ValueError):
        FaultRule("rogue_pickle")
    with pytest.raises(ValueError):
        FaultRule("drop", probability=1.5)
    with pytest.raises(ValueError):
        FaultProxy("tcp://127.0.0.1:1", host="0.0.0.0")
    with pytest.raises(ValueError):
        FaultProxy("tcp://127.0.0.1:1").add_rule(FaultRule("truncate_kv"))


def test_calls_swallowed_by_a_wedged_peer_are_settled_once_it_answers_again(proxy, connector):
    """The fence sent behind a timed-out call is swallowed too; a later fence proves it."""
    connector.register(5.0)
    proxy.add_rule(FaultRule("silence", op="*", direction="request"))
    with pytest.raises(DaemonTimeout):
        connector.end_session("wedged", 0.05)
    assert connector.unanswered("wedged") >= 2  # the call and its fence(s), all swallowed
    proxy.clear()
    wait_for(lambda: connector.unanswered("wedged") == 0, 10.0)
