"""Every `loadback_*` Prometheus instrument, declared in one place (`LoadbackMetrics`).

The orchestrator calls its small methods on every state change (dict lookups and `inc()`);
`metrics.server` serves its registry; tests and the chaos harness reconcile `snapshot()`.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import multiprocess

from .labels import (
    BREAKER_STATES,
    DAEMON_CALLS,
    DURATION_BUCKETS,
    LOADED_REASON,
    LOOKUP_RESULTS,
    OUTCOME_STATES,
    RELEASES,
    STORE_QUEUE_LIMIT,
    TRANSFER_MODES,
    UnknownLabelError,
    find_child,
    label_of,
    label_set,
    multiprocess_enabled,
    unknown_label,
)
from .l2_canary import CANARY_RESULTS, L2CanaryView
from .l2_view import L2View
from .operator_view import OperatorView, _Refresher

__all__ = [
    "LoadbackMetrics",
    "UnknownLabelError",
    "DURATION_BUCKETS",
    "LOOKUP_RESULTS",
    "BREAKER_STATES",
    "DAEMON_CALLS",
    "OUTCOME_STATES",
    "LOADED_REASON",
    "RELEASES",
    "TRANSFER_MODES",
    "multiprocess_enabled",
    "STORE_QUEUE_LIMIT",
    "CANARY_RESULTS",
]


class LoadbackMetrics(OperatorView, L2CanaryView, L2View):
    """All `loadback_*` instruments, with every labelled child pre-created.

    Label values come from closed sets given to `__init__` (the orchestrator passes its own
    enums' values, so this package never imports `orchestrator`): absent series read 0 and an
    unknown label value raises `UnknownLabelError` instead of creating a new series.
    """

    def __init__(
        self,
        *,
        states: Sequence[str],
        reasons: Sequence[str],
        ops: Sequence[str],
        registry: CollectorRegistry | None = None,
        transitions: Sequence[tuple[str, str]] | None = None,
    ) -> None:
        self.states = label_set(states, "state")
        self.reasons = label_set(reasons, "reason")
        self.ops = label_set(ops, "op")
        self.multiprocess = multiprocess_enabled()
        #: Wall clock of `loadback_last_degraded_timestamp_seconds` (tests pin it).
        self.wall_clock: Callable[[], float] = time.time
        self._init_watch()
        reg = self._setup_registry(registry)
        # Label names are declared sorted so exposition matches Prometheus' canonical order.
        self._declare_outcomes(reg, transitions)
        self._declare_daemon_calls(reg)
        self._declare_daemon_state(reg)
        self._declare_l2(reg)
        self._declare_operator_view(reg)
        self._declare_l2_canary(reg)

    def _setup_registry(self, registry: CollectorRegistry | None) -> CollectorRegistry | None:
        """Set `self.registry`; returns the registry instruments register in (None: none).

        Multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` set before prometheus_client is
        imported): instruments are not registered anywhere (prometheus_client writes them to
        mmap files) and `registry` is a read-only view through `MultiProcessCollector`. Use
        one `LoadbackMetrics` per process in that mode: two would overwrite each other's files.
        """
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
        return reg

    def _declare_outcomes(self, reg, transitions) -> None:
        """Transitions, terminal outcomes, recomputed and loaded tokens and bytes."""
        c_trans = Counter("loadback_prefix_transitions_total",
                          "Prefix state-machine transitions.", ["dst", "src"], registry=reg)
        pairs = (itertools.product(self.states, self.states) if transitions is None
                 else [(label_of(s), label_of(d)) for s, d in transitions])
        self._transition: dict[tuple[str, str], Counter] = {}
        for src, dst in pairs:
            if src not in self.states or dst not in self.states:
                raise unknown_label("transition state", (src, dst), self.states)
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

    def _declare_daemon_calls(self, reg) -> None:
        """LOOKUPs and RETRIEVEs, retries and timeouts by op."""
        c_lookups = Counter("loadback_lookups_total", "LOOKUPs by result.", ["result"], registry=reg)
        self._lookups = {r: c_lookups.labels(result=r) for r in LOOKUP_RESULTS}
        # A skipped LOOKUP degrades no prefix: during an outage this is the last refusal.
        self.last_skipped = Gauge("loadback_last_skipped_timestamp_seconds",
                                  "Unix time a LOOKUP was last skipped (breaker open, not "
                                  "registered or L2 stalled; 0: never).", registry=reg,
                                  multiprocess_mode="livemax")
        self.lookup_duration = Histogram("loadback_lookup_duration_seconds",
                                         "LOOKUP latency (hit, miss, error; skipped ones are not timed).",
                                         buckets=DURATION_BUCKETS, registry=reg)
        self.retrieve_duration = Histogram("loadback_retrieve_duration_seconds",
                                           "RETRIEVE latency including retries, per prefix.",
                                           buckets=DURATION_BUCKETS, registry=reg)

        h_call = Histogram("loadback_daemon_call_duration_seconds",
                           "Each daemon call answered in time, by wire operation: from its "
                           "send to its answer (where a request's match and load spend it).",
                           ["op"], buckets=DURATION_BUCKETS, registry=reg)
        self._call_duration = {c: h_call.labels(op=c) for c in DAEMON_CALLS}
        c_retries = Counter("loadback_retries_total", "Retried daemon operations.", ["op"], registry=reg)
        c_timeouts = Counter("loadback_timeouts_total", "Daemon operations past their deadline.",
                             ["op"], registry=reg)
        self._retries = {o: c_retries.labels(op=o) for o in self.ops}
        self._timeouts = {o: c_timeouts.labels(op=o) for o in self.ops}

    def _declare_daemon_state(self, reg) -> None:
        """The breaker, the daemon's liveness, live prefixes, registrations, late replies,
        stale and failed releases, the transfer mode, expired prepares, the config."""
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
        self.worker_thread_restarts_total = Counter(
            "loadback_worker_thread_restarts_total",
            "Engine worker threads (LOOKUP, store) that died, something having got past their "
            "handlers, and were replaced (the log has one ERROR line, the first time).",
            registry=reg)
        self.leases_expired_total = Counter(
            "loadback_leases_expired_total",
            "LOOKUPs whose read locks outlived lease_max_age_ms unreleased: forfeited, never "
            "freed (the daemon's read TTL may have given them to another reader).",
            registry=reg)
        # livemin: a rank still on an old config shows as the lower generation.
        self.config_gen = Gauge("loadback_config_generation", "Generation of the config in effect.",
                                registry=reg, multiprocess_mode="livemin")
        self.config_reload_failures = Counter("loadback_config_reload_failures_total",
                                              "Config reloads rejected (the previous config stays).",
                                              registry=reg)

    # ---- hot-path methods (called by the orchestrator) ----

    def transition(self, src: str, dst: str) -> None:
        """Count one state-machine transition src -> dst (both from `states`)."""
        key = (src, dst)
        try:
            child = self._transition[key]
        except KeyError:
            child = find_child(self._transition, key, "transition",
                               lambda k: (label_of(k[0]), label_of(k[1])))
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
            child = find_child(self._outcome, key, "outcome (state, reason)",
                               lambda k: (label_of(k[0]), label_of(k[1])))
        child.inc()
        if label_of(key[0]) != "loaded":
            self._last_degraded[label_of(key[1])].set(self.wall_clock())
        if promised_tokens:
            self.promised_tokens.inc(promised_tokens)
            if label_of(key[0]) != "loaded":
                self._recomputed[label_of(key[1])].inc(promised_tokens)
        if loaded_tokens:
            self.loaded_tokens.inc(loaded_tokens)
        if loaded_bytes:
            self.loaded_bytes.inc(loaded_bytes)

    def observe_lookup(self, seconds: float | None, result: str) -> None:
        """Count a LOOKUP by result; time it unless it was skipped (breaker open, no daemon)."""
        try:
            child = self._lookups[result]
        except KeyError:
            child = find_child(self._lookups, result, "lookup result", label_of)
        child.inc()
        if result == "skipped":
            self.last_skipped.set(self.wall_clock())
        elif seconds is not None:
            self.lookup_duration.observe(seconds)

    def observe_retrieve(self, seconds: float) -> None:
        """Time one prefix's RETRIEVE phase (all attempts), whatever its outcome."""
        self.retrieve_duration.observe(seconds)

    def daemon_call(self, op: str, seconds: float) -> None:
        """Time one call the daemon answered in time (`op`: one of `DAEMON_CALLS`)."""
        try:
            child = self._call_duration[op]
        except KeyError:
            child = find_child(self._call_duration, op, "daemon call", label_of)
        child.observe(seconds)

    def retry(self, op: str) -> None:
        try:
            child = self._retries[op]
        except KeyError:
            child = find_child(self._retries, op, "op", label_of)
        child.inc()

    def timeout(self, op: str) -> None:
        try:
            child = self._timeouts[op]
        except KeyError:
            child = find_child(self._timeouts, op, "op", label_of)
        child.inc()

    def breaker(self, state_name: str) -> None:
        """Set the breaker gauge; count a transition only when the state actually changes."""
        name = label_of(state_name)
        if name not in BREAKER_STATES:
            raise unknown_label("breaker state", state_name, BREAKER_STATES)
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
            child = find_child(self._live, state, "state", label_of)
        child.set(n)

    def live_delta(self, state: str, delta: int) -> None:
        """Move the live-prefix gauge of `state` by +1/-1 (on entering/leaving the state)."""
        try:
            child = self._live[state]
        except KeyError:
            child = find_child(self._live, state, "state", label_of)
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
        (children.get(what) or find_child(children, what, "release", label_of)).inc()

    def prepared_expired(self) -> None:
        self.prepared_expired_total.inc()

    def worker_thread_restarted(self) -> None:
        self.worker_thread_restarts_total.inc()

    def lease_expired(self) -> None:
        self.leases_expired_total.inc()

    def transfer_mode(self, mode: str) -> None:
        """Set at every registration: the chosen mode 1, the others 0."""
        if mode not in self._transfer:
            raise unknown_label("transfer mode", mode, TRANSFER_MODES)
        for m, g in self._transfer.items():
            g.set(1 if m == mode else 0)

    def config_generation(self, n: int) -> None:
        self.config_gen.set(n)

    def config_reload_failed(self) -> None:
        self.config_reload_failures.inc()

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
