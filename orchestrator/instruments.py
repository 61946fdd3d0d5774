"""The product's metric label sets, from the state table and enums, in one place:
`product_metrics()` builds the `LoadbackMetrics` the orchestrator, the demo, the chaos harness
and the metric tests use, so every series they read is one production pre-creates (`metrics/`
never imports `orchestrator`, so the label values are handed to it from here).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from lmcache_loadback.metrics import LoadbackMetrics

from .states import DegradeReason, PrefixState, transition_pairs

__all__ = ["OPS", "REFUSALS", "label_sets", "product_metrics"]

#: Daemon operations that are timed out and retried (the `op` label of retries/timeouts).
OPS: tuple[str, ...] = ("lookup", "retrieve", "store", "free_locks", "end_session", "ping",
                        "register")
#: Why a daemon is refused at registration (`loadback_daemon_refused{reason}`).
REFUSALS: tuple[str, ...] = ("chunk_size", "cpu_workers", "hash_algorithm", "model_name")


def label_sets() -> dict:
    """The closed label sets `LoadbackMetrics` pre-creates: states, reasons, ops, transitions."""
    return {
        "states": tuple(s.value for s in PrefixState),
        "reasons": tuple(r.value for r in DegradeReason),
        "ops": OPS,
        "transitions": tuple(transition_pairs()),
    }


def product_metrics(registry: CollectorRegistry | None = None) -> LoadbackMetrics:
    """A `LoadbackMetrics` with exactly the label sets the orchestrator uses."""
    m = LoadbackMetrics(registry=registry, **label_sets())
    for reason in REFUSALS:
        m.daemon_refused(reason, False)
    return m
