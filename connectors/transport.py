"""Deadline-keeping request/reply over ZMQ to the LMCache daemon.

The transport knows frames, sockets and deadlines; it knows nothing about retries,
breakers or metrics. Callers read what it counted: `late_replies`, `fences_dropped`,
`epoch` (the daemon incarnation) and `unanswered()`.

Why each mechanism exists: DESIGN.md, "The transport".
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Callable, Sequence

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from .errors import DaemonTimeout, DaemonUnavailable, ProtocolError, RequestDropped
from .fences import Fence, RetiredSockets, fence_for, uid_decoder
from .wire import OP_FRAMES

#: How often a call waiting for its reply checks whether the daemon disconnected.
_SLICE_MS = 5
#: How often the sentinel tries to reach a daemon that went away.
_WATCH_MS = 20

class ZmqTransport:
    """Thread-safe RPC to one daemon endpoint with a hard deadline per call."""

    def __init__(
        self,
        endpoint: str,
        *,
        connect_timeout_s: float = 1.0,
        reconnect_ivl_s: float = 0.05,
        reconnect_ivl_max_s: float = 0.2,
    ) -> None:
        self.endpoint = endpoint
        self._connect_timeout_ms = max(1, int(connect_timeout_s * 1000))
        self._reconnect_ms = max(1, int(reconnect_ivl_s * 1000))
        self._reconnect_max_ms = max(self._reconnect_ms, int(reconnect_ivl_max_s * 1000))
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._sockets: dict[int, zmq.Socket] = {}
        self._uids = itertools.count(1)
        self._closed = False
        self._late_replies = 0
        self.sockets_replaced = 0
        self._in_flight: dict[int, str | None] = {}  # uid -> request id, awaiting a reply
        self._retired = RetiredSockets(self._uids, lambda: self._disconnected)
        # Restart detection (see module docstring).
        self._epoch = 0
        self._connected_once = False
        self._disconnected = False
        self._disconnects = 0
        # It watches for the daemon coming back: retry often (a refused loopback connect is
        # one SYN), so calls that fail fast while it is down resume soon after it is up.
        self._sentinel = self._new_socket(reconnect_ms=min(self._reconnect_ms, _WATCH_MS),
                                          connect=False)
        # Watching before connecting: the first handshake is never missed (see docstring).
        self._monitor = self._sentinel.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        self._sentinel.connect(self.endpoint)

    # -- sockets -------------------------------------------------------------

    def _new_socket(self, reconnect_ms: int | None = None, *, connect: bool = True
                    ) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.CONNECT_TIMEOUT, self._connect_timeout_ms)
        sock.setsockopt(zmq.HANDSHAKE_IVL, self._connect_timeout_ms)
        sock.setsockopt(zmq.RECONNECT_IVL, reconnect_ms or self._reconnect_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, reconnect_ms or self._reconnect_max_ms)
        if connect:
            sock.connect(self.endpoint)
        return sock

    def _socket(self) -> zmq.Socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            with self._lock:
                if self._closed:
                    raise DaemonUnavailable(f"client for {self.endpoint} is closed")
                sock = self._new_socket()
                self._sockets[threading.get_ident()] = sock
                self._prune_dead_threads()
            self._local.sock = sock
        return sock

    def _prune_dead_threads(self) -> None:
        alive = {t.ident for t in threading.enumerate()}
        for ident in [i for i in self._sockets if i not in alive]:
            self._sockets.pop(ident).close(linger=0)

    def _discard_socket(self, sock: zmq.Socket) -> None:
        """Drop this thread's socket: late replies are counted, queued requests die."""
        self._late_replies += self._drain(sock)
        with self._lock:
            self._sockets.pop(threading.get_ident(), None)
            self.sockets_replaced += 1
        sock.close(linger=0)
        self._local.sock = None

    def _retire(self, sock: zmq.Socket, uid: int, request_id: str | None,
                fence: Fence | None, epoch: int, on_late=None) -> None:
        """Keep this thread's timed-out socket, with a fence behind the abandoned call."""
        with self._lock:
            self._sockets.pop(threading.get_ident(), None)
            self.sockets_replaced += 1
        self._local.sock = None
        self._retired.retire(sock, uid, request_id, fence, epoch, on_late)

    @property
    def late_replies(self) -> int:
        """Replies that came after their call gave up (read and dropped, or handed to the
        call's `on_late`)."""
        return self._late_replies + self._retired.late_replies

    @property
    def fences_dropped(self) -> int:
        """Retired sockets closed over `fences.MAX_RETIRED` before their fence answered."""
        return self._retired.fences_dropped

    def unanswered(self, request_id: str | None = None) -> int:
        """Calls for `request_id` (None: any) sent to the current daemon that it may still
        serve: never answered, and no later request of the same place answered on their
        connection. 0 once each is proven answered or dropped, or the daemon changed."""
        return self._retired.unanswered(self.epoch, request_id) + sum(
            1 for rid in list(self._in_flight.values())
            if request_id is None or rid == request_id)

    @staticmethod
    def _drain(sock: zmq.Socket) -> int:
        n = 0
        while True:
            try:
                sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return n
            except zmq.ZMQError:
                return n
            n += 1

    # -- calls ---------------------------------------------------------------

    def call(
        self, op: str, payloads: Sequence[bytes], timeout_s: float, *, probe: bool = False,
        request_id: str | None = None, fence: Fence | None = None,
        on_late: Callable[[bytes | None], None] | None = None,
    ) -> memoryview | None:
        """Send `op` and wait at most `timeout_s` for its reply.

        Returns the result frame (a memoryview valid until the next call on this
        thread) or None when the daemon's handler returned None. Raises DaemonTimeout,
        DaemonUnavailable or ProtocolError; never blocks past the deadline.

        `probe=True` (for ops the daemon answers inline, in arrival order, like
        registration): a noop follows `op` on the same connection, so a noop answer that
        arrives first proves the daemon dropped `op` unanswered: RequestDropped.

        `request_id`: the request `op` acts for, counted by `unanswered()` while it waits
        and, when it times out, until the daemon is proven to have served or dropped it. `fence`: (op, payloads) sent behind it then, served in the same place as `op`
        (default: by `wire.OP_PLACES`; the caller must pass one for "affinity" ops).
        `on_late` takes the result frame of a reply that comes after a timeout (never blocks)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        self.epoch  # reads the monitor's events: a disconnect after this one loses the reply
        seen = self._disconnects
        if self._disconnected:
            raise self._unavailable(op)
        sock = self._socket()
        uid = next(self._uids)
        op_frame = OP_FRAMES[op]
        self._in_flight[uid] = request_id  # before the send: never sent yet uncounted
        try:
            self._send(sock, op, [msgspec.msgpack.encode(uid), op_frame, *payloads], deadline,
                       timeout_s)
            return self._await(sock, op, op_frame, uid, request_id, fence, probe, deadline,
                               timeout_s, seen, on_late)
        finally:
            del self._in_flight[uid]

    def _await(self, sock, op, op_frame, uid, request_id, fence, probe, deadline, timeout_s,
               seen, on_late=None):
        """Wait for `uid`'s reply on `sock` (see call)."""
        probe_uid = None
        if probe:
            probe_uid = next(self._uids)
            self._send(sock, op, [msgspec.msgpack.encode(probe_uid), OP_FRAMES["noop"]],
                       deadline, timeout_s)
        result: memoryview | None = None
        answered = False
        while True:
            remaining_ms = (deadline - time.monotonic()) * 1000
            # In slices: after a disconnect the reply can never come, so stop waiting then.
            if remaining_ms <= 0 or not sock.poll(
                    max(1, min(_SLICE_MS, int(remaining_ms + 0.999))), zmq.POLLIN):
                now = time.monotonic()
                lost = now < deadline and self._lost_since(seen)
                if now < deadline and not lost:
                    continue
                if answered:  # the probe's answer is late; ours is in hand
                    self._discard_socket(sock)
                    return result
                if fence is None:
                    fence = fence_for(op)
                # Retired before it leaves _in_flight: never uncounted in between.
                self._retire(sock, uid, request_id, fence, self.epoch, on_late)
                if lost:  # it may have been served: a timeout, not "never sent"
                    raise DaemonTimeout(op, timeout_s - (deadline - now),
                                        "the daemon disconnected before answering")
                raise DaemonTimeout(op, timeout_s)
            reply = sock.recv_multipart(copy=False)
            try:
                reply_uid = uid_decoder.decode(reply[0].buffer)
            except (msgspec.DecodeError, IndexError):
                raise ProtocolError(f"{op}: reply with an undecodable request id") from None
            if probe_uid is not None and reply_uid == probe_uid:
                if answered:
                    return result
                self._discard_socket(sock)
                raise RequestDropped(f"{op}: the daemon answered a later noop but not {op}")
            if reply_uid != uid or answered:
                # A reply to a call that already gave up (or a duplicate): never hand it on.
                self._late_replies += 1
                continue
            if len(reply) < 2 or reply[1].bytes != op_frame:
                raise ProtocolError(f"{op}: reply echoes another operation")
            if len(reply) > 3:
                raise ProtocolError(f"{op}: reply has {len(reply)} frames, expected 2 or 3")
            result = None if len(reply) == 2 else reply[2].buffer
            if probe_uid is None:
                return result
            answered = True  # the probe's answer follows in order; take it off the socket

    def _send(self, sock, op, frames, deadline, timeout_s) -> None:
        while True:
            try:
                sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
            if self._down:  # no connection, and the daemon went away: do not wait for it
                raise self._unavailable(op)
            remaining_ms = (deadline - time.monotonic()) * 1000
            # In slices: a disconnect seen meanwhile ends the wait at once.
            if remaining_ms <= 0 or not sock.poll(max(1, min(_SLICE_MS, int(remaining_ms))),
                                                  zmq.POLLOUT):
                if time.monotonic() < deadline:
                    continue
                raise DaemonUnavailable(
                    f"{op}: no connection to the LMCache daemon at {self.endpoint} within "
                    f"{timeout_s * 1000:.0f} ms (refused, down or not accepting); "
                    "check that the daemon runs and listens there"
                )

    def _unavailable(self, op: str) -> DaemonUnavailable:
        return DaemonUnavailable(
            f"{op}: the LMCache daemon at {self.endpoint} disconnected and has not accepted "
            "us again; check that it runs (calls resume once it does)")

    # -- restart detection ---------------------------------------------------

    @property
    def _down(self) -> bool:
        """A disconnect was seen and no daemon has accepted us since."""
        self.epoch  # reads the monitor's events
        return self._disconnected

    def _lost_since(self, seen: int) -> bool:
        """The connection dropped after `seen` disconnects: a reply can no longer come."""
        self.epoch
        return self._disconnects > seen

    @property
    def epoch(self) -> int:
        """How many times a daemon accepted us again after a disconnect."""
        with self._lock:
            if self._closed:
                return self._epoch
            while self._monitor.poll(0):
                event = recv_monitor_message(self._monitor)["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    self._disconnected = True
                    self._disconnects += 1
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    if self._connected_once and self._disconnected:
                        self._epoch += 1
                    self._connected_once = True
                    self._disconnected = False
            return self._epoch

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for sock in self._sockets.values():
                sock.close(linger=0)
            self._sockets.clear()
            self._retired.close()
            self._sentinel.disable_monitor()
            self._monitor.close(linger=0)
            self._sentinel.close(linger=0)
        self._ctx.term()
