"""`AsyncLookups`: the engines' LOOKUP (the orchestrator's `match`) on a worker thread, so an
engine's own thread (SGLang 0.5.23's scheduler, vLLM's) submits and polls and never waits on
the daemon. Each LOOKUP is bounded by its deadline: answered, or `None` while it may still
come in time, a miss for good once it is late; a late answer is released by the worker
thread (abort), never read. The queue is bounded (a full queue is a counted skip at once) and
its thread liveness-checked (`WorkerThread`). What each engine keys a LOOKUP by and how it
uses the answer stays in the engine (SGLang's promises, vLLM's asks).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from .threads import WorkerThread

log = logging.getLogger("loadback.hook")


@dataclass(eq=False)
class Lookup:
    """One LOOKUP handed to the worker; resolved by the worker or by its deadline. Its fields
    move under the `AsyncLookups` lock; `done` is set once the worker is through with it."""

    request_id: str           # the orchestrator's id (its daemon session)
    token_ids: Sequence[int]
    local_tokens: int         # the engine's own hit the LOOKUP is made against
    salt: str
    deadline: float           # time.monotonic()
    record: Any = None        # what the engine keeps beside it (SGLang: its Promise)
    tokens: int = 0           # the daemon's answer, a late one too: load what `answer` says
    done: threading.Event = field(default_factory=threading.Event)
    abandoned: bool = False   # a miss before its answer came: the worker releases a late one
    skipped: bool = False     # refused at submit (the queue was full): a miss, nothing sent


class AsyncLookups(WorkerThread):
    """One thread running `match()`; the engine's thread only submits, polls and abandons.
    `end_misses`: the worker ends a miss's session as soon as it is answered (an engine that
    releases only its hits: vLLM's scheduler, whose LOOKUPs the orchestrator hands off)."""

    queue = "lookup"

    def __init__(self, orch, *, max_queued: int = 256, name: str = "loadback-lookup",
                 end_misses: bool = False, threads: int = 1) -> None:
        """`threads`: matches run at once (`lookup_threads`): several requests' LOOKUPs and
        prepares then overlap on the daemon's two pools and with this process's own work."""
        self.name = name
        self.end_misses = end_misses
        self.expired = 0     # LOOKUPs never sent: past their deadline or abandoned when dequeued
        super().__init__(orch, max_queued=max_queued, threads=threads)

    def _count_skipped(self) -> None:
        if self.metrics is not None:  # the request goes without a LOOKUP: it recomputes
            self.metrics.observe_lookup(None, "skipped")

    def submit(self, request_id: str, token_ids: Sequence[int], local_tokens: int, salt: str,
               deadline: float, *, record: Any = None) -> Lookup:
        """Queue a LOOKUP. When `max_queued` are held already (queued or running) it is
        answered at once as a miss (`skipped`, counted) and nothing reaches the daemon."""
        job = Lookup(request_id, token_ids, local_tokens, salt, deadline, record)
        if not self.has_room(request_id):
            job.skipped = job.abandoned = True
            job.done.set()
            return job
        self._queue(job)
        return job

    def answer(self, job: Lookup, now: float | None = None) -> int | None:
        """Tokens found beyond the local hit, or None while the LOOKUP may still answer in
        time; at its deadline a miss for good (the worker releases a late answer)."""
        self.ensure_alive()
        now = time.monotonic() if now is None else now
        with self._lock:
            if job.abandoned:
                return 0
            if job.done.is_set():
                return job.tokens
            if now < job.deadline:
                return None
            job.abandoned = True
        log.debug("%s: LOOKUP not answered within its deadline: recompute", job.request_id)
        return 0

    def abandon(self, job: Lookup) -> bool:
        """Nobody will read the answer (called once, as the engine forgets the LOOKUP). True:
        the worker answered in time and the caller releases what the LOOKUP holds; False:
        nothing is the caller's to release (the worker releases an answer still to come
        itself, or the LOOKUP was skipped, never sent or resolved as a miss before)."""
        with self._lock:
            if job.done.is_set():
                return not job.abandoned
            job.abandoned = True
            return False

    def _serve(self, job: Lookup) -> None:
        tokens, ran = 0, False
        try:
            with self._lock:
                # Past its deadline the answer is a miss whatever the daemon says: no
                # LOOKUP (nor prepare_retrieve) pins the daemon's memory for it.
                skip = job.abandoned or time.monotonic() >= job.deadline
                self.expired += skip
            if skip:
                log.debug("lookup %s not sent: past its deadline or dropped", job.request_id)
            else:
                ran = True
                tokens = self.orch.match(job.request_id, job.token_ids,
                                         local_hit_tokens=job.local_tokens,
                                         cache_salt=job.salt).tokens
        except Exception:  # a daemon failure must not kill the worker: a miss, recomputed
            log.exception("lookup %s failed", job.request_id)
        finally:
            self._completed()  # before `done`: a caller that saw it done sees the depth too
            with self._lock:  # one step: whoever abandons it after this releases it
                late = ran and job.abandoned
                job.tokens = tokens
                job.done.set()
            if late:  # answered after its deadline or its drop: this thread releases it
                self._call("releasing late lookup", self.orch.abort, job.request_id)
            elif ran and tokens == 0 and self.end_misses:
                self._call("ending the session of missed lookup", self.orch.finish,
                           job.request_id)
