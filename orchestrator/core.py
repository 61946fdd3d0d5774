"""LoadBackOrchestrator: the two-phase load-back, one state machine per prefix.

Who calls it: the SGLang cache hook (match_prefix -> `match`, init_load_back ->
`load_back`, cache_finished_req -> `store` + `finish`, abort -> `abort`), the demo, the
chaos harness and the benchmarks. Nothing here may block past a deadline or raise into
the engine for a daemon failure: failures become `degraded` with a reason, and the
engine recomputes. Where a RETRIEVE is sent: `_retrieve`; where its deadline is
decided: `load_back` (config.deadlines.retrieve_s); where its outcome is counted: `_settle`.
Keeping the daemon relationship alive (heartbeat, registration, owed releases) lives in
`upkeep.py`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from connectors.errors import (
    ConnectorError,
    DaemonRejected,
    DaemonTimeout,
    DaemonUnavailable,
    ProtocolError,
    ShortRead,
    SlotsError,
)
from metrics import LoadbackMetrics

from .config import ConfigError, LoadBackConfig
from .instruments import product_metrics
from .policies import (
    BreakEvenGuard,
    CircuitBreaker,
    Clock,
    monotonic,
    run_with_retries,
)
from .results import LoadResult, MatchResult
from .states import DegradeReason, PrefixState, fire, transition_pairs
from .tp import TPAgreement
from .upkeep import DaemonUpkeep, _Debt

log = logging.getLogger("loadback")
R = DegradeReason
S = PrefixState


@dataclass(eq=False)
class Prefix:
    """One request prefix's walk through the machine, and the marker of its promise."""

    request_id: str
    token_ids: tuple[int, ...]
    local_tokens: int
    cache_salt: str
    epoch: int
    state: str = S.LOOKING_UP.value
    hit_tokens: int = 0
    locked_from: int = 0          # chunks [locked_from, hit) still hold lookup read locks
    reason: DegradeReason | None = None
    attempts: int = 0

    @property
    def promised_tokens(self) -> int:
        return max(0, self.hit_tokens - self.local_tokens)


class LoadBackOrchestrator(DaemonUpkeep):
    def __init__(
        self,
        config: LoadBackConfig,
        connector,
        *,
        metrics: LoadbackMetrics | None = None,
        tp_group=None,
        kv_pool=None,
        clock: Clock = monotonic,
        start_heartbeat: bool | None = None,
    ) -> None:
        self.config = config
        self.connector = connector
        self.kv_pool = kv_pool
        self.clock = clock
        self.metrics = metrics or product_metrics()
        self.tp = TPAgreement(tp_group)
        self.breaker = CircuitBreaker(config.breaker, clock=clock, on_change=self.metrics.breaker)
        self.break_even = BreakEvenGuard(config.break_even, connector.layout.bytes_per_token)
        self._live: dict[str, Prefix] = {}
        self._sessions: set[str] = set()
        self._debts: list[_Debt] = []
        self._lock = threading.RLock()
        self._registered_epoch: int | None = None
        self._suspect = False  # a call went unanswered: re-register (idempotent) next tick
        self._late_seen = 0
        self._closed = False
        self._on_close: list[Callable[[], None]] = []
        self.generation = 1
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.metrics.set_daemon_up(False)
        self.metrics.config_generation(1)
        self._pay_lock = threading.Lock()
        self._release_wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._background = bool(start_heartbeat if start_heartbeat is not None
                                else config.heartbeat.enabled)
        if self._background:
            # Startup never blocks on the daemon: registration happens on the heartbeat.
            for name, target in (("heartbeat", self._heartbeat_loop),
                                 ("releaser", self._releaser_loop)):
                t = threading.Thread(target=target, name=f"loadback-{name}", daemon=True)
                t.start()
                self._threads.append(t)

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
        if not self.breaker.allow() or not self._registered():
            open_ = not self.breaker.allow()
            if open_ and self.connector.epoch != self._registered_epoch:
                self._wake.set()  # a new daemon is there: let the heartbeat probe it now
            # Other TP ranks may be asking: join the decision with a "cannot" (-1).
            self.tp.min(-1)
            self.metrics.observe_lookup(None, "skipped")
            return MatchResult(reason=R.BREAKER_OPEN if open_ else None)
        start = self.clock()
        p = Prefix(request_id, tuple(token_ids), local_hit_tokens, cache_salt,
                   epoch=self._registered_epoch)
        with self._lock:
            self._sessions.add(request_id)
        hit, reason = self._lookup(p, self.config.deadlines.lookup_ms / 1000)
        # One decision across TP ranks: a failed rank reports -1, the minimum wins.
        agreed = self.tp.min(hit if reason is None else -1)
        result = "error" if agreed < 0 else "hit" if agreed > local_hit_tokens else "miss"
        self.metrics.observe_lookup(self.clock() - start, result)
        if agreed <= local_hit_tokens:
            if hit > 0:
                self._free_locks(p, 0, hit)
            if agreed < 0:
                self._enter(p)
                self._finish_degraded(p, reason or R.TP_PEER_FAILED, locks=False)
                return self._match_result(p)
            return MatchResult()  # a clean miss leaves no machine
        p.hit_tokens = agreed
        self._enter(p)
        self._fire(p, "hit")
        if hit > agreed:
            self._free_locks(p, agreed, hit)  # this rank holds more than the group agreed on
        # Bandwidth is learned per rank: the break-even verdict is agreed on too.
        worth = self.tp.min(int(self.break_even.worth_loading(p.promised_tokens)))
        if not worth:
            self._finish_degraded(p, R.BELOW_BREAK_EVEN, locks=True)
            return self._match_result(p)
        # Chunks the engine already has are not retrieved: release their locks now.
        p.locked_from = local_hit_tokens // chunk * chunk
        if p.locked_from:
            self._free_locks(p, 0, p.locked_from)
        self._fire(p, "mark")
        return self._match_result(p)

    @staticmethod
    def _match_result(p: Prefix) -> MatchResult:
        marked = p.state == S.MARKED.value
        return MatchResult(p.promised_tokens if marked else 0, PrefixState(p.state), p.reason)

    def _lookup(self, p: Prefix, budget_s: float) -> tuple[int, DegradeReason | None]:
        deadline = self.clock() + budget_s

        def attempt() -> int:
            left = deadline - self.clock()
            if left <= 0:
                raise DaemonTimeout("lookup", budget_s)
            try:
                return self.connector.lookup_hit_tokens(
                    p.token_ids, p.request_id, left, cache_salt=p.cache_salt)
            except DaemonUnavailable:
                raise  # nothing was sent
            except ConnectorError:
                self._owe_settle(p)
                raise

        try:
            # A lookup is repeated only when nothing was sent (a timed-out one may run).
            hit = run_with_retries(attempt, self.config.retries, budget_s, only=DaemonUnavailable,
                                   before_retry=lambda _s: self.metrics.retry("lookup"))
            self.breaker.record(True)
            return hit, None
        except DaemonTimeout:
            self.breaker.record(False)
            self.metrics.timeout("lookup")
            self._suspect = True
            return 0, R.LOOKUP_TIMEOUT
        except ConnectorError as exc:
            self.breaker.record(False)
            log.debug("lookup %s failed: %s", p.request_id, exc)
            return 0, R.LOOKUP_ERROR

    # -------------------------------------------------------------- load_back

    def load_back(self, request_id: str, slots: torch.Tensor | None) -> LoadResult:
        """RETRIEVE the promised tokens into `slots` (one slot per promised token) within
        the retrieve deadline. All or nothing: every promised token byte-exact, or 0."""
        start = self.clock()
        with self._lock:
            p = self._live.get(request_id)
        if p is None or p.state != S.MARKED.value:
            state = PrefixState(p.state) if p else None
            return LoadResult(0, state, p.reason if p else None)
        n = p.promised_tokens
        if slots is None or len(slots) == 0:
            self._finish_degraded(p, R.ALLOC_FAILED, locks=True)
            return self._result(p, start)
        if len(slots) != n:
            self._finish_degraded(p, R.BAD_SLOTS, locks=True)
            raise SlotsError(
                f"load_back({request_id!r}): got {len(slots)} KV slots for {n} promised tokens; "
                f"allocate exactly the host_hit_length that match() returned ({n})")
        # Rank-local reasons not to try; every rank joins the same two decisions.
        local = (R.ALLOC_FAILED if self.kv_pool is None
                 else R.DAEMON_RESTARTED if self.connector.epoch != p.epoch
                 else R.BREAKER_OPEN if not self.breaker.allow() else None)
        if not self.tp.min(int(local is None)):
            self._finish_degraded(p, local or R.TP_PEER_FAILED,
                                  locks=local != R.DAEMON_RESTARTED)
            return self._result(p, start)
        self._fire(p, "start_retrieve")
        budget = self.config.deadlines.retrieve_s(n)
        nbytes, reason = self._retrieve(p, slots, budget)
        ok = self.tp.min(1 if reason is None else 0)
        self.metrics.observe_retrieve(self.clock() - start)
        if ok:
            self.break_even.observe(nbytes, self.clock() - start)
            self._fire(p, "land")
            self._settle(p, loaded_bytes=nbytes)
        else:
            # Locks were released by the successful prepare_retrieve or are owed already.
            self._finish_degraded(p, reason or R.TP_PEER_FAILED, locks=False)
        return self._result(p, start)

    def _retrieve(self, p: Prefix, slots: torch.Tensor, budget_s: float
                  ) -> tuple[int, DegradeReason | None]:
        deadline = self.clock() + budget_s
        start, end = p.locked_from, p.hit_tokens
        skip = p.local_tokens - start
        last: list[BaseException] = []

        def attempt() -> int:
            left = deadline - self.clock()
            if left <= 0:
                raise DaemonTimeout("retrieve", budget_s)
            if p.attempts > 0 and not isinstance(last[-1], DaemonUnavailable):
                # A lost reply may have consumed the locks: look up again first.
                try:
                    hit = self.connector.lookup_hit_tokens(
                        p.token_ids, p.request_id, left, cache_salt=p.cache_salt)
                except DaemonUnavailable:
                    raise
                except ConnectorError as exc:
                    # This LOOKUP may hold locks now: settle it, and stop retrying so no
                    # other LOOKUP of this request overlaps the settling.
                    self._owe_settle(p)
                    exc.final = True
                    raise
                if hit < end:
                    if hit:
                        self._free_locks(p, 0, hit)
                    raise DaemonRejected(f"re-lookup found {hit} of {end} tokens")
                if start:
                    self._free_locks(p, 0, start)
                if hit > end:
                    self._free_locks(p, end, hit)
                left = deadline - self.clock()
            p.attempts += 1
            try:
                return self.connector.retrieve_into(
                    p.token_ids, p.request_id, self.kv_pool, slots, start=start, end=end,
                    timeout_s=left, skip=skip, cache_salt=p.cache_salt)
            except ConnectorError as exc:
                # Only a refusal leaves the locks with us; a reply (or a request the daemon
                # may still process) releases them daemon-side, and freeing twice would
                # strip another reader's lock: those wait for the daemon's read TTL.
                last.append(exc)
                if isinstance(exc, DaemonRejected):
                    self._free_locks(p, start, end)
                raise

        try:
            nbytes = run_with_retries(attempt, self.config.retries, budget_s,
                                      before_retry=lambda _s: self._before_retry(p))
            self.breaker.record(True)
            return nbytes, None
        except SlotsError:
            raise
        except ConnectorError as exc:
            self.breaker.record(False)
            self._suspect = True
            if isinstance(exc, DaemonTimeout):
                self.metrics.timeout("retrieve")
                return 0, R.RETRIEVE_TIMEOUT
            if isinstance(exc, ShortRead):
                return 0, R.SHORT_READ
            if isinstance(exc, ProtocolError):
                return 0, R.CORRUPT_DATA
            return 0, R.RETRIEVE_ERROR

    def _owe_settle(self, p: Prefix) -> None:
        """The LOOKUP may have run (or its one-shot status reply was lost): settle it (wait
        for its result, release what it locked) before anything else of this request."""
        self._owe(_Debt("settle_lookup", p.request_id, lambda t: (
            self.connector.settle_lookup(p.token_ids, p.request_id, t, cache_salt=p.cache_salt)),
            max_tries=20, idempotent=True))
        self._release_wake.set()

    def _before_retry(self, p: Prefix) -> None:
        self.metrics.retry("retrieve")
        self._fire(p, "retry")

    # ------------------------------------------------------------ store/finish

    def store(self, request_id: str, token_ids: Sequence[int], slots: torch.Tensor,
              *, cache_salt: str = "") -> bool:
        """STORE the finished request's whole chunks (bounded by deadlines.store_ms)."""
        if self.kv_pool is None or not self.breaker.allow() or not self._registered():
            return False
        if len(token_ids) < self.connector.chunk_size:
            return True
        with self._lock:
            self._sessions.add(request_id)
        try:
            ok = self.connector.store_from(token_ids, request_id, self.kv_pool, slots,
                                           timeout_s=self.config.deadlines.store_ms / 1000,
                                           cache_salt=cache_salt)
            self.breaker.record(True)
            return ok
        except SlotsError:
            raise
        except ConnectorError as exc:
            self.breaker.record(False)
            if isinstance(exc, DaemonTimeout):
                self.metrics.timeout("store")
            log.debug("store %s failed: %s", request_id, exc)
            return False

    def finish(self, request_id: str) -> None:
        """The request is done: settle its prefix (a promise never loaded is aborted) and
        end its daemon session."""
        self._release(request_id, R.ABORTED)

    def abort(self, request_id: str) -> None:
        """Release everything the request holds: locks, session, its prefix."""
        self._release(request_id, R.ABORTED)

    def _release(self, request_id: str, reason: DegradeReason) -> None:
        with self._lock:
            p = self._live.get(request_id)
            had_session = request_id in self._sessions
            self._sessions.discard(request_id)
        if p is not None and not PrefixState(p.state).terminal:
            self._finish_degraded(p, reason, locks=True)
        with self._lock:
            self._live.pop(request_id, None)
        if had_session:
            self._control("end_session", request_id,
                          lambda t: self.connector.end_session(request_id, t), idempotent=True)

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
            self.config = config
            self.breaker.policy = config.breaker
            self.break_even.policy = config.break_even
            self.generation += 1
        self.metrics.config_generation(self.generation)
        self._wake.set()  # a new heartbeat interval applies from the next tick

    def state_of(self, request_id: str) -> PrefixState | None:
        with self._lock:
            p = self._live.get(request_id)
        return PrefixState(p.state) if p else None

    def live_prefixes(self) -> int:
        with self._lock:
            return sum(1 for p in self._live.values() if not PrefixState(p.state).terminal)

    def pending_debts(self) -> int:
        with self._lock:
            return len(self._debts)

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

    def _finish_degraded(self, p: Prefix, reason: DegradeReason, *, locks: bool) -> None:
        if locks and p.hit_tokens > p.locked_from and p.state != S.LOOKING_UP.value:
            self._free_locks(p, p.locked_from, p.hit_tokens)
        p.reason = reason
        self._fire(p, "degrade")
        self._settle(p)

    def _settle(self, p: Prefix, loaded_bytes: int = 0) -> None:
        loaded = p.state == S.LOADED.value
        self.metrics.outcome(p.state, None if loaded else p.reason.value,
                             promised_tokens=p.promised_tokens,
                             loaded_tokens=p.promised_tokens if loaded else 0,
                             loaded_bytes=loaded_bytes)

    def _result(self, p: Prefix, start: float) -> LoadResult:
        loaded = p.promised_tokens if p.state == S.LOADED.value else 0
        return LoadResult(loaded, PrefixState(p.state), p.reason, self.clock() - start)

    def _free_locks(self, p: Prefix, start: int, end: int) -> None:
        if end > start:
            self._control("free_locks", p.request_id, lambda t: self.connector.free_locks(
                p.token_ids, p.request_id, start, end, t, cache_salt=p.cache_salt))

    def close(self) -> None:
        """Abort every live prefix, pay what the daemon is owed (bounded), unregister."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        self._release_wake.set()
        for t in self._threads:
            t.join(timeout=5)
        self._background = False  # from here on, releases run inline
        with self._lock:
            ids = list(self._live) + [s for s in self._sessions if s not in self._live]
        for rid in ids:
            self._release(rid, R.CLOSED)
        self._pay_debts(self.config.deadlines.control_ms / 1000)
        try:
            if self._registered_epoch is not None and self.breaker.allow():
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
