"""The vLLM connector against the real lmcache 0.5.6 daemon, on vLLM 0.32's own classes.

Run: .venv-vllm/bin/python -m pytest tests/vllm -m "not e2e" -q
"""

from __future__ import annotations

import time

import pytest
import torch

from lmcache_loadback.connectors.ports import free_port

from tests.conftest import lookups_sent

from .conftest import CHUNK
from .mini_engine import BLOCK, LAYERS, MiniEngine, kv_value
from .waiting import wait_until

pytestmark = pytest.mark.daemon

PROMPT = [5 + (i * 13) % 4000 for i in range(200)]   # 200 tokens: 3 whole chunks of 64
HIT = (len(PROMPT) - 1) // CHUNK * CHUNK               # 192: never the whole prompt


def released(daemon) -> bool:
    """The daemon holds nothing for a client: every kind `held()` reports."""
    return not daemon.client_holds()


@pytest.fixture
def engine(model_config, daemon, yaml_for):
    eng = MiniEngine(model_config, {"loadback.config_file": yaml_for(daemon.port)})
    try:
        assert eng.wait_registered(), "connector never registered with the daemon"
        yield eng
    finally:
        eng.close()



def test_scheduler_and_worker_key_chunks_by_vllms_model(engine, model_config):
    """The YAML sets no model_name: both sides key by vLLM's --model, as LMCache's own
    connector does, so a server of another model on the daemon never reads these chunks."""
    assert model_config.model
    assert {side.orch.connector.model_name for side in (engine.sched.scheduler,
                                                        engine.worker.worker)} == {
        model_config.model}

def stored(eng: MiniEngine, rid: str = "src"):
    """Prefill `rid` (a miss) so that the daemon holds PROMPT's whole chunks."""
    req = eng.request(rid, PROMPT)
    res = eng.prefill(req)
    assert res.hits == {rid: 0} and not res.load_errors
    assert eng.worker.worker.stores_done >= 1
    return req, res.blocks[rid]


def test_store_then_load_is_byte_exact_into_other_blocks(engine, daemon):
    src, src_blocks = stored(engine)
    sched, worker = engine.sched.scheduler, engine.worker.worker
    before = lookups_sent(sched.orch)
    dst = engine.request("dst", PROMPT)
    ask = engine.ask(dst)
    assert ask[0] == HIT
    res = engine.prefill(dst, ask=ask, from_end=True)
    assert not res.load_errors and worker.loads_done == 1
    # One LOOKUP for the request: the scheduler's; the worker loaded under its session and
    # released what it locked (nothing is held while dst still runs).
    assert lookups_sent(sched.orch) == before + 1 and lookups_sent(worker.orch) == 0
    wait_until(lambda: released(daemon), what="the worker releasing the scheduler's LOOKUP")
    dst_blocks = res.blocks["dst"]
    assert not set(dst_blocks) & set(src_blocks)
    for j in range(HIT // BLOCK):
        for layer in engine.layers:   # every head, K and V rows, bit for bit
            assert torch.equal(layer[src_blocks[j]].view(torch.int16),
                               layer[dst_blocks[j]].view(torch.int16)), (j, src_blocks[j])
    for pos in (0, 31, 32, 63, 64, 150, HIT - 1):   # each token's rows where the kernel reads
        for li in range(LAYERS):
            k, v = engine.token_kv("dst", pos, li)
            want = kv_value(PROMPT[pos], pos, li)
            assert bool((k == want).all()) and bool((v == -want).all()), (pos, li)
    engine.finish(src)
    engine.finish(dst)
    wait_until(lambda: released(daemon), what="daemon holding no lock, session or job")


def test_absent_daemon_answers_a_miss_at_once(model_config, yaml_for):
    port = free_port()   # nobody listens here
    eng = MiniEngine(model_config, {"loadback.config_file": yaml_for(port)})
    try:
        n, secs, _ = eng.ask(eng.request("r", PROMPT))
        assert n == 0 and secs < 0.2 + 0.1   # within the lookup deadline (200 ms)
        res = eng.prefill(eng.requests["r"], ask=(0, 0, 0))
        assert not res.load_errors
    finally:
        eng.close()


def test_stopped_daemon_answers_a_miss_within_the_lookup_deadline(engine, daemon):
    src, _ = stored(engine)
    daemon.pause()
    try:
        req = engine.request("stuck", PROMPT)
        n, secs, nones = engine.ask(req)
        # None while it may still answer, then a miss by the deadline (200 ms + polling)
        assert n == 0 and nones >= 1 and secs < 0.2 + 0.1, (n, secs, nones)
        # the scheduler was never blocked: every pass returned at once
        t0 = time.monotonic()
        assert engine.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert time.monotonic() - t0 < 0.01
    finally:
        daemon.resume()
    # hits come back by themselves; the abandoned LOOKUP is released
    k = iter(range(10_000))
    wait_until(lambda: engine.ask(engine.request(f"again{next(k)}", PROMPT))[0] == HIT,
               what="a hit after SIGCONT")
    for rid in list(engine.requests):
        engine.finish(engine.requests[rid])
    wait_until(lambda: released(daemon), what="daemon holding no lock, session or job")


def test_daemon_killed_between_lookup_and_retrieve(engine, daemon):
    stored(engine)
    req = engine.request("victim", PROMPT)
    ask = engine.ask(req)
    assert ask[0] == HIT                      # the scheduler's LOOKUP hit
    stores_before = engine.worker.worker.stores_done
    t0 = time.monotonic()
    res = engine.prefill(req, ask=ask, from_end=True, before_load=daemon.kill)
    took = time.monotonic() - t0
    load_blocks = set(res.blocks["victim"][:HIT // BLOCK])
    assert res.load_errors == load_blocks     # every promised block, reported in this pass
    assert took < 0.2 + 2.0 + 0.5             # lookup + retrieve deadlines, not 300 s
    assert engine.idle_step() == set()        # exactly once
    assert engine.worker.worker.stores_done == stores_before   # its store was skipped
    # vLLM's recompute policy asks again: never the same hit, not even from a live daemon
    assert engine.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    daemon.start()
    k = iter(range(10_000))

    def hit_again() -> bool:
        r = engine.request(f"after{next(k)}", PROMPT)
        n = engine.ask(r)[0]
        if n == 0:
            engine.prefill(r, ask=(0, 0, 0))  # stores PROMPT in the new daemon
        return n == HIT
    wait_until(hit_again, what="hits after the daemon restarted")
    assert engine.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    for rid in list(engine.requests):
        engine.finish(engine.requests[rid])
    wait_until(lambda: released(daemon), what="daemon holding no lock, session or job")


def test_finished_and_aborted_requests_leave_nothing_held(engine, daemon):
    from vllm.v1.request import RequestStatus

    src, _ = stored(engine)
    engine.finish(src)
    wait_until(lambda: released(daemon), what="released after the store")
    # a promise never loaded (aborted while waiting): its LOOKUP's locks and session go
    aborted = engine.request("aborted", PROMPT)
    assert engine.ask(aborted)[0] == HIT
    assert daemon.held()["read_locks"] > 0
    aborted.status = RequestStatus.FINISHED_ABORTED
    engine.finish(aborted)
    wait_until(lambda: released(daemon), what="released after an abort")
    # a loaded request: released two steps after its load, and at its end
    done = engine.request("done", PROMPT)
    res = engine.prefill(done)
    assert res.hits == {"done": HIT} and not res.load_errors
    engine.idle_step()
    engine.idle_step()
    engine.finish(done)
    wait_until(lambda: released(daemon), what="released after a finished load")
    # a LOOKUP still running when the request ends (the daemon stopped) is released later
    daemon.pause()
    try:
        gone = engine.request("gone", PROMPT)
        assert engine.sched.get_num_new_matched_tokens(gone, 0) == (None, False)
        engine.finish(gone)
    finally:
        daemon.resume()
    wait_until(lambda: released(daemon), what="released after an abandoned LOOKUP")


def test_a_grown_local_hit_is_asked_again_and_loads_the_rest(engine, daemon):
    src, src_blocks = stored(engine)
    req = engine.request("grown", PROMPT)
    assert engine.ask(req, 0)[0] == HIT
    n, _, nones = engine.ask(req, 2 * BLOCK)          # the local hit grew by two blocks
    assert n == HIT - 2 * BLOCK and nones >= 1        # a new LOOKUP, not the old answer
    res = engine.prefill(req, computed=2 * BLOCK, ask=(n, 0, 0), from_end=True)
    assert not res.load_errors
    dst = res.blocks["grown"]
    for j in range(2, HIT // BLOCK):                   # only the blocks beyond the local hit
        for layer in engine.layers:
            assert torch.equal(layer[src_blocks[j]].view(torch.int16),
                               layer[dst[j]].view(torch.int16)), j
    engine.finish(src)
    engine.finish(req)
    wait_until(lambda: released(daemon), what="daemon holding no lock, session or job")


def test_preempted_request_releases_at_once_and_asks_again(engine, daemon):
    stored(engine)
    req = engine.request("preempted", PROMPT)
    res = engine.prefill(req)
    assert res.hits == {"preempted": HIT} and not res.load_errors
    engine.preempt(req)                # within the two steps the LOOKUP would be kept
    wait_until(lambda: daemon.held()["read_locks"] == 0, what="locks released on preemption")
    n, _, nones = engine.ask(req, 0)   # back in the waiting queue: a fresh LOOKUP
    assert n == HIT and nones >= 1
    res = engine.prefill(req, ask=(n, 0, 0))
    assert not res.load_errors
    for pos in (0, 100, HIT - 1):
        k, v = engine.token_kv("preempted", pos, 0)
        want = kv_value(PROMPT[pos], pos, 0)
        assert bool((k == want).all()) and bool((v == -want).all())
    for rid in list(engine.requests):
        engine.finish(engine.requests[rid])
    wait_until(lambda: released(daemon), what="daemon holding no lock, session or job")


def test_a_preempted_request_is_not_blamed_for_a_load_failing_in_its_freed_blocks(engine,
                                                                                daemon):
    """vLLM reuses a preempted request's blocks: another request's failed load there must
    not mark the preempted one failed (never promised again, its store shipped twice)."""
    stored(engine)
    first = engine.request("first", PROMPT)
    res = engine.prefill(first)
    assert res.hits == {"first": HIT} and not res.load_errors
    engine.preempt(first)                       # its blocks go back to the free list's end
    other = engine.request("other", PROMPT)
    offered = engine.ask(other)
    assert offered[0] == HIT
    # vLLM allocating part of a block: the other request's load fails, in first's old blocks
    res = engine.prefill(other, ask=(HIT - BLOCK,) + offered[1:], from_end=True)
    assert res.load_errors and res.load_errors <= set(res.blocks["other"])
    assert res.load_errors & set(engine.req_blocks["other"])
    stores = engine.worker.worker.stores_done
    n, _, _ = engine.ask(first, 0)              # back from preemption: still promised
    assert n == HIT
    res = engine.prefill(first, ask=(n, 0, 0))
    assert not res.load_errors
    assert engine.worker.worker.stores_done == stores   # stored once, not again
    for rid in list(engine.requests):
        engine.finish(engine.requests[rid])
    wait_until(lambda: released(daemon), what="daemon holding no lock, session or job")


def test_chunked_prefill_stores_once_the_prompt_is_computed(engine, daemon):
    req = engine.request("chunked", PROMPT)
    first, second = engine.prefill_in_two(req, first=96)
    assert engine.worker.worker.stores_done == 1       # only after the second step
    dst = engine.request("reader", PROMPT)
    res = engine.prefill(dst, from_end=True)
    assert res.hits == {"reader": HIT} and not res.load_errors
    for j in range(HIT // BLOCK):
        for layer in engine.layers:
            assert torch.equal(layer[second.blocks["chunked"][j]].view(torch.int16),
                               layer[res.blocks["reader"][j]].view(torch.int16)), j
    engine.finish(req)
    engine.finish(dst)
    wait_until(lambda: released(daemon), what="daemon holding no lock, session or job")


def test_salted_and_lora_requests_share_nothing(engine, daemon):
    from vllm.lora.request import LoRARequest

    stored(engine)
    salted = engine.request("salted", PROMPT, cache_salt="tenant-b")
    assert engine.ask(salted)[0] == 0                  # another salt: a miss
    engine.prefill(salted, ask=(0, 0, 0))               # ... stored under its own salt
    again = engine.request("salted2", PROMPT, cache_salt="tenant-b")
    assert engine.ask(again)[0] == HIT
    lora = engine.request("lora", PROMPT, lora_request=LoRARequest("a", 1, "/nonexistent"))
    n, _, nones = engine.ask(lora)
    assert n == 0 and nones == 0                       # never asked: its KV is the adapter's
    stores = engine.worker.worker.stores_done
    engine.prefill(lora, ask=(0, 0, 0))
    assert engine.worker.worker.stores_done == stores  # ... and never stored
    for rid in list(engine.requests):
        engine.finish(engine.requests[rid])
    wait_until(lambda: released(daemon), what="daemon holding no lock, session or job")


def test_a_hung_daemon_never_holds_up_the_forward_loop(engine, daemon):
    daemon.pause()
    try:
        first = engine.request("first", PROMPT)
        engine.prefill(first, drain=False)
        assert engine.last_save_s < 0.05              # staged and handed over, not stored
        second = engine.request("second", PROMPT[:150] + PROMPT[:50])
        engine.prefill(second, drain=False)           # the first store still hangs
        assert engine.last_save_s < 0.05
        assert engine.worker.worker.stores_skipped == 1
    finally:
        daemon.resume()
    assert engine.worker.worker.drain(5.0)            # bounded by deadlines.store_ms
    k = iter(range(10_000))

    def stored_and_hit() -> bool:
        r = engine.request(f"later{next(k)}", PROMPT)
        n = engine.ask(r)[0]
        engine.prefill(r, ask=(n, 0, 0))
        return n == HIT
    wait_until(stored_and_hit, what="stores and hits after SIGCONT")
    for rid in list(engine.requests):
        engine.finish(engine.requests[rid])
    wait_until(lambda: released(daemon), what="daemon holding no lock, session or job")


def test_lookups_queued_behind_a_stopped_daemon_are_bounded(engine, daemon, monkeypatch):
    """Past MAX_QUEUED_LOOKUPS a new request is a miss at once (a skipped LOOKUP), not one
    more LOOKUP queued behind a daemon that does not answer."""
    side = engine.sched.scheduler
    # MAX_QUEUED_LOOKUPS 2: two waiting besides the one the LOOKUP thread runs
    monkeypatch.setattr(side.lookups, "max_queued", 2 + 1)
    skipped = side.orch.metrics._lookups["skipped"]._value.get()
    daemon.pause()
    try:
        first = engine.request("q0", PROMPT)
        assert engine.sched.get_num_new_matched_tokens(first, 0) == (None, False)
        wait_until(lambda: side.lookups._q.qsize() == 0,
                   what="the worker thread taking q0's LOOKUP")
        for rid in ("q1", "q2"):  # queued behind q0's LOOKUP
            assert engine.sched.get_num_new_matched_tokens(
                engine.request(rid, PROMPT), 0) == (None, False)
        assert side.lookups._q.qsize() == 2
        over = engine.request("q3", PROMPT)
        assert engine.sched.get_num_new_matched_tokens(over, 0) == (0, False)
        assert side.orch.metrics._lookups["skipped"]._value.get() == skipped + 1
    finally:
        daemon.resume()
    for rid in list(engine.requests):
        engine.finish(engine.requests[rid])
    wait_until(lambda: released(daemon), what="daemon holding no lock, session or job")


def test_fewer_tokens_than_offered_load_and_release_the_rest(engine, daemon):
    """vLLM allocating whole chunks fewer than offered: those load byte-exact, the locks of
    the rest are freed at hand-off; a count that is not whole chunks is a load error."""
    stored(engine)
    req = engine.request("few", PROMPT)
    offered = engine.ask(req)
    assert offered[0] == HIT
    res = engine.prefill(req, ask=(HIT - CHUNK,) + offered[1:])
    assert not res.load_errors and engine.worker.worker.loads_done == 1
    for pos in (0, HIT - CHUNK - 1):
        k, v = engine.token_kv("few", pos, 0)
        assert bool((k == kv_value(PROMPT[pos], pos, 0)).all())
    wait_until(lambda: released(daemon), what="the hand-off freeing the chunk not taken")
    odd = engine.request("odd", PROMPT)
    offered = engine.ask(odd)
    res = engine.prefill(odd, ask=(HIT - BLOCK,) + offered[1:])
    assert len(res.load_errors) == (HIT - BLOCK) // BLOCK   # reported, nothing loaded
    engine.finish(req)
    engine.finish(odd)
    wait_until(lambda: released(daemon), what="daemon holding no lock, session or job")
