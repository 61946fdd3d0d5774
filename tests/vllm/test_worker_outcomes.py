"""The vLLM worker side counts every load and store outcome: its store thread never dies
silently, and a load counts only once its bytes are in vLLM's blocks. Real lmcache 0.5.6
daemon; the faults are injected where the daemon cannot cause them (a bug in the thread's own
code, vLLM's block copy failing).

Run: .venv-vllm/bin/python -m pytest tests/vllm/test_worker_outcomes.py -q
"""

from __future__ import annotations

import threading

import pytest

from .test_connector import HIT, PROMPT, engine, released, stored  # noqa: F401 - fixture
from .waiting import wait_until

pytestmark = pytest.mark.daemon

STORE_THREAD = "loadback-vllm-store"


def outcomes(orch) -> dict[str, float]:
    return {k: v for k, v in orch.metrics.snapshot().items()
            if k.startswith("loadback_prefix_outcomes_total") and v}


def test_a_store_thread_killed_outside_its_store_is_counted_and_replaced(engine, daemon,
                                                                          monkeypatch):
    side = engine.worker.worker
    metrics = side.orch.metrics
    dead = next(t for t in threading.enumerate() if t.name == STORE_THREAD and t.is_alive()
                and t is not threading.current_thread())
    real, fired = metrics.queue_depth, []

    def fails_once_on_the_store_thread(queue: str, n: int) -> None:
        if threading.current_thread() is dead and not fired:
            fired.append(n)
            raise RuntimeError("injected: a bug outside _store")
        real(queue, n)

    monkeypatch.setattr(metrics, "queue_depth", fails_once_on_the_store_thread)
    first = engine.request("first", PROMPT)
    engine.prefill(first, drain=False)
    wait_until(lambda: not dead.is_alive(), what="the store thread dying")
    assert fired
    stores, skipped = side.stores_done, side.stores_skipped
    # the next step's store is served by a new thread, not skipped behind the dead one
    later = engine.request("later", PROMPT[:150] + PROMPT[:50])
    engine.prefill(later, drain=False)
    assert side.drain(10.0), "the store after the thread died never completed"
    assert side.stores_done == stores + 1 and side.stores_skipped == skipped
    assert metrics.snapshot()["loadback_worker_thread_restarts_total"] == 1
    for rid in list(engine.requests):
        engine.finish(engine.requests[rid])
    wait_until(lambda: released(daemon), what="daemon holding no lock, session or job")


def test_a_load_whose_copy_into_vllm_blocks_fails_is_one_degraded_outcome(engine, daemon,
                                                                           monkeypatch):
    stored(engine)
    side = engine.worker.worker
    before = outcomes(side.orch)

    def copy_fails(*_a, **_k):
        raise RuntimeError("injected: vLLM's block copy failed")

    monkeypatch.setattr(side.view, "to_blocks", copy_fails)
    dst = engine.request("dst", PROMPT)
    res = engine.prefill(dst, from_end=True)
    assert res.hits == {"dst": HIT}
    assert res.load_errors == set(res.blocks["dst"][:HIT // 32])   # reported, once
    after = outcomes(side.orch)
    assert after.get("loadback_prefix_outcomes_total{reason=none,state=loaded}", 0) == \
        before.get("loadback_prefix_outcomes_total{reason=none,state=loaded}", 0)
    new = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert new == {"loadback_prefix_outcomes_total{reason=alloc_failed,state=degraded}": 1}
    for rid in list(engine.requests):
        engine.finish(engine.requests[rid])
    wait_until(lambda: released(daemon), what="daemon holding no lock, session or job")
