"""End-to-end: a real `python -m sglang.launch_server` 0.5.23 on CPU with the tiny llama config
(dummy weights), a real lmcache 0.5.6 daemon on a free loopback port, the fault proxy between
them, HTTP /generate with token ids at temperature 0.

Run by `make test` in .venv-sglang-0.5.23 only. One server per scenario group (a start is
14-60 s here, a stop ~7 s); servers, daemons and proxies are stopped by what started them.
Measured figures go to stdout (`-s`) and, when LOADBACK_E2E_REPORT names a file, as JSON lines.
LOADBACK_E2E_PROBE=1 is a measurement mode, off by default: the same backends are built through
the test-only probe plugin (harness/sglang/probe) that times the scheduler thread inside them.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

import sglang  # a missing sglang fails the run: never a silent skip

from lmcache_loadback.testing.daemon import DaemonProcess, free_port
from lmcache_loadback.testing.fault_proxy import FaultProxy
from lmcache_loadback.harness.sglang.server import (PROBE_DIR, SGLangServer, write_loadback_yaml,
                                              write_upstream_yaml)

from .helpers import CHUNK, Stack

E2E_SGLANG = "0.5.23"
# Upstream's blocking calls give up after this (its default is 300 s); short so the comparison
# finishes, long enough to tell a block from a slow prefill.
UPSTREAM_MQ_TIMEOUT_S = 3.0


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session", autouse=True)
def _sglang_version():
    if sglang.__version__ != E2E_SGLANG:
        pytest.fail(f"the end-to-end tests run on sglang {E2E_SGLANG}; this venv has "
                    f"{sglang.__version__} (run them with .venv-sglang-{E2E_SGLANG}/bin/python)")


def report(name: str, **figures) -> None:
    """Print a measured figure set and append it to LOADBACK_E2E_REPORT when set."""
    line = json.dumps({"figure": name, **figures}, default=str)
    print(f"\nE2E {line}")
    path = os.environ.get("LOADBACK_E2E_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


@pytest.fixture(scope="module")
def make_stack(tmp_path_factory):
    """Build SGLang + daemon + fault proxy; `kind` "loadback" (ours) or "upstream"
    (`--enable-lmcache` alone). `daemon_up=False` starts the server with nothing listening on
    the LMCache port (the test starts daemon and proxy later through `bring_up`).
    `daemon_chunk`: the daemon's --chunk-size (the YAML says CHUNK); `overrides`: appended to
    our YAML; `metrics`: SGLang's own /metrics (--enable-metrics, multiprocess mode) carries the
    loadback_* series; `extra_args`: more server flags; `l2_adapter`: the daemon's
    --l2-adapter JSON (a store shared with other stacks' daemons); `start=False` leaves the
    server to the caller (`stack.server.start()`, e.g. several side by side)."""
    made: list[Stack] = []

    def make(kind: str, *, daemon_up: bool = True, deadline_s: float = 30.0,
             tp: int = 1, daemon_chunk: int = CHUNK, overrides: str = "",
             metrics: bool = False, extra_args: tuple[str, ...] = (),
             l2_adapter: dict | None = None, start: bool = True) -> Stack:
        run_dir = tmp_path_factory.mktemp(f"e2e-{kind}-tp{tp}")
        daemon = DaemonProcess(chunk_size=daemon_chunk, http=True, log_dir=str(run_dir),
                               l2_adapter=l2_adapter)
        port = free_port()
        if kind == "loadback":
            cfg = write_loadback_yaml(run_dir / "loadback.yaml", port, chunk_size=CHUNK,
                                      overrides=overrides)
            backend = "loadback"
        elif kind == "upstream":
            cfg = write_upstream_yaml(run_dir / "upstream.yaml", port,
                                      mq_timeout_s=UPSTREAM_MQ_TIMEOUT_S)
            backend = None
        else:
            raise ValueError(f"kind must be 'loadback' or 'upstream', got {kind!r}")
        probe = {}
        if os.environ.get("LOADBACK_E2E_PROBE") == "1":
            backend = f"probe-{backend or 'upstream'}"
            probe = {"python_path": [str(PROBE_DIR)], "extra_env": {
                "LOADBACK_SCHED_PROBE_FILE": str(run_dir / "sched.jsonl")}}
        if tp > 1:  # SGLang on CPU needs a core binding per rank (reference/sglang-plugin.md)
            probe.setdefault("extra_env", {})["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
                str(r % (os.cpu_count() or 1)) for r in range(tp))
            # SGLang's own /metrics (multiprocess mode) carries every rank's loadback_* series
            probe["extra_args"] = ["--tp-size", str(tp), "--enable-metrics"]
        if metrics and "--enable-metrics" not in probe.get("extra_args", []):
            probe.setdefault("extra_args", []).append("--enable-metrics")
        if extra_args:
            probe.setdefault("extra_args", []).extend(extra_args)
        server = SGLangServer(python=sys.executable, lmcache_config=cfg, backend=backend,
                              log_path=run_dir / "server.log", **probe)
        stack = Stack(server=server, daemon=daemon, proxy=None, deadline_s=deadline_s,
                      proxy_port=port, config_path=cfg)
        made.append(stack)
        if daemon_up:
            bring_up(stack)
        if start:
            server.start()
        return stack

    yield make
    for st in made:
        st.close()
        probe_file = st.server.extra_env.get("LOADBACK_SCHED_PROBE_FILE")
        if probe_file and os.path.exists(probe_file):
            per_req = sorted(json.loads(x)["total_s"] for x in open(probe_file) if x.strip())
            if per_req:
                report(f"scheduler_in_backend_{st.server.backend}", requests=len(per_req),
                       p50_ms=round(per_req[len(per_req) // 2] * 1000, 2),
                       p99_ms=round(per_req[min(len(per_req) - 1, int(len(per_req) * 0.99))]
                                    * 1000, 2),
                       max_ms=round(per_req[-1] * 1000, 1))


def bring_up(stack: Stack) -> float:
    """Start the daemon (and the proxy in front of it, on the port the YAML names); returns the
    monotonic time it was ready."""
    if stack.daemon.proc is None or stack.daemon.proc.poll() is not None:
        stack.daemon.start()
    if stack.proxy is None:
        stack.proxy = FaultProxy(stack.daemon.endpoint, port=stack.proxy_port).start()
    return time.monotonic()
