"""LoadBackOrchestrator: the two-phase load-back (match, load_back), one state machine per
prefix. Nothing here blocks past a deadline or raises into the engine for a daemon failure:
failures degrade the prefix with a reason and the engine recomputes. Under tensor parallelism
every rank makes the same collectives on every path of `match` and `load_back`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

import torch

from lmcache_loadback.connectors.base import Connector, Retrieved
from lmcache_loadback.connectors.errors import SlotsError
from lmcache_loadback.metrics import LoadbackMetrics

from .calls import Prefix, PrefixCalls
from .config import LoadBackConfig
from .handoff import HandOff
from .instruments import product_metrics
from .leases import Lease, RequestKey
from .link import DaemonLink
from .ownership import owns_release
from .policies import BreakEvenGuard, CircuitBreaker, Clock, monotonic
from .results import LoadResult, MatchResult
from .sessions import Sessions
from .states import DegradeReason, PrefixState, fire
from .tp import TPAgreement

log = logging.getLogger("loadback")


class LoadBackOrchestrator:
    """Called by the SGLang backend (match_prefix/prefetch -> `match`, init_load_back ->
    `load_back`, a finished request -> `store` + `finish`, abort -> `abort`), the demo, the
    chaos harness, the benchmarks. A RETRIEVE is sent in `PrefixCalls.retrieve`, a failure
    means what `failures.FAILURES` says, an outcome is counted in `_record_outcome`; the
    daemon's debts and the heartbeat live in `DaemonLink`, the locks still ours in `Lease`,
    a LOOKUP handed to or taken from another process (vLLM) in `HandOff` (`handoff`)."""

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
        self.breaker = CircuitBreaker(config.breaker, clock=clock)
        self.break_even = BreakEvenGuard(config.break_even, connector.layout.bytes_per_token)
        self._live: dict[str, Prefix] = {}
        # Requests inside match or load_back -> the release asked for meanwhile (None: none
        # yet): `owns_release`.
        self._owners: dict[str, DegradeReason | None] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._on_close: list[Callable[[], None]] = []
        self.generation = 1
        self.metrics.set_daemon_up(False)
        self.metrics.config_generation(1)
        self.link = DaemonLink(connector, config, self.breaker, self.metrics, background=bool(
            start_heartbeat if start_heartbeat is not None else config.heartbeat.enabled),
            break_even=self.break_even)
        self.breaker.on_change = self._breaker_changed
        suffix = "" if self.tp.leader else f"@rank{self.tp.rank}"
        self.sessions = Sessions(connector, self.link, self._lock, store_suffix=suffix)
        self.calls = PrefixCalls(connector, self.link, self.breaker, self.metrics, clock, sleep,
                                 kv_pool, sharded=self.tp.enabled, touch=self._touch_session)
        self.handoff = HandOff(self, self.calls)

    # ------------------------------------------------------------------ match

    @owns_release(lambda p, _: p.match_result() if p is not None else MatchResult(),
                   answered=lambda p, result: p.tell(result.tokens))
    def match(self, request_id: str, token_ids: Sequence[int], *, local_hit_tokens: int = 0,
              cache_salt: str = "") -> MatchResult:
        """How many tokens the engine may load beyond its local hit (`.tokens`, 0 =
        recompute). Bounded by `lookup_wait_s`; a miss at once while the breaker is open or
        the L2 store stalled. Repeated calls for a live request answer from the marker."""
        with self._lock:
            p = self._live.get(request_id)
        if p is not None:
            if p.state == PrefixState.MARKED.value and self.calls.lease_expired(p):
                self.finish_degraded(p, DegradeReason.LEASE_EXPIRED)
            return p.match_result()
        chunk = self.connector.chunk_size
        aligned = len(token_ids) // chunk * chunk
        if aligned - local_hit_tokens < max(1, self.config.break_even.min_tokens):
            return MatchResult()  # the daemon cannot add enough to matter: do not even ask
        refused, why = self.calls.lookup_refused()
        if refused:
            self.tp.min(-1)  # other TP ranks may be asking: join them with a "cannot" (-1)
            return MatchResult(reason=why)
        start = self.clock()
        key = RequestKey.of(request_id, token_ids, cache_salt)
        epoch = self.link.registered_epoch
        p = Prefix(key, local_hit_tokens, epoch, Lease(key, epoch))
        hit, reason = 0, None
        if self.tp.leader:  # one LOOKUP for the whole TP group: the daemon keys it by id
            self._touch_session(request_id, epoch)
            hit, reason = self.calls.lookup(p, self.config.deadlines.lookup_ms / 1000,
                                            self.lookup_wait_s(len(token_ids), local_hit_tokens))
        # One decision across TP ranks: the leader's answer, or -1 if any rank failed.
        agreed = self.tp.share(hit, ok=reason is None)
        result = "error" if agreed < 0 else "hit" if agreed > local_hit_tokens else "miss"
        self.metrics.observe_lookup(self.clock() - start, result)
        if agreed <= local_hit_tokens:
            self.calls.free(p, 0, hit)
            if agreed < 0:
                self._enter(p)
                self.finish_degraded(p, reason or DegradeReason.TP_PEER_FAILED)
                return p.match_result()
            return MatchResult()  # a clean miss leaves no machine
        p.hit_tokens = agreed
        self._enter(p)
        self._fire(p, "hit")
        self.calls.free(p, agreed, hit)  # this rank may hold more than the group agreed on
        self._mark(p, chunk)
        return p.match_result()

    def lookup_wait_s(self, num_tokens: int, local_hit_tokens: int = 0) -> float:
        """The most a LOOKUP of `num_tokens` waits, the engines' deadline too (`L2Wait`:
        longer than lookup_ms only while the daemon copies from L2 and that still pays)."""
        return self.link.l2.wait.wait_s(num_tokens, local_hit_tokens,
                                        self.config.deadlines.lookup_ms / 1000)

    def _mark(self, p: Prefix, chunk: int) -> None:
        """A matched prefix: promise it (marked) if loading beats recomputing, releasing
        the locks of what the engine already has, and prepare its retrieve where that is
        on; degraded otherwise. Every TP rank joins each decision."""
        # Bandwidth is learned per rank: the break-even verdict is agreed on too.
        if not self.tp.min(int(self.break_even.worth_loading(p.promised_tokens))):
            self.finish_degraded(p, DegradeReason.BELOW_BREAK_EVEN)
            return
        # Chunks the engine already has are not retrieved: release their locks now.
        p.retrieve_from = p.local_tokens // chunk * chunk
        if not self.handoff.hands_off:  # else they are the adopter's to free
            self.calls.free(p, 0, p.retrieve_from)
        self._fire(p, "mark")
        if self.config.prepare_at_match:
            # Shared memory: take the retrieve's round trip now (on the thread that runs
            # match), so load_back only copies. It runs under the retrieve deadline.
            ok, why = self.calls.prepare(
                p, self.config.deadlines.retrieve_s(p.promised_tokens))
            if not self.tp.min(int(ok)):
                self.finish_degraded(p, why or DegradeReason.TP_PEER_FAILED)

    # -------------------------------------------------------------- load_back

    @owns_release(lambda _, loaded: loaded)  # the load's own outcome: the slots hold that
    def load_back(self, request_id: str, slots: torch.Tensor | None, *,
                  decline: DegradeReason | None = None,
                  land: Callable[[Retrieved], None] | None = None) -> LoadResult:
        """RETRIEVE the promised tokens into `slots` (one slot per promised token) within
        the retrieve deadline. All or nothing: every promised token byte-exact, or 0.
        `decline`: this rank's engine will not load (the prefix degrades with that reason);
        under tensor parallelism the call still joins the group's decision. `land`: the
        engine's own step once the bytes are in `slots` (vLLM copies them into its blocks),
        before the outcome is decided: if it raises, the load degrades (`alloc_failed`)."""
        start = self.clock()
        with self._lock:
            p = self._live.get(request_id)
        if p is None or p.state != PrefixState.MARKED.value:
            return LoadResult(0, PrefixState(p.state) if p else None, p.reason if p else None)
        n = p.promised_tokens
        # Rank-local reasons not to try; every rank joins the same two decisions.
        no_slots = slots is None or len(slots) == 0 or self.kv_pool is None
        local = (decline if decline is not None
                 else DegradeReason.ALLOC_FAILED if no_slots
                 else DegradeReason.BAD_SLOTS if len(slots) != n
                 else DegradeReason.LEASE_EXPIRED if self.calls.lease_expired(p)
                 else DegradeReason.DAEMON_RESTARTED if self.connector.epoch != p.epoch
                 else DegradeReason.BREAKER_OPEN if not self.breaker.allow() else None)
        if not self.tp.min(int(local is None)):
            self.finish_degraded(p, local or DegradeReason.TP_PEER_FAILED)
            if local == DegradeReason.BAD_SLOTS:
                raise SlotsError(
                    f"load_back({request_id!r}): got {len(slots)} KV slots for {n} promised "
                    f"tokens; allocate exactly the tokens that match() returned ({n})")
            return p.load_result(self.clock() - start)
        self._fire(p, "start_retrieve")
        got, reason, bad = self.calls.retrieve(p, slots, self.config.deadlines.retrieve_s(n),
                                               on_retry=lambda: self._fire(p, "retry"))
        if reason is None and land is not None:
            try:
                land(got)
            except Exception:  # noqa: BLE001 - the engine recomputes, never crashes
                log.exception("%s: the load landed but the engine could not take it", request_id)
                reason = DegradeReason.ALLOC_FAILED
        ok = self.tp.min(int(reason is None))
        self.metrics.observe_retrieve(self.clock() - start)
        if ok:
            self.break_even.observe(got.nbytes, self.clock() - start)
            self._fire(p, "land")
            self._record_outcome(p, loaded_bytes=got.nbytes)
        else:
            if got is not None and got.ready is not None:
                # Landed here but a peer failed: the engine recomputes into these slots, so
                # the copy still in flight must finish first (no late write).
                got.ready.synchronize()
            self.finish_degraded(p, reason or DegradeReason.TP_PEER_FAILED)
        if bad is not None:
            raise bad
        return p.load_result(self.clock() - start, ready=got.ready if ok else None)

    # ------------------------------------------------------------ store/finish

    def store(self, request_id: str, token_ids: Sequence[int], slots: torch.Tensor,
              *, cache_salt: str = "", pool=None) -> bool:
        """STORE the finished request's whole chunks (bounded by deadlines.store_ms); `pool`:
        where `slots` are, if not the pool loads land in (vLLM's staged store region)."""
        pool = self.kv_pool if pool is None else pool
        if pool is None or not self.breaker.allow() or not self.link.registered():
            return False
        if len(token_ids) < self.connector.chunk_size or not self.connector.writer:
            return True  # TP-replicated KV (MLA): one rank writes for the group
        sid = self.sessions.store_id(request_id)
        self._touch_session(sid, self.connector.epoch)
        return self.calls.store(sid, token_ids, pool, slots,
                                self.config.deadlines.store_ms / 1000, cache_salt)

    def finish(self, request_id: str) -> None:
        """The request is done: end its prefix (a promise never loaded degrades as
        `unused`) and its daemon session."""
        self._release(request_id, DegradeReason.UNUSED)

    def abort(self, request_id: str) -> None:
        """Release everything the request holds: locks, session, its prefix (`aborted`)."""
        self._release(request_id, DegradeReason.ABORTED)

    def _release(self, request_id: str, reason: DegradeReason) -> None:
        """One thread releases a request id: the prefix and the session are taken out under
        the lock (a second release finds nothing), and while match or load_back runs for
        the id the release is left to that call's own thread (`owns_release`), so nothing
        the call does afterwards (a LOOKUP's lock free, a prepared range, a copy) outlives
        the release."""
        with self._lock:
            if request_id in self._owners:
                self._owners[request_id] = self._owners[request_id] or reason
                return
            p = self._live.pop(request_id, None)
            ended = self.sessions.take(request_id)
        if p is not None and not PrefixState(p.state).terminal:
            self.finish_degraded(p, reason)
        self.sessions.end(ended)

    def _touch_session(self, request_id: str, epoch: int) -> None:
        self.sessions.touch(request_id, epoch)

    # ------------- handoff.LivePrefixes: what `HandOff` may do with the live prefixes

    def take_idle(self, request_id: str, fits: Callable[[Prefix], bool]) -> Prefix | None:
        with self._lock:
            p = self._live.get(request_id)
            if p is None or request_id in self._owners or not fits(p):
                return None
            del self._live[request_id]
            self.sessions.take(request_id)
        return p

    def enter_marked(self, p: Prefix) -> None:
        with self._lock:
            if p.request_id in self._live:
                raise ValueError(f"adopt({p.request_id!r}): the request is live already; "
                                 "finish it before adopting another LOOKUP under its id")
            self._touch_session(p.request_id, p.lease.epoch)
            self._enter(p)
        self._fire(p, "hit")
        self._fire(p, "mark")

    def reload(self, config: LoadBackConfig) -> None:
        """Swap policy values (deadlines, retries, breaker, break-even, heartbeat, l2).

        Raises ConfigError for changes that need a restart (`LoadBackConfig.check_reload`);
        the running config then stays in force.
        """
        self.config.check_reload(config)
        with self._lock:
            self.config = self.link.config = config
            self.breaker.policy = config.breaker
            self.break_even.policy = config.break_even
            self.link.l2.wait.policy = config.l2
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

    def on_tick(self, fn: Callable[[], None]) -> None:
        """Run `fn` at the end of every heartbeat, on the heartbeat thread (the SGLang
        backend watches its config file there)."""
        self.link.on_tick(fn)

    def _breaker_changed(self, state: str) -> None:
        self.metrics.breaker(state)
        self.link.breaker_changed(state)

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

    def finish_degraded(self, p: Prefix, reason: DegradeReason) -> None:
        """End `p` degraded (`reason`, or lease_expired), freeing what it still holds, and
        count it; also `handoff.LivePrefixes`'."""
        if self.calls.lease_expired(p) and p.state == PrefixState.MARKED.value:
            reason = DegradeReason.LEASE_EXPIRED  # its promise lapsed before the engine ended it
        self.calls.drop_prepared(p)
        held = p.lease.held
        if held:
            self.calls.free(p, *held)
        p.reason = reason
        log.debug("%s: degraded (%s), %d promised tokens recomputed", p.request_id,
                  reason.value, p.promised_tokens)
        self._fire(p, "degrade")
        self._record_outcome(p)

    def _record_outcome(self, p: Prefix, loaded_bytes: int = 0) -> None:
        """Count the prefix's final outcome (once: it has just reached a terminal state).
        Its tokens count as promised only if match answered them to the engine (`told`)."""
        loaded = p.state == PrefixState.LOADED.value
        self.metrics.outcome(p.state, None if loaded else p.reason.value,
                             promised_tokens=p.promised_tokens if p.told else 0,
                             loaded_tokens=p.promised_tokens if loaded else 0,
                             loaded_bytes=loaded_bytes)

    def close(self) -> None:
        """Abort every live prefix, pay what the daemon is owed and unregister, all within
        `deadlines.close_ms` (`DebtBook.close_out`)."""
        if self._closed:
            return
        self._closed = True
        self.link.begin_close(self.config.deadlines.close_ms / 1000)
        self.link.stop_threads()
        with self._lock:
            ids = list(self._live) + [s for s in self.sessions.ids() if s not in self._live]
        for rid in ids:
            self._release(rid, DegradeReason.CLOSED)
        self.link.close_out()
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

