"""The L2 canary's series (`loadback_l2_canary_*`): whether what the daemon stores reaches its
L2 store, as the canary (orchestrator/l2_canary.py) last found it. Declared with the other
instruments by `LoadbackMetrics`; `loadback status` and the LoadbackL2CanaryFailing alert
read them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from .labels import unknown_label

#: A check's result: `ok` loaded back from L2 byte-exact; `lost` stored but not (wholly) in
#: L2; `wrong_bytes` loaded other bytes; `timeout` a call past the check's deadline (L2 or the
#: daemon hangs); `unchecked` the check could not be made (daemon or its admin API not
#: answering, keys this process cannot compute): neither a success nor an L2 failure.
CANARY_RESULTS: tuple[str, ...] = ("ok", "lost", "wrong_bytes", "timeout", "unchecked")
#: The results that count as L2 failures (`loadback_l2_canary_consecutive_failures`).
CANARY_FAILURES = frozenset({"lost", "wrong_bytes", "timeout"})


class L2CanaryView:
    """Mixed into `LoadbackMetrics` (its `multiprocess`, `wall_clock`)."""

    def _declare_l2_canary(self, reg: CollectorRegistry | None) -> None:
        c_checks = Counter("loadback_l2_canary_checks_total",
                           "L2 canary checks by result (ok, lost, wrong_bytes, timeout, "
                           "unchecked).", ["result"], registry=reg)
        self._canary_checks = {r: c_checks.labels(result=r) for r in CANARY_RESULTS}
        self.canary_last_ok = Gauge(
            "loadback_l2_canary_last_success_timestamp_seconds",
            "Unix time the L2 canary last loaded its marker back from L2 byte-exact (0: "
            "never).", registry=reg, multiprocess_mode="livemax")
        self.canary_failures = Gauge(
            "loadback_l2_canary_consecutive_failures",
            "L2 canary checks in a row that were lost, wrong_bytes or timeout (0 after an ok; "
            "unchecked leaves it).", registry=reg, multiprocess_mode="livemax")
        self.canary_interval = Gauge(
            "loadback_l2_canary_interval_seconds",
            "The L2 canary's period; 0 while it does not run (l2.canary_interval_ms 0, no "
            "mp_http_port, or a daemon without an L2 adapter).", registry=reg,
            multiprocess_mode="livemax")

    def l2_canary_checked(self, result: str) -> None:
        """Count one canary check; an ok stamps the time and ends a run of failures."""
        child = self._canary_checks.get(result)
        if child is None:
            raise unknown_label("canary result", result, CANARY_RESULTS)
        child.inc()
        if result == "ok":
            self.canary_last_ok.set(self.wall_clock())
            self.canary_failures.set(0)
        elif result in CANARY_FAILURES:
            self.canary_failures.inc()

    def l2_canary_running(self, interval_s: float) -> None:
        self.canary_interval.set(interval_s)
