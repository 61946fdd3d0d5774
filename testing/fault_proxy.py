"""Fault-injecting ZMQ proxy between LMCache MP clients and a real 0.5.6 daemon, for the chaos
harness and the integration tests: lost, late, duplicated, garbled or misaddressed replies,
corrupt or hostile KV payloads, the silence of a daemon of another version. Hangs, crashes and
restarts come from `DaemonProcess.pause/kill/restart`, not from here.
"""

from __future__ import annotations

import heapq
import itertools
import os
import pickle
import random
import re
import shlex
import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

import msgspec
import torch
import zmq

from lmcache_loadback.connectors import wire
from lmcache_loadback.connectors.errors import ProtocolError
from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.connectors.safe_decode import dump_tensor_list, load_tensor_list

REQUEST_ACTIONS = frozenset({"drop", "delay", "garble", "silence"})
KV_ACTIONS = frozenset({"truncate_kv", "reshape_kv", "retype_kv", "rogue_pickle"})
REPLY_ACTIONS = frozenset({"drop", "delay", "duplicate", "garble", "wrong_op"}) | KV_ACTIONS
ACTIONS = REQUEST_ACTIONS | REPLY_ACTIONS

MAX_RULES = 64
MAX_PENDING = 4096  # requests awaiting a reply; the oldest is forgotten beyond this
MAX_HELD = 1024  # delayed messages; beyond this a message to delay is dropped (counted)
PENDING_TTL_S = 60.0  # a request unanswered this long is forgotten
_BATCH = 256  # messages per socket per loop turn, so neither side starves the other
_POLL_MS = 20  # upper bound on how long close() waits for the loop to notice

_NOT_MSGPACK = b"\xc1"  # the one byte msgpack never uses: no type decodes from it
_OP_NAMES = {i: op for op, i in wire.OP_IDS.items()}
_uid_decoder = msgspec.msgpack.Decoder(int)
_prepare_decoder = msgspec.msgpack.Decoder(wire.PrepareRetrieveReply)


@dataclass
class FaultRule:
    """Fire `action` on messages of `op` ("*" = any) travelling in `direction`, with
    `probability` (the proxy's seeded RNG), at most `count` times (None = unlimited).

    `delay_s` is for "delay"; `payload_path` is the file "rogue_pickle" data would create if
    anyone unpickled it. "silence" acts on requests whatever `direction` says (never
    forwarded, like a daemon of another version); *_kv and rogue_pickle act only on replies
    to prepare_retrieve.
    """

    action: str
    op: str = "*"
    direction: str = "reply"
    probability: float = 1.0
    count: int | None = None
    delay_s: float = 0.0
    payload_path: str | None = None

    def __post_init__(self) -> None:
        allowed = REQUEST_ACTIONS if self.direction == "request" else REPLY_ACTIONS | {"silence"}
        problems = [
            (self.action not in ACTIONS, f"unknown action {self.action!r}: {sorted(ACTIONS)}"),
            (self.direction not in ("request", "reply"), "direction must be 'request' or 'reply'"),
            (self.action not in allowed, f"{self.action!r} does not apply to {self.direction}s"),
            (self.op != "*" and self.op not in wire.OP_IDS, f"unknown op {self.op!r}"),
            (not 0.0 <= self.probability <= 1.0, "probability must be in [0, 1]"),
            (self.count is not None and self.count < 0, "count must be None or >= 0"),
            (self.delay_s < 0, "delay_s must be >= 0"),
            (self.action == "rogue_pickle" and not self.payload_path,
             "rogue_pickle needs payload_path (the file its command would touch)"),
        ]
        for bad, why in problems:
            if bad:
                raise ValueError(f"FaultRule: {why}")

    def matches(self, op: str, direction: str) -> bool:
        on = "request" if self.action == "silence" else self.direction
        return on == direction and self.op in ("*", op) and (
            self.action not in KV_ACTIONS or op == "prepare_retrieve")


def _rogue_pickle(path: str) -> bytes:
    """KV data whose unpickling would run `touch path`: what a hostile daemon could send.
    pickle.dumps only builds it; nothing here ever unpickles it."""

    class RunsCommand:
        def __reduce__(self):
            return (os.system, (f"touch {shlex.quote(path)}",))

    return pickle.dumps([RunsCommand()])


def _op_name(frame: bytes | memoryview) -> str:
    try:
        op = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return "?"
    return op if isinstance(op, str) else _OP_NAMES.get(op, "?") if type(op) is int else "?"


class FaultProxy:
    """A ROUTER front for clients, one DEALER to the daemon, rules applied in between.

        client DEALERs -> ROUTER [proxy thread: rules] DEALER -> daemon ROUTER

    Clients (and threads, each counting its own uids) share the one upstream DEALER, so each
    forwarded request gets a proxy uid and its reply returns to the client identity with the
    client's uid frame. Faults are data (`FaultRule`), added and cleared at runtime, drawn
    from `random.Random(seed)` so a run replays exactly. Everything is bounded; `close()`
    takes well under a second. Loopback only; socket bytes are only ever read by
    `safe_decode`."""

    def __init__(self, upstream_endpoint: str, *, layout: KVLayout | None = None,
                 host: str = "127.0.0.1", port: int = 0, seed: int = 0,
                 upstream_wait_s: float = 2.0) -> None:
        if not re.fullmatch(r"127(\.\d{1,3}){3}", host):
            raise ValueError(f"the fault proxy binds IPv4 loopback only, got host {host!r}")
        self.upstream_endpoint = upstream_endpoint
        self.layout = layout
        self.host, self.port = host, port
        self.upstream_wait_s = upstream_wait_s
        self.upstream_ready = False  # the upstream handshake finished within start()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._rules: list[list] = []  # [rule, times fired]
        self._stats: dict[str, int] = defaultdict(int)
        self._forwarded = {"requests": defaultdict(int), "replies": defaultdict(int)}
        self._pending: OrderedDict[int, tuple] = OrderedDict()
        self._held: list[tuple] = []  # heap of (due, seq, side, frames, op)
        self._seq = itertools.count()
        self._uids = itertools.count(1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: BaseException | None = None  # last exception a message caused

    # -- lifecycle -------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        if self._thread is None:
            raise RuntimeError("FaultProxy.endpoint is known after start()")
        return f"tcp://{self.host}:{self.port}"

    def start(self) -> "FaultProxy":
        if self._thread is not None:
            raise RuntimeError("FaultProxy already started")
        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.ROUTER)
        self._back = self._ctx.socket(zmq.DEALER)
        for sock in (self._front, self._back):
            for opt, val in ((zmq.LINGER, 0), (zmq.SNDHWM, MAX_PENDING), (zmq.RCVHWM, MAX_PENDING)):
                sock.setsockopt(opt, val)
        # Like ZmqTransport: nothing queues for a daemon that is down (no delivery to the
        # next daemon that binds the port); such requests are dropped and counted.
        for opt, val in ((zmq.IMMEDIATE, 1), (zmq.RECONNECT_IVL, 50), (zmq.RECONNECT_IVL_MAX, 500)):
            self._back.setsockopt(opt, val)
        try:
            self._front.bind(f"tcp://{self.host}:{self.port or '*'}")
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self.port = int(self._front.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._back.connect(self.upstream_endpoint)
        # With IMMEDIATE, writable means connected: wait (bounded) so a first call is not
        # lost; a daemon that starts later is still connected to later.
        self.upstream_ready = bool(self._back.poll(int(self.upstream_wait_s * 1000), zmq.POLLOUT))
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    @property
    def thread_ids(self) -> list[int]:
        """The OS thread ids of the proxy's own work (rules, re-encoding payloads): it stands
        for the network and the daemon, so a deadline judge does not charge its CPU to the
        caller (`testing.os_delay.OsDelay(foreign=...)`)."""
        t = self._thread
        return [t.native_id] if t is not None and t.native_id is not None else []

    def close(self) -> None:
        if self._thread is None or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._ctx.term()

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- rules and counters (any thread) -----------------------------------------

    def add_rule(self, rule: FaultRule) -> FaultRule:
        if rule.action in KV_ACTIONS - {"rogue_pickle"} and self.layout is None:
            raise ValueError(f"{rule.action} decodes KV chunks: build the proxy with layout=")
        with self._lock:
            if len(self._rules) >= MAX_RULES:
                raise ValueError(f"at most {MAX_RULES} rules; clear() some first")
            self._rules.append([rule, 0])
        return rule

    def clear(self) -> None:
        """Remove every rule; messages already held for a delay are still delivered."""
        with self._lock:
            self._rules.clear()

    def fired(self, rule: FaultRule) -> int:
        with self._lock:
            return sum(n for r, n in self._rules if r is rule)

    @property
    def stats(self) -> dict:
        """Action -> times fired, misc counters, and {"requests"|"replies": {op: forwarded}}."""
        with self._lock:
            out: dict = dict(self._stats)
            out.update({k: dict(v) for k, v in self._forwarded.items()})
            return out

    def _count(self, key: str) -> None:
        with self._lock:
            self._stats[key] += 1

    def _firing(self, op: str, direction: str) -> list[FaultRule]:
        fired = []
        with self._lock:
            for entry in self._rules:
                rule, n = entry
                if not rule.matches(op, direction) or (rule.count is not None and n >= rule.count):
                    continue
                if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                    continue
                entry[1] += 1
                self._stats[rule.action] += 1
                fired.append(rule)
        return fired

    # -- the loop (proxy thread only) --------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        poller.register(self._back, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                due_ms = (self._held[0][0] - time.monotonic()) * 1000 if self._held else _POLL_MS
                events = dict(poller.poll(max(0, min(_POLL_MS, int(due_ms + 0.999)))))
                for sock, handle in ((self._front, self._on_request), (self._back, self._on_reply)):
                    if sock in events:
                        self._drain(sock, handle)
                self._release_due()
                self._expire_pending()
        finally:
            self._front.close(linger=0)
            self._back.close(linger=0)

    def _drain(self, sock: zmq.Socket, handle) -> None:
        for _ in range(_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                handle(frames)
            except Exception as exc:  # a bad message must never kill the proxy thread
                self.last_error = exc
                self._count("internal_errors")

    def _on_request(self, frames: list) -> None:
        if len(frames) < 3:
            self._count("malformed_requests")
            return
        ident, uid, msg = frames[0].bytes, frames[1].bytes, list(frames[2:])
        op = _op_name(msg[0].buffer)
        delay = 0.0
        for rule in self._firing(op, "request"):
            if rule.action in ("drop", "silence"):
                return
            if rule.action == "delay":
                delay += rule.delay_s
            elif rule.action == "garble":  # the first payload, or the op frame of a bare op
                msg[1 if len(msg) > 1 else 0] = self._garbage()
        puid = next(self._uids)
        self._pending[puid] = (ident, uid, op, time.monotonic())
        if len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)
            self._count("pending_evicted")
        self._deliver("back", [wire.encode(puid), *msg], op, delay)

    def _on_reply(self, frames: list) -> None:
        try:
            entry = self._pending.pop(_uid_decoder.decode(frames[0].buffer), None)
        except msgspec.MsgspecError:
            entry = None
        if entry is None or len(frames) < 2:
            self._count("orphan_replies")
            return
        ident, uid, op, _ = entry
        rest = list(frames[1:])  # [op_echo] or [op_echo, result]
        copies, delay = 1, 0.0
        for rule in self._firing(op, "reply"):
            action = rule.action
            if action == "drop":
                return
            if action == "delay":
                delay += rule.delay_s
            elif action == "duplicate":
                copies += 1
            elif action == "garble":  # the result, or the op echo of a result-less reply
                rest[1 if len(rest) > 1 else 0] = self._garbage()
            elif action == "wrong_op":
                rest[0] = wire.OP_FRAMES["ping" if op == "noop" else "noop"]
            else:
                rest = self._corrupt_kv(rule, rest)
        for _ in range(copies):
            self._deliver("front", [ident, uid, *rest], op, delay)

    def _garbage(self) -> bytes:  # random bytes, but never decodable
        return _NOT_MSGPACK + self._rng.randbytes(7)

    def _corrupt_kv(self, rule: FaultRule, rest: list) -> list:
        """Rewrite a prepare_retrieve result the way a broken or hostile daemon might;
        a reply it cannot rewrite (refusal, no result, undecodable) passes unchanged."""
        try:
            reply = _prepare_decoder.decode(memoryview(rest[1])) if len(rest) > 1 else None
            if reply is None or not reply.success:
                raise ProtocolError("nothing to corrupt")
            if rule.action == "rogue_pickle":
                data = _rogue_pickle(rule.payload_path)
            else:
                shape, dtype, size = self.layout.chunk_shape, self.layout.dtype, len(reply.data)
                chunks = load_tensor_list(reply.data, expected_shape=shape, expected_dtype=dtype,
                                          max_items=max(1, size // self.layout.chunk_bytes))
                if not chunks:
                    raise ProtocolError("no chunk to corrupt")
                if rule.action == "truncate_kv":
                    chunks.pop()
                elif rule.action == "reshape_kv":  # one token short
                    chunks[-1] = chunks[-1][:, :, 1:, :].contiguous()
                else:
                    chunks[-1] = chunks[-1].to(torch.float32)
                data = dump_tensor_list(chunks)
        except (msgspec.MsgspecError, ProtocolError):
            self._count(f"{rule.action}_skipped")
            return rest
        return [rest[0], wire.encode(msgspec.structs.replace(reply, data=memoryview(data)))]

    def _deliver(self, side: str, frames: list, op: str, delay: float) -> None:
        if delay <= 0:
            self._send(side, frames, op)
        elif len(self._held) >= MAX_HELD:
            self._count("held_overflow")
        else:
            due = time.monotonic() + delay
            heapq.heappush(self._held, (due, next(self._seq), side, frames, op))

    def _release_due(self) -> None:
        now = time.monotonic()
        while self._held and self._held[0][0] <= now:
            _, _, side, frames, op = heapq.heappop(self._held)
            self._count("released")
            self._send(side, frames, op)

    def _send(self, side: str, frames: list, op: str) -> None:
        sock = self._back if side == "back" else self._front
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:  # back: no daemon connected (IMMEDIATE) or its pipe is full
            self._count("upstream_unavailable" if side == "back" else "client_gone")
            return
        with self._lock:
            self._forwarded["requests" if side == "back" else "replies"][op] += 1

    def _expire_pending(self) -> None:  # oldest first: insertion order is send order
        cutoff = time.monotonic() - PENDING_TTL_S
        while self._pending and next(iter(self._pending.values()))[3] <= cutoff:
            self._pending.popitem(last=False)
            self._count("pending_expired")
