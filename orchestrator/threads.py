"""`WorkerThread`: one daemon thread an engine's own thread submits jobs to and never waits
on (the engines' LOOKUPs, `lookups.AsyncLookups`; SGLang's store worker, vLLM's store
thread). A worker outlives anything a job does: every job completes on every path, and a
thread that died all the same is counted and replaced where the engine's thread next touches
it (`ensure_alive`). In the core so that both engines share it (the core imports no engine).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

log = logging.getLogger("loadback.hook")


class WorkerThread:
    """`threads` daemon threads (one unless told) serving one queue; `_serve` completes every
    job it is given, on every path, and may run on several threads at once. A thread that
    dies all the same (anything past `_serve`'s handlers) is replaced where the engine's
    thread next touches the worker (`ensure_alive`), counted
    (`loadback_worker_thread_restarts_total`) and logged at ERROR the first time; jobs never
    run inline instead: the engine's thread (SGLang's scheduler, vLLM's forward loop) must
    never wait on the daemon. `depth` is exported whenever a job is queued or completes."""

    name = "loadback-worker"
    queue = "lookup"  # which depth series it sets (LoadbackMetrics.queue_depth)

    def __init__(self, orch, *, max_queued: int, threads: int = 1) -> None:
        if max_queued < 1:
            raise ValueError(f"{type(self).__name__} max_queued must be at least 1, "
                             f"got {max_queued}")
        if threads < 1:
            raise ValueError(f"{type(self).__name__} threads must be at least 1, got {threads}")
        self.max_queued = max_queued
        self.skipped = 0     # jobs refused: max_queued were held already
        self.orch = orch
        #: The orchestrator's LoadbackMetrics (None: an orchestrator that exports none).
        self.metrics = orch.metrics
        # The owner's submit refuses (counts a skip) at max_queued held jobs.
        self._q: queue.SimpleQueue = queue.SimpleQueue()  # bounded by the owner's max_queued
        self._lock = threading.Lock()
        self._closed = False
        self.depth = 0       # jobs submitted and not yet completed (queued or running)
        self.restarts = 0    # threads that died and were replaced
        self._threads = [self._start(i) for i in range(threads)]

    @property
    def _thread(self) -> threading.Thread:
        """The first thread (the only one unless `threads` said more)."""
        return self._threads[0]

    def _start(self, i: int) -> threading.Thread:
        name = self.name if i == 0 else f"{self.name}-{i}"
        t = threading.Thread(target=self._run, name=name, daemon=True)
        t.start()
        return t

    def ensure_alive(self) -> None:
        """The engine's thread (submit, poll): replace a thread that died; the jobs it left
        queued are served by the others and the new one (the one it was running was
        completed on its way out)."""
        if self._closed:
            return
        for i, t in enumerate(self._threads):
            if t.is_alive():
                continue
            self.restarts += 1
            if self.metrics is not None:
                self.metrics.worker_thread_restarted()
            if self.restarts == 1:
                log.error("loadback: the %s thread died (an exception got past its "
                          "handlers); a new one serves its queue", t.name)
            else:
                log.debug("loadback: the %s thread died again; restarted (%d times)",
                          t.name, self.restarts)
            self._threads[i] = self._start(i)

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
        for _ in self._threads:
            self._q.put(None)  # one stop per thread, behind the jobs queued
        end = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, end - time.monotonic()))

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
