"""DaemonLink: the orchestrator's relationship with one daemon, kept alive off the request
path: the registration (which daemon incarnation, `epoch`), the heartbeat thread and the
releaser thread that pays the daemon's debts (debts.py). Operators read one line per change
of that relationship (state_log.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from lmcache_loadback.connectors.base import Connector
from lmcache_loadback.connectors.daemon_settings import DaemonSettings, read_settings
from lmcache_loadback.connectors.errors import ConnectorError, VersionSkew
from lmcache_loadback.metrics.instruments import TRANSFER_MODES, LoadbackMetrics

from .config import LoadBackConfig
from .debts import DebtBook
from .fleet_identity import FleetIdentity
from .instruments import REFUSALS
from .l2 import L2Health
from .policies import BreakerState, BreakEvenGuard, CircuitBreaker, L2Wait
from .state_log import StateLog

log = logging.getLogger("loadback")

#: While a debt waits only for its `ready` (a copy still reading the daemon's buffer), the
#: releaser looks again after this long, doubling up to the max: the buffer is released
#: milliseconds after the copy, not a heartbeat later. Nothing waiting: no polling at all.
READY_POLL_MIN_S = 0.001
READY_POLL_MAX_S = 0.016

#: The heartbeat never sleeps less than this while the breaker waits for its probe (a
#: half-open breaker that a refused daemon keeps half-open must not spin the thread).
PROBE_POLL_MIN_S = 0.05

#: A refused daemon is asked its chunk size again at most this often on one connection (and
#: at once when a new daemon incarnation answers).
REFUSED_RECHECK_S = 5.0
#: What a refused daemon lacks, by `loadback_daemon_refused` reason (its ERROR line).
_REFUSED_FOR = {"chunk_size": "chunk size", "cpu_workers": "CPU worker count",
                "hash_algorithm": "hash algorithm", "model_name": "KV layout for its model name"}


class DaemonLink(DebtBook):
    """The heartbeat registers (at start, after a restart or a suspect silence), pings,
    probes a half-open breaker and counts late replies; the releaser pays what the daemon is
    owed (`owe`) in order per request. The orchestrator calls `owe`, `registered`,
    `suspect`; only this object's own fields cross threads, each under `_lock` or an Event.

    A daemon whose chunk size is not the config's, or whose CPU pool runs several workers
    (read from its HTTP API where `mp_http_port` names it), is refused, never registered:
    `registered()` answers False without waking the heartbeat (match answers 0 without
    touching the socket), and it is checked again at once when a new daemon incarnation
    answers, else every REFUSED_RECHECK_S (a proxy in front can hide a restart from the
    epoch). Operators read one WARNING per change of the relationship (down, breaker open /
    half-open / closed, re-registered, transfer mode chosen) and one ERROR per refusal, each
    kind rate-limited (`StateLog`); request-scoped detail stays at DEBUG. Callbacks given to
    `on_tick` run at the end of every heartbeat (the SGLang backend watches its config file
    there).
    """

    def __init__(self, connector: Connector, config: LoadBackConfig, breaker: CircuitBreaker,
                 metrics: LoadbackMetrics, *, background: bool,
                 break_even: BreakEvenGuard | None = None) -> None:
        self.connector = connector
        self.config = config  # swapped by the orchestrator's reload
        self.breaker = breaker
        self.metrics = metrics
        connector.on_call = metrics.daemon_call  # each answered call timed, registration on
        self._init_debts()
        self.registered_epoch: int | None = None
        self._suspect = threading.Event()  # a call went unanswered: re-register next tick
        self._skew_warned = float("-inf")  # when VersionSkew was last logged at WARNING
        self._late_seen = 0
        self._wake = threading.Event()
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
        self._identity: FleetIdentity | None = None  # made at the first daemon with an L2
        #: The daemon's L2 store as its LOOKUPs show it; probed from the heartbeat.
        layout = connector.layout
        self.l2 = L2Health(L2Wait(config.l2, layout.chunk_size, break_even
                                  or BreakEvenGuard(config.break_even, layout.bytes_per_token)),
                           metrics, self.states, breaker.clock, connector.endpoint)
        self.l2.on_stall = self.wake
        for reason in REFUSALS:
            metrics.daemon_refused(reason, False)
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
            self._wake.set()  # the heartbeat may sleep a whole interval: time the probe now
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
        return self.connector.endpoint

    def _check_daemon(self, epoch: int) -> bool:
        """At every registration attempt, the daemon's settings this link relies on, as the
        daemon reports them: its chunk size (an inline round trip) against this config's,
        then, where it serves its HTTP API (`mp_http_port`), its CPU worker count (the
        fence behind an abandoned LOOKUP proves it served only on one). False (refused: one
        ERROR per change, `loadback_daemon_refused{reason}` 1) on a mismatch. Raises
        ConnectorError when the daemon does not answer."""
        refusal = self._refusal()
        self._checked_epoch, self._checked_at = epoch, self.breaker.clock()
        was = self.refused
        for reason in REFUSALS:
            self.metrics.daemon_refused(reason, refusal is not None and refusal[0] == reason)
        if refusal is not None:
            reason, self.refused = refusal
            if self.refused != was:
                self.states.change("refused", "daemon refused, every request recomputes "
                                   "until one with the right %s registers: %s",
                                   _REFUSED_FOR[reason], self.refused, level=logging.ERROR)
            return False
        self.refused = None
        if was is not None:
            self.states.change("accepted", "daemon %s accepted: its chunk size %d matches%s",
                               self._endpoint, self.connector.chunk_size,
                               ", one CPU worker" if self.config.mp_http_port else "")
        return True

    def _refusal(self) -> tuple[str, str] | None:
        """(reason, what to change) when the daemon cannot be served, else None."""
        theirs = int(self.connector.get_chunk_size(self.control_s))
        ours = self.connector.chunk_size
        if theirs != ours:
            return "chunk_size", (f"daemon {self._endpoint} --chunk-size {theirs}, this config "
                                  f"chunk_size {ours}: start the daemon with --chunk-size {ours} "
                                  f"or set chunk_size: {theirs}")
        port = self.config.mp_http_port
        if not port:
            return None
        try:
            settings = read_settings(self.config.mp_host, port, self.control_s)
        except ConnectorError as exc:  # its HTTP API may come up later: checked next time
            self.states.change("settings_unread", "daemon %s: %s; its CPU worker count and L2 "
                               "are not checked", self._endpoint, exc)
            return None
        workers = settings.max_cpu_workers
        if workers > 1:
            return "cpu_workers", (
                f"daemon {self._endpoint} runs {workers} CPU workers (--max-workers or "
                "--max-cpu-workers): a LOOKUP may still run when the fence behind it answers, "
                "and a session ended then comes back with its read locks; start the daemon "
                "with --max-cpu-workers 1 (--max-workers N still sets its GPU workers)")
        return self._fleet_refusal(settings) if settings.l2_adapters else None

    def _fleet_refusal(self, settings: DaemonSettings) -> tuple[str, str] | None:
        """A daemon with an L2 shares it with the fleet: the same keys need the fleet's hash
        algorithm, and this model name must not name another KV layout there."""
        want = self.config.l2.hash_algorithm
        if settings.hash_algorithm != want:
            return "hash_algorithm", (
                f"daemon {self._endpoint} --hash-algorithm {settings.hash_algorithm}, the "
                f"fleet's (l2.hash_algorithm) {want}: its chunks get other L2 keys than the "
                f"fleet's, so nothing is shared; start the daemon with --hash-algorithm {want}, "
                f"or set l2.hash_algorithm: {settings.hash_algorithm} on every engine if the "
                "whole fleet hashes so")
        if self._identity is None:
            c = self.connector
            self._identity = FleetIdentity(
                self._endpoint, c.model_name, c.world_size, c.layout,
                connect_timeout_s=self.config.deadlines.connect_ms / 1000, owe=self.owe,
                hold=lambda: self.l2.stalled, clock=self.breaker.clock)
        why = self._identity.refusal(settings.chunk_size, self.config.l2.canary_deadline_ms / 1000,
                                     self.connector.epoch)
        return None if why is None else ("model_name", why)

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
        # A probe registers: a daemon restarted behind a proxy answers pings, drops our calls
        must_register = (self.registered_epoch is None or epoch != self.registered_epoch
                         or self._suspect.is_set() or self.breaker.state == BreakerState.HALF_OPEN)
        try:
            if must_register:
                self._suspect.clear()
                if not self._register(epoch):
                    return
            else:
                self.connector.ping(self.control_s)
        except ConnectorError as exc:
            self._unreachable(exc, must_register)
            return
        self._up = True
        self.metrics.set_daemon_up(True)
        if self.breaker.state == BreakerState.HALF_OPEN:
            self.breaker.record(True)
        if self.registered_epoch == epoch and self.breaker.allow():
            was = self.l2.stalled
            self.l2.tick(self.connector, self.control_s, self.owe)
            if was and not self.l2.stalled:
                self._release_wake.set()  # abandoned LOOKUPs held for the store: pay them
        self.pay()

    def _register(self, epoch: int) -> bool:
        """Check the chunk size, then register with the daemon incarnation `epoch`; False
        when it was refused (it answered: up, never registered). Raises ConnectorError."""
        if not self._check_daemon(epoch):
            self.registered_epoch = None
            self._up = True
            self.metrics.set_daemon_up(True)
            return False
        # Off the request path: registration may take the connect budget.
        self.connector.register(max(self.control_s, self.config.deadlines.connect_ms / 1000))
        old = self.registered_epoch
        if old is not None and epoch != old:
            self.metrics.reregistered()
            self.states.change("reregistered", "daemon %s: re-registered with a new "
                               "incarnation (epoch %d -> %d); what was owed to the "
                               "old one is dropped", self._endpoint, old, epoch)
        elif old is None:
            log.info("daemon %s: registered (epoch %d)", self._endpoint, epoch)
        self.registered_epoch = epoch
        mode = self.connector.transfer
        if mode in TRANSFER_MODES:  # auto decides again at every registration
            self.metrics.transfer_mode(mode)
            if mode != self._transfer_logged:
                self._transfer_logged = mode
                self.states.change("transfer", "daemon %s: transfer mode %s chosen "
                                   "(setting %s)", self._endpoint, mode,
                                   self.connector.transfer_setting)
        return True

    def _unreachable(self, exc: ConnectorError, must_register: bool) -> None:
        """The heartbeat's call failed: say so (once per change), mark the daemon down, and
        tell the breaker (tripped at once when we never reached the daemon)."""
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

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            interval = self.config.heartbeat.interval_ms / 1000
            try:
                self.tick()
            except Exception:  # the heartbeat must outlive any bug in one tick
                log.exception("heartbeat tick failed")
            wait = interval if self.registered_epoch is not None else min(interval, 0.05)
            # An open breaker's probe, or a stalled L2's, goes out when due, not a tick late.
            for due in (self.breaker.probe_in(), self.l2.probe_in()):
                if due is not None:
                    wait = min(wait, max(due, PROBE_POLL_MIN_S))
            self._wake.wait(wait)
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

    def close_out(self) -> None:
        """close(): a probe of the L2 store still on the daemon is owed too; then settle,
        and unregister the fleet identity's marker once what it was owed is settled."""
        self.l2.close(self.connector, self.owe)
        super().close_out()
        if self._identity is not None:
            budget = self._closing
            self._identity.close(budget.timeout(self.control_s)
                                 if budget is not None and budget.goes_on() else 0.0)

    def stop_threads(self) -> None:
        """Stop both threads; from here on, releases run inline."""
        self._stop.set()
        self._wake.set()
        self._release_wake.set()
        for t in self._threads:
            t.join(timeout=5)
        self.background = False
