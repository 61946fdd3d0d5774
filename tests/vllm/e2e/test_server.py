"""A real vLLM server with LoadBackConnector: same outputs as without it, hits load, a daemon
killed between LOOKUP and RETRIEVE costs one recompute, hits resume after its restart."""

from __future__ import annotations

import threading
import urllib.request

import pytest

from lmcache_loadback.connectors.ports import check_port_free, free_port
from lmcache_loadback.harness.vllm.server import VLLMServer, kv_transfer_config, metric_value
from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.testing.fault_proxy import FaultProxy, FaultRule
from ..waiting import wait_until

pytestmark = pytest.mark.e2e

CHUNK = 256
PROMPTS = [[5 + (i * k) % 4000 for i in range(600)] for k in (7, 11, 13)]
HIT = 512   # whole chunks of a 600-token prompt, one token left to compute
MAX_TOKENS = 8
RETRIEVE_BASE_MS = 1000


def metrics_ports(avoid: set[int]) -> int:
    """A port p with p (the worker's /metrics) and p + 1 (the scheduler's, asked for with
    loadback.scheduler_metrics_port) both free."""
    for _ in range(100):
        p = free_port()
        try:
            check_port_free("127.0.0.1", p + 1)
        except OSError:
            continue
        if not {p, p + 1} & avoid:
            return p
    raise AssertionError("no two consecutive free ports")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Greedy outputs of a server without any connector."""
    d = tmp_path_factory.mktemp("vllm-ref")
    server = VLLMServer(free_port(), str(d / "vllm.log")).start()
    try:
        return [server.complete(p, MAX_TOKENS)[0] for p in PROMPTS]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, reference):
    d = tmp_path_factory.mktemp("vllm-loadback")
    daemon = DaemonProcess(chunk_size=CHUNK, http=True, log_dir=str(d)).start()
    proxy = FaultProxy(daemon.endpoint).start()
    server_port = free_port()
    metrics_port = metrics_ports({server_port, proxy.port, daemon.port, daemon.http_port})
    yaml = d / "loadback.yaml"
    yaml.write_text(
        f"mp_host: 127.0.0.1\nmp_port: {proxy.port}\nchunk_size: {CHUNK}\n"
        f"deadlines: {{lookup_ms: 200, retrieve_base_ms: {RETRIEVE_BASE_MS}, "
        "retrieve_max_ms: 3000}\nheartbeat: {interval_ms: 200}\n"
        "breaker: {cooldown_ms: 200, cooldown_max_ms: 1000}\n"
        f"metrics: {{enabled: true, port: {metrics_port}}}\n")
    server = VLLMServer(server_port, str(d / "vllm.log"),
                        kv_config=kv_transfer_config(
                            str(yaml), scheduler_metrics_port=metrics_port + 1)).start()
    try:
        yield server, daemon, proxy, metrics_port
    finally:
        server.stop()
        proxy.close()
        daemon.stop()


def external_hits(server) -> float:
    return metric_value(server.metrics_text(), "vllm:external_prefix_cache_hits_total")


def loadback(port: int, name: str, **labels) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return metric_value(r.read().decode(), name, labels)


def test_outputs_identical_and_hits_load(stack, reference):
    server, daemon, _, mport = stack
    for prompt, ref in zip(PROMPTS, reference):
        objects = daemon.held()["objects"]
        out, _ = server.complete(prompt, MAX_TOKENS)   # a miss: computed, then stored
        assert out == ref
        # stores run off the forward path: the repeat waits until the chunks landed
        wait_until(lambda: daemon.held()["objects"] >= objects + HIT // CHUNK, 10,
                   "the prompt's chunks stored")
        before = external_hits(server)
        out, _ = server.complete(prompt, MAX_TOKENS)   # a hit: loaded from the daemon
        assert out == ref
        assert external_hits(server) - before == HIT
    # the worker's loadback_* series: every repeat loaded, nothing degraded
    assert loadback(mport, "loadback_prefix_outcomes_total", state="loaded") == len(PROMPTS)
    assert loadback(mport, "loadback_loaded_tokens_total") == HIT * len(PROMPTS)
    assert loadback(mport, "loadback_prefix_outcomes_total", state="degraded") == 0
    assert loadback(mport + 1, "loadback_lookups_total", result="hit") >= len(PROMPTS)
    assert daemon.held()["read_locks"] == 0 or wait_until(
        lambda: daemon.held()["read_locks"] == 0, 10, "locks released")


def test_daemon_killed_between_lookup_and_retrieve(stack, reference):
    server, daemon, proxy, mport = stack
    prompt, ref = PROMPTS[0], reference[0]
    # hold the worker's prepare_retrieve in the proxy; kill the daemon while it is held
    rule = proxy.add_rule(FaultRule("delay", op="prepare_retrieve", direction="request",
                                    delay_s=0.3, count=1))
    degraded = loadback(mport, "loadback_prefix_outcomes_total", state="degraded")
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(zip(("out", "secs"),
                                                       server.complete(prompt, MAX_TOKENS))))
    t.start()
    wait_until(lambda: proxy.fired(rule) >= 1, 30, "the load's prepare_retrieve")
    daemon.kill()
    t.join(timeout=60)
    assert not t.is_alive()
    assert got["out"] == ref                                   # recomputed, same output
    assert got["secs"] < 0.2 + RETRIEVE_BASE_MS / 1000 + 3.0   # within its bound
    assert loadback(mport, "loadback_prefix_outcomes_total", state="degraded") == degraded + 1
    # outputs stay identical while the daemon is down
    assert server.complete(PROMPTS[1], MAX_TOKENS)[0] == reference[1]
    daemon.restart()
    before = external_hits(server)

    def hit_again() -> bool:
        out, _ = server.complete(PROMPTS[2], MAX_TOKENS)
        assert out == reference[2]
        return external_hits(server) > before
    wait_until(hit_again, 90, "a hit after the daemon restarted")
    assert server.complete(PROMPTS[2], MAX_TOKENS)[0] == reference[2]
