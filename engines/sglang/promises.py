"""A request's promise from the daemon, and the STORE worker the scheduler thread submits to
and polls, never waits on (0.5.23's LOOKUPs run on the core's `AsyncLookups`). A worker
outlives anything a job does: every job completes on every path, and a thread that died all
the same is replaced where the scheduler thread next touches it (`WorkerThread.ensure_alive`).
Queue depths are exported as gauges.
"""

from __future__ import annotations

import logging
import queue
from array import array
from dataclasses import dataclass
from typing import Any

from lmcache_loadback.orchestrator.threads import WorkerThread

log = logging.getLogger("loadback.hook")


@dataclass(eq=False)
class Promise:
    """One request's answer from the daemon, the marker later passes are answered from."""

    request_id: str           # the orchestrator's id for this derivation
    token_ids: array          # the page-aligned key the LOOKUP saw (a copy)
    salt: str
    local_tokens: int         # device hit the promise was made against
    tokens: int = 0           # tokens to load beyond local_tokens (0: recompute / used)
    loaded: int = 0
    key: Any = None           # detached RadixKey snapshot for the node load_back attaches
    relookups: int = 0


@dataclass(eq=False)
class StoreJob:
    """A finished request's whole chunks on their way to the daemon. The tree node holding
    their slots stays locked until the scheduler thread sees the job done."""

    handle: Any
    request_id: str
    token_ids: list
    slots: Any
    salt: str
    node: Any                 # None once the tree it belongs to was reset
    receipt: Any              # the tree lock's release receipt (scheduler thread only)
    finish: bool = False      # end the daemon session after the store
    stored: bool = False


class StoreWorker(WorkerThread):
    """One thread per cache running `store()` (bounded by deadlines.store_ms) and the session
    end behind it, so a finished request never holds the scheduler thread. At most
    `max_queued` stores wait or run at once: each holds a tree lock on its slots, so an
    unbounded queue behind a slow daemon would leave nothing in the KV pool to evict."""

    name = "loadback-store"
    queue = "store"

    def __init__(self, orch, *, max_queued: int = 64) -> None:
        # A job is admitted only below max_queued (`admitted`, counted until drained).
        self.completed: queue.SimpleQueue = queue.SimpleQueue()  # bounded by max_queued
        #: Stores admitted and not yet drained (scheduler thread only). A store that went
        #: through keeps its tree lock until the scheduler thread drains it, so it counts
        #: until then; and since only the scheduler thread moves this count, at points every
        #: TP rank passes in one order, every rank admits the same stores (`depth` and
        #: `completed` move on the store thread, at a different moment on each rank).
        self.admitted = 0
        super().__init__(orch, max_queued=max_queued)
        if self.metrics is not None:
            self.metrics.store_queue_limit.set(max_queued)

    def _held(self) -> int:
        return self.admitted

    def _count_skipped(self) -> None:
        if self.metrics is not None:
            self.metrics.store_skipped()

    def submit(self, job: StoreJob) -> None:
        self.admitted += 1
        self._queue(job)

    def drain(self, n: int) -> list[StoreJob]:
        """Scheduler thread: the first `n` completed stores (n at most `completed.qsize()`),
        no longer counted against the bound."""
        jobs = [self.completed.get_nowait() for _ in range(n)]
        self.admitted -= len(jobs)
        return jobs

    def finish_after(self, job: StoreJob) -> bool:
        """End the session once the store is through; False when it already is (the caller
        ends it)."""
        with self._lock:
            if job.stored:
                return False
            job.finish = True
            return True

    def _serve(self, job: StoreJob) -> None:
        try:
            self.orch.store(job.request_id, job.token_ids, job.slots, cache_salt=job.salt)
        except Exception:  # counted by the orchestrator; the worker carries on
            log.exception("store %s failed", job.request_id)
        finally:
            # Whatever happened, the job completes: its node is unlocked at the next pass.
            with self._lock:
                job.stored = True
                finish = job.finish
            try:
                if finish:
                    self._call("ending the session of", self.orch.finish, job.request_id)
            finally:
                self._completed()
                self.completed.put(job)
