"""Policies, declared as data from the config: clock, retries, circuit breaker, break-even.

Each policy is a small object the orchestrator consults; none of them does I/O.
Time comes from one injectable clock so deadline and cooldown tests run in milliseconds.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import tenacity

from lmcache_loadback.connectors.errors import ConnectorError

from .config import L2, BreakEven, Breaker, Retries

T = TypeVar("T")
Clock = Callable[[], float]
monotonic: Clock = time.monotonic


# -- retries -------------------------------------------------------------------


def retry_safe(exc: BaseException) -> bool:
    """Whether repeating the call can succeed: the error class says (`retry_safe` on
    connectors.errors.ConnectorError and its subclasses); nothing else is retried."""
    return isinstance(exc, ConnectorError) and exc.retry_safe


def _stop_before(deadline: float, clock: Clock):
    """Stop when the next backoff would end at or past `deadline` (by `clock`)."""
    def stop(state: tenacity.RetryCallState) -> bool:
        return clock() + (state.upcoming_sleep or 0.0) >= deadline
    return stop


def retrying(policy: Retries, deadline: float, *, clock: Clock = monotonic,
             sleep: Callable[[float], None] = time.sleep,
             before_retry: Callable[[tenacity.RetryCallState], None] | None = None
             ) -> tenacity.Retrying:
    """A tenacity policy that never starts an attempt it could not begin before `deadline`
    (a time on `clock`), sleeping its backoff with `sleep`.

    tenacity cannot cancel an attempt in flight: each attempt's own timeout (the socket
    poll) is what bounds it; this stops before the next one would cross the deadline.
    """
    return tenacity.Retrying(
        stop=tenacity.stop_after_attempt(policy.max_attempts) | _stop_before(deadline, clock),
        wait=tenacity.wait_exponential_jitter(
            multiplier=policy.backoff_initial_ms / 1000,
            max=policy.backoff_max_ms / 1000,
            jitter=policy.jitter_ms / 1000,
        ),
        retry=tenacity.retry_if_exception(retry_safe),
        reraise=True,
        sleep=sleep,
        before_sleep=before_retry,
    )


def run_with_retries(fn: Callable[[], T], policy: Retries, budget_s: float, *,
                     before_retry: Callable[[tenacity.RetryCallState], None] | None = None,
                     clock: Clock = monotonic,
                     sleep: Callable[[float], None] = time.sleep) -> T:
    """Call `fn`; on a retry-safe failure hand it and the remaining attempts to tenacity.

    The first attempt runs bare: a Retrying object costs more than the rest of a
    healthy load-back's bookkeeping, and the healthy path never needs it.
    """
    deadline = clock() + budget_s
    try:
        return fn()
    except BaseException as exc:
        if not retry_safe(exc) or policy.max_attempts <= 1 or clock() >= deadline:
            raise
        first: list[BaseException] = [exc]

    def again() -> T:
        if first:
            raise first.pop()  # tenacity sees the first failure as its attempt 1
        return fn()

    for attempt in retrying(policy, deadline, clock=clock, sleep=sleep,
                            before_retry=before_retry):
        with attempt:
            return again()
    raise AssertionError("unreachable: reraise=True re-raises the last failure")


# -- circuit breaker ---------------------------------------------------------


class BreakerState:
    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"


@dataclass
class CircuitBreaker:
    """Opens on N consecutive failures or a failure ratio over a window of calls.

    While open, `allow()` answers False at once (no socket is touched). After a cooldown
    one probe is let through (half-open); its failure reopens with the cooldown doubled
    up to a cap, its success closes.
    """

    policy: Breaker
    clock: Clock = monotonic
    on_change: Callable[[str], None] | None = None
    state: str = BreakerState.CLOSED
    _consecutive: int = 0
    _window: collections.deque = field(default_factory=collections.deque)
    _opened_at: float = 0.0
    _cooldown_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def allow(self) -> bool:
        """May a normal call go to the daemon now? (Never transitions state.)"""
        return self.state == BreakerState.CLOSED

    def probe_due(self) -> bool:
        """Open and cooled down: the heartbeat should send one probe now."""
        if self.state == BreakerState.OPEN and self.clock() - self._opened_at >= self._cooldown_s:
            self._set(BreakerState.HALF_OPEN)
            return True
        return self.state == BreakerState.HALF_OPEN

    def probe_in(self) -> float | None:
        """Seconds until the open breaker's probe is due (0 when due or half-open), None
        when closed: the heartbeat sleeps no longer than this, so the probe is never a
        heartbeat interval late."""
        if self.state == BreakerState.CLOSED:
            return None
        if self.state == BreakerState.HALF_OPEN:
            return 0.0
        return max(0.0, self._opened_at + self._cooldown_s - self.clock())

    def probe_now(self) -> None:
        """Half-open at once (the daemon came back as a new process)."""
        with self._lock:
            if self.state == BreakerState.OPEN:
                self._set(BreakerState.HALF_OPEN)

    def record(self, ok: bool) -> None:
        with self._lock:
            if self.state == BreakerState.HALF_OPEN:
                if ok:
                    self._close()
                else:
                    self._open(min(self._cooldown_s * 2, self.policy.cooldown_max_ms / 1000))
                return
            if self.state == BreakerState.OPEN:
                return
            window = self._window
            window.append(ok)
            if len(window) > self.policy.window:
                window.popleft()
            self._consecutive = 0 if ok else self._consecutive + 1
            if ok:
                return
            failures = len(window) - sum(window)
            if self._consecutive >= self.policy.consecutive_failures or (
                len(window) >= self.policy.min_calls
                and failures / len(window) >= self.policy.failure_ratio
            ):
                self._open(self.policy.cooldown_ms / 1000)

    def trip(self) -> None:
        """Open now (e.g. the daemon cannot be reached at start-up)."""
        with self._lock:
            if self.state != BreakerState.OPEN:
                self._open(self._cooldown_s * 2 if self.state == BreakerState.HALF_OPEN
                           else self.policy.cooldown_ms / 1000)

    def _open(self, cooldown_s: float) -> None:
        self._cooldown_s = min(max(cooldown_s, self.policy.cooldown_ms / 1000),
                               self.policy.cooldown_max_ms / 1000)
        self._opened_at = self.clock()
        self._set(BreakerState.OPEN)

    def _close(self) -> None:
        self._window.clear()
        self._consecutive = 0
        self._cooldown_s = 0.0
        self._set(BreakerState.CLOSED)

    def _set(self, state: str) -> None:
        if state != self.state:
            self.state = state
            if self.on_change:
                self.on_change(state)

    @property
    def cooldown_s(self) -> float:
        return self._cooldown_s


# -- break-even ----------------------------------------------------------------


@dataclass
class BreakEvenGuard:
    """Load only when it beats recomputing: a token floor and a time comparison.

    Load time = tokens * bytes_per_token / bandwidth, bandwidth learned online (EMA of
    measured retrieves); recompute time = tokens / prefill_tokens_per_s (operator-given).
    """

    policy: BreakEven
    bytes_per_token: int
    bandwidth_bps: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.bandwidth_bps = self.policy.initial_bandwidth_gbps * 1e9

    def worth_loading(self, tokens: int) -> bool:
        if tokens <= 0 or tokens < self.policy.min_tokens:
            return False
        if self.policy.prefill_tokens_per_s <= 0:
            return True
        return self.load_seconds(tokens) < tokens / self.policy.prefill_tokens_per_s

    def load_seconds(self, tokens: int) -> float:
        return tokens * self.bytes_per_token / self.bandwidth_bps

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        a = self.policy.bandwidth_ema_alpha
        with self._lock:
            self.bandwidth_bps = (1 - a) * self.bandwidth_bps + a * (nbytes / seconds)


# -- waiting for L2 ------------------------------------------------------------


@dataclass
class L2Wait:
    """How long a LOOKUP waits for the daemon to copy its prefix from the L2 store, and the
    moving estimate of that copy's time per chunk it is derived from (DESIGN.md, "Waiting
    for L2"). For a prompt of `chunks` whole chunks, `tokens` of them beyond the engine's
    own hit:

        fetch = chunks * per_chunk                (the daemon copies the whole prompt)
        pays  = tokens / prefill_tokens_per_s - load(tokens)
        wait  = lookup  when fetch >= pays, or max_wait <= lookup
        wait  = max(lookup, min(max_wait, pays, wait_slack * fetch))  otherwise

    Past `pays` even a full hit costs more than recomputing at once; past `wait_slack`
    times the expected fetch a store that still has not delivered is more likely stalled
    than slow. Until a LOOKUP has measured the store, `fetch` is unknown and only `pays`
    and `max_wait` bound the wait (a guess from bytes alone was far off for small chunks:
    their round trips, not their bytes, take the time, and the first fetch of a daemon is
    its slowest). The wait only ever lengthens past `lookup` while the daemon answers that
    its prefetch is still running, so a daemon without L2, or a hung one, is bounded by
    `lookup` as before, and an L1 hit answered at once is not slowed.

    The estimate learns from every answered LOOKUP with a hit: its time until the prefetch
    status answered, per chunk found (the first such LOOKUP sets it). The daemon's answer
    does not say how many of those chunks its own memory already held, and those come
    faster: a sample above the estimate weighs `fetch_ema_alpha`, one below a quarter of
    that, so the estimate follows the store's rate rather than memory hits'. A LOOKUP whose
    prefetch outlived its wait is a lower bound on the rate (counted the same way when
    above an estimate already made)."""

    policy: L2
    chunk_size: int
    break_even: BreakEvenGuard
    #: Seconds per chunk; None until an answered LOOKUP measured the store.
    per_chunk_s: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def fetch_s(self, chunks: int) -> float | None:
        """The expected time for the daemon to copy `chunks` from L2 (None: not measured)."""
        per_chunk = self.per_chunk_s
        return None if per_chunk is None else chunks * per_chunk

    def wait_s(self, num_tokens: int, local_tokens: int, lookup_s: float) -> float:
        """The LOOKUP's wait for a prompt of `num_tokens`, `local_tokens` of them in the
        engine's own cache (formula above)."""
        p = self.policy
        chunks = num_tokens // self.chunk_size
        tokens = max(0, chunks * self.chunk_size - local_tokens)
        tps = self.break_even.policy.prefill_tokens_per_s
        recompute = tokens / tps if tps > 0 else math.inf
        pays = recompute - self.break_even.load_seconds(tokens)
        cap = p.max_wait_ms / 1000
        fetch = self.fetch_s(chunks)
        if cap <= lookup_s or (fetch is not None and fetch >= pays):
            return lookup_s
        slack = math.inf if fetch is None else p.wait_slack * fetch
        return max(lookup_s, min(cap, pays, slack))

    def answered(self, chunks_hit: int, elapsed_s: float) -> None:
        """A LOOKUP's prefetch answered `chunks_hit` chunks after `elapsed_s`."""
        if chunks_hit > 0 and elapsed_s > 0:
            self._learn(elapsed_s / chunks_hit, slower_only=False)

    def outlived(self, chunks: int, waited_s: float) -> bool:
        """A LOOKUP of `chunks` whose prefetch was still running after `waited_s`: True
        when it waited at least the fetch the estimate expected (evidence of a stalled
        store, not of a wait cut short by break-even or the cap); True while nothing was
        measured (then only the cap or break-even ended it)."""
        if chunks <= 0:
            return False
        expected = self.fetch_s(chunks)
        self._learn(waited_s / chunks, slower_only=True)
        return expected is None or waited_s >= expected

    def _learn(self, sample: float, *, slower_only: bool) -> None:
        if not math.isfinite(sample) or sample <= 0:
            return
        with self._lock:
            now = self.per_chunk_s
            if now is None:
                if not slower_only:  # a lower bound alone (a hung store) is no rate
                    self.per_chunk_s = sample
                return
            slower = sample > now
            if not slower and slower_only:
                return
            a = self.policy.fetch_ema_alpha * (1.0 if slower else 0.25)
            self.per_chunk_s = (1 - a) * now + a * sample
