"""What a failed daemon call means, by table: (phase, error class) -> outcome (degrade reason,
breaker verdict, timeout counter, suspicion). Rows are tried in order, the first whose class
matches wins, so subclasses come before their bases.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmcache_loadback.connectors.errors import (
    ConnectorError,
    DaemonTimeout,
    PrefetchPending,
    ProtocolError,
    ShortRead,
)
from lmcache_loadback.connectors.retrieval import TransferBusy

from .states import DegradeReason


class LookupAbandoned(ConnectorError):
    """A LOOKUP whose answer was lost is being abandoned (its result waited for, its locks
    released: `Connector.abandon_lookup`): no other LOOKUP of the request may overlap
    that, so it is never retried."""

    retry_safe = False

    def __init__(self, cause: ConnectorError) -> None:
        super().__init__(f"lookup unanswered, abandoned: {cause}")
        self.cause = cause


@dataclass(frozen=True)
class Outcome:
    #: The prefix's degrade reason (None for store, which has no prefix).
    reason: DegradeReason | None
    #: What the breaker records (False: a failure toward opening it).
    breaker_ok: bool = False
    #: The op whose timeout counter moves (None: not a timeout).
    timeout_op: str | None = None
    #: The daemon may have dropped our registration: re-register on the next heartbeat.
    suspect: bool = False


#: (phase, error class, outcome). Read top-down; the first matching row wins.
FAILURES: list[tuple[str, type[ConnectorError], Outcome]] = [
    # The daemon answered every poll, only its copy from L2 outlived the wait: it is alive
    # (the L2 store's health is `L2Health`'s to judge, never the breaker's).
    ("lookup", PrefetchPending,
     Outcome(DegradeReason.LOOKUP_TIMEOUT, breaker_ok=True, timeout_op="lookup")),
    ("lookup", DaemonTimeout,
     Outcome(DegradeReason.LOOKUP_TIMEOUT, timeout_op="lookup", suspect=True)),
    ("lookup", ConnectorError, Outcome(DegradeReason.LOOKUP_ERROR)),
    ("retrieve", DaemonTimeout,
     Outcome(DegradeReason.RETRIEVE_TIMEOUT, timeout_op="retrieve", suspect=True)),
    # Not sent: the daemon is fine, only this range is another request's until its commit.
    ("retrieve", TransferBusy, Outcome(DegradeReason.TRANSFER_BUSY, breaker_ok=True)),
    ("retrieve", ShortRead, Outcome(DegradeReason.SHORT_READ, suspect=True)),
    ("retrieve", ProtocolError, Outcome(DegradeReason.CORRUPT_DATA, suspect=True)),
    ("retrieve", ConnectorError, Outcome(DegradeReason.RETRIEVE_ERROR, suspect=True)),
    # lmcache 0.5.6 drops an unregistered instance's transfers unanswered: a store is the
    # only call a TP rank that is not the leader makes, so its failure must be suspect too.
    ("store", DaemonTimeout, Outcome(None, timeout_op="store", suspect=True)),
    ("store", ConnectorError, Outcome(None, suspect=True)),
]


def classify(phase: str, exc: ConnectorError) -> Outcome:
    if isinstance(exc, LookupAbandoned):
        exc = exc.cause  # judged by what happened to the LOOKUP
    for row_phase, cls, outcome in FAILURES:
        if row_phase == phase and isinstance(exc, cls):
            return outcome
    raise KeyError(f"no failure row for phase {phase!r}")  # every phase ends in ConnectorError
