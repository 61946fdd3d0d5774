"""Retired sockets and their fences: a socket whose call timed out is never used for a call
again, but kept, with a harmless request (the fence) sent behind the abandoned one; the
daemon serves a connection's requests of one place in order, so the fence's reply proves
every call before it on that socket served or dropped. Until then those calls count as
unanswered (`ZmqTransport.unanswered`). A late reply read meanwhile is counted, or handed to
the caller that asked for it (`on_late`). Why: DESIGN.md, "The transport".
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import msgspec
import zmq

from .wire import OP_FRAMES, OP_PLACES

uid_decoder = msgspec.msgpack.Decoder(int)

#: A fence unanswered this long is sent again (doubling up to the max): a peer that
#: swallowed requests for a while (a wedged proxy) answers a later one.
_REFENCE_MIN_S = 0.1
_REFENCE_MAX_S = 2.0

#: Retired sockets kept for their fences; beyond this the oldest is closed and its calls
#: are no longer tracked (a daemon hung through this many timeouts).
MAX_RETIRED = 64

#: The fence sent behind an abandoned request, by the place the daemon serves it in.
#: "affinity" has no request without a key: the caller passes that fence. "cpu" proves
#: anything only on a daemon with one CPU worker (the daemon link refuses one with more).
_PLACE_FENCES: dict[str, tuple[str, list[bytes]]] = {
    "inline": ("noop", []),
    "cpu": ("ping", [msgspec.msgpack.encode(None)]),
}

Fence = tuple[str, list[bytes]]


def fence_for(op: str) -> Fence | None:
    """The fence of `op`'s place (None: the caller must pass one, or none proves anything)."""
    return _PLACE_FENCES.get(OP_PLACES.get(op, ""))


@dataclass
class _Retired:
    """A socket whose call timed out, kept until a fence answers or the daemon changes."""

    sock: zmq.Socket
    epoch: int
    #: uid -> request id of the calls sent on it and never answered (fences included).
    pending: dict[int, str | None]
    request_id: str | None
    fence: Fence | None
    fences: set[int] = field(default_factory=set)
    fenced_at: float = 0.0
    late: dict[int, Callable[[bytes | None], None]] = field(default_factory=dict)  # on_late
    refence_s: float = _REFENCE_MIN_S / 2


class RetiredSockets:
    """The transport's retired sockets (any calling thread; one lock). `uids`: the
    transport's request ids, shared with its calls; `down`: the daemon disconnected and no
    daemon accepted us since (no fence is sent then: a retired socket may have reconnected
    to a new daemon)."""

    def __init__(self, uids: Iterator[int], down: Callable[[], bool]) -> None:
        self._uids = uids
        self._down = down
        self._lock = threading.Lock()
        self._retired: list[_Retired] = []
        #: Replies read here after their call gave up.
        self.late_replies = 0
        #: Retired sockets closed over MAX_RETIRED before their fence answered.
        self.fences_dropped = 0

    def retire(self, sock: zmq.Socket, uid: int, request_id: str | None, fence: Fence | None,
               epoch: int, on_late: Callable[[bytes | None], None] | None = None) -> None:
        """Keep `sock`, whose call `uid` timed out, with a fence behind that call."""
        r = _Retired(sock, epoch, {uid: request_id}, request_id, fence, late={uid: on_late})
        with self._lock:
            self._send_fence(r, time.monotonic())
            self._retired.append(r)
            self._sweep(epoch)

    def unanswered(self, epoch: int, request_id: str | None = None) -> int:
        """Calls for `request_id` (None: any) on retired sockets of daemon `epoch` that it
        may still serve."""
        with self._lock:
            self._sweep(epoch)
            return sum(1 for r in self._retired for rid in r.pending.values()
                       if request_id is None or rid == request_id)

    def close(self) -> None:
        with self._lock:
            for r in self._retired:
                r.sock.close(linger=0)
            self._retired.clear()

    def _send_fence(self, r: _Retired, now: float) -> None:
        """Send (again) r's fence; a peer that swallows requests may have lost the last.
        Never while the daemon is down: r's socket may have reconnected to a new daemon."""
        if r.fence is None or self._down():
            return
        r.fenced_at, r.refence_s = now, min(r.refence_s * 2, _REFENCE_MAX_S)
        uid = next(self._uids)
        try:
            r.sock.send_multipart([msgspec.msgpack.encode(uid), OP_FRAMES[r.fence[0]],
                                   *r.fence[1]], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            return  # no connection now: a later fence, or the next daemon, answers for it
        r.pending[uid] = r.request_id
        r.fences.add(uid)

    def _sweep(self, epoch: int) -> None:
        """Read what retired sockets received, fence again where no fence answered for a
        while, close those answered for, and those of another daemon incarnation (what was
        queued there died with it). Holds _lock."""
        keep = []
        now = time.monotonic()
        for r in self._retired:
            if r.epoch == epoch:
                while r.pending:
                    try:
                        reply = r.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.ZMQError:
                        break
                    try:
                        reply_uid = uid_decoder.decode(reply[0].buffer)
                    except (msgspec.DecodeError, IndexError):
                        continue
                    if reply_uid in r.fences:
                        # Everything sent before it on this connection was served or dropped.
                        r.pending = {u: rid for u, rid in r.pending.items() if u > reply_uid}
                        r.fences = {u for u in r.fences if u > reply_uid}
                    elif r.pending.pop(reply_uid, False) is not False:
                        self.late_replies += 1
                        if r.late.get(reply_uid):  # its caller takes the late answer
                            r.late[reply_uid](bytes(reply[2].buffer) if len(reply) > 2 else None)
                if r.pending:
                    if now - r.fenced_at >= r.refence_s:
                        self._send_fence(r, now)
                    keep.append(r)
                    continue
            r.sock.close(linger=0)
        while len(keep) > MAX_RETIRED:
            keep.pop(0).sock.close(linger=0)
            self.fences_dropped += 1
        self._retired = keep
