"""The closed label sets of the `loadback_*` instruments and the checks that keep them closed.

An unknown label value raises `UnknownLabelError` instead of creating a new series; enums
are accepted as their `.value`.
"""

from __future__ import annotations

import os
from enum import Enum
from typing import Iterable

# Log-spaced 0.1 ms .. 60 s (20 buckets); 0.75 refines p99 around the ~0.64 s alert threshold.
DURATION_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
)
LOOKUP_RESULTS: tuple[str, ...] = ("hit", "miss", "error", "skipped")
BREAKER_STATES: dict[str, int] = {"closed": 0, "half_open": 1, "open": 2}
TRANSFER_MODES: tuple[str, ...] = ("shm", "pickle")
#: The lmcache 0.5.6 daemon's wire operations (connectors/wire.py `OP_PLACES`, which a test
#: keeps equal): the `op` of loadback_daemon_call_duration_seconds.
DAEMON_CALLS: tuple[str, ...] = (
    "noop", "get_chunk_size", "register_kv_cache_engine_driven_context",
    "unregister_kv_cache_engine_driven_context", "prepare_store", "commit_store",
    "prepare_retrieve", "commit_retrieve", "store", "retrieve", "lookup",
    "query_prefetch_status", "wait_prefetch_status", "free_lookup_locks", "end_session", "ping",
    "clear",
)
#: The releases the daemon can be owed (the `what` of loadback_releases_failed_total).
RELEASES: tuple[str, ...] = ("free_locks", "abandon_lookup", "commit_retrieve", "end_session",
                             "commit_store")
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


def label_of(value: object) -> str:
    # Orchestrator enums may be passed as-is; their .value is the label.
    return str(value.value) if isinstance(value, Enum) else str(value)


def label_set(values: Iterable[object], what: str) -> tuple[str, ...]:
    out = tuple(dict.fromkeys(label_of(v) for v in values))
    if not out:
        raise ValueError(f"LoadbackMetrics needs at least one {what}")
    return out


def unknown_label(what: str, value: object, known: Iterable[object]) -> UnknownLabelError:
    return UnknownLabelError(f"unknown {what} {value!r}; known: {sorted(map(str, known))}")


def find_child(children: dict, key, what: str, normalize):
    """Slow path after a dict miss: accept enums, else raise UnknownLabelError."""
    norm = normalize(key)
    if norm in children:
        return children[norm]
    raise unknown_label(what, key, children)
