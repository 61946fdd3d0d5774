"""The fleet's KV layout for a model name, kept in L2 itself: one engine of another layout
under the same model name is refused before it shares a byte.

The L2 key (`<model>@<rank>@<group>@<chunk hash>`) names no layout or dtype, so two engines
that give one model name to two layouts read each other's chunks as their own: wrong bytes,
or loads that fail. Nothing in the daemon can tell (its registration reply carries only the
shared-memory pool; its `/status` and `/config` know no model). So the product writes the
layout into the store: at registration, where the daemon has an L2 (its `/config`), the daemon
link LOOKUPs an identity marker (fixed tokens under `loadback-identity.<model>.w<world size>`,
its own salt and tiny layout, so it never touches the engine's layout registration), and
- finds it (in the daemon's L1 or in L2): loads it back and compares the layout it names
  with this engine's; another layout refuses the daemon (`loadback_daemon_refused
  {reason="model_name"}`, one ERROR naming both layouts and the fix);
- misses it: stores this engine's layout, which the fleet's later engines are held to.
An L2 that does not answer leaves it unchecked (checked again at the next registration).
The same keys need the same chunk size and hash algorithm, which the link checks first.

A LOOKUP of the record that outlives the check (the daemon still copying from, or checking,
a slow or dead store) is the daemon's until its status is read: lmcache 0.5.6 keeps the
prefetch job, the session and, once it ends, the read lock on the record's chunk with no
TTL on the job. So it is owed through the link's debts, as an engine's abandoned LOOKUP
is (its status read once its prefetch ended, then its locks freed and its session ended),
on the one connector this check keeps registered for the link's life: the daemon names
what the LOOKUP locked from the layout registered under the record's model name.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from dataclasses import dataclass
from typing import Callable

import torch

from lmcache_loadback.connectors.errors import ConnectorError, DaemonTimeout
from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector

from .l2 import Owe
from .l2_marker import MARKER_LAYOUT

log = logging.getLogger("loadback")

__all__ = ["FleetIdentity", "describe_layout"]

IDENTITY_SALT = "loadback-fleet-identity"
#: An owed abandon of the record's LOOKUP is tried again this long after its prefetch was
#: still running, doubling up to the max: its 20 tries span about half a minute.
ABANDON_RETRY_S = 0.05
ABANDON_RETRY_MAX_S = 2.0
_LEN = struct.Struct("<I")


def describe_layout(layout: KVLayout) -> str:
    """What must agree for two engines to read each other's chunks, in words."""
    kind = "MLA latent" if layout.mla else "K and V"
    return (f"{layout.num_layers} layers x {layout.num_heads} heads x {layout.head_dim} dim "
            f"{layout.dtype_str} ({kind})")


@dataclass(frozen=True)
class _Record:
    layout: str
    written_through: str


class _Paced:
    """When an owed abandon whose prefetch still ran is tried again: ABANDON_RETRY_S after,
    doubling up to ABANDON_RETRY_MAX_S. Each "still running" spends one of the debt's tries,
    and the link's releaser passes whenever any debt is queued (many a second under
    traffic): unpaced, l2_shard_lost runs gave such an abandon up while the outage's
    prefetches took up to 14.5 s.
    Used by whichever thread pays the link's debts (one pass at a time)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.waits = 0
        self.until = float("-inf")

    def early(self) -> bool:
        return self.clock() < self.until

    def ran(self, done: bool) -> bool:
        if not done:
            self.until = self.clock() + min(ABANDON_RETRY_MAX_S, ABANDON_RETRY_S * 2 ** self.waits)
            self.waits += 1
        return done


class FleetIdentity:
    """`refusal` is called by the daemon link on its heartbeat thread, at a registration;
    `close` on the closing thread, after the link's debts were settled. The debts it owes
    run on the link's releaser thread through the same connector (one socket per calling
    thread, so nothing else of it is shared)."""

    def __init__(self, endpoint: str, model_name: str, world_size: int, layout: KVLayout,
                 *, connect_timeout_s: float, owe: Owe, hold: Callable[[], bool],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint = endpoint
        self.model_name = model_name
        self.world_size = world_size
        self.layout = describe_layout(layout)
        self.connect_timeout_s = connect_timeout_s
        self._marker_model = f"loadback-identity.{model_name}.w{world_size}"
        #: Owes the daemon a release (the link's `owe`), and whether such a release must
        #: not be tried now (the link's L2 store stalled: the prefetch cannot end yet).
        self._owe = owe
        self._hold = hold
        self._clock = clock
        self._conn: LMCacheMPConnector | None = None
        #: Checks made: each LOOKUP gets a request id of its own (the daemon keys a
        #: prefetch job by it, and a reused id replaces a job still owed).
        self._checks = 0

    def refusal(self, chunk_size: int, timeout_s: float, epoch: int) -> str | None:
        """What to change when the fleet's record names another layout for this model name,
        else None (matched, written now, or not checked: L2 did not answer). `epoch`: the
        daemon incarnation the link checks, which a release owed from here belongs to."""
        conn = self._connector(chunk_size)
        toks = list(range(1, chunk_size + 1))  # one chunk; the model name and salt are the key
        self._checks += 1
        rid = f"loadback-identity-{os.getpid()}-{self._checks}"
        try:
            conn.register(timeout_s)
            record = self._read(conn, toks, rid, timeout_s, epoch)
            if record is None:
                self._write(conn, toks, rid, timeout_s)
                log.info("fleet identity: model name %r (world size %d) recorded in L2 as %s",
                         self.model_name, self.world_size, self.layout)
                return None
        except (ConnectorError, ValueError) as exc:  # ValueError: a chunk too small for it
            log.warning("fleet identity of model name %r not checked (%s): checked again at "
                        "the next registration", self.model_name, exc)
            return None
        if record.layout == self.layout:
            return None
        return (f"model_name {self.model_name!r} (world size {self.world_size}) is used in this "
                f"fleet's L2 for a KV layout of {record.layout} (recorded through "
                f"{record.written_through}), this engine's is {self.layout}: the L2 key names no "
                "layout, so they would read each other's chunks as their own; give this engine "
                "a model_name of its own (every engine of one layout the same)")

    def close(self, timeout_s: float) -> None:
        """The link closes: unregister the record's model name (when `timeout_s` is left
        for it) and close the connector."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if timeout_s > 0:
            try:
                conn.unregister(timeout_s)
            except ConnectorError:
                pass  # the daemon's reaper ends it
        conn.close()

    def _connector(self, chunk_size: int) -> LMCacheMPConnector:
        if self._conn is not None and self._conn.chunk_size != chunk_size:
            self.close(0.0)  # another daemon: what the old one was owed went with it
        if self._conn is None:
            self._conn = LMCacheMPConnector(
                self.endpoint, KVLayout(**MARKER_LAYOUT, chunk_size=chunk_size),
                model_name=self._marker_model, transfer="auto",
                connect_timeout_s=self.connect_timeout_s)
        return self._conn

    def _read(self, conn: LMCacheMPConnector, toks: list[int], rid: str, timeout_s: float,
              epoch: int) -> _Record | None:
        n = len(toks)
        try:
            hit = conn.lookup_hit_tokens(toks, rid, timeout_s, cache_salt=IDENTITY_SALT)
        except DaemonTimeout:
            self._owe_lookup(conn, toks, rid, epoch)
            raise
        try:
            if hit < n:
                return None
            pool = _pool(n)
            got = conn.retrieve_into(toks, rid, pool, torch.arange(n, 2 * n), start=0, end=n,
                                     timeout_s=timeout_s, cache_salt=IDENTITY_SALT)
            if got.commit is not None:
                got.commit(timeout_s)
        finally:
            _end(conn, rid, timeout_s)
        return _decode(pool, n)

    def _owe_lookup(self, conn: LMCacheMPConnector, toks: list[int], rid: str,
                    epoch: int) -> None:
        """The record's LOOKUP `rid` outlived the check: owe its abandon (once the daemon
        answered every call of it and its prefetch ended; re-registering first, so the
        daemon still knows the record's layout should it have reaped this silent worker),
        then its session's end."""
        paced = _Paced(self._clock)

        def abandon(t: float) -> bool:
            conn.register(t)
            return paced.ran(conn.abandon_lookup(toks, rid, t, cache_salt=IDENTITY_SALT))

        self._owe("abandon_lookup", rid, epoch, abandon, idempotent=True,
                  ready=lambda: conn.unanswered(rid) == 0,
                  hold=lambda: self._hold() or paced.early())
        self._owe("end_session", rid, epoch, lambda t: conn.end_session(rid, t))

    def _write(self, conn: LMCacheMPConnector, toks: list[int], rid: str, timeout_s: float
               ) -> None:
        n = len(toks)
        pool = _pool(n)
        _encode(pool, n, json.dumps({"layout": self.layout,
                                     "written_through": self.endpoint}).encode())
        try:
            conn.store_from(toks, f"{rid}-store", pool, torch.arange(n), timeout_s=timeout_s,
                            cache_salt=IDENTITY_SALT)
        finally:
            _end(conn, f"{rid}-store", timeout_s)


def _end(conn: LMCacheMPConnector, rid: str, timeout_s: float) -> None:
    try:
        conn.end_session(rid, timeout_s)
    except ConnectorError:
        pass  # the daemon's session TTL ends it


def _pool(n: int) -> KVPool:
    layers = MARKER_LAYOUT["num_layers"]
    shape = (2 * n, MARKER_LAYOUT["num_heads"], MARKER_LAYOUT["head_dim"])
    bufs = [torch.zeros(shape, dtype=MARKER_LAYOUT["dtype"]) for _ in range(2 * layers)]
    return KVPool(bufs[:layers], bufs[layers:])


def _buffers(pool: KVPool) -> list[torch.Tensor]:
    return list(pool.k_buffer) + list(pool.v_buffer)


def _encode(pool: KVPool, n: int, payload: bytes) -> None:
    """`payload`, length first, as the raw bytes of slots [0, n) of every buffer in turn."""
    data = _LEN.pack(len(payload)) + payload
    room = sum(t[:n].numel() * t.element_size() for t in _buffers(pool))
    if len(data) > room:
        raise ValueError(f"the identity record ({len(data)} bytes) exceeds one marker chunk "
                         f"({room} bytes)")
    flat = torch.zeros(room, dtype=torch.uint8)
    flat[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    at = 0
    for t in _buffers(pool):
        size = t[:n].numel() * t.element_size()
        t[:n].view(-1).view(torch.uint8).copy_(flat[at:at + size])
        at += size


def _decode(pool: KVPool, n: int) -> _Record:
    """The record `_encode` wrote, read from slots [n, 2n); one that does not parse names
    itself as an unreadable layout (a record of another product version, or other bytes)."""
    raw = b"".join(t[n:2 * n].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                   for t in _buffers(pool))
    (size,) = _LEN.unpack_from(raw)
    try:
        obj = json.loads(raw[_LEN.size:_LEN.size + size])
        return _Record(str(obj["layout"]), str(obj["written_through"]))
    except (ValueError, KeyError, TypeError):
        return _Record("an unreadable record", "an unknown daemon")
