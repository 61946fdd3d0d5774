"""LoadBackOrchestrator: the two-phase load-back, one state machine per prefix.

Who calls it: the SGLang cache hook (match_prefix -> `match`, init_load_back ->
`load_back`, cache_finished_req -> `store` + `finish`, abort -> `abort`), the demo, the
chaos harness and the benchmarks. Nothing here may block past a deadline or raise into
the engine for a daemon failure: failures become `degraded` with a reason, and the
engine recomputes. Where a RETRIEVE is sent: `_retrieve`; where its deadline is decided:
`load_back` (config.deadlines.retrieve_s); what a failure means: `failures.FAILURES`;
where its outcome is counted: `_settle`. What the daemon is owed, and the heartbeat, live
in the `DaemonLink` (link.py); which read locks are still ours to free, in `Lease`.

Tensor parallel: every rank makes the same sequence of collectives on every path of
`match` and `load_back` (SGLang's scheduler is SPMD), so no rank waits alone.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from connectors.base import Connector, Retrieved
from connectors.errors import (
    ConnectorError,
    DaemonRejected,
    DaemonTimeout,
    DaemonUnavailable,
    SlotsError,
)
from metrics import LoadbackMetrics

from .config import ConfigError, LoadBackConfig
from .failures import LookupUnsettled, classify
from .instruments import product_metrics
from .leases import Lease, RequestKey
from .link import DaemonLink
from .policies import BreakEvenGuard, CircuitBreaker, Clock, monotonic, run_with_retries
from .results import LoadResult, MatchResult
from .states import DegradeReason, PrefixState, fire
from .tp import TPAgreement

log = logging.getLogger("loadback")
R = DegradeReason
S = PrefixState


@dataclass(eq=False)
class Prefix:
    """One request prefix's walk through the machine, and the marker of its promise."""

    key: RequestKey
    local_tokens: int
    epoch: int                    # the daemon incarnation its LOOKUP went to
    lease: Lease
    state: str = S.LOOKING_UP.value
    hit_tokens: int = 0
    retrieve_from: int = 0        # chunk-aligned start of the range to retrieve
    reason: DegradeReason | None = None
    attempts: int = 0

    @property
    def request_id(self) -> str:
        return self.key.request_id

    @property
    def promised_tokens(self) -> int:
        return max(0, self.hit_tokens - self.local_tokens)


class LoadBackOrchestrator:
    def __init__(
        self,
        config: LoadBackConfig,
        connector: Connector,
        *,
        metrics: LoadbackMetrics | None = None,
        tp_group=None,
        kv_pool=None,
        clock: Clock = monotonic,
        sleep: Callable[[float], None] = time.sleep,
        start_heartbeat: bool | None = None,
    ) -> None:
        self.config = config
        self.connector = connector
        self.kv_pool = kv_pool
        self.clock = clock
        self.sleep = sleep
        self.metrics = metrics or product_metrics()
        self.tp = TPAgreement(tp_group)
        self.breaker = CircuitBreaker(config.breaker, clock=clock, on_change=self.metrics.breaker)
        self.break_even = BreakEvenGuard(config.break_even, connector.layout.bytes_per_token)
        self._live: dict[str, Prefix] = {}
        self._sessions: dict[str, int] = {}  # request -> daemon epoch its last call went to
        self._lock = threading.RLock()
        self._closed = False
        self._on_close: list[Callable[[], None]] = []
        self.generation = 1
        self.metrics.set_daemon_up(False)
        self.metrics.config_generation(1)
        self.link = DaemonLink(connector, config, self.breaker, self.metrics, background=bool(
            start_heartbeat if start_heartbeat is not None else config.heartbeat.enabled))

    # ------------------------------------------------------------------ match

    def match(self, request_id: str, token_ids: Sequence[int], *, local_hit_tokens: int = 0,
              cache_salt: str = "") -> MatchResult:
        """How many tokens the engine may load beyond its local hit (`.tokens`, 0 =
        recompute). Bounded by deadlines.lookup_ms; repeated calls for a live request
        answer from the marker."""
        with self._lock:
            p = self._live.get(request_id)
            if p is not None:
                return self._match_result(p)
        chunk = self.connector.chunk_size
        aligned = len(token_ids) // chunk * chunk
        if aligned - local_hit_tokens < max(1, self.config.break_even.min_tokens):
            return MatchResult()  # the daemon cannot add enough to matter: do not even ask
        is_open = not self.breaker.allow()
        if is_open or not self.link.registered():
            if is_open and self.connector.epoch != self.link.registered_epoch:
                self.link.wake()  # a new daemon is there: let the heartbeat probe it now
            # Other TP ranks may be asking: join the decision with a "cannot" (-1).
            self.tp.min(-1)
            self.metrics.observe_lookup(None, "skipped")
            return MatchResult(reason=R.BREAKER_OPEN if is_open else None)
        start = self.clock()
        key = RequestKey.of(request_id, token_ids, cache_salt)
        epoch = self.link.registered_epoch
        p = Prefix(key, local_hit_tokens, epoch, Lease(key, epoch))
        self._touch_session(request_id, epoch)
        hit, reason = self._lookup(p, self.config.deadlines.lookup_ms / 1000)
        # One decision across TP ranks: a failed rank reports -1, the minimum wins.
        agreed = self.tp.min(hit if reason is None else -1)
        result = "error" if agreed < 0 else "hit" if agreed > local_hit_tokens else "miss"
        self.metrics.observe_lookup(self.clock() - start, result)
        if agreed <= local_hit_tokens:
            self._free(p, 0, hit)
            if agreed < 0:
                self._enter(p)
                self._finish_degraded(p, reason or R.TP_PEER_FAILED)
                return self._match_result(p)
            return MatchResult()  # a clean miss leaves no machine
        p.hit_tokens = agreed
        self._enter(p)
        self._fire(p, "hit")
        self._free(p, agreed, hit)  # this rank may hold more than the group agreed on
        # Bandwidth is learned per rank: the break-even verdict is agreed on too.
        if not self.tp.min(int(self.break_even.worth_loading(p.promised_tokens))):
            self._finish_degraded(p, R.BELOW_BREAK_EVEN)
            return self._match_result(p)
        # Chunks the engine already has are not retrieved: release their locks now.
        p.retrieve_from = local_hit_tokens // chunk * chunk
        self._free(p, 0, p.retrieve_from)
        self._fire(p, "mark")
        return self._match_result(p)

    def _lookup(self, p: Prefix, budget_s: float) -> tuple[int, DegradeReason | None]:
        deadline = self.clock() + budget_s

        def attempt() -> int:
            left = deadline - self.clock()
            if left <= 0:
                raise DaemonTimeout("lookup", budget_s)
            return self._send_lookup(p, left)

        try:
            hit = run_with_retries(attempt, self.config.retries, budget_s, clock=self.clock,
                                   sleep=self.sleep,
                                   before_retry=lambda _s: self.metrics.retry("lookup"))
        except ConnectorError as exc:
            return 0, self._failed("lookup", exc, p.request_id)
        self.breaker.record(True)
        return hit, None

    def _send_lookup(self, p: Prefix, timeout_s: float) -> int:
        """One LOOKUP; on an answer the prefix's lease holds [0, hit). Any failure but
        "not sent" may leave a LOOKUP running: it is settled off the request path (its
        result waited for, what it locked released) and never overlapped by another."""
        k = p.key
        try:
            hit = self.connector.lookup_hit_tokens(k.token_ids, k.request_id, timeout_s,
                                                   cache_salt=k.cache_salt)
        except DaemonUnavailable:
            raise
        except ConnectorError as exc:
            p.lease.forfeit()
            self.link.owe("settle_lookup", k.request_id, p.epoch, lambda t: (
                self.connector.settle_lookup(k.token_ids, k.request_id, t,
                                             cache_salt=k.cache_salt)),
                idempotent=True)
            raise LookupUnsettled(exc) from exc
        p.lease = Lease(k, p.epoch, 0, hit)
        return hit

    # -------------------------------------------------------------- load_back

    def load_back(self, request_id: str, slots: torch.Tensor | None) -> LoadResult:
        """RETRIEVE the promised tokens into `slots` (one slot per promised token) within
        the retrieve deadline. All or nothing: every promised token byte-exact, or 0."""
        start = self.clock()
        with self._lock:
            p = self._live.get(request_id)
        if p is None or p.state != S.MARKED.value:
            return LoadResult(0, PrefixState(p.state) if p else None, p.reason if p else None)
        n = p.promised_tokens
        # Rank-local reasons not to try; every rank joins the same two decisions.
        local = (R.ALLOC_FAILED if slots is None or len(slots) == 0 or self.kv_pool is None
                 else R.BAD_SLOTS if len(slots) != n
                 else R.DAEMON_RESTARTED if self.connector.epoch != p.epoch
                 else R.BREAKER_OPEN if not self.breaker.allow() else None)
        if not self.tp.min(int(local is None)):
            self._finish_degraded(p, local or R.TP_PEER_FAILED)
            if local == R.BAD_SLOTS:
                raise SlotsError(
                    f"load_back({request_id!r}): got {len(slots)} KV slots for {n} promised "
                    f"tokens; allocate exactly the tokens that match() returned ({n})")
            return self._result(p, start)
        self._fire(p, "start_retrieve")
        got, reason, bad = self._retrieve(p, slots, self.config.deadlines.retrieve_s(n))
        ok = self.tp.min(int(reason is None))
        self.metrics.observe_retrieve(self.clock() - start)
        if ok:
            self.break_even.observe(got.nbytes, self.clock() - start)
            self._fire(p, "land")
            self._settle(p, loaded_bytes=got.nbytes)
        else:
            self._finish_degraded(p, reason or R.TP_PEER_FAILED)
        if bad is not None:
            raise bad
        return self._result(p, start)

    def _retrieve(self, p: Prefix, slots: torch.Tensor, budget_s: float
                  ) -> tuple[Retrieved | None, DegradeReason | None, SlotsError | None]:
        deadline = self.clock() + budget_s
        start, end = p.retrieve_from, p.hit_tokens
        failed: list[BaseException] = []  # this load_back's failed attempts

        def attempt() -> Retrieved:
            left = deadline - self.clock()
            if left <= 0:
                raise DaemonTimeout("retrieve", budget_s)
            if p.attempts > 0 and not isinstance(failed[-1], DaemonUnavailable):
                # A lost reply may have consumed the locks: look up again first.
                hit = self._send_lookup(p, left)
                if hit < end:
                    self._free(p, 0, hit)
                    raise DaemonRejected(f"re-lookup found {hit} of {end} tokens")
                self._free(p, 0, start)
                self._free(p, end, hit)
                left = deadline - self.clock()
            p.attempts += 1
            return self._send_retrieve(p, slots, start, end, left, failed)

        try:
            got = run_with_retries(attempt, self.config.retries, budget_s, clock=self.clock,
                                   sleep=self.sleep, before_retry=lambda _s: self._before_retry(p))
        except SlotsError as exc:
            return None, R.BAD_SLOTS, exc
        except ConnectorError as exc:
            return None, self._failed("retrieve", exc, p.request_id), None
        self.breaker.record(True)
        return got, None, None

    def _send_retrieve(self, p: Prefix, slots, start: int, end: int, timeout_s: float,
                       failed: list[BaseException]) -> Retrieved:
        """One RETRIEVE. Once it returns, the load has landed (every byte in the slots, or
        once `ready` completes): its commit becomes a release owed off the request path."""
        k, epoch = p.key, self.connector.epoch
        try:
            got = self.connector.retrieve_into(
                k.token_ids, k.request_id, self.kv_pool, slots, start=start, end=end,
                timeout_s=timeout_s, skip=p.local_tokens - start, cache_salt=k.cache_salt)
        except ConnectorError as exc:
            failed.append(exc)
            self._owe_commit(p, exc.owed, None, epoch)
            if not isinstance(exc, (DaemonUnavailable, DaemonRejected)):
                p.lease.forfeit()  # prepare_retrieve reached the daemon, which releases them
            raise
        if not isinstance(got, Retrieved):
            got = Retrieved(int(got))  # a connector that still commits inline
        p.lease.forfeit()  # the answered prepare_retrieve took the locks over
        self._owe_commit(p, got.commit, got.ready, epoch)
        return got

    def _owe_commit(self, p: Prefix, commit, ready, epoch: int) -> None:
        if commit is not None:
            self.link.owe("commit_retrieve", p.request_id, epoch, commit,
                          ready=None if ready is None else ready.query)

    def _before_retry(self, p: Prefix) -> None:
        self.metrics.retry("retrieve")
        self._fire(p, "retry")

    def _failed(self, phase: str, exc: ConnectorError, request_id: str) -> DegradeReason | None:
        """Apply the failure table's verdict: breaker, timeout counter, suspicion."""
        out = classify(phase, exc)
        self.breaker.record(out.breaker_ok)
        if out.timeout_op:
            self.metrics.timeout(out.timeout_op)
        if out.suspect:
            self.link.suspect()
        log.debug("%s %s failed: %s", phase, request_id, exc)
        return out.reason

    # ------------------------------------------------------------ store/finish

    def store(self, request_id: str, token_ids: Sequence[int], slots: torch.Tensor,
              *, cache_salt: str = "") -> bool:
        """STORE the finished request's whole chunks (bounded by deadlines.store_ms)."""
        if self.kv_pool is None or not self.breaker.allow() or not self.link.registered():
            return False
        if len(token_ids) < self.connector.chunk_size:
            return True
        self._touch_session(request_id, self.connector.epoch)
        try:
            ok = self.connector.store_from(token_ids, request_id, self.kv_pool, slots,
                                           timeout_s=self.config.deadlines.store_ms / 1000,
                                           cache_salt=cache_salt)
        except ConnectorError as exc:
            self._failed("store", exc, request_id)
            return False
        self.breaker.record(True)
        return ok

    def finish(self, request_id: str) -> None:
        """The request is done: settle its prefix (a promise never loaded degrades as
        `unused`) and end its daemon session."""
        self._release(request_id, R.UNUSED)

    def abort(self, request_id: str) -> None:
        """Release everything the request holds: locks, session, its prefix (`aborted`)."""
        self._release(request_id, R.ABORTED)

    def _release(self, request_id: str, reason: DegradeReason) -> None:
        with self._lock:
            p = self._live.get(request_id)
            epoch = self._sessions.pop(request_id, None)
        if p is not None and not PrefixState(p.state).terminal:
            self._finish_degraded(p, reason)
        with self._lock:
            self._live.pop(request_id, None)
        if epoch is not None:
            # A call the daemon has not answered yet would re-create the session when
            # served: the end waits until every call of the request is answered or dropped.
            self.link.owe("end_session", request_id, epoch,
                          lambda t: self.connector.end_session(request_id, t),
                          idempotent=True, ready=lambda: self._answered(request_id))

    def _answered(self, request_id: str) -> bool:
        unanswered = getattr(self.connector, "unanswered", None)
        return unanswered is None or unanswered(request_id) == 0

    def _touch_session(self, request_id: str, epoch: int) -> None:
        with self._lock:
            self._sessions[request_id] = epoch

    def reload(self, config: LoadBackConfig) -> None:
        """Swap policy values (deadlines, retries, breaker, break-even, heartbeat) in place.

        Raises ConfigError for changes that need a restart (mode, endpoint, transfer, model,
        chunk size, in-process settings); the running config then stays in force.
        """
        fixed = ("mode", "mp_host", "mp_port", "transfer", "model_name", "chunk_size", "ip")
        changed = [k for k in fixed if getattr(config, k) != getattr(self.config, k)]
        if changed:
            raise ConfigError(
                f"{', '.join(changed)}: cannot change while running; restart the engine to "
                "apply it (policy keys reload live: deadlines, retries, breaker, break_even, "
                "heartbeat)")
        with self._lock:
            self.config = self.link.config = config
            self.breaker.policy = config.breaker
            self.break_even.policy = config.break_even
            self.generation += 1
        self.metrics.config_generation(self.generation)
        self.link.wake()  # a new heartbeat interval applies from the next tick

    # ------------------------------------------------------------ inspection

    def state_of(self, request_id: str) -> PrefixState | None:
        with self._lock:
            p = self._live.get(request_id)
        return PrefixState(p.state) if p else None

    def live_prefixes(self) -> int:
        with self._lock:
            return sum(1 for p in self._live.values() if not PrefixState(p.state).terminal)

    def pending_debts(self) -> int:
        return self.link.pending()

    def tick(self) -> None:
        """One heartbeat (the heartbeat thread runs it; tests call it directly)."""
        self.link.tick()

    def wake(self) -> None:
        """Run the next heartbeat now."""
        self.link.wake()

    def wait_registered(self, timeout_s: float) -> bool:
        return self.link.wait_registered(timeout_s)

    # --------------------------------------------------------------- plumbing

    def _enter(self, p: Prefix) -> None:
        with self._lock:
            self._live[p.request_id] = p
        self.metrics.live_delta(p.state, +1)

    def _fire(self, p: Prefix, trigger: str) -> None:
        src, dst = fire(p, trigger)
        self.metrics.transition(src, dst)
        if src != dst:
            self.metrics.live_delta(src, -1)
            if not PrefixState(dst).terminal:
                self.metrics.live_delta(dst, +1)

    def _finish_degraded(self, p: Prefix, reason: DegradeReason) -> None:
        held = p.lease.held
        if held:
            self._free(p, *held)
        p.reason = reason
        self._fire(p, "degrade")
        self._settle(p)

    def _settle(self, p: Prefix, loaded_bytes: int = 0) -> None:
        loaded = p.state == S.LOADED.value
        self.metrics.outcome(p.state, None if loaded else p.reason.value,
                             promised_tokens=p.promised_tokens,
                             loaded_tokens=p.promised_tokens if loaded else 0,
                             loaded_bytes=loaded_bytes)

    @staticmethod
    def _match_result(p: Prefix) -> MatchResult:
        marked = p.state == S.MARKED.value
        return MatchResult(p.promised_tokens if marked else 0, PrefixState(p.state), p.reason)

    def _result(self, p: Prefix, start: float) -> LoadResult:
        loaded = p.promised_tokens if p.state == S.LOADED.value else 0
        return LoadResult(loaded, PrefixState(p.state), p.reason, self.clock() - start)

    def _free(self, p: Prefix, start: int, end: int) -> None:
        """Free read locks [start, end) if the lease still holds them (never twice)."""
        rng = p.lease.give_back(start, end)
        if rng is not None:
            k = p.key
            self.link.owe("free_locks", k.request_id, p.lease.epoch, lambda t: (
                self.connector.free_locks(k.token_ids, k.request_id, rng[0], rng[1], t,
                                          cache_salt=k.cache_salt)))

    def close(self) -> None:
        """Abort every live prefix, pay what the daemon is owed (bounded), unregister."""
        if self._closed:
            return
        self._closed = True
        self.link.stop_threads()
        with self._lock:
            ids = list(self._live) + [s for s in self._sessions if s not in self._live]
        for rid in ids:
            self._release(rid, R.CLOSED)
        self.link.pay()
        try:
            if self.link.registered_epoch is not None and self.breaker.allow():
                self.connector.unregister(self.config.deadlines.control_ms / 1000)
        except ConnectorError:
            pass  # the daemon reaps a silent worker by itself
        self.connector.close()
        for fn in self._on_close:
            fn()

    def on_close(self, fn: Callable[[], None]) -> None:
        """Run `fn` after close() released everything (e.g. stop an in-process daemon)."""
        self._on_close.append(fn)

    def __enter__(self) -> "LoadBackOrchestrator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

