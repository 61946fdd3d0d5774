"""The daemon's debts: releases it is owed (lock frees, abandoned LOOKUPs, commits of
retrievals, session ends), each tied to the daemon incarnation it was incurred on, and paid in
order per request, off the request path; `DebtBook` is the part of `DaemonLink` that keeps them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from lmcache_loadback.connectors.base import Connector
from lmcache_loadback.connectors.errors import (
    ConnectorError,
    DaemonTimeout,
    DaemonUnavailable,
    RequestDropped,
)
from lmcache_loadback.metrics import LoadbackMetrics

from .policies import CircuitBreaker

log = logging.getLogger("loadback")

# What one try at a debt came to (`DaemonLink._step`).
_PAID = "paid"    # off the books: done, never to be repeated, or given up
_WAIT = "wait"    # its `ready` is false: not tried, no try spent
_LATER = "later"  # failed: tried again on a later pass


@dataclass
class Debt:
    """One release the daemon is owed. `run(timeout_s)` returns False (or raises) while it
    cannot complete yet; debts of one request are paid in order (a session is never ended
    before its locks are released)."""

    what: str
    request_id: str
    #: The daemon incarnation (connector epoch) the debt was incurred on.
    epoch: int
    run: Callable[[float], object]
    #: Repeat after any failure (True only for idempotent work). A release that may have
    #: reached the daemon is never sent twice: a second free_lookup_locks would strip
    #: another reader's lock. Only "not sent" (DaemonUnavailable) repeats those.
    idempotent: bool = False
    #: Not before this holds (the copy finished reading the daemon's buffer; the daemon
    #: answered every call of the request). Waiting costs no try.
    ready: Callable[[], bool] | None = None
    #: Not tried while this holds (the daemon's L2 store is stalled, so an abandoned
    #: LOOKUP's prefetch cannot finish yet): no try spent, no fast polling; the releaser
    #: is woken when it ends.
    hold: Callable[[], bool] | None = None
    tries: int = 0
    max_tries: int = 20
    #: Its run or ready raised unexpectedly and that was logged at WARNING (once a debt).
    warned: bool = False
    #: Its call timed out: sent, and the daemon may serve it still. Never sent again (unless
    #: idempotent); owed until the daemon answered every call of the request (then paid),
    #: or dropped with its incarnation.
    sent: bool = False


class DebtBook:
    """The debts of one daemon link, and how they are paid.

    Every debt is tied to the daemon incarnation it was incurred on: a daemon that restarted
    never saw those locks or sessions, and in lmcache 0.5.6 `free_lookup_locks` and a served
    `prepare_retrieve` create the session they name, so paying an old debt to a new daemon
    would leave it a session for a request it never served. Such debts are dropped, counted
    (`stale_dropped`). A debt whose `run` or `ready` raises something no daemon failure
    explains (a CUDA error in `Event.query()`, a bug) never costs the other debts: it is
    warned about once, asked again while a repeat is safe, and given up after `max_tries`,
    counted (`given_up`, `loadback_releases_failed_total{what}`).
    """

    connector: Connector
    breaker: CircuitBreaker
    metrics: LoadbackMetrics
    background: bool
    control_s: float  # the link's control-call timeout
    registered_epoch: int | None

    def _init_debts(self) -> None:
        self.stale_dropped = 0  # debts of an old daemon incarnation, never sent
        self.given_up = 0  # debts out of tries (or unsafe to repeat), never paid
        self.closed_dropped = 0  # debts left unpaid at close (settle), never paid
        self._closing: _CloseBudget | None = None  # close() began: what it may still spend
        self._debts: list[Debt] = []
        #: The pass now paying (its queue and what it keeps): still owed until paid; holds
        #: the debts it took from `_debts` (one per owed release), never added to.
        self._paying: tuple[deque, list] = (deque(), [])  # bounded by the debts taken
        self._lock = threading.Lock()
        self._pay_lock = threading.Lock()  # one payer at a time keeps each request's order
        self._release_wake = threading.Event()

    def owe(self, what: str, request_id: str, epoch: int, run: Callable[[float], object], *,
            idempotent: bool = False, ready: Callable[[], bool] | None = None,
            hold: Callable[[], bool] | None = None, max_tries: int = 20) -> None:
        """A release the daemon incarnation `epoch` is owed. With background threads it is
        queued and paid by the releaser at once, off the request path (a hung daemon must
        not stretch match, load_back or finish); without them it runs inline if it can."""
        debt = Debt(what, request_id, epoch, run, idempotent, ready, hold, max_tries=max_tries)
        if self._stale(debt):
            return
        if self.background or self._closing is not None:  # close_out pays it, in budget
            self._queue(debt)
            self._release_wake.set()
            return
        with self._lock:
            queued = any(d.request_id == request_id for d in self._debts)
        if (queued or not self.breaker.allow()
                or self._step(debt, self.control_s, on_failure=self.breaker.record) != _PAID):
            self._queue(debt)

    def pending(self, request_id: str | None = None) -> int:
        """Debts not yet paid, those a pass is paying now included (a call in flight
        is owed until it returned)."""
        with self._lock:
            todo, keep = self._paying
            return sum(1 for d in (*self._debts, *todo, *keep)
                       if request_id in (None, d.request_id))

    def _queue(self, debt: Debt) -> None:
        with self._lock:
            self._debts.append(debt)

    def _stale(self, d: Debt) -> bool:
        if d.epoch == self.connector.epoch:
            return False
        log.debug("%s for %s was owed to daemon incarnation %d, now %d: dropped",
                  d.what, d.request_id, d.epoch, self.connector.epoch)
        with self._lock:
            self.stale_dropped += 1
        self.metrics.stale_release_dropped()
        return True

    def _step(self, d: Debt, timeout_s: float, *, on_failure=None) -> str:
        """One try at `d` once its `ready` holds: _PAID, _WAIT (not ready) or _LATER. An
        unexpected raise from `ready` or `run` is `_raised`'s to handle, never the caller's."""
        if d.sent:  # in the daemon's hands: paid once it answered, never sent twice
            return _PAID if self.connector.unanswered(d.request_id) == 0 else _LATER
        if d.hold is not None and d.hold():
            return _LATER
        if d.ready is not None:
            try:
                if not d.ready():
                    return _WAIT
            except Exception as exc:  # noqa: BLE001 - a bug or a CUDA error, not the daemon
                # Is a copy still reading the buffer? Unknown: never pay on it; ask again.
                return self._raised(d, "ready", exc, repeat=True)
        return _PAID if self._attempt(d, timeout_s, on_failure=on_failure) else _LATER

    def _raised(self, d: Debt, step: str, exc: Exception, *, repeat: bool) -> str:
        """`d.<step>` raised `exc`: spend a try; _LATER while `repeat` and tries are left,
        else give it up (_PAID: never paid, counted). One WARNING per debt."""
        d.tries += 1
        left = repeat and d.tries < d.max_tries
        if not d.warned:
            d.warned = True
            log.warning("%s for %s: its %s raised %r; %s", d.what, d.request_id, step, exc,
                        f"asked again, given up after {d.max_tries} tries" if left
                        else "given up (the daemon keeps what it holds until its TTL)",
                        exc_info=exc)
        else:
            log.debug("%s for %s: its %s raised %r (try %d of %d)", d.what, d.request_id,
                      step, exc, d.tries, d.max_tries)
        if left:
            return _LATER
        self._give_up(d)
        return _PAID

    def _give_up(self, d: Debt) -> None:
        with self._lock:
            self.given_up += 1
        self.metrics.release_failed(d.what)
        if not d.warned:
            d.warned = True
            log.warning("%s for %s given up after %d tries (the daemon keeps what it holds "
                        "until its TTL)", d.what, d.request_id, d.tries)

    def _attempt(self, d: Debt, timeout_s: float, *, on_failure=None) -> bool:
        """Run one debt; True when it is off the books: done, possibly applied and so never to
        be sent again (unless idempotent), or out of tries (given up, counted). A try is
        spent only on a call the daemon got: one never sent waits (for the daemon, or its
        epoch to pass) for free. `on_failure(False)` hears each failure."""
        try:
            done = d.run(timeout_s) is not False
        except DaemonUnavailable:
            if on_failure:
                on_failure(False)
            return False  # nothing was sent
        except DaemonTimeout:
            if on_failure:
                on_failure(False)
            if d.idempotent:
                d.tries += 1
                return self._out_of_tries(d)
            d.sent = True  # owed until the daemon answered it (`_step`); never resent
            return False
        except RequestDropped as exc:
            if on_failure:
                on_failure(False)
            if d.idempotent:
                d.tries += 1
                return self._out_of_tries(d)
            log.debug("%s for %s dropped by the daemon, never applied: %s", d.what,
                      d.request_id, exc)
            self._give_up(d)  # never applied, and its handler would raise again: unpaid
            return True
        except ConnectorError as exc:
            if on_failure:
                on_failure(False)
            if not d.idempotent:
                log.debug("%s for %s may have reached the daemon; not repeated: %s",
                          d.what, d.request_id, exc)
                return True
            done = False
        except Exception as exc:  # noqa: BLE001 - a bug, not a daemon failure
            # It may have reached the daemon: repeated only when that is harmless.
            return self._raised(d, "run", exc, repeat=d.idempotent) == _PAID
        if done:
            return True
        d.tries += 1
        return self._out_of_tries(d)

    def _out_of_tries(self, d: Debt) -> bool:
        """False while `d` has tries left; else given up (counted) and True."""
        if d.tries < d.max_tries:
            return False
        self._give_up(d)
        return True

    def pay(self, timeout_s: float | None = None, *, budget: "_CloseBudget | None" = None
            ) -> bool:
        """Pay every owed release that can be paid now, in order per request. True when a
        debt waits only for its `ready` (a copy in flight): look again soon. With `budget`
        (close), each call gets at most what is left of it, and the pass stops where the
        budget says (spent, breaker open, a daemon failure)."""
        timeout_s = self.control_s if timeout_s is None else timeout_s
        with self._pay_lock:
            keep: list[Debt] = []
            with self._lock:
                todo, self._debts = deque(self._debts), []
                self._paying = (todo, keep)
            blocked: set[str] = set()
            waiting = False
            try:
                while todo:
                    if budget is not None and not budget.goes_on():
                        break  # the rest stays queued: settle() counts it dropped
                    if budget is None and self._closing is not None:
                        break  # close() took over: the releaser's pass ends at once
                    d = todo[0]
                    kept = d.request_id in blocked
                    if not kept and not self._stale(d):
                        step = (self._step(d, timeout_s) if budget is None else
                                self._step(d, budget.timeout(timeout_s),
                                           on_failure=budget.failed))
                        if step != _PAID:
                            kept = True
                            blocked.add(d.request_id)
                            waiting = waiting or step == _WAIT
                    with self._lock:  # pending() reads both: move it under the lock
                        if kept:
                            keep.append(d)
                        todo.popleft()
            finally:  # even a bug in this loop loses no debt
                with self._lock:
                    self._debts = keep + list(todo) + self._debts
                    self._paying = (deque(), [])  # bounded: emptied, refilled only from _debts
            return waiting

    def begin_close(self, budget_s: float) -> None:
        """close() begins, with `budget_s` for the daemon in all: from here releases are
        only queued (never paid on the closing thread one by one), and a pass of the
        releaser or the heartbeat stops at its next debt."""
        self._closing = _CloseBudget(self.breaker, budget_s)

    def close_out(self) -> None:
        """close(), once its releases are queued: settle what is owed within what is left of
        the budget, then unregister in the rest. A daemon that did not answer is not asked
        again: it reaps a silent worker by itself."""
        budget = self._closing or _CloseBudget(self.breaker, self.control_s)
        self.settle(budget)
        if budget.goes_on() and self.registered_epoch is not None:
            try:
                self.connector.unregister(budget.timeout(self.control_s))
            except ConnectorError:
                pass  # the daemon reaps a silent worker by itself

    def settle(self, budget: "_CloseBudget") -> None:
        """At close, on the caller's thread (the releaser has stopped): pay what can be paid
        within `budget`, each call within what is left. A hung daemon stops the paying at
        its first failure, an open breaker before any call; what is left is dropped,
        counted (`closed_dropped`, `loadback_releases_failed_total{what}`), with one WARNING."""
        while self.pay(budget=budget) and budget.goes_on():
            time.sleep(min(0.001, budget.left()))  # a copy in flight: its debt pays soon
        with self._lock:
            left, self._debts = self._debts, []
        for d in left:
            self.metrics.release_failed(d.what)
        self.closed_dropped += len(left)
        if left:
            log.warning("daemon %s: %d release(s) owed were not paid at close (%s); the "
                        "daemon's TTLs release what they hold (read locks 300 s, sessions and "
                        "write reservations 600 s)", self.connector.endpoint, len(left),
                        budget.why())


class _CloseBudget:
    """What close() may still spend on the daemon: time, and the daemon's answers."""

    def __init__(self, breaker: CircuitBreaker, budget_s: float) -> None:
        self.breaker = breaker
        self.deadline = time.monotonic() + budget_s
        self.budget_s = budget_s
        self.hung = False

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def goes_on(self) -> bool:
        return not self.hung and self.left() > 0 and self.breaker.allow()

    def timeout(self, control_s: float) -> float:
        return min(control_s, self.left())

    def failed(self, ok: bool) -> None:
        """A call failed on the daemon: the breaker hears it; no more calls at close."""
        self.breaker.record(ok)
        self.hung = True

    def why(self) -> str:
        return ("the daemon did not answer" if self.hung else "the breaker is open"
                if not self.breaker.allow() else f"close budget of {self.budget_s * 1000:.0f} "
                "ms spent")
