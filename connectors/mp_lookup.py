"""The LOOKUP side of the daemon client: start a prefetch, poll its status within the
deadline, free or abandon what a lookup locked."""

from __future__ import annotations

import time
from typing import Sequence

from . import wire
from .errors import DaemonTimeout, PrefetchPending, ProtocolError


class LookupCalls:
    """Mixed into `LMCacheMPConnector` (its `_call`, `key`, `aligned`, `world_size`)."""

    def lookup_hit_tokens(
        self, token_ids: Sequence[int], request_id: str, timeout_s: float, *,
        cache_salt: str = "", wait_s: float = 0.0,
    ) -> int:
        """LOOKUP the whole chunks of `token_ids` and wait for the prefetch: hit tokens.

        The daemon must answer the LOOKUP and each status poll within `timeout_s` of the
        start; once it has answered that its prefetch is still running (copying from its L2
        store), polling goes on until `wait_s` from the start, if that is later. A wait
        that ends with the prefetch still running raises PrefetchPending (the daemon is
        alive); a daemon that does not answer, DaemonTimeout.

        On a hit the daemon holds read locks on the hit chunks until a retrieve of that
        range or free_lookup_locks. Raises on timeout; the caller then owes the daemon a
        free_lookup_locks for the range (the prefetch may still complete).
        """
        start = time.monotonic()
        call_deadline = start + timeout_s
        deadline = start + max(timeout_s, wait_s)
        end = self.aligned(len(token_ids))
        if end == 0:
            return 0
        self.lookup(self.key(token_ids, request_id, lookup=True, cache_salt=cache_salt), timeout_s)
        pause = 0.0001
        pending = False  # the daemon said "still running" at least once
        while True:
            # Until the daemon said it is prefetching, only the call deadline holds.
            limit = deadline if pending else call_deadline
            remaining = limit - time.monotonic()
            if remaining <= 0:
                if pending:
                    raise PrefetchPending("query_prefetch_status", limit - start,
                                          "prefetch from L2 still running")
                raise DaemonTimeout("query_prefetch_status", timeout_s, "no status answered")
            poll_s = min(remaining, timeout_s)  # a daemon that stops answering: DaemonTimeout
            try:
                chunks = self.query_prefetch_status(request_id, poll_s)
            except DaemonTimeout as exc:
                if pending and poll_s < timeout_s:  # cut short by the wait's end
                    raise PrefetchPending("query_prefetch_status", deadline - start,
                                          "prefetch from L2 still running") from exc
                raise
            if chunks is not None:
                hit = chunks * self.chunk_size
                if hit < 0 or hit > end:
                    raise ProtocolError(f"prefetch reports {chunks} chunks of a {end}-token key")
                return hit
            pending = True
            time.sleep(min(pause, max(0.0, limit - time.monotonic())))
            pause = min(pause * 2, 0.002)

    def lookup(self, key: wire.CacheKey, timeout_s: float) -> None:
        """Start a prefetch of `key` (worker_id None); the hit comes from prefetch_status."""
        self._call("lookup", [key, self.world_size], timeout_s, request_id=key.request_id)

    def query_prefetch_status(self, request_id: str, timeout_s: float) -> int | None:
        """Hit chunks, or None while running. Answers once: a lost reply reads as a miss."""
        return self._call("query_prefetch_status", [request_id], timeout_s,
                          request_id=request_id)

    def wait_prefetch_status(self, request_id: str, wait_s: float, timeout_s: float) -> int | None:
        return self._call("wait_prefetch_status", [request_id, wait_s], timeout_s,
                          request_id=request_id)

    def free_lookup_locks(self, key: wire.CacheKey, timeout_s: float) -> None:
        self._call("free_lookup_locks", [key, self.world_size], timeout_s,
                   request_id=key.request_id)

    def free_locks(self, token_ids: Sequence[int], request_id: str, start: int, end: int,
                   timeout_s: float, *, cache_salt: str = "", shard: bool = False) -> None:
        """free_lookup_locks of [start, end): every KV rank's share of those chunks, as the
        group's LOOKUP locked them, or with `shard` this rank's alone (one read lock per
        object: under TP-replicated MLA the other ranks' locks on it stay theirs)."""
        if end > start:
            key = self.key(token_ids, request_id, start=start, end=end, lookup=not shard,
                           cache_salt=cache_salt, readers=1 if shard else None)
            self.free_lookup_locks(key, timeout_s)

    def abandon_lookup(self, token_ids: Sequence[int], request_id: str, timeout_s: float,
                       *, cache_salt: str = "") -> bool:
        """After a LOOKUP whose answer never came: once its prefetch has finished, release
        what it locked. False while it is still running (ask again later).

        The daemon derives the release from the lookup result it recorded for the session,
        so this is right whether the one-shot status was consumed by a lost reply (answers
        0 now), never arrived (nothing to release) or is answered now.
        """
        if self.query_prefetch_status(request_id, timeout_s) is None:
            return False
        self.free_locks(token_ids, request_id, 0, self.aligned(len(token_ids)), timeout_s,
                        cache_salt=cache_salt)
        return True
