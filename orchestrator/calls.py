"""One prefix's calls to the daemon, each inside its deadline, with retries: `PrefixCalls`
sends the LOOKUP (match), the RETRIEVE (load_back) and a request's STORE (store). Read locks
are freed only through the prefix's `Lease`, a retrieve's obligations only through its
`Retrieval`, and every release goes to the `DaemonLink` as a debt of the daemon incarnation
it belongs to; a failed call's meaning is the failure table's (`failed`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from lmcache_loadback.connectors.base import Connector, Prepared, Retrieved
from lmcache_loadback.connectors.errors import (
    ConnectorError,
    DaemonRejected,
    DaemonTimeout,
    DaemonUnavailable,
    PrefetchPending,
    SlotsError,
)
from lmcache_loadback.connectors.retrieval import Retrieval
from lmcache_loadback.connectors.store import Store
from lmcache_loadback.metrics import LoadbackMetrics

from .failures import LookupAbandoned, classify
from .leases import Lease, RequestKey
from .link import DaemonLink
from .policies import CircuitBreaker, Clock, run_with_retries
from .results import LoadResult, MatchResult
from .states import DegradeReason, PrefixState

log = logging.getLogger("loadback")
T = TypeVar("T")


@dataclass(eq=False)
class Prefix:
    """One request prefix's walk through the machine, and the marker of its promise."""

    key: RequestKey
    local_tokens: int
    epoch: int                    # the daemon incarnation its LOOKUP went to
    lease: Lease
    state: str = PrefixState.LOOKING_UP.value
    hit_tokens: int = 0
    retrieve_from: int = 0        # chunk-aligned start of the range to retrieve
    reason: DegradeReason | None = None
    attempts: int = 0
    prepared: Prepared | None = None  # [retrieve_from, hit) prepared at match, until used
    prepared_at: float = 0.0        # when it was prepared (the orchestrator's clock)
    # The engine was answered its promise (match returned tokens > 0, or another process's
    # match did: adopt): only then do its tokens count as promised, loaded or recomputed.
    told: bool = False

    @property
    def request_id(self) -> str:
        return self.key.request_id

    @property
    def promised_tokens(self) -> int:
        return max(0, self.hit_tokens - self.local_tokens)

    def tell(self, tokens: int) -> None:
        """match answered `tokens` to the engine for this prefix."""
        self.told = self.told or tokens > 0

    def match_result(self) -> MatchResult:
        """What match answers for it: the promise while it is marked, else 0."""
        marked = self.state == PrefixState.MARKED.value
        return MatchResult(self.promised_tokens if marked else 0, PrefixState(self.state),
                           self.reason)

    def load_result(self, elapsed_s: float, ready: object | None = None) -> LoadResult:
        """What load_back answers for it: every promised token once loaded, else 0."""
        loaded = self.promised_tokens if self.state == PrefixState.LOADED.value else 0
        return LoadResult(loaded, PrefixState(self.state), self.reason, elapsed_s,
                          ready=ready if loaded else None)


@dataclass
class PrefixCalls:
    connector: Connector
    link: DaemonLink              # its `config` is the one in force (reload swaps it)
    breaker: CircuitBreaker
    metrics: LoadbackMetrics
    clock: Clock
    sleep: Callable[[float], None]
    kv_pool: object = None
    #: Tensor parallel: the leader's LOOKUP locked every rank's shard; each rank retrieves
    #: (and from then frees) its own. A retry of a RETRIEVE whose predecessor may have
    #: consumed its locks would need a LOOKUP of its own, which would consume the group's
    #: prefetch job (one per request id): such a failure degrades the group instead.
    sharded: bool = False
    #: Called with (request_id, epoch) before a call that touches the daemon's session.
    touch: Callable[[str, int], None] | None = None

    @property
    def relookup(self) -> bool:
        return not self.sharded

    # ---------------------------------------------------------------- LOOKUP

    def lookup_refused(self) -> tuple[bool, DegradeReason | None]:
        """Before a LOOKUP: (True, why) when none may be sent (the breaker open, not
        registered, the daemon's L2 store stalled), counted as skipped; else (False, None)."""
        is_open, stalled = not self.breaker.allow(), self.link.l2.stalled
        if not (is_open or stalled or not self.link.registered()):
            return False, None
        if is_open and self.connector.epoch != self.link.registered_epoch:
            self.link.wake()  # a new daemon is there: let the heartbeat probe it now
        self.metrics.observe_lookup(None, "skipped")
        if stalled and not is_open:
            self.metrics.l2_fast_miss()
        return True, (DegradeReason.BREAKER_OPEN if is_open
                      else DegradeReason.L2_STALLED if stalled else None)

    def lookup(self, p: Prefix, call_s: float, wait_s: float = 0.0
               ) -> tuple[int, DegradeReason | None]:
        """LOOKUP: the daemon answers within `call_s`; while it says its prefetch from L2
        runs, the wait goes on up to `wait_s` in all (`L2Wait`)."""
        start = self.clock()
        call_end, wait_end = start + call_s, start + max(call_s, wait_s)

        def attempt() -> int:  # retried only within call_s: the wait is for L2 alone
            left = call_end - self.clock()
            if left <= 0:
                raise DaemonTimeout("lookup", call_s)
            return self._send_lookup(p, left, wait_end - self.clock())

        try:
            hit = run_with_retries(attempt, self.link.config.retries, call_s, clock=self.clock,
                                   sleep=self.sleep,
                                   before_retry=lambda _s: self.metrics.retry("lookup"))
        except ConnectorError as exc:
            return 0, self.failed("lookup", exc, p.request_id)
        self.breaker.record(True)
        return hit, None

    def _send_lookup(self, p: Prefix, timeout_s: float, wait_s: float = 0.0) -> int:
        """One LOOKUP; on an answer the prefix's lease holds [0, hit). Any failure but
        "not sent" may leave a LOOKUP running: it is abandoned off the request path (its
        result waited for, what it locked released) and never overlapped by another. What
        it shows of the L2 store (how long its prefetch took, or that it outlived the
        wait) goes to `L2Health`."""
        k = p.key
        l2 = self.link.l2
        sent = self.clock()  # the lease's age counts from before the daemon locked anything
        try:
            hit = self.connector.lookup_hit_tokens(k.token_ids, k.request_id, timeout_s,
                                                   cache_salt=k.cache_salt, wait_s=wait_s)
        except DaemonUnavailable:
            raise
        except ConnectorError as exc:
            if isinstance(exc, PrefetchPending):
                l2.observe_pending(len(k.token_ids) // self.connector.chunk_size,
                                   self.clock() - sent)
            p.lease.forfeit()
            # Not before the daemon answered the LOOKUP: an abandon served first finds no
            # prefetch (query answers 0, the free releases nothing) and the LOOKUP then
            # locks its whole hit until the read TTL. Not while the L2 store is stalled:
            # the prefetch cannot finish, and tries spent on it would run out.
            self.link.owe("abandon_lookup", k.request_id, p.epoch, lambda t: (
                self.connector.abandon_lookup(k.token_ids, k.request_id, t,
                                              cache_salt=k.cache_salt)),
                idempotent=True,
                ready=lambda: self.connector.unanswered(k.request_id) == 0,
                hold=lambda: l2.stalled)
            raise LookupAbandoned(exc) from exc
        l2.observe_answer(hit // self.connector.chunk_size, self.clock() - sent)
        p.lease = Lease(k, p.epoch, 0, hit, taken_at=sent)
        return hit

    # -------------------------------------------------------------- RETRIEVE

    def retrieve(self, p: Prefix, slots: torch.Tensor, budget_s: float,
                 on_retry: Callable[[], None]
                 ) -> tuple[Retrieved | None, DegradeReason | None, SlotsError | None]:
        """Land tokens [retrieve_from, hit) in `slots`: (what landed, None, None), or
        (None, reason, the SlotsError to raise once the ranks agreed, if any)."""
        deadline = self.clock() + budget_s
        start, end = p.retrieve_from, p.hit_tokens
        self._own_shard(p)
        failed: list[BaseException] = []  # this load_back's failed attempts
        relookup = [False]
        if p.prepared is not None and (self.clock() - p.prepared_at
                                       > self.link.config.prepare_max_age_ms / 1000):
            # Past the daemon's read-lock TTL it may evict and reuse what it prepared:
            # never copy from it. Release it and ask again.
            self.drop_prepared(p)
            self.metrics.prepared_expired()
            if not self.relookup:
                return None, DegradeReason.RETRIEVE_ERROR, None
            relookup[0] = True

        def attempt() -> Retrieved:
            left = deadline - self.clock()
            if left <= 0:
                raise DaemonTimeout("retrieve", budget_s)
            if relookup[0] or (p.attempts > 0 and not isinstance(failed[-1],
                                                                 DaemonUnavailable)):
                # A lost reply may have consumed the locks: look up again first.
                relookup[0] = False
                hit = self._send_lookup(p, left)
                if hit < end:
                    self.free(p, 0, hit)
                    raise DaemonRejected(f"re-lookup found {hit} of {end} tokens")
                self.free(p, 0, start)
                self.free(p, end, hit)
                left = deadline - self.clock()
            p.attempts += 1
            try:
                return self._send_retrieve(p, slots, start, end, left)
            except ConnectorError as exc:
                failed.append(exc)
                if not self.relookup and not isinstance(exc, DaemonUnavailable):
                    exc.retry_safe = False  # a retry would need a LOOKUP of its own
                raise

        def before_retry(_state) -> None:
            self.metrics.retry("retrieve")
            on_retry()

        try:
            got = run_with_retries(attempt, self.link.config.retries, budget_s,
                                   clock=self.clock, sleep=self.sleep, before_retry=before_retry)
        except SlotsError as exc:
            return None, DegradeReason.BAD_SLOTS, exc
        except ConnectorError as exc:
            return None, self.failed("retrieve", exc, p.request_id), None
        self.breaker.record(True)
        return got, None, None

    def prepare(self, p: Prefix, timeout_s: float) -> tuple[bool, DegradeReason | None]:
        """Match time, shared memory only: prepare_retrieve of [retrieve_from, hit) now, so
        the load pays no round trip. (True, None) when prepared or not applicable; on a
        failure (False, reason): the caller degrades the prefix."""
        if self.connector.transfer != "shm":
            return True, None
        k = p.key
        self._own_shard(p)
        r = self._retrieval(p)
        try:
            p.prepared = self._owing(p, r, lambda: self.connector.prepare(
                k.token_ids, k.request_id, start=p.retrieve_from, end=p.hit_tokens,
                timeout_s=timeout_s, cache_salt=k.cache_salt, retrieval=r))
        except ConnectorError as exc:
            return False, self.failed("retrieve", exc, k.request_id)
        p.prepared_at = self.clock()
        self.breaker.record(True)
        return True, None

    def lease_expired(self, p: Prefix) -> bool:
        """The prefix's LOOKUP is older than lease_max_age_ms (kept under the daemon's read
        TTL): what it still holds is forfeited, counted once, never freed (a late free would
        strip a newer reader's lock); the caller does not use it either."""
        if not p.lease.aged(self.clock(), self.link.config.lease_max_age_ms / 1000):
            return False
        if p.lease.held is not None:
            p.lease.forfeit()
            self.metrics.lease_expired()
        return True

    def drop_prepared(self, p: Prefix) -> None:
        """The prefix ends without loading what it prepared: release it on the daemon."""
        prepared, p.prepared = p.prepared, None
        if prepared is not None:
            self._hand_over(p, prepared.retrieval, None)

    def _send_retrieve(self, p: Prefix, slots, start: int, end: int,
                       timeout_s: float) -> Retrieved:
        """One RETRIEVE. Once it returns, the load has landed (every byte in the slots, or
        once `ready` completes): what its retrieval owes is paid off the request path, after
        the copy completed."""
        k = p.key
        prepared, p.prepared = p.prepared, None  # used once, whatever happens
        r = prepared.retrieval if prepared is not None else self._retrieval(p)
        got = self._owing(p, r, lambda: self.connector.retrieve_into(
            k.token_ids, k.request_id, self.kv_pool, slots, start=start, end=end,
            timeout_s=timeout_s, skip=p.local_tokens - start, cache_salt=k.cache_salt,
            prepared=prepared, retrieval=r))
        p.lease.forfeit()  # the landed load consumed the locks
        self._hand_over(p, r, None if got.ready is None else got.ready.query)
        return got

    def _retrieval(self, p: Prefix) -> Retrieval:
        """A new retrieval of [retrieve_from, hit), on the daemon incarnation now."""
        return Retrieval(self.connector.epoch, p.retrieve_from, p.hit_tokens,
                         shard=p.lease.shard)

    def _owing(self, p: Prefix, r: Retrieval, call: Callable[[], T]) -> T:
        """Run `call`, a connector call that sends prepare_retrieve under `r`. However it
        ends, the lease gives up the locks that moved to `r`; when it raises, what `r` owes
        goes to the link at once.

        One abandoned at its deadline may still be served (after a SIGSTOP, under load): on
        shared memory the daemon then parks the range's read locks in a transfer that only a
        commit_retrieve of the same key releases (else its read TTL), so `r` owes that
        commit. After a daemon failure it is paid once the daemon answered every call of the
        request: it goes out on the releaser's connection, which the daemon may serve on
        another worker than the abandoned call's, and must not overtake it. After refused
        slots no call of `r` is unanswered."""
        rid = p.request_id
        try:
            return call()
        except SlotsError:
            self._hand_over(p, r, None)
            raise
        except BaseException:
            self._hand_over(p, r, lambda: self.connector.unanswered(rid) == 0)
            raise
        finally:
            if r.locks_moved:
                p.lease.forfeit()  # what `r` owes releases them

    def _hand_over(self, p: Prefix, r: Retrieval, ready: Callable[[], bool] | None) -> None:
        """Each step `r` owes becomes a debt of its own, of its daemon incarnation (at most
        once per retrieval, whatever path ends it): one that times out stays owed without
        costing the steps after it their turn. `ready`: none is paid before it holds."""
        if r.hand_over():
            for step in r.owed:
                self.link.owe(step.what, p.request_id, r.epoch,
                              functools.partial(r.pay_step, step), ready=ready)

    # ------------------------------------------------------------- releases

    # ----------------------------------------------------------------- STORE

    def store(self, session_id: str, token_ids, pool, slots: torch.Tensor, timeout_s: float,
              cache_salt: str) -> bool:
        """STORE `token_ids`' whole chunks from `slots` of `pool` under `session_id` within
        `timeout_s`; a failure is the failure table's verdict (False), never raised."""
        try:
            ok = self.connector.store_from(token_ids, session_id, pool, slots,
                                           timeout_s=timeout_s, cache_salt=cache_salt,
                                           on_owed=self._owed_store(session_id))
        except ConnectorError as exc:
            self.failed("store", exc, session_id)
            return False
        self.breaker.record(True)
        return ok

    def _owed_store(self, session_id: str) -> Callable[[Store], None]:
        """What a STORE under `session_id` owes when its prepare_store went unanswered (a
        reservation the daemon may still make, completed with the store's own bytes): a
        debt of its incarnation, paid once the daemon answered every call of the session."""
        def owe(st: Store) -> None:
            self.link.owe("commit_store", session_id, st.epoch, st.complete,
                          ready=lambda: self.connector.unanswered(session_id) == 0)
        return owe

    def free(self, p: Prefix, start: int, end: int) -> None:
        """Free read locks [start, end) if the lease still holds them (never twice)."""
        rng = p.lease.give_back(start, end)
        if rng is not None:
            k, shard = p.key, p.lease.shard
            self.link.owe("free_locks", k.request_id, p.lease.epoch, lambda t: (
                self.connector.free_locks(k.token_ids, k.request_id, rng[0], rng[1], t,
                                          cache_salt=k.cache_salt, shard=shard)))

    def _own_shard(self, p: Prefix) -> None:
        """Tensor parallel, before this rank's first prepare_retrieve of the prefix: from
        here each rank answers for its own shard of [retrieve_from, hit) (the leader's
        LOOKUP locked every rank's; until now the leader held them all)."""
        if self.sharded and not p.lease.shard:
            p.lease = Lease(p.key, p.epoch, p.retrieve_from, p.hit_tokens, shard=True,
                            taken_at=p.lease.taken_at)
            if self.touch is not None:
                self.touch(p.request_id, p.epoch)

    def failed(self, phase: str, exc: ConnectorError, request_id: str) -> DegradeReason | None:
        """Apply the failure table's verdict: breaker, timeout counter, suspicion."""
        out = classify(phase, exc)
        self.breaker.record(out.breaker_ok)
        if out.timeout_op:
            self.metrics.timeout(out.timeout_op)
        if out.suspect:
            self.link.suspect()
        log.debug("%s %s failed: %s", phase, request_id, exc)
        return out.reason
