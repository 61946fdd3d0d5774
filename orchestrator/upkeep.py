"""Keeping the relationship with the daemon alive, off the request path.

The heartbeat registers (at start, after a restart, after a suspect silence), pings so the
daemon does not reap this worker, probes a half-open breaker and notices late replies.
The releaser pays what the daemon is owed (lock releases, session ends, the settling of a
LOOKUP whose answer was lost) in order per request, as soon as it is queued. Mixed into
`LoadBackOrchestrator`, whose state (config, connector, breaker, metrics, locks) it uses.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from connectors.errors import ConnectorError, DaemonUnavailable

from .policies import BreakerState

log = logging.getLogger("loadback")


@dataclass
class _Debt:
    """Cleanup the daemon is owed but could not take yet (down, hung, breaker open).

    `run(timeout_s)` returns False (or raises) while it cannot complete yet. Debts of one
    request are paid in order: a session is never ended before its locks are settled.
    Debts outlive a daemon restart on purpose: every release derives from the daemon's own
    session record, so on a daemon that never saw the request it is a no-op, and a request
    that reached the new daemon before the restart was noticed is released there.
    """

    what: str
    request_id: str
    run: Callable[[float], bool | None]
    tries: int = 0
    max_tries: int = 20
    #: Repeat after any failure (True only for idempotent work). A release that may have
    #: reached the daemon is never sent twice: a second free_lookup_locks would strip
    #: another reader's lock. Only "not sent" (DaemonUnavailable) repeats those.
    idempotent: bool = False


class DaemonUpkeep:
    def _control(self, op: str, request_id: str, run: Callable[[float], bool | None],
                 *, idempotent: bool = False) -> None:
        """A release the daemon is owed. With background threads it is queued and paid by
        the releaser at once, off the request path (a hung daemon must not stretch match,
        load_back or finish); without them (tests, benchmarks) it runs inline."""
        debt = _Debt(op, request_id, run, idempotent=idempotent)
        if self._background:
            self._owe(debt)
            self._release_wake.set()
            return
        with self._lock:
            queued = any(d.request_id == request_id for d in self._debts)
        if queued or not self.breaker.allow() or not self._attempt(
                debt, self.config.deadlines.control_ms / 1000, on_failure=self.breaker.record):
            self._owe(debt)

    @staticmethod
    def _attempt(d: _Debt, timeout_s: float, *, on_failure=None) -> bool:
        """Run one debt; True when it is settled: done, or possibly applied and so never
        to be sent again (unless idempotent). `on_failure(False)` hears each failure."""
        try:
            return d.run(timeout_s) is not False
        except DaemonUnavailable:
            pass  # nothing was sent
        except ConnectorError as exc:
            if on_failure:
                on_failure(False)
            if not d.idempotent:
                log.debug("%s for %s may have reached the daemon; not repeated: %s",
                          d.what, d.request_id, exc)
                return True
            return False
        if on_failure:
            on_failure(False)
        return False

    def _owe(self, debt: _Debt) -> None:
        with self._lock:
            self._debts.append(debt)

    def _registered(self) -> bool:
        epoch = self.connector.epoch
        if self._registered_epoch is None or epoch != self._registered_epoch:
            self._wake.set()  # let the heartbeat (re-)register now
            return False
        return True

    # -------------------------------------------------------------- heartbeat

    def tick(self) -> None:
        """One heartbeat: register if needed, probe when the breaker allows, ping, pay
        debts. Runs on the heartbeat thread; tests call it directly."""
        late = self.connector.late_replies
        if late > self._late_seen:
            self.metrics.late_reply(late - self._late_seen)
            self._late_seen = late
        epoch = self.connector.epoch
        if self.breaker.state == BreakerState.OPEN and not self.breaker.probe_due():
            if epoch == self._registered_epoch:
                return
            # A new daemon accepted our connection: probe it now, not after the cooldown.
            self.breaker.probe_now()
        control_s = self.config.deadlines.control_ms / 1000
        must_register = (self._registered_epoch is None or epoch != self._registered_epoch
                         or self._suspect)
        try:
            if must_register:
                # Off the request path: registration may take the connect budget.
                self.connector.register(max(control_s, self.config.deadlines.connect_ms / 1000))
                self._suspect = False
                if self._registered_epoch is not None and epoch != self._registered_epoch:
                    self.metrics.reregistered()
                self._registered_epoch = epoch
            else:
                self.connector.ping(control_s)
        except ConnectorError as exc:
            log.debug("heartbeat failed: %s", exc)
            self.metrics.set_daemon_up(False)
            if self._registered_epoch is None and self.breaker.state == BreakerState.CLOSED:
                self.breaker.trip()  # never reached: answer 0 at once until a probe succeeds
            else:
                self.breaker.record(False)
            return
        self.metrics.set_daemon_up(True)
        if self.breaker.state == BreakerState.HALF_OPEN:
            self.breaker.record(True)
        self._pay_debts(control_s)

    def _pay_debts(self, control_s: float) -> None:
        with self._pay_lock:  # one payer at a time keeps each request's releases in order
            self._pay_debts_locked(control_s)

    def _pay_debts_locked(self, control_s: float) -> None:
        with self._lock:
            debts, self._debts = self._debts, []
        keep: list[_Debt] = []
        blocked: set[str] = set()
        for d in debts:
            if d.request_id in blocked:
                keep.append(d)
                continue
            if not self._attempt(d, control_s):
                d.tries += 1
                if d.tries < d.max_tries:
                    keep.append(d)
                    blocked.add(d.request_id)
        with self._lock:
            self._debts = keep + self._debts

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            interval = self.config.heartbeat.interval_ms / 1000
            try:
                self.tick()
            except Exception:  # the heartbeat must outlive any bug in one tick
                log.exception("heartbeat tick failed")
            self._wake.wait(interval if self._registered_epoch is not None else
                            min(interval, 0.05))
            self._wake.clear()

    def _releaser_loop(self) -> None:
        """Pays what the daemon is owed as soon as it is queued, while the breaker allows."""
        while not self._stop.is_set():
            self._release_wake.wait(self.config.heartbeat.interval_ms / 1000)
            self._release_wake.clear()
            if self._debts and self.breaker.allow() and self._registered_epoch is not None:
                try:
                    self._pay_debts(self.config.deadlines.control_ms / 1000)
                except Exception:  # the releaser must outlive any bug in one pass
                    log.exception("releasing owed daemon state failed")

    def wait_registered(self, timeout_s: float) -> bool:
        """Wait until registered with the current daemon and the breaker is closed."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self._registered() and self.breaker.allow():
                return True
            time.sleep(0.01)
        return False
