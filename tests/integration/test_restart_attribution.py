"""A call is attributed to the daemon incarnation that serves it, across a restart.

The connector's `epoch` moves when the sentinel socket's monitor reports a new daemon's
handshake after a disconnect; debts are tied to it, stale ones dropped. Two ways it could
name the wrong daemon, each held open here on purpose against a real lmcache 0.5.6 daemon
(SIGKILL, then a new one on the same port, where another engine registered and stored):

- The monitor attached after the sentinel connected: when the constructing thread lost the
  CPU between the two (GIL contention: the engines built before it already run their
  heartbeats), the first handshake went unseen, and the first restart then read as the
  same daemon coming back (epoch unchanged). That engine never re-registered: its LOOKUP
  hit the chunks the others stored, its prepare_retrieve under an instance id the new
  daemon never registered went unanswered (a retrieve_timeout), and the daemon kept the
  LOOKUP's read locks (`loadback chaos run --scenario kill --engines 4` ended with 35).
- A thread's own DEALER reconnects on its own timer: it may be connected to the new
  daemon before the sentinel reports it. A call sent then is owed to the old incarnation.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.connectors.errors import DaemonUnavailable
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator import LoadBackConfig, LoadBackOrchestrator
from tests.conftest import CHUNK, kv_of, make_pool, same_kv
from tests.integration.test_orchestrator_daemon import wait_for

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(120)]

_HANDSHAKE = zmq.EVENT_HANDSHAKE_SUCCEEDED.to_bytes(2, "little")


class HeldHandshakes:
    """The sentinel's monitor socket with its handshake events held back until `release`
    is set: the sentinel "has not yet seen" the daemon that accepted it. Other events (the
    disconnect) pass in order, up to the first held one."""

    def __init__(self, monitor: zmq.Socket) -> None:
        self.monitor = monitor
        self.release = threading.Event()
        self.held = threading.Event()  # a handshake arrived and is being withheld
        self._queue: list[list[bytes]] = []

    def _deliverable(self) -> bool:
        while self.monitor.poll(0):
            self._queue.append(self.monitor.recv_multipart())
        if self._queue and self._queue[0][0][:2] == _HANDSHAKE and not self.release.is_set():
            self.held.set()
            return False
        return bool(self._queue)

    def poll(self, timeout: int = 0, flags: int = zmq.POLLIN) -> int:
        return zmq.POLLIN if self._deliverable() else 0

    def recv_multipart(self, flags: int = 0, **kw) -> list[bytes]:
        if not self._deliverable():
            raise zmq.Again()
        return self._queue.pop(0)

    def close(self, linger: int | None = None) -> None:
        self.monitor.close(linger=linger)


def config_for(d: DaemonProcess) -> LoadBackConfig:
    return LoadBackConfig.from_dict({
        "mp_port": d.port, "chunk_size": CHUNK,
        "deadlines": {"lookup_ms": 200, "retrieve_base_ms": 300, "retrieve_per_ki_token_ms": 0,
                      "retrieve_max_ms": 300, "control_ms": 300},
        "breaker": {"consecutive_failures": 50, "cooldown_ms": 50, "cooldown_max_ms": 200},
    })


def tick_until_registered(orch: LoadBackOrchestrator, timeout_s: float = 15.0) -> bool:
    def ok() -> bool:
        orch.tick()
        return orch.link.registered() and orch.breaker.allow()
    return wait_for(ok, timeout_s)


def settle(*orchs: LoadBackOrchestrator, timeout_s: float = 10.0) -> None:
    def paid() -> bool:
        for o in orchs:
            o.link.pay()
        return all(o.pending_debts() == 0 and o.connector.unanswered() == 0 for o in orchs)
    assert wait_for(paid, timeout_s), [o.pending_debts() for o in orchs]


def late_monitor(monkeypatch) -> None:
    """`get_monitor_socket` as if the calling thread lost the CPU after `connect`: on a
    socket connected already, its first handshake completes (seen by a throwaway monitor)
    before the monitor asked for is attached."""
    attach = zmq.Socket.get_monitor_socket

    def late(self, events=None, addr=None):
        if self.get(zmq.LAST_ENDPOINT):
            first = attach(self, zmq.EVENT_HANDSHAKE_SUCCEEDED)
            assert first.poll(10_000), "the sentinel never connected"
            recv_monitor_message(first)
            self.disable_monitor()
            first.close(linger=0)
        return attach(self, events, addr)

    monkeypatch.setattr(zmq.Socket, "get_monitor_socket", late)


class Engines:
    """One daemon and two engines stepped by hand (no heartbeat or releaser threads): `a`
    re-registers and stores on the new daemon; `b` is the engine under test."""

    def __init__(self, layout, monkeypatch=None) -> None:
        self.d = DaemonProcess(chunk_size=CHUNK, http=True).start()
        self.pools = [make_pool(layout, 2048), make_pool(layout, 2048)]
        orchs = []
        for i, pool in enumerate(self.pools):
            with monkeypatch.context() if i and monkeypatch else contextlib.nullcontext() as mp:
                if mp is not None:
                    late_monitor(mp)
                conn = LMCacheMPConnector(self.d.endpoint, layout, connect_timeout_s=0.2)
            orchs.append(LoadBackOrchestrator(config_for(self.d), conn, kv_pool=pool,
                                              start_heartbeat=False))
        self.a, self.b = orchs
        self.toks = torch.randint(0, 32000, (560,),
                                  generator=torch.Generator().manual_seed(5)).tolist()
        self.src = torch.arange(560)

    def restart_and_store(self, before_start=lambda: None) -> None:
        """Kill the daemon (b sees it go), start a new one, `a` stores the prefix there."""
        assert tick_until_registered(self.a) and tick_until_registered(self.b)
        self.d.kill()
        assert wait_for(lambda: self.b.connector.transport._down)  # b saw the disconnect
        before_start()
        self.d.start()
        assert tick_until_registered(self.a)  # a is on the new daemon
        assert self.a.store("a-store", self.toks, self.src)
        self.a.finish("a-store")
        settle(self.a)
        assert self.d.held()["read_locks"] == 0

    def loads(self, rid: str) -> bool:
        """b matches, loads (byte-exact) and finishes the stored prefix."""
        m = self.b.match(rid, self.toks)
        dst = torch.arange(1000, 1000 + m.tokens)
        got = self.b.load_back(rid, dst).loaded_tokens if m.tokens else 0
        self.b.finish(rid)
        return (m.tokens, got) == (560, 560) and same_kv(kv_of(self.pools[0], self.src),
                                                       kv_of(self.pools[1], dst))

    def close(self) -> None:
        self.a.close()
        self.b.close()
        self.d.stop()


def test_a_restart_after_a_first_handshake_the_monitor_missed_is_a_new_epoch(
        layout, monkeypatch):
    e = Engines(layout, monkeypatch)  # b's sentinel connected before its monitor watched
    try:
        e.restart_and_store()
        assert wait_for(lambda: not e.b.connector.transport._down)  # b is connected again
        # What b's heartbeat and engine thread do next: tick, then a request.
        e.b.tick()
        loaded = e.loads("b-1")
        assert tick_until_registered(e.b)
        settle(e.a, e.b)
        assert e.d.held()["read_locks"] == 0 and e.d.held()["sessions"] == 0, e.d.held()
        assert e.b.connector.epoch == 1 and loaded
    finally:
        e.close()


def test_a_dealer_reconnected_before_the_sentinel_sends_nothing_to_the_new_daemon(layout):
    e = Engines(layout)
    held = HeldHandshakes(e.b.connector.transport._monitor)

    def hold() -> None:
        e.b.connector.transport._monitor = held

    try:
        e.restart_and_store(before_start=hold)
        # b's own DEALER (this thread's) is connected to the new daemon; b's sentinel has
        # been accepted too, but that is not reported yet: b's epoch names the killed one.
        sock = e.b.connector.transport._local.sock
        assert wait_for(lambda: sock.poll(0, zmq.POLLOUT) != 0)
        assert wait_for(lambda: not held.poll() and held.held.is_set())
        assert e.b.connector.epoch == e.a.connector.epoch - 1

        m = e.b.match("b-1", e.toks)
        if m.tokens:  # promised on a daemon b cannot name (the defect): walk it through
            e.b.load_back("b-1", torch.arange(1000, 1000 + m.tokens))
        try:
            e.b.connector.ping(0.05)
            pinged = True
        except DaemonUnavailable:
            pinged = False  # refused, never sent: the new daemon is not named yet
        e.b.finish("b-1")

        held.release.set()  # the sentinel reports the new daemon: b re-registers
        assert tick_until_registered(e.b)
        settle(e.a, e.b)
        assert e.d.held()["read_locks"] == 0 and e.d.held()["sessions"] == 0, e.d.held()
        assert m.tokens == 0 and not pinged
        assert e.loads("b-2")  # hits resume by themselves on the new daemon
        settle(e.a, e.b)
        assert e.d.held()["read_locks"] == 0 and e.d.held()["sessions"] == 0, e.d.held()
    finally:
        held.release.set()
        e.close()
