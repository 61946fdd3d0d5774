"""The operator's view among the `loadback_*` instruments (`loadback status` reads it): the
hook's queues and scheduler waits, owed releases, fences, the registration epoch, the daemon.

Values owned elsewhere (the daemon link, the transport) are `watch`ed and read at every
scrape and every heartbeat (`refresh`).
"""

from __future__ import annotations

import threading
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .labels import DURATION_BUCKETS, STORE_QUEUE_LIMIT, unknown_label


class _Refresher:
    """A collector with no series of its own: reads the watched values at every scrape."""

    def __init__(self, metrics: "OperatorView") -> None:
        self._metrics = metrics

    def describe(self):
        return []

    def collect(self):
        self._metrics.refresh()
        return []


class OperatorView:
    """`LoadbackMetrics`' queues, waits, debts and daemon series, and the watched values."""

    multiprocess: bool
    registry: CollectorRegistry

    def _init_watch(self) -> None:
        """Before the registry exists: a scrape may `refresh` from then on."""
        self._watched: dict[str, Callable[[], object]] = {}
        self._fences_seen = 0
        self._refresh_lock = threading.Lock()

    def _declare_operator_view(self, reg: CollectorRegistry | None) -> None:
        """Queue depths, skipped stores and scheduler waits (set by the SGLang hook), then
        the watched series and the daemon's identity (`_declare_watched`)."""

        def gauge(name: str, doc: str, mode: str) -> Gauge:
            return Gauge(name, doc, registry=reg, multiprocess_mode=mode)

        # The SGLang hook's worker queues (set where it submits and finishes a job). Store:
        # livemax, the bound is per rank, so the fullest rank's queue is the one to watch.
        self.lookup_queue = gauge("loadback_lookup_queue_depth", "LOOKUPs handed to the hook's "
                                  "worker thread and not yet finished (queued or running).",
                                  "livesum")
        self.store_queue = gauge("loadback_store_queue_depth", "STOREs queued or running on the "
                                 "hook's store worker; each holds a tree lock on its slots.",
                                 "livemax")
        self.store_queue_limit = gauge("loadback_store_queue_limit", "The store worker's bound: a "
                                       "store finding this many queued is skipped "
                                       "(loadback_stores_skipped_total).", "livemin")
        self.store_queue_limit.set(STORE_QUEUE_LIMIT)
        self.stores_skipped = Counter("loadback_stores_skipped_total", "STOREs not queued "
                                      "because the store queue was at its bound (the prefix is "
                                      "not saved to the daemon).", registry=reg)
        self.scheduler_wait = Histogram(
            "loadback_scheduler_wait_seconds",
            "Time the engine's scheduler thread spent in one call that may wait on the daemon "
            "(match, re-derive or load_back of a request).",
            buckets=DURATION_BUCKETS, registry=reg)
        self._declare_watched(gauge, reg)

    def _declare_watched(self, gauge, reg: CollectorRegistry | None) -> None:
        # Read from the orchestrator at every heartbeat and scrape (`watch`, `refresh`).
        # Epoch: livemin, a rank not registered (-1) shows.
        self.pending_debts = gauge("loadback_owed_releases", "Releases owed to the daemon and "
                                   "not yet paid (lock frees, abandoned lookups, commits, session ends).",
                                   "livesum")
        self.fences_dropped = Counter("loadback_fences_dropped_total", "Timed-out sockets closed "
                                      "(over the transport's retired limit) before their fence "
                                      "answered: whether the daemon served their call is never "
                                      "known.", registry=reg)
        self.registered_epoch = gauge("loadback_registered_epoch", "Connection epoch (daemon "
                                      "incarnation as this process counts them) of the current "
                                      "registration; -1 when not registered.", "livemin")
        self.registered_epoch.set(-1)
        self._daemon_info = Gauge("loadback_daemon_info",
                                  "1 for the daemon this orchestrator talks to (endpoint) and "
                                  "its configured transfer setting (auto, shm, pickle).",
                                  ["endpoint", "transfer"], registry=reg,
                                  multiprocess_mode="livemax")

    # ---- the operator's view (hook, factory) ----

    def queue_depth(self, which: str, n: int) -> None:
        """The hook's worker queue depth: `which` is "lookup" or "store"."""
        if which == "lookup":
            self.lookup_queue.set(n)
        elif which == "store":
            self.store_queue.set(n)
        else:
            raise unknown_label("queue", which, ("lookup", "store"))

    def store_skipped(self) -> None:
        self.stores_skipped.inc()

    def observe_scheduler_wait(self, seconds: float) -> None:
        self.scheduler_wait.observe(seconds)

    def daemon_info(self, endpoint: str, transfer: str) -> None:
        """Set once when the orchestrator is built: the one daemon it talks to."""
        self._daemon_info.labels(endpoint=str(endpoint), transfer=str(transfer)).set(1)

    def watch(self, *, pending_debts: Callable[[], int] | None = None,
              fences_dropped: Callable[[], int] | None = None,
              registered_epoch: Callable[[], int | None] | None = None) -> None:
        """Values owned elsewhere (the daemon link, the transport), read at `refresh`:
        pending_debts -> loadback_owed_releases, fences_dropped (a monotonic count) ->
        loadback_fences_dropped_total, registered_epoch (None: not registered) ->
        loadback_registered_epoch."""
        for name, fn in (("pending_debts", pending_debts), ("fences_dropped", fences_dropped),
                         ("registered_epoch", registered_epoch)):
            if fn is not None:
                self._watched[name] = fn
        self.refresh()

    def refresh(self) -> None:
        """Read the watched values into their series (each scrape, each heartbeat). A value
        that cannot be read (its owner closed) keeps its last one: a scrape never fails."""
        if not self._watched:
            return
        with self._refresh_lock:
            for name, fn in self._watched.items():
                try:
                    value = fn()
                except Exception:  # noqa: BLE001 - the owner is closing: keep the last value
                    continue
                if name == "pending_debts":
                    self.pending_debts.set(int(value or 0))
                elif name == "registered_epoch":
                    self.registered_epoch.set(-1 if value is None else int(value))
                else:
                    now = int(value or 0)
                    if now > self._fences_seen:
                        self.fences_dropped.inc(now - self._fences_seen)
                    self._fences_seen = now

    # ---- registration refusals (the daemon link) ----

    def daemon_refused(self, reason: str, refused: bool) -> None:
        """`loadback_daemon_refused{reason}`: 1 while the daemon is refused at registration
        for `reason` (chunk_size: its --chunk-size is not the config's), else 0. The gauge is
        made at the first call (the daemon link's construction)."""
        gauge = self.__dict__.get("_refused_gauge")
        if gauge is None:
            gauge = self._refused_gauge = Gauge(
                "loadback_daemon_refused", "1 while the daemon is refused at registration "
                "for this reason (every request recomputes), else 0.", ["reason"],
                registry=None if self.multiprocess else self.registry,
                multiprocess_mode="livemax")
        gauge.labels(reason=reason).set(1 if refused else 0)
