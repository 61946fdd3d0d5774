"""A request's promise from the daemon, and the worker thread that LOOKUPs for 0.5.23.

Who uses it: LoadBackRadixCache only. The worker is the one place a LOOKUP runs off the
scheduler thread; the scheduler thread only submits and polls (`resolve`), never waits.
"""

from __future__ import annotations

import logging
import queue
import threading
from array import array
from dataclasses import dataclass, field
from typing import Any

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


class LookupWorker:
    """One thread per cache running `match()`: the scheduler thread only polls."""

    def __init__(self, orch) -> None:
        self.orch = orch
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="loadback-lookup", daemon=True)
        self._thread.start()

    def submit(self, job: Lookup) -> None:
        self._q.put(job)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while (job := self._q.get()) is not None:
            p = job.promise
            with self._lock:
                skip = job.abandoned
            tokens = 0
            if not skip:
                try:
                    tokens = promised_tokens(self.orch.match(
                        p.request_id, p.token_ids, local_hit_tokens=p.local_tokens,
                        cache_salt=p.salt))
                except Exception:  # a daemon failure must not kill the worker
                    log.exception("lookup %s failed", p.request_id)
            with self._lock:
                job.tokens = tokens
                late = job.abandoned
                job.done.set()
            if late:
                self.orch.abort(p.request_id)  # settled after its deadline: release it

    def resolve(self, job: Lookup, now: float) -> int | None:
        """Tokens promised, or None while the LOOKUP may still answer in time."""
        with self._lock:
            if job.abandoned:
                return 0  # a miss for good: the worker releases whatever it got
            if job.done.is_set():
                return job.tokens
            if now < job.deadline:
                return None
            job.abandoned = True
            return 0


def promised_tokens(result) -> int:
    return int(getattr(result, "tokens", result))


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


class StoreWorker:
    """One thread per cache running `store()` (bounded by deadlines.store_ms) and the session
    end behind it, so a finished request never holds the scheduler thread."""

    def __init__(self, orch) -> None:
        self.orch = orch
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.completed: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="loadback-store", daemon=True)
        self._thread.start()

    def submit(self, job: StoreJob) -> None:
        self._q.put(job)

    def finish_after(self, job: StoreJob) -> bool:
        """End the session once the store is through; False when it already is (the caller
        ends it)."""
        with self._lock:
            if job.stored:
                return False
            job.finish = True
            return True

    def close(self, timeout_s: float) -> None:
        self._q.put(None)
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while (job := self._q.get()) is not None:
            try:
                self.orch.store(job.request_id, job.token_ids, job.slots, cache_salt=job.salt)
            except Exception:  # counted by the orchestrator; the worker carries on
                log.exception("store %s failed", job.request_id)
            with self._lock:
                job.stored = True
                finish = job.finish
            if finish:
                self.orch.finish(job.request_id)
            self.completed.put(job)
