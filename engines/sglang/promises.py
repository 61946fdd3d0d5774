"""A request's promise from the daemon, and the worker threads (LOOKUP for 0.5.23, STORE) the
scheduler thread submits to and polls, never waits on. A worker outlives anything a job does:
every job completes on every path, and a thread that died all the same is replaced where the
scheduler thread next touches it (`ensure_alive`). Queue depths are exported as gauges.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from .contract import Orchestrator

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
class Lookup:
    """A LOOKUP handed to the worker (0.5.23); resolved by the worker or by its deadline."""

    promise: Promise
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    tokens: int = 0
    abandoned: bool = False   # resolved as a miss at its deadline: the worker releases it


class _Worker:
    """One daemon thread serving a queue; `_serve` completes every job it is given, on every
    path. A thread that dies all the same (a BaseException past every handler) is replaced
    where the scheduler thread next touches the worker (`ensure_alive`), logged at ERROR the
    first time; jobs never run inline instead: the scheduler thread must never wait on the
    daemon. `depth` is exported whenever a job is queued or completes."""

    name = "loadback-worker"
    queue = "lookup"  # which depth series it sets (LoadbackMetrics.queue_depth)

    def __init__(self, orch: Orchestrator, *, max_queued: int) -> None:
        if max_queued < 1:
            raise ValueError(f"{type(self).__name__} max_queued must be at least 1, "
                             f"got {max_queued}")
        self.max_queued = max_queued
        self.skipped = 0     # jobs refused: max_queued were held already
        self.orch = orch
        #: The orchestrator's LoadbackMetrics (None: an orchestrator that exports none).
        self.metrics = orch.metrics
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self.depth = 0       # jobs submitted and not yet completed (queued or running)
        self.restarts = 0    # threads that died and were replaced
        self._thread = self._start()

    def _start(self) -> threading.Thread:
        t = threading.Thread(target=self._run, name=self.name, daemon=True)
        t.start()
        return t

    def ensure_alive(self) -> None:
        """Scheduler thread (submit, poll): replace a thread that died; the jobs it left
        queued are served by the new one (the one it was running was completed on its way
        out)."""
        if self._closed or self._thread.is_alive():
            return
        self.restarts += 1
        if self.restarts == 1:
            log.error("loadback: the %s thread died (an exception got past its handlers); "
                      "a new one serves its queue", self.name)
        else:
            log.debug("loadback: the %s thread died again; restarted (%d times)", self.name,
                      self.restarts)
        self._thread = self._start()

    def _held(self) -> int:
        """Jobs that still hold what they were given (queued or running)."""
        return self.depth

    def has_room(self, request_id: str) -> bool:
        """Scheduler thread, before it builds a job: False (counted, logged at DEBUG) when
        `max_queued` jobs are held already; the caller then goes without (recomputes)."""
        held = self._held()
        if held < self.max_queued:
            return True
        self.skipped += 1
        self._count_skipped()
        log.debug("%s for %s skipped: %d jobs already held", self.queue, request_id, held)
        return False

    def _count_skipped(self) -> None:
        raise NotImplementedError

    def _queue(self, job) -> None:
        self.ensure_alive()
        with self._lock:
            self.depth += 1
            self._export_depth()
        self._q.put(job)

    def _completed(self) -> None:
        with self._lock:
            self.depth -= 1
            self._export_depth()

    def _export_depth(self) -> None:
        """Under _lock: the gauge moves in the order `depth` does."""
        if self.metrics is not None:
            self.metrics.queue_depth(self.queue, self.depth)

    def close(self, timeout_s: float = 5.0) -> None:
        self._closed = True
        self._q.put(None)
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while (job := self._q.get()) is not None:
            self._serve(job)

    def _serve(self, job) -> None:
        raise NotImplementedError

    def _call(self, what: str, fn, request_id: str) -> None:
        try:
            fn(request_id)
        except Exception:  # a daemon failure or a bug: the worker carries on
            log.exception("%s %s failed", what, request_id)


class LookupWorker(_Worker):
    """One thread per cache running `match()`: the scheduler thread only polls."""

    name = "loadback-lookup"

    def __init__(self, orch, *, max_queued: int = 256) -> None:
        super().__init__(orch, max_queued=max_queued)
        self.expired = 0     # jobs dropped at dequeue, past their deadline or abandoned

    def _count_skipped(self) -> None:
        if self.metrics is not None:  # the request goes without a LOOKUP: it recomputes
            self.metrics.observe_lookup(None, "skipped")

    def submit(self, job: Lookup) -> None:
        self._queue(job)

    def _serve(self, job: Lookup) -> None:
        p = job.promise
        tokens, ran = 0, False
        try:
            with self._lock:
                # Past its deadline the answer is a miss whatever the daemon says: no
                # LOOKUP (nor prepare_retrieve) pins the daemon's memory for it.
                skip = job.abandoned or time.monotonic() >= job.deadline
            if skip:
                self.expired += 1
                log.debug("lookup %s not sent: past its deadline or dropped", p.request_id)
            else:
                ran = True
                tokens = self.orch.match(p.request_id, p.token_ids,
                                         local_hit_tokens=p.local_tokens,
                                         cache_salt=p.salt).tokens
        except Exception:  # a daemon failure must not kill the worker
            log.exception("lookup %s failed", p.request_id)
        finally:
            with self._lock:
                job.tokens = tokens
                late = ran and job.abandoned
                job.done.set()
            self._completed()
            if late:  # answered after its deadline: this thread releases it
                self._call("releasing late lookup", self.orch.abort, p.request_id)

    def resolve(self, job: Lookup, now: float) -> int | None:
        """Tokens promised, or None while the LOOKUP may still answer in time."""
        self.ensure_alive()
        with self._lock:
            if job.abandoned:
                return 0  # a miss for good: the worker releases whatever it got
            if job.done.is_set():
                return job.tokens
            if now < job.deadline:
                return None
            job.abandoned = True
            return 0


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


class StoreWorker(_Worker):
    """One thread per cache running `store()` (bounded by deadlines.store_ms) and the session
    end behind it, so a finished request never holds the scheduler thread. At most
    `max_queued` stores wait or run at once: each holds a tree lock on its slots, so an
    unbounded queue behind a slow daemon would leave nothing in the KV pool to evict."""

    name = "loadback-store"
    queue = "store"

    def __init__(self, orch, *, max_queued: int = 64) -> None:
        self.completed: queue.SimpleQueue = queue.SimpleQueue()
        super().__init__(orch, max_queued=max_queued)
        if self.metrics is not None:
            self.metrics.store_queue_limit.set(max_queued)

    def _held(self) -> int:
        # A store that went through keeps its tree lock until the scheduler thread drains
        # it (with TP > 1, until every rank finished it): it counts until then.
        return self.depth + self.completed.qsize()

    def _count_skipped(self) -> None:
        if self.metrics is not None:
            self.metrics.store_skipped()

    def submit(self, job: StoreJob) -> None:
        self._queue(job)

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
