"""What an operator gets from a real vLLM server with LoadBackConnector under vLLM's default
`kv_load_failure_policy`, "fail", started while no daemon listens on the configured port.

- Start-up: the connector's one WARNING naming `"kv_load_failure_policy": "recompute"`.
- The daemon absent: every request completes at once with the output of a server without the
  connector (nothing is promised, so nothing can fail); once the daemon (and the proxy in front
  of it, on the port the YAML names) starts, hits begin with no server restart.
- The daemon SIGSTOPped at LOOKUP: no request fails (a miss after the lookup deadline).
- The daemon SIGKILLed between LOOKUP and RETRIEVE: that request fails (vLLM answers HTTP 500:
  the load it was promised failed and the policy is "fail"), the server stays up, later
  requests succeed, and hits resume once the daemon is back.
"""

from __future__ import annotations

import json
import time
import urllib.request
from types import SimpleNamespace

import pytest

from lmcache_loadback.connectors.ports import free_port
from lmcache_loadback.harness.vllm.server import VLLMServer, kv_transfer_config
from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.testing.fault_proxy import FaultProxy
from .helpers import (CHUNK, LOAD_BOUND_S, LOOKUP_BOUND_S, MAX_TOKENS, PROMPTS, SLACK_S,
                      external_hits, killed_between_lookup_and_retrieve, loaded, metrics_ports,
                      nothing_held, report, until_hit, write_yaml)

pytestmark = pytest.mark.e2e

WARMUP_BOUND_S = 30.0   # vLLM's first forward after start-up (measured 3-7 s here)


@pytest.fixture(scope="module")
def failing(tmp_path_factory, reference):
    """The server with the `fail` policy, started with nothing on the YAML's daemon port."""
    d = tmp_path_factory.mktemp("vllm-fail-policy")
    daemon = DaemonProcess(chunk_size=CHUNK, http=True, log_dir=str(d))   # not started
    proxy_port, server_port = free_port(), free_port()
    mport = metrics_ports({server_port, proxy_port, daemon.port})
    yaml = write_yaml(d / "loadback.yaml", proxy_port, mport)
    server = VLLMServer(server_port, str(d / "vllm.log"),
                        kv_config=kv_transfer_config(yaml, policy="fail"))
    st = SimpleNamespace(server=server, daemon=daemon, proxy=None, proxy_port=proxy_port,
                         mport=mport)
    try:
        server.start()
        yield st
    finally:
        server.stop()
        if st.proxy is not None:
            st.proxy.close()
        daemon.stop()


def log_lines(server: VLLMServer, text: str) -> list[str]:
    with open(server.log_path, errors="replace") as f:
        return [x for x in f if text in x]


def complete_all(server: VLLMServer, reference: list[str]) -> list[float]:
    """Every prompt once: each succeeds with the reference output; their latencies."""
    secs = []
    for prompt, ref in zip(PROMPTS, reference):
        out, s = server.complete(prompt, MAX_TOKENS)
        assert out == ref, "an answer differs from the server without the connector"
        secs.append(round(s, 3))
    return secs


def test_daemon_absent_at_start_then_hits_begin(failing, reference):
    server, daemon = failing.server, failing.daemon
    warnings = log_lines(server, '"kv_load_failure_policy": "recompute"')
    assert len(warnings) == 1 and "WARNING" in warnings[0], warnings
    assert "EngineCore" in warnings[0] and "'fail'" in warnings[0], warnings
    warmup = server.complete([5, 6, 7, 8], MAX_TOKENS)[1]   # vLLM's first forward
    assert warmup < WARMUP_BOUND_S
    absent = complete_all(server, reference) + complete_all(server, reference)
    assert max(absent) < SLACK_S, absent   # no deadline is waited for: nothing listens
    assert external_hits(server) == 0 and loaded(failing.mport) == 0
    daemon.start()
    failing.proxy = FaultProxy(daemon.endpoint, port=failing.proxy_port).start()
    up_at = time.monotonic()
    until_hit(server, failing.mport, PROMPTS[0], reference[0])
    first_hit_s = time.monotonic() - up_at
    assert external_hits(server) > 0
    held = nothing_held(daemon, "after the first hits")
    report("vllm_absent_at_start", start_s=round(server.start_s, 1),
           warmup_s=round(warmup, 3), absent_latencies_s=absent,
           first_hit_after_daemon_up_s=round(first_hit_s, 2), daemon_after=held)


def test_daemon_stopped_at_lookup_fails_no_request(failing, reference):
    server, daemon = failing.server, failing.daemon
    until_hit(server, failing.mport, PROMPTS[1], reference[1])   # stored: next ask a hit
    daemon.pause()
    try:
        stalled = complete_all(server, reference)   # PROMPTS[1] among them, a miss now
    finally:
        daemon.resume()
    assert max(stalled) < LOOKUP_BOUND_S, stalled
    resumed_s = until_hit(server, failing.mport, PROMPTS[1], reference[1])
    nothing_held(daemon, "after SIGCONT")
    report("vllm_fail_policy_sigstop_lookup", stopped_latencies_s=stalled,
           hits_resumed_after_sigcont_s=round(resumed_s, 2))


def test_daemon_killed_between_lookup_and_retrieve_fails_that_request(failing, reference):
    server, daemon = failing.server, failing.daemon
    until_hit(server, failing.mport, PROMPTS[2], reference[2])   # stored: next ask a hit
    got = killed_between_lookup_and_retrieve(server, daemon, failing.proxy, PROMPTS[2])
    assert got.get("status") == 500, got   # what vLLM answers under the `fail` policy
    assert json.loads(got["body"])["error"]["type"] == "InternalServerError", got
    assert got["secs"] < LOAD_BOUND_S, got
    assert log_lines(server, "due to KV load failure (failure_policy=fail")
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert r.status == 200   # the server stays up
    down = complete_all(server, reference)   # the daemon down: every request succeeds
    assert max(down) < LOOKUP_BOUND_S, down
    daemon.restart()
    up_at = time.monotonic()
    until_hit(server, failing.mport, PROMPTS[2], reference[2])
    resumed_s = time.monotonic() - up_at
    held = nothing_held(daemon, "after the restart")
    report("vllm_fail_policy_kill_prepare_retrieve", status=got["status"],
           body=got["body"][:120], failed_after_s=round(got["secs"], 3), down_latencies_s=down,
           hits_resumed_after_restart_s=round(resumed_s, 2), daemon_after=held)
