"""Orchestrators in OS processes of their own, stepped from the test: vLLM's scheduler and a
worker rank share no memory, and each pays the daemon from its own threads, so a race between
them is a race between processes. `Remote` builds one orchestrator in a spawned process and
runs the test's calls there one at a time, over a pipe; `hold` stops that process's next call
of a connector method (on whichever of its threads makes it: the releaser, the heartbeat)
before it is sent, until the test says `go`. No sleeps: every step waits on the other side's
answer, bounded.
"""

from __future__ import annotations

import multiprocessing
import traceback
from types import SimpleNamespace
from typing import Any

#: What one remote step may take at most, the spawn (interpreter, torch) included.
STEP_TIMEOUT_S = 60.0


class Remote:
    """One orchestrator (`role`: "asker", a process with no KV that LOOKUPs and hands off, as
    vLLM's scheduler; "loader", one with a KV pool that adopts and loads, as a worker rank)
    over the real daemon on `port`, in a spawned process. `call("orch.match", ...)` runs a
    method there and returns its result (an attribute's value when it is not callable);
    what the call raised is raised here as RemoteError. Called from the test's thread only."""

    def __init__(self, role: str, port: int, *, background: bool) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, role, port, background),
                                name=f"loadback-{role}", daemon=True)
        self.proc.start()
        child.close()
        self.call("ready")

    def call(self, path: str, *args, **kwargs) -> Any:
        self._conn.send((path, args, kwargs))
        if not self._conn.poll(STEP_TIMEOUT_S):
            raise TimeoutError(f"{path}: no answer within {STEP_TIMEOUT_S} s")
        ok, value = self._conn.recv()
        if not ok:
            raise RemoteError(f"{path} raised in the remote process:\n{value}")
        return value

    def hold(self, method: str) -> None:
        """The remote connector's next call of `method`, from any thread, waits before it
        runs until `go(method)`."""
        self.call("hold", method)

    def go(self, method: str) -> None:
        self.call("go", method)

    def close(self) -> None:
        """Close the orchestrator (it pays what it owes, bounded), then end the process."""
        try:
            if self.proc.is_alive():
                self.call("close")
        finally:
            self._conn.close()
            self.proc.join(STEP_TIMEOUT_S)
            if self.proc.is_alive():
                self.proc.kill()  # only this process, which this object started
                self.proc.join(STEP_TIMEOUT_S)


class RemoteError(AssertionError):
    pass


class _Side:
    """What runs in the spawned process: the orchestrator, its connector and pool, holds."""

    def __init__(self, role: str, port: int, background: bool) -> None:
        import torch

        from lmcache_loadback.connectors.kv_layout import KVLayout
        from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
        from lmcache_loadback.orchestrator import LoadBackOrchestrator
        from tests.conftest import CHUNK, make_pool
        from tests.integration.test_orchestrator_daemon import config_for
        from tests.integration.test_release_during_load import Stop

        layout = KVLayout(num_layers=2, num_heads=4, head_dim=16, dtype=torch.float16,
                          chunk_size=CHUNK)
        self.pool = make_pool(layout, 1024) if role == "loader" else None
        self.conn = LMCacheMPConnector(f"tcp://127.0.0.1:{port}", layout,
                                       connect_timeout_s=0.2)
        # What is stepped here is ownership and order across processes, not speed: deadlines
        # a loaded host meets (a first LOOKUP on a just-restarted daemon took over 100 ms).
        config = config_for(SimpleNamespace(port=port), prepare_at_match=False, deadlines={
            "lookup_ms": 2000, "retrieve_base_ms": 3000, "retrieve_max_ms": 3000,
            "control_ms": 1000})
        self.orch = LoadBackOrchestrator(config, self.conn, kv_pool=self.pool,
                                         start_heartbeat=background)
        self.orch.handoff.hands_off = role == "asker"  # as vLLM's scheduler sets it
        self.link = self.orch.link
        self._holds: dict = {}  # connector method -> its Stop
        self._torch = torch
        self._stop = Stop

    def ready(self) -> bool:
        return True

    def registered(self, timeout_s: float = 10.0) -> bool:
        """Registered with the daemon now (ticking here when there is no heartbeat)."""
        if not self.link.background:
            self.orch.tick()
        return self.orch.wait_registered(timeout_s)

    def slots(self, start: int, n: int):
        return self._torch.arange(start, start + n)

    def hold(self, method: str) -> None:
        self._holds[method] = self._stop(self.conn, method)

    def go(self, method: str) -> None:
        self._holds[method].go.set()

    def settled(self, timeout_s: float = 10.0) -> bool:
        """Owes the daemon nothing (paying inline when there is no releaser), bounded."""
        import time

        end = time.monotonic() + timeout_s
        while self.orch.pending_debts():
            if not self.link.background:
                self.link.pay()
            if time.monotonic() > end:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        for h in self._holds.values():
            h.go.set()
        self.orch.close()


def _serve(conn, role: str, port: int, background: bool) -> None:
    """The spawned process: build the side, then run the test's calls until it closes."""
    from lmcache_loadback.connectors.telemetry import quiet_telemetry

    quiet_telemetry()
    side = None
    try:
        side = _Side(role, port, background)
        while True:
            try:
                path, args, kwargs = conn.recv()
            except EOFError:
                return
            try:
                target: Any = side
                for name in path.split("."):
                    target = getattr(target, name)
                value = target(*args, **kwargs) if callable(target) else target
                conn.send((True, value))
            except BaseException:  # noqa: BLE001 - reported to the test, never lost
                conn.send((False, traceback.format_exc()))
            if path == "close":
                return
    except BaseException:  # noqa: BLE001 - the build failed: the test's first call says why
        if side is None:
            try:
                conn.recv()
                conn.send((False, traceback.format_exc()))
            except (EOFError, OSError):
                pass
