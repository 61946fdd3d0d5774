"""Prompts, the loadback YAML and the checks shared by the real-server tests: hits read from
vLLM's /metrics and the worker ranks' loadback_* series, and what the daemon still holds.

Every wait is on a condition with a bound; every request carries a client deadline.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lmcache_loadback.connectors.ports import check_port_free, free_port
from lmcache_loadback.harness.vllm.server import VLLMServer, metric_value
from lmcache_loadback.testing.daemon import DaemonProcess, first_answer
from lmcache_loadback.testing.fault_proxy import FaultProxy, FaultRule
from ..waiting import wait_until

CHUNK = 256
PROMPTS = [[5 + (i * k) % 4000 for i in range(600)] for k in (7, 11, 13)]
HIT = 512   # whole chunks of a 600-token prompt, one token left to compute
MAX_TOKENS = 8
LOOKUP_MS = 200
RETRIEVE_BASE_MS = 1000
RETRIEVE_MAX_MS = 3000
#: What a request may take beyond its connector deadlines: CPU prefill of 600 tokens and
#: decode on this loaded 2-core machine (measured 0.05-0.4 s; vLLM's first forward after
#: start-up, a warm-up the server without the connector pays too, is kept out of it).
SLACK_S = 3.0
#: A request whose LOOKUP the daemon never answers: a miss after the lookup deadline.
LOOKUP_BOUND_S = LOOKUP_MS / 1000 + SLACK_S
#: A request whose load the daemon never answers: its LOOKUP, then the retrieve deadline.
LOAD_BOUND_S = (LOOKUP_MS + RETRIEVE_MAX_MS) / 1000 + SLACK_S
#: Hits back after a daemon (re)start: heartbeat, breaker cooldown, re-registration.
RECOVERY_BOUND_S = 60.0


def metrics_ports(avoid: set[int], n: int = 2) -> int:
    """A port p with p .. p + n - 1 all free and none in `avoid`: the worker ranks'
    /metrics (metrics.port + rank), then the scheduler's if asked for."""
    for _ in range(100):
        p = free_port()
        try:
            for q in range(p + 1, p + n):
                check_port_free("127.0.0.1", q)
        except OSError:
            continue
        if not set(range(p, p + n)) & avoid:
            return p
    raise AssertionError(f"no {n} consecutive free ports")


#: The first hit after the daemon serves again, on the recovery defaults: the product's part
#: is within 2 s (tests/integration/test_recovery_defaults.py); the rest of this bound is a
#: loaded 2-core machine (a CPU prefill, the store, the repeat).
SERVING_TO_HIT_BOUND_S = 15.0


def write_yaml(path: Path, daemon_port: int, metrics_port: int,
               recovery_defaults: bool = False) -> str:
    """The connector's YAML: deadlines a loaded 2-core machine meets; a 200 ms heartbeat and a
    short breaker unless `recovery_defaults` (then heartbeat, breaker and retries as shipped)."""
    recovery = "" if recovery_defaults else (
        "heartbeat: {interval_ms: 200}\nbreaker: {cooldown_ms: 200, cooldown_max_ms: 1000}\n")
    path.write_text(
        f"mp_host: 127.0.0.1\nmp_port: {daemon_port}\nchunk_size: {CHUNK}\n"
        f"deadlines: {{lookup_ms: {LOOKUP_MS}, retrieve_base_ms: {RETRIEVE_BASE_MS}, "
        f"retrieve_max_ms: {RETRIEVE_MAX_MS}}}\n{recovery}"
        f"metrics: {{enabled: true, port: {metrics_port}}}\n")
    return str(path)


def external_hits(server: VLLMServer) -> float:
    return metric_value(server.metrics_text(), "vllm:external_prefix_cache_hits_total")


def loadback(port: int, name: str, **labels) -> float:
    """One loadback_* series summed, from the /metrics a worker rank serves on `port`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return metric_value(r.read().decode(), name, labels)


def loaded(port: int) -> float:
    return loadback(port, "loadback_prefix_outcomes_total", state="loaded")


def degraded(port: int) -> float:
    return loadback(port, "loadback_prefix_outcomes_total", state="degraded")


def stored(daemon: DaemonProcess, objects: int, chunks: int) -> None:
    """Stores run off the forward path: wait (bounded) until the daemon holds `chunks` more
    objects than `objects`."""
    wait_until(lambda: daemon.held()["objects"] >= objects + chunks, 10,
               "the prompt's chunks stored")


def until_hit(server: VLLMServer, mport: int, prompt: list[int], ref: str,
              timeout_s: float = RECOVERY_BOUND_S, bound_s: float = LOAD_BOUND_S) -> float:
    """Send `prompt` until the worker (rank 0 on `mport`) loads it; every answer must be `ref`
    within `bound_s`. Returns the seconds it took."""
    t0, before = time.monotonic(), loaded(mport)

    def hit() -> bool:
        out, secs = server.complete(prompt, MAX_TOKENS)
        assert out == ref, "an answer differs from the server without the connector"
        assert secs < bound_s, f"a request took {secs:.2f} s"
        return loaded(mport) > before
    wait_until(hit, timeout_s, "a hit", poll_s=0.05)
    return time.monotonic() - t0


def first_hit_after_serving(server: VLLMServer, mport: int, dialed: str, start_daemon,
                            prompt: list[int], ref: str) -> float:
    """`start_daemon()`, then `until_hit` on `prompt`: the seconds from the first answer a
    client of the test's own got on `dialed` (the address the connector dials) to the hit,
    asserted within SERVING_TO_HIT_BOUND_S."""
    with ThreadPoolExecutor(1) as pool:
        served = pool.submit(first_answer, dialed, 120.0)
        start_daemon()
        served_at = served.result()
    until_hit(server, mport, prompt, ref)
    took = time.monotonic() - served_at
    assert took <= SERVING_TO_HIT_BOUND_S, (
        f"the first hit {took:.2f} s after the daemon served again on {dialed}")
    return took


def nothing_held(daemon: DaemonProcess, what: str) -> dict:
    """The daemon holds no lock, session or prefetch job once nothing runs (bounded)."""
    wait_until(lambda: not daemon.client_holds(), 15,
               f"{what}: the daemon idle with nothing held")
    return daemon.held()


def killed_between_lookup_and_retrieve(server: VLLMServer, daemon: DaemonProcess,
                                       proxy: FaultProxy, prompt: list[int]) -> dict:
    """Send `prompt` (stored: the scheduler promises a hit); hold the worker's first
    prepare_retrieve in the proxy and SIGKILL the daemon while it is held. Returns what the
    request got: "out" and "secs", or "status" and "body" (vLLM failed it) and "secs"."""
    rule = proxy.add_rule(FaultRule("delay", op="prepare_retrieve", direction="request",
                                    delay_s=0.3, count=1))
    got: dict = {}

    def send() -> None:
        t0 = time.monotonic()
        try:
            got["out"], _ = server.complete(prompt, MAX_TOKENS)
        except urllib.error.HTTPError as e:   # vLLM failed the request
            got["status"], got["body"] = e.code, e.read().decode(errors="replace")
        got["secs"] = time.monotonic() - t0
    t = threading.Thread(target=send)
    t.start()
    wait_until(lambda: proxy.fired(rule) >= 1, 30, "the load's prepare_retrieve")
    daemon.kill()
    t.join(timeout=60)
    assert not t.is_alive(), "the request never returned"
    proxy.clear()
    return got


def report(name: str, **figures) -> None:
    """A measured figure set on stdout (`-s` shows it)."""
    print(f"\nE2E {name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
