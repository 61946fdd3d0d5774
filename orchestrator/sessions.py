"""The daemon sessions this rank's calls opened, per request, and their end: a debt paid once
the daemon answered every call of the request (a call served after the end would re-create
the session)."""

from __future__ import annotations

import threading

from lmcache_loadback.connectors.base import Connector

from .link import DaemonLink


class Sessions:
    def __init__(self, connector: Connector, link: DaemonLink, lock: threading.RLock, *,
                 store_suffix: str) -> None:
        self._connector = connector
        self._link = link
        self._lock = lock  # the orchestrator's: a release takes prefix and sessions at once
        self._store_suffix = store_suffix
        self._epochs: dict[str, int] = {}  # session -> daemon epoch its last call went to

    def store_id(self, request_id: str) -> str:
        """The daemon session a STORE runs under. A TP rank other than the leader stores
        under its own: ending it can then never remove the group's lookup session while
        the leader still owes that lookup a release."""
        return request_id + self._store_suffix

    def touch(self, session_id: str, epoch: int) -> None:
        """A call under `session_id` goes to daemon incarnation `epoch`."""
        with self._lock:
            self._epochs[session_id] = epoch

    def take(self, request_id: str) -> list[tuple[str, int]]:
        """Stop tracking the request's sessions (its own and its store's): (id, epoch) of
        each that a call opened; a second take finds nothing."""
        with self._lock:
            return [(sid, self._epochs.pop(sid)) for sid in
                    (request_id, self.store_id(request_id)) if sid in self._epochs]

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._epochs)

    def end(self, taken: list[tuple[str, int]]) -> None:
        """Owe the end of each session taken, to the incarnation its last call went to; a
        call the daemon has not answered yet would re-create the session when served, so
        the end waits until every call of the request is answered or dropped."""
        for sid, epoch in taken:
            self._link.owe("end_session", sid, epoch,
                           lambda t, sid=sid: self._connector.end_session(sid, t),
                           idempotent=True, ready=lambda sid=sid: self._answered(sid))

    def _answered(self, session_id: str) -> bool:
        return self._connector.unanswered(session_id) == 0
