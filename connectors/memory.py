"""An in-process connector with no I/O: chunks live in a dict.

Who uses it: `loadback bench core` (the orchestrator's own cost, with no socket in the
way), the property tests of the state machine, and unit tests of the policies that script
a failure per call (`fail_next`). It honours the same contract as the daemon client: a
lookup locks the hit chunks until retrieved or freed, retrieve is all or nothing.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import torch

from .errors import DaemonRejected, DaemonTimeout
from .kv_layout import KVLayout, gather_chunks
from .lmcache_mp import scatter_skipping


class InMemoryConnector:
    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.epoch = 0
        self.late_replies = 0
        self._chunks: dict[bytes, torch.Tensor] = {}
        self.locks: collections.Counter = collections.Counter()   # request_id -> locked chunks
        self.sessions: set[str] = set()
        self.calls: collections.Counter = collections.Counter()
        #: op -> the next failures to raise, one per call. A DaemonTimeout models a lost
        #: reply: the daemon did the work (took or released locks), the answer never came.
        self.fail_next: dict[str, collections.deque[Exception]] = \
            collections.defaultdict(collections.deque)

    @property
    def chunk_size(self) -> int:
        return self.layout.chunk_size

    def _failure(self, op: str) -> Exception | None:
        self.calls[op] += 1
        q = self.fail_next.get(op)
        return q.popleft() if q else None

    def _maybe_fail(self, op: str) -> None:
        exc = self._failure(op)
        if exc is not None:
            raise exc

    def _hashes(self, token_ids: Sequence[int], end: int, salt: str) -> list[bytes]:
        h = hashlib.blake2b(salt.encode(), digest_size=16)
        out = []
        c = self.chunk_size
        for i in range(0, end, c):
            h.update(repr(tuple(token_ids[i:i + c])).encode())
            out.append(h.copy().digest())
        return out

    def register(self, timeout_s: float) -> None:
        self._maybe_fail("register")

    def unregister(self, timeout_s: float) -> None:
        pass

    def ping(self, timeout_s: float) -> bool:
        self._maybe_fail("ping")
        return True

    def lookup_hit_tokens(self, token_ids, request_id, timeout_s, *, cache_salt=""):
        exc = self._failure("lookup")
        if exc is not None and not isinstance(exc, DaemonTimeout):
            raise exc
        self.sessions.add(request_id)
        end = len(token_ids) // self.chunk_size * self.chunk_size
        hit = 0
        for h in self._hashes(token_ids, end, cache_salt):
            if h not in self._chunks:
                break
            hit += 1
        self.locks[request_id] += hit
        if exc is not None:
            raise exc
        return hit * self.chunk_size

    def free_locks(self, token_ids, request_id, start, end, timeout_s, *, cache_salt=""):
        self._maybe_fail("free_locks")
        n = (end - start) // self.chunk_size
        self.locks[request_id] = max(0, self.locks[request_id] - n)

    def settle_lookup(self, token_ids, request_id, timeout_s, *, cache_salt=""):
        self._maybe_fail("settle_lookup")
        self.locks[request_id] = 0
        return True

    def retrieve_into(self, token_ids, request_id, pool, slots, *, start, end, timeout_s,
                      skip=0, cache_salt=""):
        exc = self._failure("retrieve")
        hashes = self._hashes(token_ids, end, cache_salt)[start // self.chunk_size:]
        n = len(hashes)
        if isinstance(exc, DaemonTimeout):
            self.locks[request_id] = max(0, self.locks[request_id] - n)
        if exc is not None:
            raise exc
        if self.locks[request_id] < n or any(h not in self._chunks for h in hashes):
            raise DaemonRejected("chunks not locked by a lookup of this request")
        chunks = [self._chunks[h] for h in hashes]
        scatter_skipping(self.layout, chunks, pool, slots, skip)
        self.locks[request_id] -= n
        return n * self.layout.chunk_bytes

    def store_from(self, token_ids, request_id, pool, slots, *, timeout_s, cache_salt=""):
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
        return sum(self.locks.values())

    def close(self) -> None:
        pass
