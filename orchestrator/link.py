"""DaemonLink: the orchestrator's relationship with one daemon, kept alive off the request path.

It owns the registration (which daemon incarnation, `epoch`, we are registered with), the
heartbeat thread (register at start, after a restart or a suspect silence; ping; probe a
half-open breaker; count late replies) and the releaser thread, which pays what the daemon
is owed (lock releases, settles of lost LOOKUPs, commits of landed retrieves, session
ends) in order per request. The orchestrator holds one and calls `owe`, `registered`,
`suspect`; only this object's own fields cross threads, each under `_lock` or an Event.

Every debt is tied to the daemon incarnation it was incurred on: a daemon that restarted
never saw those locks or sessions, and in lmcache 0.5.6 `free_lookup_locks` and a served
`prepare_retrieve` create the session they name, so paying an old debt to a new daemon
would leave it a session for a request it never served. Such debts are dropped, counted.

A debt whose `run` or `ready` raises something no daemon failure explains (a CUDA error in
`Event.query()`, a bug) never costs the other debts: it is warned about once, asked again
while a repeat is safe, and given up after `max_tries`, counted in
`loadback_releases_failed_total{what}` (the daemon keeps what it held until its TTL).

What an operator reads (`StateLog`): one WARNING per change of the relationship with the
daemon (down, breaker open / half-open / closed, re-registered with a new incarnation,
transfer mode chosen), one ERROR when a daemon is refused at registration (its chunk size is
not the config's), each kind at most once per `STATE_LOG_INTERVAL_S` with the count of the
changes suppressed meanwhile in its next line. Request-scoped detail stays at DEBUG, each line
naming its request id.

A refused daemon is never registered: `registered()` answers False without waking the
heartbeat (match answers 0 at once, without touching the socket), and the check is made again
at the next registration attempt: at once when a new daemon incarnation answers, else every
REFUSED_RECHECK_S (a proxy in front can hide a restart from the epoch), so a daemon restarted
with the right size is accepted without an engine restart. Callbacks given to `on_tick` run at the end of every heartbeat
(the SGLang backend watches its config file there).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from lmcache_loadback.connectors.base import Connector
from lmcache_loadback.connectors.errors import ConnectorError, DaemonUnavailable, VersionSkew
from lmcache_loadback.metrics import LoadbackMetrics
from lmcache_loadback.metrics.instruments import TRANSFER_MODES

from .config import LoadBackConfig
from .policies import BreakerState, CircuitBreaker

log = logging.getLogger("loadback")

#: While a debt waits only for its `ready` (a copy still reading the daemon's buffer), the
#: releaser looks again after this long, doubling up to the max: the buffer is released
#: milliseconds after the copy, not a heartbeat later. Nothing waiting: no polling at all.
READY_POLL_MIN_S = 0.001
READY_POLL_MAX_S = 0.016

#: One WARNING per kind of state change at most this often; the changes in between are
#: counted and the count is given in the kind's next line.
STATE_LOG_INTERVAL_S = 10.0


class StateLog:
    """Rate-limited lines about the daemon relationship: `change(kind, msg, *args)` logs at
    `level` unless a line of that kind went out less than `interval_s` ago; a suppressed
    change is logged at DEBUG and counted into the next line of its kind."""

    def __init__(self, logger: logging.Logger, *, interval_s: float = STATE_LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = logger
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def change(self, kind: str, msg: str, *args, level: int = logging.WARNING) -> bool:
        """Log one change of `kind`; False when it was suppressed (rate limit)."""
        now = self.clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval_s:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                suppressed = None
            else:
                self._last[kind] = now
                suppressed = self._suppressed.pop(kind, 0)
        if suppressed is None:
            self.log.debug("(suppressed, %s) " + msg, kind, *args)
            return False
        if suppressed:
            msg += " (%d earlier %s change%s not logged: at most one line per %g s)"
            args = (*args, suppressed, kind, "" if suppressed == 1 else "s", self.interval_s)
        self.log.log(level, msg, *args)
        return True


#: A refused daemon is asked its chunk size again at most this often on one connection (and
#: at once when a new daemon incarnation answers).
REFUSED_RECHECK_S = 5.0

# What one try at a debt came to (`DaemonLink._step`).
_PAID = "paid"    # settled: done, never to be repeated, or given up
_WAIT = "wait"    # its `ready` is false: not tried, no try spent
_LATER = "later"  # failed: tried again on a later pass


@dataclass
class Debt:
    """One release the daemon is owed. `run(timeout_s)` returns False (or raises) while it
    cannot complete yet; debts of one request are paid in order (a session is never ended
    before its locks are settled)."""

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
    tries: int = 0
    max_tries: int = 20
    #: Its run or ready raised unexpectedly and that was logged at WARNING (once a debt).
    warned: bool = False


class DaemonLink:
    def __init__(self, connector: Connector, config: LoadBackConfig, breaker: CircuitBreaker,
                 metrics: LoadbackMetrics, *, background: bool) -> None:
        self.connector = connector
        self.config = config  # swapped by the orchestrator's reload
        self.breaker = breaker
        self.metrics = metrics
        self.registered_epoch: int | None = None
        self.stale_dropped = 0  # debts of an old daemon incarnation, never sent
        self.given_up = 0  # debts out of tries (or unsafe to repeat), never paid
        self._suspect = threading.Event()  # a call went unanswered: re-register next tick
        self._skew_warned = float("-inf")  # when VersionSkew was last logged at WARNING
        self._debts: list[Debt] = []
        self._lock = threading.Lock()
        self._pay_lock = threading.Lock()  # one payer at a time keeps each request's order
        self._late_seen = 0
        self._wake = threading.Event()
        self._release_wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.states = StateLog(log, clock=breaker.clock)
        #: Whether the last heartbeat reached the daemon (None: not tried yet).
        self._up: bool | None = None
        #: The daemon incarnation whose chunk size was checked, and why it was refused
        #: (None: accepted or not checked yet).
        self._checked_epoch: int | None = None
        self._checked_at = float("-inf")
        self.refused: str | None = None
        self._transfer_logged: str | None = None
        self._on_tick: list[Callable[[], None]] = []
        metrics.daemon_refused("chunk_size", False)
        self.background = background
        if background:
            # Startup never blocks on the daemon: registration happens on the heartbeat.
            for name, target in (("heartbeat", self._heartbeat_loop),
                                 ("releaser", self._releaser_loop)):
                t = threading.Thread(target=target, name=f"loadback-{name}", daemon=True)
                t.start()
                self._threads.append(t)

    @property
    def control_s(self) -> float:
        return self.config.deadlines.control_ms / 1000

    # ------------------------------------------------------------- registration

    def registered(self) -> bool:
        """Registered with the daemon the connector talks to now."""
        epoch = self.connector.epoch
        if self.registered_epoch is None or epoch != self.registered_epoch:
            if self.refused is None or epoch != self._checked_epoch:
                self._wake.set()  # let the heartbeat (re-)register now
            return False
        return True

    def on_tick(self, fn: Callable[[], None]) -> None:
        """Run `fn` at the end of every heartbeat (on the heartbeat thread); what it raises
        is logged, never the heartbeat's end."""
        self._on_tick.append(fn)

    def breaker_changed(self, state: str) -> None:
        """The breaker's `on_change`: one WARNING per change (rate-limited)."""
        if state == BreakerState.OPEN:
            self.states.change("breaker_open", "daemon %s: circuit breaker open, requests "
                               "recompute without asking it; first probe in %.1f s",
                               self._endpoint, self.breaker.cooldown_s)
        elif state == BreakerState.HALF_OPEN:
            self.states.change("breaker_half_open", "daemon %s: circuit breaker half-open, "
                               "probing it", self._endpoint)
        else:
            self.states.change("breaker_closed", "daemon %s: circuit breaker closed, loads "
                               "resume", self._endpoint)

    @property
    def _endpoint(self) -> str:
        return str(getattr(self.connector, "endpoint", "in-memory"))

    def _check_chunk_size(self, epoch: int) -> bool:
        """At every registration attempt (an inline round trip): the daemon's chunk size
        against this config's. False (refused: one ERROR per change,
        `loadback_daemon_refused{reason="chunk_size"}` 1) on a mismatch. Raises
        ConnectorError when the daemon does not answer."""
        ask = getattr(self.connector, "get_chunk_size", None)
        if ask is None:
            return True  # a connector with no daemon behind it (in-memory)
        theirs = int(ask(self.control_s))
        ours = self.connector.chunk_size
        self._checked_epoch, self._checked_at = epoch, self.breaker.clock()
        was = self.refused
        if theirs != ours:
            self.refused = (f"daemon {self._endpoint} --chunk-size {theirs}, this config "
                            f"chunk_size {ours}: start the daemon with --chunk-size {ours} or "
                            f"set chunk_size: {theirs}")
            self.metrics.daemon_refused("chunk_size", True)
            if self.refused != was:
                self.states.change("refused", "daemon refused, every request recomputes "
                                   "until one with the right chunk size registers: %s",
                                   self.refused, level=logging.ERROR)
            return False
        self.refused = None
        self.metrics.daemon_refused("chunk_size", False)
        if was is not None:
            self.states.change("accepted", "daemon %s accepted: its chunk size %d matches",
                               self._endpoint, ours)
        return True

    def suspect(self) -> None:
        """The daemon may have forgotten us: the heartbeat re-registers now, not at its next
        ping (a daemon restarted behind a proxy leaves the connection's epoch unchanged)."""
        self._suspect.set()
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def wait_registered(self, timeout_s: float) -> bool:
        """Wait until registered with the current daemon and the breaker is closed."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.registered() and self.breaker.allow():
                return True
            time.sleep(0.01)
        return False

    # ---------------------------------------------------------------- debts

    def owe(self, what: str, request_id: str, epoch: int, run: Callable[[float], object], *,
            idempotent: bool = False, ready: Callable[[], bool] | None = None,
            max_tries: int = 20) -> None:
        """A release the daemon incarnation `epoch` is owed. With background threads it is
        queued and paid by the releaser at once, off the request path (a hung daemon must
        not stretch match, load_back or finish); without them it runs inline if it can."""
        debt = Debt(what, request_id, epoch, run, idempotent, ready, max_tries=max_tries)
        if self._stale(debt):
            return
        if self.background:
            self._queue(debt)
            self._release_wake.set()
            return
        with self._lock:
            queued = any(d.request_id == request_id for d in self._debts)
        if (queued or not self.breaker.allow()
                or self._step(debt, self.control_s, on_failure=self.breaker.record) != _PAID):
            self._queue(debt)

    def pending(self, request_id: str | None = None) -> int:
        with self._lock:
            return sum(1 for d in self._debts if request_id in (None, d.request_id))

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
        unexpected raise from `ready` or `run` is `_raised`'s to settle, never the caller's."""
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
        """Run one debt; True when it is settled: done, possibly applied and so never to
        be sent again (unless idempotent), or out of tries (given up, counted). A try is
        spent only on a call the daemon got: one never sent waits (for the daemon, or its
        epoch to pass) for free. `on_failure(False)` hears each failure."""
        try:
            done = d.run(timeout_s) is not False
        except DaemonUnavailable:
            if on_failure:
                on_failure(False)
            return False  # nothing was sent
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
        if d.tries < d.max_tries:
            return False
        self._give_up(d)
        return True

    def pay(self, timeout_s: float | None = None) -> bool:
        """Pay every owed release that can be paid now, in order per request. True when a
        debt waits only for its `ready` (a copy in flight): look again soon."""
        timeout_s = self.control_s if timeout_s is None else timeout_s
        with self._pay_lock:
            with self._lock:
                todo, self._debts = deque(self._debts), []
            keep: list[Debt] = []
            blocked: set[str] = set()
            waiting = False
            try:
                while todo:
                    d = todo[0]
                    if d.request_id in blocked:
                        keep.append(d)
                    elif not self._stale(d):
                        step = self._step(d, timeout_s)
                        if step != _PAID:
                            keep.append(d)
                            blocked.add(d.request_id)
                            waiting = waiting or step == _WAIT
                    todo.popleft()
            finally:  # even a bug in this loop loses no debt
                with self._lock:
                    self._debts = keep + list(todo) + self._debts
            return waiting

    # ------------------------------------------------------------- heartbeat

    def tick(self) -> None:
        """One heartbeat: register if needed, probe when the breaker allows, ping, pay
        debts, then the `on_tick` callbacks. Runs on the heartbeat thread; tests call it
        directly."""
        try:
            self._tick()
        finally:
            # Every tick, also while an open breaker waits for its probe: the owed releases,
            # epoch and dropped fences an operator reads (multiprocess mode has no scrape hook).
            self.metrics.refresh()
            for fn in list(self._on_tick):
                try:
                    fn()
                except Exception:  # noqa: BLE001 - a callback's bug never ends the heartbeat
                    log.exception("heartbeat callback %r failed", fn)

    def _tick(self) -> None:
        late = self.connector.late_replies
        if late > self._late_seen:
            self.metrics.late_reply(late - self._late_seen)
            self._late_seen = late
        epoch = self.connector.epoch
        if self.breaker.state == BreakerState.OPEN and not self.breaker.probe_due():
            if epoch == self.registered_epoch:
                return
            # A new daemon accepted our connection: probe it now, not after the cooldown.
            self.breaker.probe_now()
        if (self.refused is not None and epoch == self._checked_epoch
                and self.breaker.clock() - self._checked_at < REFUSED_RECHECK_S):
            # Refused: asked again when another incarnation answers, or after a while (a
            # proxy in front may hide a daemon's restart from the connection's epoch).
            return
        must_register = (self.registered_epoch is None or epoch != self.registered_epoch
                         or self._suspect.is_set())
        try:
            if must_register:
                self._suspect.clear()
                if not self._check_chunk_size(epoch):
                    self.registered_epoch = None
                    self._up = True
                    self.metrics.set_daemon_up(True)
                    return
                # Off the request path: registration may take the connect budget.
                self.connector.register(
                    max(self.control_s, self.config.deadlines.connect_ms / 1000))
                old = self.registered_epoch
                if old is not None and epoch != old:
                    self.metrics.reregistered()
                    self.states.change("reregistered", "daemon %s: re-registered with a new "
                                       "incarnation (epoch %d -> %d); what was owed to the "
                                       "old one is dropped", self._endpoint, old, epoch)
                elif old is None:
                    log.info("daemon %s: registered (epoch %d)", self._endpoint, epoch)
                self.registered_epoch = epoch
                mode = getattr(self.connector, "transfer", None)
                if mode in TRANSFER_MODES:  # auto decides again at every registration
                    self.metrics.transfer_mode(mode)
                    if mode != self._transfer_logged:
                        self._transfer_logged = mode
                        self.states.change("transfer", "daemon %s: transfer mode %s chosen "
                                           "(setting %s)", self._endpoint, mode, getattr(
                                               self.connector, "transfer_setting", mode))
            else:
                self.connector.ping(self.control_s)
        except ConnectorError as exc:
            if must_register:
                self._suspect.set()
            if isinstance(exc, VersionSkew):
                # An operator must act (install matching versions): say so, once a minute.
                now = time.monotonic()
                if now - self._skew_warned >= 60.0:
                    self._skew_warned = now
                    log.warning("heartbeat failed: %s", exc)
                else:
                    log.debug("heartbeat failed: %s", exc)
            else:
                log.debug("heartbeat failed: %s", exc)
            if self._up is not False and not isinstance(exc, VersionSkew):
                self._up = False
                self.states.change("down", "daemon %s %s: %s; requests recompute until it "
                                   "answers", self._endpoint, "down" if self.registered_epoch
                                   is not None else "not reachable", exc)
            self.metrics.set_daemon_up(False)
            if self.registered_epoch is None and self.breaker.state == BreakerState.CLOSED:
                self.breaker.trip()  # never reached: answer 0 at once until a probe succeeds
            else:
                self.breaker.record(False)
            return
        self._up = True
        self.metrics.set_daemon_up(True)
        if self.breaker.state == BreakerState.HALF_OPEN:
            self.breaker.record(True)
        self.pay()

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            interval = self.config.heartbeat.interval_ms / 1000
            try:
                self.tick()
            except Exception:  # the heartbeat must outlive any bug in one tick
                log.exception("heartbeat tick failed")
            self._wake.wait(interval if self.registered_epoch is not None else
                            min(interval, 0.05))
            self._wake.clear()

    def _releaser_loop(self) -> None:
        """Pays what the daemon is owed as soon as it is queued, while the breaker allows;
        while a debt waits for its `ready`, looks again within milliseconds (backing off
        from READY_POLL_MIN_S to READY_POLL_MAX_S), else at the heartbeat interval."""
        poll = 0.0
        while not self._stop.is_set():
            interval = self.config.heartbeat.interval_ms / 1000
            self._release_wake.wait(min(poll, interval) if poll else interval)
            self._release_wake.clear()
            waiting = False
            if self.pending() and self.breaker.allow() and self.registered_epoch is not None:
                try:
                    waiting = self.pay()
                except Exception:  # the releaser must outlive any bug in one pass
                    log.exception("releasing owed daemon state failed")
            poll = min(max(poll * 2, READY_POLL_MIN_S), READY_POLL_MAX_S) if waiting else 0.0

    def stop_threads(self) -> None:
        """Stop both threads; from here on, releases run inline."""
        self._stop.set()
        self._wake.set()
        self._release_wake.set()
        for t in self._threads:
            t.join(timeout=5)
        self.background = False
