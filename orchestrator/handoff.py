"""One LOOKUP serving two processes: the process that decides a hit (vLLM's scheduler) hands
its LOOKUP's read locks and daemon session over (`hand_off`), and the process that loads
(vLLM's workers, every TP rank) takes them over (`adopt`) and loads under that same daemon
session, sending no LOOKUP of its own. After the hand-off, every release is the adopter's:
the free of each lock it does not load, its load's commit_retrieve, and the end of the session.
The handing process then sends the session nothing, so the adopter's end_session, paid once
its own calls were answered, is the session's last call whatever the two processes' timing
(DESIGN.md, "vLLM: two processes, one LOOKUP").
"""

from __future__ import annotations

from typing import Sequence

from .calls import Prefix
from .leases import Lease, RequestKey
from .results import MatchResult
from .states import DegradeReason, PrefixState


class HandOff:
    """Mixed into `LoadBackOrchestrator` (its lock, live prefixes, sessions and calls)."""

    #: This process hands its marked prefixes to another (vLLM's scheduler sets it before its
    #: first match): a marked prefix's read locks are then never freed here before its release,
    #: so a hand-off hands all of them over and this process owes the session nothing more.
    hands_off: bool = False

    def _free_local_chunks(self, p: Prefix) -> None:
        """match: free the locks of the chunks the engine already has, unless this process
        hands its prefixes off (the adopter frees them then)."""
        if not self.hands_off:
            self.calls.free(p, 0, p.retrieve_from)

    def hand_off(self, request_id: str, keep_tokens: int) -> tuple[int, int] | None:
        """Give the matched prefix of `request_id` to another process, which loads tokens up
        to `keep_tokens` under this same daemon session: the answer is the range of tokens
        [start, end) still read-locked for it, every lock of which is the adopter's from
        now on (`adopt`'s `locked`): it frees what it does not load, and ends the session.
        Nothing more of the session is sent from here, so the adopter's end_session, paid
        once its own calls were answered, is the session's last call. The prefix ends
        `unused` in this process's metrics (its load is counted where it runs). None when
        there is no marked prefix to hand off, or when a release of it is still owed from
        here (it would reach the daemon after the adopter's end and re-create the session):
        the prefix then stays this process's to release."""
        with self._lock:
            p = self._live.get(request_id)
            if (p is None or request_id in self._owners
                    or p.state != PrefixState.MARKED.value or p.prepared is not None
                    or p.lease.held is None or self.link.pending(request_id)
                    or keep_tokens <= p.retrieve_from or keep_tokens > p.hit_tokens):
                return None
            del self._live[request_id]
            self.sessions.take(request_id)  # the session's end is the adopter's
        locked = p.lease.held
        p.lease.forfeit()  # every lock still held is the adopter's to release
        self._finish_degraded(p, DegradeReason.UNUSED)  # frees nothing: forfeited
        return locked

    def adopt(self, request_id: str, token_ids: Sequence[int], *, local_hit_tokens: int,
              hit_tokens: int, locked: tuple[int, int], cache_salt: str = "") -> MatchResult:
        """Take over the LOOKUP that another process made under `request_id` and handed
        off (`hand_off`): the daemon holds read locks on tokens `locked` of `token_ids` for
        that session, all of them this process's to release from here. No call is sent but
        those releases: the prefix is marked at once, the same on every TP rank (each rank's
        reasons not to load join load_back's decision), what will not be loaded is freed
        now ([locked start, local_hit_tokens // chunk * chunk) and [hit_tokens, locked
        end)), and `load_back` then loads the rest; `finish` or `abort` frees what is left
        and ends the session after every call of it from here was answered.

        Whose locks they are is the daemon's record, not a clock: lmcache 0.5.6 keeps a
        LOOKUP's result on its session, and free_lookup_locks of that session releases
        exactly what that LOOKUP locked, and nothing on an incarnation that never saw it
        (session re-created empty, which the end_session after it removes). So the releases
        go to the incarnation this process's connection reaches now, whenever this process
        registered. A load needs this process registered there: until its heartbeat
        re-registers with a restarted daemon, load_back degrades (daemon_restarted) without
        a call."""
        chunk = self.connector.chunk_size
        start = local_hit_tokens // chunk * chunk
        lo, hi = locked
        if (hit_tokens % chunk or lo % chunk or hi % chunk
                or not 0 <= lo <= start <= local_hit_tokens < hit_tokens <= hi <= len(token_ids)):
            raise ValueError(
                f"adopt({request_id!r}): hit_tokens {hit_tokens} must be chunk aligned "
                f"(chunk {chunk}), above local_hit_tokens {local_hit_tokens}, within the "
                f"locked range {tuple(locked)} and within the {len(token_ids)} token ids")
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"adopt({request_id!r}): the request is live already; "
                                 "finish it before adopting another LOOKUP under its id")
        key = RequestKey.of(request_id, token_ids[:hi], cache_salt)
        epoch = self.connector.epoch  # where this process's releases reach the session
        registered = self.link.registered_epoch
        p = Prefix(key, local_hit_tokens, -1 if registered is None else registered,
                   Lease(key, epoch, lo, hi, shard=self.tp.enabled), hit_tokens=hit_tokens,
                   retrieve_from=start, told=True)  # the handing process's match told it
        self._touch_session(request_id, epoch)
        self._enter(p)
        self._fire(p, "hit")
        self._fire(p, "mark")
        self.calls.free(p, lo, start)
        self.calls.free(p, hit_tokens, hi)
        return p.match_result()
