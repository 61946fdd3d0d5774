"""InMemoryConnector: the `Connector` contract with no I/O (chunks in a dict), for the
property tests and the unit tests that script a failure per call (`fail_next`) or hold a
call unanswered (`hold_next`). Its read locks are strict: a release of a lock not held
raises `LeaseViolation` (on the real daemon it would strip another reader's lock).
"""

from __future__ import annotations

import collections
import hashlib
from typing import Callable, Sequence

import torch

from lmcache_loadback.connectors.base import Retrieved
from lmcache_loadback.connectors.errors import DaemonRejected, DaemonTimeout
from lmcache_loadback.connectors.kv_copy import gather_chunks, scatter_skipping
from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.connectors.retrieval import Retrieval


class LeaseViolation(AssertionError):
    """A release of locks or pins the request does not hold: a double free."""


class InMemoryConnector:
    """The whole `Connector` contract; what it cannot do is declared: no daemon behind it
    (`endpoint` "in-memory"), no transfer mode of the daemon's (`transfer` "memory": the
    orchestrator never asks it to `prepare`, which raises), no dropped fences."""

    _NO_PREPARE = ("the in-memory connector has no prepare step (transfer 'memory'): the "
                   "orchestrator prepares at match only on shared memory")

    endpoint = "in-memory"
    transfer = "memory"
    transfer_setting = "memory"
    fences_dropped = 0

    def __init__(self, layout: KVLayout, *, writer: bool = True) -> None:
        self.layout = layout
        self.writer = writer
        self.epoch = 0
        self.late_replies = 0
        self._chunks: dict[bytes, torch.Tensor] = {}
        #: request_id -> chunk index -> read locks this request holds on it.
        self.locks: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        #: request_id -> retrieves whose commit is still owed.
        self.pins: collections.Counter = collections.Counter()
        self.sessions: set[str] = set()
        self.calls: collections.Counter = collections.Counter()
        #: op -> the next failures to raise, one per call. A DaemonTimeout models a lost
        #: reply: the daemon did the work (took or released locks), the answer never came.
        self.fail_next: dict[str, collections.deque[Exception]] = \
            collections.defaultdict(collections.deque)
        #: ops whose next call is queued on the "daemon" unanswered (the caller times out)
        #: and served only by `serve_held()`, the way a hung daemon serves it on resume.
        self.hold_next: collections.Counter = collections.Counter()
        self._held: list[tuple[str, Callable[[], object]]] = []

    @property
    def chunk_size(self) -> int:
        return self.layout.chunk_size

    # -- scripting -------------------------------------------------------------

    def restart(self) -> None:
        """A new daemon process: nothing of the old one survives."""
        self.epoch += 1
        self.locks.clear()
        self.pins.clear()
        self.sessions.clear()
        self._held.clear()

    def serve_held(self) -> None:
        """The daemon serves every call it was holding (their answers are late, dropped)."""
        held, self._held = self._held, []
        for _, serve in held:
            serve()
            self.late_replies += 1

    def unanswered(self, request_id: str | None = None) -> int:
        return sum(1 for rid, _ in self._held if request_id in (None, rid))

    def _failure(self, op: str) -> Exception | None:
        self.calls[op] += 1
        q = self.fail_next.get(op)
        return q.popleft() if q else None

    def _maybe_fail(self, op: str) -> None:
        exc = self._failure(op)
        if exc is not None:
            raise exc

    def _hold(self, op: str, request_id: str, serve: Callable[[], object],
              timeout_s: float) -> bool:
        if not self.hold_next[op]:
            return False
        self.hold_next[op] -= 1
        self._held.append((request_id, serve))
        raise DaemonTimeout(op, timeout_s, "held unanswered")

    def _hashes(self, token_ids: Sequence[int], end: int, salt: str) -> list[bytes]:
        h = hashlib.blake2b(salt.encode(), digest_size=16)
        out = []
        c = self.chunk_size
        for i in range(0, end, c):
            h.update(repr(tuple(token_ids[i:i + c])).encode())
            out.append(h.copy().digest())
        return out

    def _unlock(self, request_id: str, first: int, last: int) -> None:
        held = self.locks[request_id]
        missing = [i for i in range(first, last) if held[i] <= 0]
        if missing:
            raise LeaseViolation(
                f"{request_id}: release of chunks {missing} it does not hold (double free)")
        for i in range(first, last):
            held[i] -= 1
            if not held[i]:
                del held[i]

    # -- the Connector contract ---------------------------------------------------

    def register(self, timeout_s: float) -> None:
        self._maybe_fail("register")

    def unregister(self, timeout_s: float) -> None:
        pass

    def ping(self, timeout_s: float) -> bool:
        self._maybe_fail("ping")
        return True

    def get_chunk_size(self, timeout_s: float) -> int:
        self._maybe_fail("get_chunk_size")
        return self.chunk_size

    def lookup_hit_tokens(self, token_ids, request_id, timeout_s, *, cache_salt="", wait_s=0.0):
        exc = self._failure("lookup")
        if exc is not None and not isinstance(exc, DaemonTimeout):
            raise exc
        end = len(token_ids) // self.chunk_size * self.chunk_size

        def serve() -> int:
            self.sessions.add(request_id)
            hit = 0
            for h in self._hashes(token_ids, end, cache_salt):
                if h not in self._chunks:
                    break
                hit += 1
            for i in range(hit):
                self.locks[request_id][i] += 1
            return hit

        self._hold("lookup", request_id, serve, timeout_s)
        hit = serve()
        if exc is not None:
            raise exc
        return hit * self.chunk_size

    def free_locks(self, token_ids, request_id, start, end, timeout_s, *, cache_salt="",
                   shard=False):
        self._maybe_fail("free_locks")
        self._unlock(request_id, start // self.chunk_size, end // self.chunk_size)

    def abandon_lookup(self, token_ids, request_id, timeout_s, *, cache_salt=""):
        self._maybe_fail("abandon_lookup")
        # The daemon derives the release from its own record of the request's lookup.
        self.locks.pop(request_id, None)
        return True

    def prepare(self, token_ids, request_id, *, start, end, timeout_s, cache_salt="",
                retrieval=None):
        raise NotImplementedError(self._NO_PREPARE)

    def retrieve_into(self, token_ids, request_id, pool, slots, *, start, end, timeout_s,
                      skip=0, cache_salt="", prepared=None, retrieval=None):
        if prepared is not None:
            raise NotImplementedError(self._NO_PREPARE)
        r = retrieval if retrieval is not None else Retrieval(self.epoch, start, end)
        exc = self._failure("retrieve")
        first, last = start // self.chunk_size, end // self.chunk_size
        hashes = self._hashes(token_ids, end, cache_salt)[first:]

        def serve(pin: bool = False) -> bool:
            self.sessions.add(request_id)
            held = self.locks[request_id]
            if any(held[i] <= 0 for i in range(first, last)) or any(
                    h not in self._chunks for h in hashes):
                return False
            self._unlock(request_id, first, last)
            self.pins[request_id] += pin  # only an answered retrieve owes its commit
            return True

        if self.hold_next["retrieve"] or isinstance(exc, DaemonTimeout):
            r.asked(end, None)  # served unanswered (now or later): the locks are consumed
        self._hold("retrieve", request_id, serve, timeout_s)
        if isinstance(exc, DaemonTimeout):
            serve()  # the daemon did the work; only the answer is lost
        if exc is not None:
            raise exc
        if not serve(pin=True):
            raise DaemonRejected("chunks not locked by a lookup of this request")
        r.asked(end, lambda t: self._commit(request_id))
        chunks = [self._chunks[h] for h in hashes]
        scatter_skipping(self.layout, chunks, pool, slots, skip)
        return Retrieved(len(hashes) * self.layout.chunk_bytes, commit=r.release)

    def _commit(self, request_id: str) -> bool:
        self._maybe_fail("commit")
        if self.pins[request_id] <= 0:
            raise LeaseViolation(f"{request_id}: commit of a retrieve it does not pin")
        self.pins[request_id] -= 1
        return True

    def store_from(self, token_ids, request_id, pool, slots, *, timeout_s, cache_salt="",
                   on_owed=None):
        self._maybe_fail("store")
        end = len(token_ids) // self.chunk_size * self.chunk_size
        chunks = gather_chunks(self.layout, pool.k_buffer, pool.v_buffer, slots[:end])
        for h, c in zip(self._hashes(token_ids, end, cache_salt), chunks):
            self._chunks.setdefault(h, c)
        self.sessions.add(request_id)
        return True

    def end_session(self, request_id, timeout_s):
        self._maybe_fail("end_session")
        self.sessions.discard(request_id)

    def held_locks(self) -> int:
        """Read locks and retrieve pins held, over every request."""
        return sum(sum(c.values()) for c in self.locks.values()) + sum(self.pins.values())

    def close(self) -> None:
        pass
