"""One LOOKUP serving two processes: the process that decides a hit (vLLM's scheduler) hands
its LOOKUP's read locks and daemon session over (`hand_off`), and the process that loads
(vLLM's workers, every TP rank) takes them over (`adopt`) and loads under that same daemon
session, sending no LOOKUP of its own. After the hand-off, the releases are the adopter's
alone: its load's commit_retrieve, or on any other outcome the free of what is still locked
and the end of the session (docs/vllm.md, "One LOOKUP per request").
"""

from __future__ import annotations

import logging
from typing import Sequence

from .calls import Prefix
from .leases import Lease, RequestKey
from .results import MatchResult
from .states import DegradeReason, PrefixState

log = logging.getLogger("loadback")


class HandOff:
    """Mixed into `LoadBackOrchestrator` (its lock, live prefixes, sessions and calls)."""

    def hand_off(self, request_id: str, keep_tokens: int) -> bool:
        """Give the matched prefix of `request_id` to another process, which loads tokens up
        to `keep_tokens` under this same daemon session: the read locks beyond
        `keep_tokens` are freed here, the rest become the other process's (never freed
        here), and the session is no longer ended here. The prefix ends `unused` in this
        process's metrics (its load is counted where it runs). False when there is no
        marked prefix to hand off (nothing is then held for it here)."""
        with self._lock:
            p = self._live.get(request_id)
            if (p is None or request_id in self._owners
                    or p.state != PrefixState.MARKED.value or p.prepared is not None
                    or keep_tokens <= p.retrieve_from or keep_tokens > p.hit_tokens):
                return False
            del self._live[request_id]
            self.sessions.take(request_id)  # the session's end is the adopter's
        self.calls.free(p, keep_tokens, p.hit_tokens)
        p.lease.forfeit()  # what is still locked is the adopter's to release
        self._finish_degraded(p, DegradeReason.UNUSED)  # frees nothing more: forfeited
        return True

    def adopt(self, request_id: str, token_ids: Sequence[int], *, local_hit_tokens: int,
              hit_tokens: int, looked_up_at: float, cache_salt: str = "") -> MatchResult:
        """Take over the LOOKUP that another process made under `request_id` and handed
        off: the daemon read-locked tokens [local_hit_tokens // chunk * chunk, hit_tokens)
        of `token_ids` for it. No call is sent; the prefix is marked at once, the same on
        every TP rank (each rank's reasons not to load join load_back's decision), and
        `load_back` then loads it. Its releases are this process's from here (`finish`,
        `abort`). `looked_up_at` (wall_clock() just before that LOOKUP was sent): if this
        process registered with the daemon after it, the locks may belong to an earlier
        daemon incarnation and are never freed from here (the daemon's read TTL ends
        them)."""
        chunk = self.connector.chunk_size
        start = local_hit_tokens // chunk * chunk
        if hit_tokens % chunk or not 0 <= local_hit_tokens < hit_tokens <= len(token_ids):
            raise ValueError(
                f"adopt({request_id!r}): hit_tokens {hit_tokens} must be chunk aligned "
                f"(chunk {chunk}), above local_hit_tokens {local_hit_tokens} and within the "
                f"{len(token_ids)} token ids")
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"adopt({request_id!r}): the request is live already; "
                                 "finish it before adopting another LOOKUP under its id")
        key = RequestKey.of(request_id, token_ids[:hit_tokens], cache_salt)
        epoch = self.link.registered_epoch or 0
        lease = Lease(key, epoch, start, hit_tokens, shard=self.tp.enabled)
        if self.link.registered_wall > looked_up_at:
            lease.forfeit()
            log.debug("%s: registered after the LOOKUP it adopts; its locks are left to the "
                      "daemon's TTL", request_id)
        p = Prefix(key, local_hit_tokens, epoch, lease, hit_tokens=hit_tokens,
                   retrieve_from=start, told=True)  # the handing process's match told it
        self._touch_session(request_id, epoch)
        self._enter(p)
        self._fire(p, "hit")
        self._fire(p, "mark")
        return p.match_result()
