"""L2Health: whether the daemon's L2 store delivers, as this process sees it through its
LOOKUPs, and the probe that tells when a stalled one answers again. The daemon link holds
one (`DaemonLink.l2`); match asks it how long to wait (`L2Wait`) and whether the store is
stalled; the LOOKUPs report to it what they saw.

A hung or dead L2 store is not a dead daemon: the daemon still answers ping and every status
poll of a LOOKUP ("still running"), only its prefetch from the store never finishes (lmcache
0.5.6 checks the store for every chunk of every LOOKUP, hits in its own memory included).
So the breaker, which is about the daemon, never hears of it. After `stall_after` LOOKUPs
in a row whose prefetch outlived the fetch they were expected to take, the store is
`stalled`: match answers a miss at once (`DegradeReason.L2_STALLED`) without a LOOKUP, until
a probe (one LOOKUP of a one-chunk key no engine stores, every `probe_interval_ms` on the
heartbeat thread) is answered within `probe_timeout_ms`. Loads of prefixes already found
need nothing from the store and go on.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from lmcache_loadback.connectors.base import Connector
from lmcache_loadback.connectors.errors import ConnectorError, PrefetchPending
from lmcache_loadback.metrics import LoadbackMetrics

from .config import L2
from .policies import Clock, L2Wait
from .state_log import StateLog

log = logging.getLogger("loadback")

#: The probe's key: one chunk of these token ids under this salt, which no engine stores.
PROBE_TOKEN = 0
PROBE_SALT = "loadback-l2-probe"

#: Owes the daemon a release of `what` for `request_id` on incarnation `epoch` (DebtBook.owe).
Owe = Callable[..., None]


class L2Health:
    """Thread contract: `observe_*` and `stalled` from any thread that runs match (the
    engines' LOOKUP threads); `tick` and `close` from the heartbeat thread (or close's);
    every field that crosses threads moves under `_lock`."""

    def __init__(self, wait: L2Wait, metrics: LoadbackMetrics, states: StateLog,
                 clock: Clock, endpoint: str) -> None:
        self.wait = wait
        self.metrics = metrics
        self.states = states
        self.clock = clock
        self.endpoint = endpoint
        self.stalled = False
        self.stalls = 0
        self._outlived_in_row = 0
        self._next_probe_at = 0.0
        #: The probe LOOKUP whose prefetch was still running at its wait's end: (request
        #: id, epoch). Asked again at the next probe; never more than one on the daemon.
        self._probe: tuple[str, int] | None = None
        self._probes = 0
        self._lock = threading.Lock()
        #: Called when the store stalls: the heartbeat wakes to time its first probe.
        self.on_stall: Callable[[], None] | None = None
        metrics.l2_state(False)
        metrics.l2_fetch_estimate(self.wait.per_chunk_s)  # None: not measured, 0

    @property
    def policy(self) -> L2:
        return self.wait.policy

    # ---------------------------------------------------------- what LOOKUPs saw

    def observe_answer(self, chunks_hit: int, elapsed_s: float) -> None:
        """A LOOKUP's prefetch answered: the store delivered (or had nothing to deliver)."""
        self.wait.answered(chunks_hit, elapsed_s)
        self.metrics.l2_fetch_estimate(self.wait.per_chunk_s)
        with self._lock:
            self._outlived_in_row = 0

    def observe_pending(self, chunks: int, waited_s: float) -> None:
        """A LOOKUP of `chunks` ended with the daemon's prefetch still running after
        `waited_s`. `stall_after` in a row that waited their expected fetch: stalled."""
        evidence = self.wait.outlived(chunks, waited_s)
        self.metrics.l2_fetch_estimate(self.wait.per_chunk_s)
        with self._lock:
            if not evidence or self.stalled:
                return
            self._outlived_in_row += 1
            if self._outlived_in_row < self.policy.stall_after:
                return
            self._outlived_in_row = 0
            self.stalled = True
            self.stalls += 1
            self._next_probe_at = self.clock() + self.policy.probe_interval_ms / 1000
        self.metrics.l2_state(True)
        self.metrics.l2_stalled()
        self.states.change("l2_stalled", "daemon %s: its L2 store stalled (%d LOOKUPs in a row "
                           "still fetching after %.0f ms, the daemon answering); LOOKUPs are "
                           "misses at once (l2_stalled) until a probe is answered within "
                           "%.0f ms", self.endpoint, self.policy.stall_after, waited_s * 1000,
                           self.policy.probe_timeout_ms)
        if self.on_stall is not None:
            self.on_stall()

    # ---------------------------------------------------------------- the probe

    def probe_in(self) -> float | None:
        """Seconds until the next probe is due (0: now), None while the store is not
        stalled: the heartbeat sleeps no longer than this."""
        with self._lock:
            if not self.stalled:
                return None
            return max(0.0, self._next_probe_at - self.clock())

    def tick(self, connector: Connector, control_s: float, owe: Owe) -> None:
        """Heartbeat thread, the daemon answering and registered: probe a stalled store when
        due. A probe still running from before is asked once (its answer frees it; a new
        probe follows at once); else a new probe LOOKUP is sent."""
        if self.probe_in() != 0.0:
            return
        with self._lock:
            self._next_probe_at = self.clock() + self.policy.probe_interval_ms / 1000
            outstanding = self._probe
        epoch = connector.epoch
        if outstanding is not None and outstanding[1] == epoch:
            rid = outstanding[0]
            if connector.unanswered(rid):
                return  # a poll of it still unanswered: never overlap it
            try:  # answers False while its prefetch runs; once done, frees what it locked
                done = connector.abandon_lookup(_probe_tokens(connector), rid, control_s,
                                                cache_salt=PROBE_SALT)
            except ConnectorError as exc:
                log.debug("L2 probe %s: status not answered: %s", rid, exc)
                return
            if not done:
                return  # the store still has not answered the earlier probe
            with self._lock:
                self._probe = None
            owe("end_session", rid, epoch, lambda t: connector.end_session(rid, t))
        self._send_probe(connector, control_s, owe)

    def _send_probe(self, connector: Connector, control_s: float, owe: Owe) -> None:
        self._probes += 1
        rid = f"loadback-l2-probe-{os.getpid()}-{self._probes}"
        epoch = connector.epoch
        tokens = _probe_tokens(connector)
        with self._lock:
            self._probe = (rid, epoch)
        try:
            hit = connector.lookup_hit_tokens(tokens, rid, control_s, cache_salt=PROBE_SALT,
                                              wait_s=self.policy.probe_timeout_ms / 1000)
        except PrefetchPending:
            log.debug("L2 probe %s: the store has not answered within %.0f ms", rid,
                      self.policy.probe_timeout_ms)
            return  # asked again at the next probe
        except ConnectorError as exc:  # the daemon's trouble: the breaker hears the ping
            log.debug("L2 probe %s failed: %s", rid, exc)
            with self._lock:
                self._probe = None
            _abandon(rid, epoch, connector, owe)
            return
        self._end_probe(rid, epoch, hit, connector, owe)
        self._recovered()

    def _end_probe(self, rid: str, epoch: int, hit: int, connector: Connector,
                   owe: Owe) -> None:
        """An answered probe: release what it locked (its key is stored by no engine, so
        normally nothing) and its session."""
        with self._lock:
            self._probe = None
        if hit > 0:
            owe("free_locks", rid, epoch, lambda t: connector.free_locks(
                _probe_tokens(connector), rid, 0, hit, t, cache_salt=PROBE_SALT))
        owe("end_session", rid, epoch, lambda t: connector.end_session(rid, t))

    def _recovered(self) -> None:
        with self._lock:
            if not self.stalled:
                return
            self.stalled = False
            self._outlived_in_row = 0
        self.metrics.l2_state(False)
        self.states.change("l2_recovered", "daemon %s: its L2 store answers again (a probe "
                           "within %.0f ms); LOOKUPs wait for it again", self.endpoint,
                           self.policy.probe_timeout_ms)

    def close(self, connector: Connector, owe: Owe) -> None:
        """close(): a probe still running on the daemon is owed its abandon and session end
        (paid within close's budget, if the store answers by then)."""
        with self._lock:
            outstanding, self._probe = self._probe, None
        if outstanding is None:
            return
        _abandon(*outstanding, connector, owe)


def _probe_tokens(connector: Connector) -> list[int]:
    return [PROBE_TOKEN] * connector.chunk_size


def _abandon(rid: str, epoch: int, connector: Connector, owe: Owe) -> None:
    """A probe whose answer will not be read: released once the daemon answered its calls
    and its prefetch ended, then its session (as any abandoned LOOKUP)."""
    owe("abandon_lookup", rid, epoch, lambda t: connector.abandon_lookup(
        _probe_tokens(connector), rid, t, cache_salt=PROBE_SALT), idempotent=True,
        ready=lambda: connector.unanswered(rid) == 0)
    owe("end_session", rid, epoch, lambda t: connector.end_session(rid, t))
