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

from typing import Callable, Protocol, Sequence

from .calls import Prefix, PrefixCalls
from .leases import Lease, RequestKey
from .results import MatchResult
from .states import DegradeReason, PrefixState


class LivePrefixes(Protocol):
    """What a hand-off needs of the orchestrator that holds it: its live prefixes, each taken
    out or put in under the orchestrator's lock, and a prefix's end counted as any other."""

    def take_idle(self, request_id: str, fits: Callable[[Prefix], bool]) -> Prefix | None:
        """Under the lock: the live prefix of `request_id`, if no match or load_back runs for
        it and `fits(prefix)`, removed with the request's sessions (whose end is then no
        longer this process's); else None and nothing changes."""

    def enter_marked(self, p: Prefix) -> None:
        """Make `p` (a new prefix whose LOOKUP another process made) live and marked, its
        session touched on `p.lease.epoch`; ValueError if its request is live already."""

    def finish_degraded(self, p: Prefix, reason: DegradeReason) -> None:
        """End `p` degraded for `reason` (freeing what its lease still holds) and count it."""


class HandOff:
    """Held by `LoadBackOrchestrator` as `handoff`. `hand_off` and `adopt` run on the engine's
    own thread (vLLM's scheduler thread, a worker's forward thread); they share the
    orchestrator's live prefixes only through `LivePrefixes`, under its lock."""

    def __init__(self, prefixes: LivePrefixes, calls: PrefixCalls) -> None:
        self._prefixes = prefixes
        self._calls = calls
        #: This process hands its marked prefixes to another (vLLM's scheduler sets it before
        #: its first match): match then never frees a marked prefix's read locks before its
        #: release, so a hand-off hands all of them over and this process owes the session
        #: nothing more.
        self.hands_off = False

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
        link = self._calls.link
        p = self._prefixes.take_idle(request_id, lambda p: (
            p.state == PrefixState.MARKED.value and p.prepared is None
            and p.lease.held is not None and not link.pending(request_id)
            and p.retrieve_from < keep_tokens <= p.hit_tokens))
        if p is None:
            return None
        locked = p.lease.held
        p.lease.forfeit()  # every lock still held is the adopter's to release
        self._prefixes.finish_degraded(p, DegradeReason.UNUSED)  # frees nothing: forfeited
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
        connector = self._calls.connector
        chunk = connector.chunk_size
        start = local_hit_tokens // chunk * chunk
        lo, hi = locked
        if (hit_tokens % chunk or lo % chunk or hi % chunk
                or not 0 <= lo <= start <= local_hit_tokens < hit_tokens <= hi <= len(token_ids)):
            raise ValueError(
                f"adopt({request_id!r}): hit_tokens {hit_tokens} must be chunk aligned "
                f"(chunk {chunk}), above local_hit_tokens {local_hit_tokens}, within the "
                f"locked range {tuple(locked)} and within the {len(token_ids)} token ids")
        key = RequestKey.of(request_id, token_ids[:hi], cache_salt)
        epoch = connector.epoch  # where this process's releases reach the session
        registered = self._calls.link.registered_epoch
        p = Prefix(key, local_hit_tokens, -1 if registered is None else registered,
                   Lease(key, epoch, lo, hi, shard=self._calls.sharded), hit_tokens=hit_tokens,
                   retrieve_from=start, told=True)  # the handing process's match told it
        self._prefixes.enter_marked(p)
        self._calls.free(p, lo, start)
        self._calls.free(p, hit_tokens, hi)
        return p.match_result()
