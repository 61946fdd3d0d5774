"""The core's asynchronous LOOKUP (`orchestrator.lookups.AsyncLookups`), which SGLang's
backend and vLLM's scheduler both submit to: a bounded queue, deadlines, late answers
released by the worker thread, a replaced thread. Stepped by events, never by sleeps.

The orchestrator here is a stand-in (`HeldOrchestrator`): what is under test is the thread
and its bookkeeping around `match`, and a match held at an exact point (or ending its thread
with a BaseException) is not something the real daemon can be made to do on cue. The engines'
tests (tests/sglang, tests/vllm) run the same component against the real daemon.
"""

from __future__ import annotations

import threading
import time

import pytest

from lmcache_loadback.orchestrator.instruments import product_metrics
from lmcache_loadback.orchestrator.lookups import AsyncLookups
from lmcache_loadback.orchestrator.results import MatchResult

WAIT_S = 10


class HeldOrchestrator:
    """Stand-in for the orchestrator's match/abort/finish: each match waits until the test
    lets it answer `answers[request_id]` (64 unless told); `fatal` ends the calling thread."""

    def __init__(self) -> None:
        self.metrics = product_metrics()
        self.asked: list[str] = []
        self.entered = threading.Event()
        self.go = threading.Event()
        self.answers: dict[str, int] = {}
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.fatal: BaseException | None = None

    def match(self, request_id, token_ids, *, local_hit_tokens, cache_salt):
        self.asked.append(request_id)
        self.entered.set()
        assert self.go.wait(WAIT_S)
        if self.fatal is not None:
            raise self.fatal
        return MatchResult(self.answers.get(request_id, 64))

    def abort(self, request_id):
        self.aborted.append(request_id)

    def finish(self, request_id):
        self.finished.append(request_id)


def ahead() -> float:
    return time.monotonic() + 60


def wait_until(cond, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_a_full_lookup_queue_answers_a_counted_skip_at_once():
    """With `max_queued` LOOKUPs held (one running, one waiting) the next is answered as a
    miss at submit, counted as skipped, and never reaches the daemon; the held ones are
    answered; the depth gauge follows the held count back to 0."""
    orch = HeldOrchestrator()
    m = orch.metrics
    lookups = AsyncLookups(orch, max_queued=2)
    try:
        running = lookups.submit("a", [1] * 64, 0, "", ahead())
        assert orch.entered.wait(WAIT_S)
        waiting = lookups.submit("b", [2] * 64, 0, "", ahead())
        over = lookups.submit("c", [3] * 64, 0, "", ahead())
        assert over.skipped and over.done.is_set() and lookups.answer(over) == 0
        assert not waiting.skipped and lookups.answer(waiting) is None
        assert lookups.skipped == 1 and m._lookups["skipped"]._value.get() == 1
        assert lookups.depth == 2 and m.lookup_queue._value.get() == 2
        assert lookups.abandon(over) is False  # nothing taken: nothing to release
        orch.go.set()
        assert running.done.wait(WAIT_S) and waiting.done.wait(WAIT_S)
        assert lookups.answer(running) == 64 and lookups.answer(waiting) == 64
        assert orch.asked == ["a", "b"]
        assert lookups.depth == 0 and m.lookup_queue._value.get() == 0
    finally:
        lookups.close()


def test_a_late_answer_is_abandoned_and_released_by_the_worker_thread():
    """A LOOKUP past its deadline is a miss for good (None before it): its answer, once it
    comes, is never read and the worker thread aborts it; one queued behind it, past its
    deadline when dequeued, is never sent. One answered in time is the caller's to release."""
    orch = HeldOrchestrator()
    lookups = AsyncLookups(orch)
    try:
        late = lookups.submit("late", [1] * 64, 0, "", ahead())
        assert orch.entered.wait(WAIT_S)
        expired = lookups.submit("expired", [2] * 64, 0, "", time.monotonic())
        assert lookups.answer(late, now=late.deadline - 1) is None  # may still come in time
        assert lookups.answer(late, now=late.deadline) == 0         # at its deadline: a miss
        assert lookups.abandon(late) is False     # the worker releases it, not the caller
        orch.go.set()
        assert late.done.wait(WAIT_S) and expired.done.wait(WAIT_S)
        wait_until(lambda: orch.aborted == ["late"], "the late answer released")
        assert late.tokens == 64 and lookups.answer(late) == 0       # never 64
        assert orch.asked == ["late"] and lookups.expired == 1
        assert lookups.answer(expired) == 0
        timely = lookups.submit("timely", [3] * 64, 0, "", ahead())
        assert timely.done.wait(WAIT_S)
        assert lookups.answer(timely) == 64
        assert lookups.abandon(timely) is True    # answered in time: the caller releases it
        assert orch.aborted == ["late"] and orch.finished == []
    finally:
        lookups.close()


def test_end_misses_ends_a_missed_lookup_on_the_worker_thread():
    """vLLM's scheduler releases only hits: with `end_misses` the worker ends a miss's
    session as soon as it is answered, and leaves a hit to the caller."""
    orch = HeldOrchestrator()
    orch.go.set()
    orch.answers["miss"] = 0
    lookups = AsyncLookups(orch, end_misses=True)
    try:
        miss = lookups.submit("miss", [1] * 64, 0, "", ahead())
        hit = lookups.submit("hit", [2] * 64, 0, "", ahead())
        assert miss.done.wait(WAIT_S) and hit.done.wait(WAIT_S)
        wait_until(lambda: orch.finished == ["miss"], "the miss's session ended")
        assert lookups.answer(miss) == 0 and lookups.answer(hit) == 64
        assert orch.aborted == []
    finally:
        lookups.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_lookup_thread_is_replaced_where_the_engine_next_polls():
    """A BaseException past every handler ends the thread: its LOOKUP still completes (a
    miss), the next poll starts a new thread (counted in
    loadback_worker_thread_restarts_total), and later LOOKUPs are answered."""
    orch = HeldOrchestrator()
    orch.fatal = SystemExit()
    lookups = AsyncLookups(orch)
    try:
        dead = lookups._thread
        job = lookups.submit("a", [1] * 64, 0, "", ahead())
        orch.go.set()
        assert job.done.wait(WAIT_S)
        dead.join(WAIT_S)
        assert not dead.is_alive() and lookups.depth == 0
        orch.fatal = None
        assert lookups.answer(job) == 0
        assert lookups._thread is not dead and lookups._thread.is_alive()
        assert lookups.restarts == 1
        assert orch.metrics.worker_thread_restarts_total._value.get() == 1
        later = lookups.submit("b", [2] * 64, 0, "", ahead())
        assert later.done.wait(WAIT_S) and lookups.answer(later) == 64
    finally:
        lookups.close()


def test_several_lookup_threads_run_that_many_matches_at_once():
    """`threads=3` (sglang.lookup_threads): three matches are inside the daemon call together
    while a fourth waits its turn; every one is answered and close stops every thread."""
    orch = HeldOrchestrator()
    lookups = AsyncLookups(orch, threads=3)
    try:
        jobs = [lookups.submit(f"r{i}", [i] * 64, 0, "", ahead()) for i in range(4)]
        wait_until(lambda: len(orch.asked) == 3, "three matches at once")
        assert not any(j.done.is_set() for j in jobs) and lookups.depth == 4
        orch.go.set()
        assert all(j.done.wait(WAIT_S) for j in jobs)
        assert [lookups.answer(j) for j in jobs] == [64] * 4
        assert sorted(orch.asked) == ["r0", "r1", "r2", "r3"]
    finally:
        lookups.close()
    assert not any(t.is_alive() for t in lookups._threads) and len(lookups._threads) == 3
    with pytest.raises(ValueError, match="threads must be at least 1"):
        AsyncLookups(orch, threads=0)
