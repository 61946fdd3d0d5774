"""Every Prometheus instrument of lmcache-loadback, declared in one place.

Who calls what:
- `orchestrator.LoadBackOrchestrator` builds one `LoadbackMetrics` (passing its own enums'
  label values, so this package never imports `orchestrator`) and calls the small methods
  below on every state change; the hot paths only do dict lookups and `inc()`/`set()`.
- `metrics.server.start_metrics_server` serves `LoadbackMetrics.registry` on `/metrics`.
- The SGLang hook sets its worker queue depths and times the scheduler thread's waits;
  `orchestrator.factory` names the daemon (`daemon_info`) and `watch`es what the daemon link
  and the transport own (owed releases, registration epoch, dropped fences), read at every
  scrape and every heartbeat (`set_daemon_up`). `loadback status` reads all of it back.
- Tests and the chaos harness call `snapshot()` to reconcile counters against outcomes.

Label values come from closed sets given to `__init__`; every labelled child is created
there, so absent series read 0 and an unknown label value raises `UnknownLabelError`
(a KeyError and a ValueError) instead of silently creating a new series.

Multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` set before prometheus_client is imported):
instruments are not registered anywhere (prometheus_client writes them to mmap files) and
`registry` is a read-only view through `MultiProcessCollector`. Use one `LoadbackMetrics`
per process in that mode: two instances in one process would overwrite each other's files.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from enum import Enum
from typing import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import multiprocess

__all__ = [
    "LoadbackMetrics",
    "UnknownLabelError",
    "DURATION_BUCKETS",
    "LOOKUP_RESULTS",
    "BREAKER_STATES",
    "OUTCOME_STATES",
    "LOADED_REASON",
    "multiprocess_enabled",
    "STORE_QUEUE_LIMIT",
]

# Log-spaced 0.1 ms .. 60 s (20 buckets); 0.75 refines p99 around the ~0.64 s alert threshold.
DURATION_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
)
LOOKUP_RESULTS: tuple[str, ...] = ("hit", "miss", "error", "skipped")
BREAKER_STATES: dict[str, int] = {"closed": 0, "half_open": 1, "open": 2}
TRANSFER_MODES: tuple[str, ...] = ("shm", "pickle")
#: The releases the daemon can be owed (the `what` of loadback_releases_failed_total).
RELEASES: tuple[str, ...] = ("free_locks", "settle_lookup", "commit_retrieve", "end_session")
OUTCOME_STATES: tuple[str, ...] = ("loaded", "degraded")
LOADED_REASON = "none"
#: The hook's store worker bound (`StoreWorker.max_queued`), the store queue limit gauge's
#: value until the hook sets its own.
STORE_QUEUE_LIMIT = 64


class UnknownLabelError(KeyError, ValueError):
    """A label value outside the closed set given to LoadbackMetrics (a programming error)."""


def multiprocess_enabled() -> bool:
    """True when prometheus_client writes values to mmap files (one process per TP rank)."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir"))


def _label(value: object) -> str:
    # Orchestrator enums may be passed as-is; their .value is the label.
    return str(value.value) if isinstance(value, Enum) else str(value)


def _labels(values: Iterable[object], what: str) -> tuple[str, ...]:
    out = tuple(dict.fromkeys(_label(v) for v in values))
    if not out:
        raise ValueError(f"LoadbackMetrics needs at least one {what}")
    return out


def _unknown(what: str, value: object, known: Iterable[object]) -> UnknownLabelError:
    return UnknownLabelError(f"unknown {what} {value!r}; known: {sorted(map(str, known))}")


def _lookup(children: dict, key, what: str, normalize):
    """Slow path after a dict miss: accept enums, else raise UnknownLabelError."""
    norm = normalize(key)
    if norm in children:
        return children[norm]
    raise _unknown(what, key, children)


class _Refresher:
    """A collector with no series of its own: reads the watched values at every scrape."""

    def __init__(self, metrics: "LoadbackMetrics") -> None:
        self._metrics = metrics

    def describe(self):
        return []

    def collect(self):
        self._metrics.refresh()
        return []


class LoadbackMetrics:
    """All `loadback_*` instruments, with every labelled child pre-created."""

    def __init__(
        self,
        *,
        states: Sequence[str],
        reasons: Sequence[str],
        ops: Sequence[str],
        registry: CollectorRegistry | None = None,
        transitions: Sequence[tuple[str, str]] | None = None,
    ) -> None:
        self.states = _labels(states, "state")
        self.reasons = _labels(reasons, "reason")
        self.ops = _labels(ops, "op")
        self.multiprocess = multiprocess_enabled()
        #: Wall clock of `loadback_last_degraded_timestamp_seconds` (tests pin it).
        self.wall_clock: Callable[[], float] = time.time
        self._watched: dict[str, Callable[[], object]] = {}
        self._fences_seen = 0
        self._refresh_lock = threading.Lock()
        if self.multiprocess:
            # Values live in mmap files; registering would duplicate them, so read them back.
            if registry is None:
                registry = CollectorRegistry()
                multiprocess.MultiProcessCollector(registry)
            reg = None
        else:
            registry = registry if registry is not None else CollectorRegistry()
            reg = registry
            # First in the registry: every scrape reads the watched values (`watch`) before
            # the instruments are collected. (Multiprocess mode: the heartbeat does, below.)
            registry.register(_Refresher(self))
        self.registry = registry

        # Label names are declared sorted so exposition matches Prometheus' canonical order.
        c_trans = Counter("loadback_prefix_transitions_total",
                          "Prefix state-machine transitions.", ["dst", "src"], registry=reg)
        pairs = (itertools.product(self.states, self.states) if transitions is None
                 else [(_label(s), _label(d)) for s, d in transitions])
        self._transition: dict[tuple[str, str], Counter] = {}
        for src, dst in pairs:
            if src not in self.states or dst not in self.states:
                raise _unknown("transition state", (src, dst), self.states)
            self._transition[(src, dst)] = c_trans.labels(dst=dst, src=src)

        g_last = Gauge("loadback_last_degraded_timestamp_seconds",
                       "Unix time a prefix last degraded with this reason (0: never); the "
                       "largest is the last refusal reason (`loadback status`).", ["reason"],
                       registry=reg, multiprocess_mode="livemax")
        self._last_degraded = {r: g_last.labels(reason=r) for r in self.reasons}
        c_out = Counter("loadback_prefix_outcomes_total",
                        "Prefixes that reached a terminal state (loaded, or degraded with a reason).",
                        ["reason", "state"], registry=reg)
        c_recomp = Counter("loadback_recomputed_tokens_total",
                           "Tokens promised by match() and then recomputed, by degrade reason.",
                           ["reason"], registry=reg)
        self._outcome = {("loaded", LOADED_REASON): c_out.labels(reason=LOADED_REASON, state="loaded")}
        self._recomputed: dict[str, Counter] = {}
        for r in self.reasons:
            self._outcome[("degraded", r)] = c_out.labels(reason=r, state="degraded")
            self._recomputed[r] = c_recomp.labels(reason=r)

        self.loaded_tokens = Counter("loadback_loaded_tokens_total",
                                     "Tokens copied from the daemon into KV slots and checked.", registry=reg)
        self.loaded_bytes = Counter("loadback_loaded_bytes_total",
                                    "Bytes copied from the daemon into KV slots.", registry=reg)
        self.promised_tokens = Counter("loadback_promised_tokens_total",
                                       "Tokens match() reported as loadable (counted when the prefix settles).",
                                       registry=reg)

        c_lookups = Counter("loadback_lookups_total", "LOOKUPs by result.", ["result"], registry=reg)
        self._lookups = {r: c_lookups.labels(result=r) for r in LOOKUP_RESULTS}
        self.lookup_duration = Histogram("loadback_lookup_duration_seconds",
                                         "LOOKUP latency (hit, miss, error; skipped ones are not timed).",
                                         buckets=DURATION_BUCKETS, registry=reg)
        self.retrieve_duration = Histogram("loadback_retrieve_duration_seconds",
                                           "RETRIEVE latency including retries, per prefix.",
                                           buckets=DURATION_BUCKETS, registry=reg)

        c_retries = Counter("loadback_retries_total", "Retried daemon operations.", ["op"], registry=reg)
        c_timeouts = Counter("loadback_timeouts_total", "Daemon operations past their deadline.",
                             ["op"], registry=reg)
        self._retries = {o: c_retries.labels(op=o) for o in self.ops}
        self._timeouts = {o: c_timeouts.labels(op=o) for o in self.ops}

        # livemax: the worst rank's breaker shows; dead ranks drop out.
        self.breaker_state = Gauge("loadback_breaker_state",
                                   "Circuit breaker toward the daemon: 0 closed, 1 half_open, 2 open.",
                                   registry=reg, multiprocess_mode="livemax")
        c_btrans = Counter("loadback_breaker_transitions_total", "Breaker state changes, by new state.",
                           ["to"], registry=reg)
        self._breaker_to = {s: c_btrans.labels(to=s) for s in BREAKER_STATES}
        self._breaker_now = "closed"
        # livemin: one rank that cannot reach the daemon makes the whole engine read down.
        self.daemon_up = Gauge("loadback_daemon_up", "1 when the daemon answers, else 0.",
                               registry=reg, multiprocess_mode="livemin")
        g_live = Gauge("loadback_live_prefixes", "Prefixes currently in each state.", ["state"],
                       registry=reg, multiprocess_mode="livesum")
        self._live = {s: g_live.labels(state=s) for s in self.states}
        self.reregistrations = Counter("loadback_reregistrations_total",
                                       "Registrations repeated after the daemon lost its state.", registry=reg)
        self.late_replies = Counter("loadback_late_replies_total",
                                    "Daemon replies that arrived after their deadline and were dropped.",
                                    registry=reg)
        self.stale_releases = Counter("loadback_stale_releases_dropped_total",
                                      "Releases owed to a daemon that has since restarted, "
                                      "dropped unsent (the new daemon never held them).",
                                      registry=reg)
        g_transfer = Gauge("loadback_transfer_mode",
                           "1 for the transfer the last registration chose (transfer auto: shm "
                           "when the daemon offers a shared-memory pool, else pickle).",
                           ["mode"], registry=reg, multiprocess_mode="livemax")
        self._transfer = {m: g_transfer.labels(mode=m) for m in TRANSFER_MODES}
        c_failed = Counter("loadback_releases_failed_total",
                           "Releases owed to the daemon and given up unpaid: out of tries, or "
                           "their check or call raised where a repeat is unsafe (the daemon "
                           "keeps what they would have released until its TTL).",
                           ["what"], registry=reg)
        self._releases_failed = {w: c_failed.labels(what=w) for w in RELEASES}
        self.prepared_expired_total = Counter(
            "loadback_prepared_expired_total",
            "Ranges prepared at match that waited past prepare_max_age_ms for their load: "
            "released and asked for again, never copied (the daemon's read TTL).",
            registry=reg)
        # livemin: a rank still on an old config shows as the lower generation.
        self.config_gen = Gauge("loadback_config_generation", "Generation of the config in effect.",
                                registry=reg, multiprocess_mode="livemin")
        self.config_reload_failures = Counter("loadback_config_reload_failures_total",
                                              "Config reloads rejected (the previous config stays).",
                                              registry=reg)

        # ---- the operator's view (`loadback status`): queues, waits, debts, the daemon ----
        def gauge(name: str, doc: str, mode: str) -> Gauge:
            return Gauge(name, doc, registry=reg, multiprocess_mode=mode)

        # The SGLang hook's worker queues (set where it submits and settles a job). Store:
        # livemax, the bound is per rank, so the fullest rank's queue is the one to watch.
        self.lookup_queue = gauge("loadback_lookup_queue_depth", "LOOKUPs handed to the hook's "
                                  "worker thread and not yet settled (queued or running).",
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
        # Read from the orchestrator at every heartbeat and scrape (`watch`, `refresh`).
        # Epoch: livemin, a rank not registered (-1) shows.
        self.pending_debts = gauge("loadback_owed_releases", "Releases owed to the daemon and "
                                   "not yet paid (lock frees, settles, commits, session ends).",
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

    # ---- hot-path methods (called by the orchestrator) ----

    def transition(self, src: str, dst: str) -> None:
        """Count one state-machine transition src -> dst (both from `states`)."""
        key = (src, dst)
        try:
            child = self._transition[key]
        except KeyError:
            child = _lookup(self._transition, key, "transition",
                            lambda k: (_label(k[0]), _label(k[1])))
        child.inc()

    def outcome(self, state: str, reason: str | None, promised_tokens: int = 0,
                loaded_tokens: int = 0, loaded_bytes: int = 0) -> None:
        """Count a prefix reaching a terminal state, once per prefix.

        loaded uses reason "none" (or None); degraded needs a reason from `reasons` and adds
        `promised_tokens` to recomputed_tokens{reason}. promised_tokens is counted here (when
        the prefix settles) so promised == loaded + recomputed holds at every scrape.
        """
        key = (state, LOADED_REASON if reason is None else reason)
        try:
            child = self._outcome[key]
        except KeyError:
            child = _lookup(self._outcome, key, "outcome (state, reason)",
                            lambda k: (_label(k[0]), _label(k[1])))
        child.inc()
        if _label(key[0]) != "loaded":
            self._last_degraded[_label(key[1])].set(self.wall_clock())
        if promised_tokens:
            self.promised_tokens.inc(promised_tokens)
            if _label(key[0]) != "loaded":
                self._recomputed[_label(key[1])].inc(promised_tokens)
        if loaded_tokens:
            self.loaded_tokens.inc(loaded_tokens)
        if loaded_bytes:
            self.loaded_bytes.inc(loaded_bytes)

    def observe_lookup(self, seconds: float | None, result: str) -> None:
        """Count a LOOKUP by result; time it unless it was skipped (breaker open, no daemon)."""
        try:
            child = self._lookups[result]
        except KeyError:
            child = _lookup(self._lookups, result, "lookup result", _label)
        child.inc()
        if seconds is not None and result != "skipped":
            self.lookup_duration.observe(seconds)

    def observe_retrieve(self, seconds: float) -> None:
        """Time one prefix's RETRIEVE phase (all attempts), whatever its outcome."""
        self.retrieve_duration.observe(seconds)

    def retry(self, op: str) -> None:
        try:
            child = self._retries[op]
        except KeyError:
            child = _lookup(self._retries, op, "op", _label)
        child.inc()

    def timeout(self, op: str) -> None:
        try:
            child = self._timeouts[op]
        except KeyError:
            child = _lookup(self._timeouts, op, "op", _label)
        child.inc()

    def breaker(self, state_name: str) -> None:
        """Set the breaker gauge; count a transition only when the state actually changes."""
        name = _label(state_name)
        if name not in BREAKER_STATES:
            raise _unknown("breaker state", state_name, BREAKER_STATES)
        self.breaker_state.set(BREAKER_STATES[name])
        if name != self._breaker_now:
            self._breaker_now = name
            self._breaker_to[name].inc()

    def set_daemon_up(self, up: bool) -> None:
        """The heartbeat's report (the daemon link calls this on every tick): also reads the
        watched values, so multiprocess mode, which has no scrape-time read, has them."""
        self.daemon_up.set(1 if up else 0)
        self.refresh()

    def set_live(self, state: str, n: int) -> None:
        try:
            child = self._live[state]
        except KeyError:
            child = _lookup(self._live, state, "state", _label)
        child.set(n)

    def live_delta(self, state: str, delta: int) -> None:
        """Move the live-prefix gauge of `state` by +1/-1 (on entering/leaving the state)."""
        try:
            child = self._live[state]
        except KeyError:
            child = _lookup(self._live, state, "state", _label)
        child.inc(delta)

    def reregistered(self) -> None:
        self.reregistrations.inc()

    def late_reply(self, n: int = 1) -> None:
        self.late_replies.inc(n)

    def stale_release_dropped(self, n: int = 1) -> None:
        self.stale_releases.inc(n)

    def release_failed(self, what: str) -> None:
        """Count one owed release given up unpaid (`what`: one of RELEASES)."""
        children = self._releases_failed
        (children.get(what) or _lookup(children, what, "release", _label)).inc()

    def prepared_expired(self) -> None:
        self.prepared_expired_total.inc()

    def transfer_mode(self, mode: str) -> None:
        """Set at every registration: the chosen mode 1, the others 0."""
        if mode not in self._transfer:
            raise _unknown("transfer mode", mode, TRANSFER_MODES)
        for m, g in self._transfer.items():
            g.set(1 if m == mode else 0)

    def config_generation(self, n: int) -> None:
        self.config_gen.set(n)

    def config_reload_failed(self) -> None:
        self.config_reload_failures.inc()

    # ---- the operator's view (hook, factory) ----

    def queue_depth(self, which: str, n: int) -> None:
        """The hook's worker queue depth: `which` is "lookup" or "store"."""
        if which == "lookup":
            self.lookup_queue.set(n)
        elif which == "store":
            self.store_queue.set(n)
        else:
            raise _unknown("queue", which, ("lookup", "store"))

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

    # ---- reading back (tests, chaos harness) ----

    def snapshot(self) -> dict[str, float]:
        """Every sample in `registry` as {"name{label=value,...}": value}, labels sorted.

        `_created` timestamps are left out: they are not values to reconcile.
        """
        out: dict[str, float] = {}
        for family in self.registry.collect():
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
        return out

    def serve(self, host: str = "127.0.0.1", port: int = 0):
        """Start a /metrics server for this registry (see metrics.server)."""
        from lmcache_loadback.metrics.server import start_metrics_server
        return start_metrics_server(host=host, port=port, registry=self.registry)

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
