"""A real vLLM server with LoadBackConnector: same outputs as without it, hits load, a daemon
SIGSTOPped at LOOKUP costs the lookup deadline, a daemon killed between LOOKUP and RETRIEVE
costs one recompute; hits resume after each, and the daemon is left holding nothing. Heartbeat,
breaker and retries run on the defaults: the first hit comes within SERVING_TO_HIT_BOUND_S of a
new daemon's first answer, behind the proxy and on the dialed address (printed:
`serving_to_first_hit_s`)."""

from __future__ import annotations

import dataclasses

import pytest

from lmcache_loadback.connectors.ports import free_port
from lmcache_loadback.harness.vllm.server import VLLMServer, kv_transfer_config, metric_value
from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.testing.fault_proxy import FaultProxy
from .helpers import (CHUNK, HIT, LOAD_BOUND_S, LOOKUP_BOUND_S, MAX_TOKENS, PROMPTS, degraded,
                      external_hits, first_hit_after_serving,
                      killed_between_lookup_and_retrieve, loadback, loaded, metrics_ports,
                      nothing_held, report, stored, until_hit, write_yaml)
from ..waiting import wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory, reference):
    d = tmp_path_factory.mktemp("vllm-loadback")
    daemon = DaemonProcess(chunk_size=CHUNK, http=True, log_dir=str(d)).start()
    proxy = FaultProxy(daemon.endpoint).start()
    server_port = free_port()
    metrics_port = metrics_ports({server_port, proxy.port, daemon.port, daemon.http_port})
    yaml = write_yaml(d / "loadback.yaml", proxy.port, metrics_port, recovery_defaults=True)
    server = VLLMServer(server_port, str(d / "vllm.log"),
                        kv_config=kv_transfer_config(
                            yaml, scheduler_metrics_port=metrics_port + 1)).start()
    try:
        # vLLM's first forward after start-up takes both cores for seconds (the daemon then
        # misses its heartbeats): pay it here, on a prompt of no whole chunk
        server.complete(list(range(5, 105)), MAX_TOKENS)
        yield server, daemon, proxy, metrics_port
    finally:
        server.stop()
        proxy.close()
        daemon.stop()


def test_outputs_identical_and_hits_load(stack, reference):
    server, daemon, _, mport = stack
    for prompt, ref in zip(PROMPTS, reference):
        objects = daemon.held()["objects"]
        out, _ = server.complete(prompt, MAX_TOKENS)   # a miss: computed, then stored
        assert out == ref
        # stores run off the forward path: the repeat waits until the chunks landed
        stored(daemon, objects, HIT // CHUNK)
        before = external_hits(server)
        # a hit: loaded from the daemon (repeated, bounded, only if a starved daemon missed
        # its deadline; every answer is the reference)
        until_hit(server, mport, prompt, ref)
        assert external_hits(server) - before == HIT
    # the worker's loadback_* series: every prompt loaded once; a load degraded only by a
    # deadline the busy machine made the daemon miss
    assert loaded(mport) == len(PROMPTS)
    assert loadback(mport, "loadback_loaded_tokens_total") == HIT * len(PROMPTS)
    timeouts = sum(loadback(mport, "loadback_prefix_outcomes_total", state="degraded",
                            reason=r) for r in ("retrieve_timeout", "breaker_open"))
    assert degraded(mport) == timeouts
    report("hits", degraded_by_a_deadline=timeouts)
    assert loadback(mport + 1, "loadback_lookups_total", result="hit") >= len(PROMPTS)
    # the same series on vLLM's own /metrics, by process (stats.py): a snapshot rides on a
    # step at most once a second, so short requests (no whole chunk) make the steps
    def on_vllms_metrics() -> bool:
        server.complete(list(range(5, 105)), 1)
        text = server.metrics_text()
        return (metric_value(text, "loadback_prefix_outcomes_total",
                             {"state": "loaded", "loadback_process": "rank0"}) == len(PROMPTS)
                and metric_value(text, "loadback_lookups_total", {
                    "result": "hit", "loadback_process": "scheduler"}) >= len(PROMPTS))
    wait_until(on_vllms_metrics, what="the rank's loads and the scheduler's LOOKUPs on "
               "vLLM's /metrics", poll_s=0.3)
    text = server.metrics_text()
    assert metric_value(text, "loadback_prefix_outcomes_total",
                        {"loadback_process": "scheduler"}) == 0
    nothing_held(daemon, "after the hits")


def test_daemon_stopped_at_lookup(stack, reference):
    """SIGSTOP: the daemon keeps its sockets and answers nothing. Each request is a miss
    within the lookup deadline with the same output; after SIGCONT hits resume."""
    server, daemon, _, mport = stack
    until_hit(server, mport, PROMPTS[1], reference[1])   # stored: the next ask is a hit
    hits, loads = external_hits(server), loaded(mport)
    daemon.pause()
    try:
        stalled = []
        for prompt, ref in zip(PROMPTS, reference):   # the stored prompt first
            out, secs = server.complete(prompt, MAX_TOKENS)
            assert out == ref
            stalled.append(round(secs, 3))
    finally:
        daemon.resume()
    assert max(stalled) < LOOKUP_BOUND_S, stalled
    assert external_hits(server) == hits and loaded(mport) == loads   # nothing was promised
    resumed_s = until_hit(server, mport, PROMPTS[1], reference[1])
    held = nothing_held(daemon, "after SIGCONT")
    report("vllm_sigstop_lookup", stopped_latencies_s=stalled,
           hits_resumed_after_sigcont_s=round(resumed_s, 2), daemon_after=held)


def test_daemon_killed_between_lookup_and_retrieve(stack, reference):
    server, daemon, proxy, mport = stack
    until_hit(server, mport, PROMPTS[0], reference[0])   # stored: the next ask is a hit
    before = degraded(mport)
    got = killed_between_lookup_and_retrieve(server, daemon, proxy, PROMPTS[0])
    assert got.get("out") == reference[0], got                # recomputed, same output
    assert got["secs"] < LOAD_BOUND_S                         # within its bound
    assert degraded(mport) == before + 1
    # outputs stay identical while the daemon is down
    down = server.complete(PROMPTS[1], MAX_TOKENS)
    assert down[0] == reference[1] and down[1] < LOOKUP_BOUND_S
    # a new daemon behind the proxy: the connection stays open, its epoch does not move
    resumed_s = first_hit_after_serving(server, mport, proxy.endpoint, daemon.restart,
                                        PROMPTS[2], reference[2])
    assert server.complete(PROMPTS[2], MAX_TOKENS)[0] == reference[2]
    held = nothing_held(daemon, "after the restart")
    report("vllm_kill_prepare_retrieve", faulted_latency_s=round(got["secs"], 3),
           down_latency_s=round(down[1], 3), serving_to_first_hit_s=round(resumed_s, 2),
           daemon_after=held)


def test_first_hit_soon_after_a_restart_on_the_dialed_address(stack, reference):
    """The daemon SIGKILLed and the proxy closed (the connection drops, as when the daemon
    the connector dials dies), then a new daemon on that address. Runs last: the proxy is gone."""
    server, daemon, proxy, mport = stack
    until_hit(server, mport, PROMPTS[1], reference[1])
    daemon.kill()
    proxy.close()
    new = dataclasses.replace(daemon, port=proxy.port)
    try:
        resumed_s = first_hit_after_serving(server, mport, new.endpoint, new.start,
                                            PROMPTS[0], reference[0])
        held = nothing_held(new, "after the restart on the dialed address")
    finally:
        new.stop()
    report("vllm_restart_dialed_address", serving_to_first_hit_s=round(resumed_s, 2),
           daemon_after=held)
