"""The `loadback_*` instruments of the daemon's L2 store, declared by `LoadbackMetrics`
(through this mixin, as `operator_view` does for the operator's view): the store as this
process sees it through its LOOKUPs (`orchestrator/l2.py`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge


class L2View:
    """`loadback_l2_*`, set by `orchestrator/l2.py` and the orchestrator's match."""

    def _declare_l2(self, reg) -> None:
        """The daemon's L2 store as this process sees it through its LOOKUPs
        (`orchestrator/l2.py`): stalled or not, how often, the misses it cost, and the fetch
        time per chunk the LOOKUP waits are derived from."""
        # livemax: one rank that sees the store stalled shows it.
        self.l2_state_gauge = Gauge("loadback_l2_state",
                                    "The daemon's L2 store: 0 delivers, 1 stalled (LOOKUPs are "
                                    "misses at once until a probe is answered).",
                                    registry=reg, multiprocess_mode="livemax")
        self.l2_stalls = Counter("loadback_l2_stalls_total",
                                 "Times the daemon's L2 store was found stalled: LOOKUPs in a "
                                 "row still fetching past their expected time while the "
                                 "daemon answered.", registry=reg)
        self.l2_fast_misses = Counter("loadback_l2_fast_misses_total",
                                      "LOOKUPs answered as a miss at once, without asking the "
                                      "daemon, because its L2 store is stalled (also counted "
                                      "in loadback_lookups_total{result=\"skipped\"}).",
                                      registry=reg)
        self.l2_fetch_seconds = Gauge("loadback_l2_fetch_seconds_per_chunk",
                                      "Moving estimate of the daemon's time to copy one chunk "
                                      "from its L2 store, from answered LOOKUPs (0: none "
                                      "measured yet): a LOOKUP's wait for L2 derives from it.",
                                      registry=reg, multiprocess_mode="livemax")

    def l2_state(self, stalled: bool) -> None:
        self.l2_state_gauge.set(1 if stalled else 0)

    def l2_stalled(self) -> None:
        self.l2_stalls.inc()

    def l2_fast_miss(self) -> None:
        self.l2_fast_misses.inc()

    def l2_fetch_estimate(self, seconds_per_chunk: float | None) -> None:
        """None (not measured yet) reads 0."""
        self.l2_fetch_seconds.set(seconds_per_chunk or 0.0)
