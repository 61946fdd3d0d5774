"""A retrieve's obligations as an object (`Retrieval`), paid exactly once whatever happens:
the ledger alone (released twice, paid once; a raising step stays owed), then the real
`LMCacheMPConnector` over a scripted transport (no daemon, no sleeps): a failure at each step
of a retrieve, whole or in pieces, leaves exactly the debt the daemon is owed, and the lookup's
read locks are the caller's to free exactly when no debt covers them."""

from __future__ import annotations

import collections
import time

import msgspec
import pytest
import torch

from lmcache_loadback.connectors import wire
from lmcache_loadback.connectors.base import Connector
from lmcache_loadback.connectors.errors import (
    DaemonRejected,
    DaemonTimeout,
    DaemonUnavailable,
    ProtocolError,
    ShortRead,
    SlotsError,
)
from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.connectors.retrieval import CommitBehind, Retrieval
from lmcache_loadback.connectors.safe_decode import dump_tensor_list
from lmcache_loadback.orchestrator import LoadBackConfig
from lmcache_loadback.orchestrator.calls import Prefix, PrefixCalls
from lmcache_loadback.orchestrator.instruments import product_metrics
from lmcache_loadback.orchestrator.leases import Lease, RequestKey
from lmcache_loadback.orchestrator.link import DaemonLink
from lmcache_loadback.orchestrator.policies import CircuitBreaker
from lmcache_loadback.testing.memory import InMemoryConnector
from tests.conftest import kv_of, make_pool, same_kv

C = 16
LAYOUT = KVLayout(num_layers=1, num_heads=2, head_dim=8, dtype=torch.float16, chunk_size=C)
TOKS = list(range(6 * C))


# -- the ledger alone ----------------------------------------------------------------


def _paying(log: list, name: str):
    return lambda _t: log.append(name)


def test_released_twice_is_paid_once_in_order():
    paid: list[str] = []
    r = Retrieval(epoch=3, start=0, end=64)
    r.asked(32, _paying(paid, "commit a"))
    r.asked(64, _paying(paid, "commit b"))
    assert r.locks_moved and [o.what for o in r.owed] == ["commit_retrieve"] * 2
    assert r.release(1.0) and r.release(1.0)
    assert paid == ["commit a", "commit b"] and not r.owes
    assert [(o.start, o.end) for o in r.paid] == [(0, 32), (32, 64)]


def test_a_raising_step_stays_owed_and_the_steps_after_it_are_still_paid():
    """Each step is an obligation of its own: one that raises costs the others nothing."""
    paid: list[str] = []
    fail = [True]

    def flaky(_t):
        if fail[0]:
            raise DaemonUnavailable("not sent")
        paid.append("commit b")

    r = Retrieval(0, 0, 96)
    r.asked(32, _paying(paid, "commit a"))
    r.asked(64, flaky)
    r.owe("free_locks", 64, 96, _paying(paid, "free c"))
    with pytest.raises(DaemonUnavailable):
        r.release(1.0)
    assert paid == ["commit a", "free c"] and [repr(o) for o in r.owed] == [
        "commit_retrieve[32, 64)"]
    fail[0] = False
    r.release(1.0)
    r.release(1.0)
    assert paid == ["commit a", "free c", "commit b"]


def test_handed_over_once_and_closed_after():
    r = Retrieval(0, 0, 32)
    assert not r.locks_moved and not r.hand_over()  # nothing owed: nothing to queue
    r2 = Retrieval(0, 0, 32)
    r2.asked(32, lambda _t: None)
    assert r2.hand_over() and not r2.hand_over()
    with pytest.raises(RuntimeError, match="handed over"):
        r2.owe("free_locks", 0, 32, lambda _t: None)


def test_asked_without_a_commit_moves_the_locks_and_owes_nothing():
    r = Retrieval(0, 16, 48)
    r.asked(48, None)
    assert r.locks_moved and not r.owes and r.asked_to == 48
    with pytest.raises(ValueError):
        r.asked(64, None)  # beyond the range


class _Event:
    """A CUDA event's `query()`, set by hand."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_commits_are_paid_behind_the_copy_only_once_each_piece_completed():
    paid: list[str] = []
    r = Retrieval(0, 0, 96)
    behind = CommitBehind(r)
    events = [_Event() for _ in range(3)]
    for i, (end, ev) in enumerate(zip((32, 64, 96), events)):
        r.asked(end, _paying(paid, f"commit {i}"))
        behind.landed(end, ev)
    assert behind.pay_landed(1.0) == 0 and paid == []  # no copy completed: nothing, no wait
    events[1].done = True  # a later piece done before an earlier one: still in order
    assert behind.pay_landed(1.0) == 0 and paid == []
    events[0].done = True
    assert behind.pay_landed(1.0) == 2 and paid == ["commit 0", "commit 1"]
    assert [repr(o) for o in r.owed] == ["commit_retrieve[64, 96)"]
    r.release(1.0)  # the caller's release pays what is left, once
    assert paid == ["commit 0", "commit 1", "commit 2"] and not r.owes


def test_a_commit_failing_behind_the_copy_stays_owed_for_the_release():
    paid: list[str] = []
    fail = [True]

    def flaky(_t):
        if fail[0]:
            raise DaemonTimeout("commit_retrieve", 0.1, "no answer")
        paid.append("commit 0")

    r = Retrieval(0, 0, 64)
    behind = CommitBehind(r)
    ev = _Event()
    r.asked(32, flaky)
    behind.landed(32, ev)
    r.asked(64, _paying(paid, "commit 1"))
    ev.done = True
    assert behind.pay_landed(1.0) == 0 and behind.failed and len(r.owed) == 2
    fail[0] = False
    r.release(1.0)
    assert paid == ["commit 0", "commit 1"]


def test_the_rest_of_a_range_prepared_in_part_is_freed_once_whatever_was_asked_for():
    freed: list[tuple[int, int]] = []
    r = Retrieval(0, 0, 96)
    r.owe_rest(lambda s, e, _t: freed.append((s, e)))
    assert not r.owes and not r.locks_moved  # nothing asked: the lookup's locks, the caller's
    r.asked(32, lambda _t: None)
    assert r.owes and [repr(o) for o in r.owed][-1] == "free_locks[32, 96)"
    r.asked(64, lambda _t: None)  # the load goes on: less is left to free
    r.release(1.0)
    r.release(1.0)
    assert freed == [(64, 96)]
    done = Retrieval(0, 0, 64)
    done.owe_rest(lambda s, e, _t: freed.append((s, e)))
    done.asked(32, None)
    done.asked(64, None)  # every piece asked for: nothing left to free
    assert not done.owes and done.release(1.0) and freed == [(64, 96)]


# -- the connector, over a scripted transport ----------------------------------------


class ScriptedTransport:
    """Answers each op from a script (a value to encode, a frame, or an exception to
    raise), else like an idle healthy daemon; records every op sent, in order."""

    def __init__(self) -> None:
        self.epoch = 0
        self.late_replies = 0
        self.fences_dropped = 0
        self.sent: list[tuple[str, tuple[int, int] | None]] = []
        self.keys: list[wire.CacheKey] = []
        self.script: dict[str, collections.deque] = collections.defaultdict(collections.deque)

    def call(self, op, frames, timeout_s, *, request_id=None, fence=None, probe=False):
        key = None
        if op in ("prepare_retrieve", "commit_retrieve", "free_lookup_locks"):
            k = msgspec.msgpack.decode(frames[0], type=wire.CacheKey)
            self.keys.append(k)
            key = (k.start, k.end)
        self.sent.append((op, key))
        step = self.script[op].popleft() if self.script[op] else _DEFAULT.get(op)
        if isinstance(step, BaseException):
            raise step
        if callable(step):
            step = step(key)
        if isinstance(step, bytes) or step is None:
            return step
        return wire.encode(step)

    #: Calls the scripted "daemon" has not answered yet (a test sets it).
    pending = 0

    def unanswered(self, request_id=None) -> int:
        return self.pending

    def close(self) -> None:
        pass


_DEFAULT = {"commit_retrieve": True, "free_lookup_locks": None}
SOURCE = make_pool(LAYOUT, 256)


def _chunks_reply(key) -> wire.PrepareRetrieveReply:
    """The chunks of tokens [start, end), from SOURCE's slots 0..."""
    from lmcache_loadback.connectors.kv_copy import gather_chunks

    s, e = key
    chunks = gather_chunks(LAYOUT, SOURCE.k_buffer, SOURCE.v_buffer, torch.arange(s, e))
    return wire.PrepareRetrieveReply(success=True, data=dump_tensor_list(chunks))


FAILURES = {
    "unavailable": lambda: DaemonUnavailable("injected: not sent"),
    "timeout": lambda: DaemonTimeout("prepare_retrieve", 0.1),
    "refused": lambda: wire.PrepareRetrieveReply(success=False),
    "short": lambda: wire.PrepareRetrieveReply(success=True, data=dump_tensor_list([])),
    "undecodable": lambda: b"\xc1",
}
#: Whether the daemon may have served the failed call (its commit is then owed).
REACHED = {"unavailable": False, "timeout": True, "refused": False, "short": True,
           "undecodable": True}
RAISES = {"unavailable": DaemonUnavailable, "timeout": DaemonTimeout,
          "refused": DaemonRejected, "short": ShortRead, "undecodable": ProtocolError}


def _conn(pieces=None) -> tuple[LMCacheMPConnector, ScriptedTransport]:
    t = ScriptedTransport()
    conn = LMCacheMPConnector("tcp://scripted", LAYOUT, transfer="pickle", transport=t)
    conn.force_pieces = pieces
    return conn, t


def _retrieve(conn, r, slots=None):
    dst = make_pool(LAYOUT, 256, fill=False)
    slots = torch.arange(100, 100 + r.end - r.start) if slots is None else slots
    return dst, slots, conn.retrieve_into(TOKS, "r", dst, slots, start=r.start, end=r.end,
                                          timeout_s=1.0, retrieval=r)


def _paid_ops(t: ScriptedTransport, r: Retrieval) -> list:
    """Pay the retrieval twice; the releases that went out (once each)."""
    n = len(t.sent)
    r.release(1.0)
    r.release(1.0)
    return t.sent[n:]


def test_both_connectors_satisfy_the_whole_protocol():
    assert isinstance(_conn()[0], Connector)
    assert isinstance(InMemoryConnector(LAYOUT), Connector)


def test_a_landed_retrieve_owes_its_commit_once():
    conn, t = _conn()
    t.script["prepare_retrieve"].append(_chunks_reply)
    r = Retrieval(conn.epoch, 0, 2 * C)
    dst, slots, got = _retrieve(conn, r)
    assert same_kv(kv_of(dst, slots), kv_of(SOURCE, torch.arange(2 * C)))
    assert r.locks_moved and got.commit == r.release
    assert _paid_ops(t, r) == [("commit_retrieve", (0, 2 * C))]


@pytest.mark.parametrize("how", sorted(FAILURES))
def test_a_failed_whole_retrieve_owes_exactly_its_commit_when_it_may_have_been_served(how):
    conn, t = _conn()
    t.script["prepare_retrieve"].append(FAILURES[how]())
    r = Retrieval(conn.epoch, 0, 2 * C)
    with pytest.raises(RAISES[how]):
        _retrieve(conn, r)
    assert r.locks_moved == REACHED[how]  # else the caller's lease frees [0, 32) itself
    want = [("commit_retrieve", (0, 2 * C))] if REACHED[how] else []
    assert _paid_ops(t, r) == want


def test_refused_slots_send_nothing_and_owe_nothing():
    conn, t = _conn()
    r = Retrieval(conn.epoch, 0, 2 * C)
    with pytest.raises(SlotsError):
        _retrieve(conn, r, slots=torch.arange(5))
    assert t.sent == [] and not r.locks_moved and not r.owes


@pytest.mark.parametrize("how", sorted(FAILURES))
@pytest.mark.parametrize("piece", [0, 1, 2])
def test_a_piece_failing_leaves_exactly_the_right_debt(piece, how):
    """Pieces of [2, 2, 2] chunks, piece `piece` fails: the pieces before it owe their
    commits, the failed one its commit if the daemon may have served it, and once anything
    moved the locks, the free of the pieces never asked for; nothing at all if nothing
    reached the daemon (the caller's lease then frees the whole range)."""
    conn, t = _conn(pieces=lambda n: [2, 2, 2])
    for _ in range(piece):
        t.script["prepare_retrieve"].append(_chunks_reply)
    t.script["prepare_retrieve"].append(FAILURES[how]())
    r = Retrieval(conn.epoch, 0, 6 * C)
    with pytest.raises(RAISES[how]):
        _retrieve(conn, r)
    ranges = [(i * 2 * C, (i + 1) * 2 * C) for i in range(3)]
    asked = piece + REACHED[how]  # pieces whose locks may have moved to daemon transfers
    want = [("commit_retrieve", ranges[i]) for i in range(asked)]
    if 0 < asked < 3:
        want.append(("free_lookup_locks", (asked * 2 * C, 6 * C)))
    assert r.locks_moved == bool(asked)
    assert _paid_ops(t, r) == want


def test_a_prepared_range_owes_its_commit_to_its_own_incarnation():
    conn, t = _conn()
    t.script["prepare_retrieve"].append(_chunks_reply)
    r = Retrieval(conn.epoch, 0, 2 * C)
    prepared = conn.prepare(TOKS, "r", start=0, end=2 * C, timeout_s=1.0, retrieval=r)
    assert prepared.retrieval is r and r.locks_moved and r.owes
    t.epoch += 1  # the daemon restarted before the copy
    with pytest.raises(DaemonUnavailable, match="restarted"):
        conn.retrieve_into(TOKS, "r", make_pool(LAYOUT, 64, fill=False), torch.arange(2 * C),
                           start=0, end=2 * C, timeout_s=1.0, prepared=prepared)
    assert r.epoch == 0 and r.owes  # owed to the old daemon: the link drops it as stale
    with pytest.raises(ValueError, match="its own retrieval"):
        conn.retrieve_into(TOKS, "r", make_pool(LAYOUT, 64, fill=False), torch.arange(2 * C),
                           start=0, end=2 * C, timeout_s=1.0, prepared=prepared,
                           retrieval=Retrieval(1, 0, 2 * C))


def test_a_sharded_retrieval_frees_only_its_own_share_of_the_pieces_never_asked_for():
    conn, t = _conn(pieces=lambda n: [2, 4])
    t.script["prepare_retrieve"].extend([_chunks_reply, DaemonUnavailable("gone")])
    r = Retrieval(conn.epoch, 0, 6 * C, shard=True)
    with pytest.raises(DaemonUnavailable):
        _retrieve(conn, r)
    n = len(t.keys)
    r.release(1.0)
    free = t.keys[n + 1:]  # after piece 1's commit
    assert [(k.start, k.end, k.worker_id, k.num_kv_readers) for k in free] == [
        (2 * C, 6 * C, conn.kv_rank, 1)]  # this rank's share, not the group's


# -- handed over: each step a debt of its own ----------------------------------------


def _calls_over(conn) -> tuple[PrefixCalls, Prefix]:
    cfg = LoadBackConfig.from_dict({"chunk_size": C, "deadlines": {"control_ms": 100}})
    breaker = CircuitBreaker(cfg.breaker)
    link = DaemonLink(conn, cfg, breaker, product_metrics(), background=False)
    link.registered_epoch = conn.epoch
    calls = PrefixCalls(conn, link, breaker, link.metrics, clock=time.monotonic,
                        sleep=lambda _s: None)
    key = RequestKey.of("r", TOKS)
    return calls, Prefix(key, 0, conn.epoch, Lease(key, conn.epoch, 0, len(TOKS)))


def test_a_release_step_that_times_out_costs_the_later_steps_nothing():
    """A pipelined load fails at piece 3 (its prepare_retrieve timed out); the release's
    first commit then times out too. That commit stays owed (never sent twice) until the
    daemon answered it, and the other commits and the free of the piece never asked for
    still go out. Before: the whole release was one debt, marked paid at the first
    timeout; the rest was never sent (the read locks stayed until the daemon's TTL)."""
    conn, t = _conn(pieces=lambda n: [1, 1, 1, 3])
    t.script["prepare_retrieve"].extend([_chunks_reply, _chunks_reply,
                                         DaemonTimeout("prepare_retrieve", 0.1)])
    calls, p = _calls_over(conn)
    r = Retrieval(conn.epoch, 0, 6 * C)
    with pytest.raises(DaemonTimeout):
        _retrieve(conn, r)
    t.script["commit_retrieve"].append(DaemonTimeout("commit_retrieve", 0.1))
    n = len(t.sent)
    calls._hand_over(p, r, None)
    t.pending = 1  # the timed-out commit: the daemon may serve it still
    calls.link.pay()
    calls.link.pay()
    assert t.sent[n:] == [("commit_retrieve", (0, C))]  # the rest waits behind it, in order
    assert calls.link.pending("r") == 4
    t.pending = 0  # the daemon answered it
    calls.link.pay()
    assert t.sent[n:] == [("commit_retrieve", (0, C)), ("commit_retrieve", (C, 2 * C)),
                          ("commit_retrieve", (2 * C, 3 * C)),
                          ("free_lookup_locks", (3 * C, 6 * C))]
    assert calls.link.pending() == 0
    snap = calls.link.metrics.snapshot()
    assert snap["loadback_releases_failed_total{what=commit_retrieve}"] == 0
