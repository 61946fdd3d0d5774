"""Start, break and stop a real LMCache 0.5.6 MP daemon as a subprocess.

Used by the tests, `loadback demo` and the chaos harness. Every process it starts it
ends by PID, and only those. Telemetry is always off.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from lmcache_loadback.connectors.errors import ConnectorError
from lmcache_loadback.connectors.ports import check_port_free, free_port
from lmcache_loadback.connectors.telemetry import QUIET_TELEMETRY
from lmcache_loadback.connectors.transport import ZmqTransport


#: Every kind of hold a client can leave on the daemon, which an idle daemon must have given
#: back: a judge that counts fewer passes leaks of the kinds it leaves out (a pending write is
#: a write lock; a LOOKUP's prefetch job lives until its status was read).
CLIENT_HOLDS = ("read_locks", "write_locks", "sessions", "prefetch_jobs")


def held_in_status(st: dict) -> dict[str, int]:
    """The holds in one `/status` answer of the daemon (lmcache 0.5.6's field names)."""
    l1 = st["storage_manager"]["l1_manager"]
    return {
        "read_locks": int(l1["read_locked_count"]),
        "write_locks": int(l1["write_locked_count"]),
        "sessions": int(st["active_sessions"]),
        "registered": len(st.get("registered_non_cuda_instance_ids", [])),
        "prefetch_jobs": int(st["active_prefetch_jobs"]),  # the lookup module's count
        "objects": int(l1["total_object_count"]),
    }


def stop_process(pid: int, settle_s: float = 2.0) -> bool:
    """SIGSTOP `pid` and wait until the kernel shows every thread of it stopped (state T in
    /proc): a signal is delivered asynchronously, and a request sent right after kill()
    returns can still be served. False if it did not show stopped within `settle_s`."""
    os.kill(pid, signal.SIGSTOP)
    tasks = Path(f"/proc/{pid}/task")
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        try:
            if all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] in "Tt"
                   for t in tasks.iterdir()):
                return True
        except OSError:
            return False  # gone
        time.sleep(0.0005)
    return False


def first_answer(endpoint: str, timeout_s: float = 30.0) -> float:
    """The monotonic time a client of our own first got an answer (noop) from the daemon at
    `endpoint`: when it serves again, as its users could see it (bounded)."""
    probe = ZmqTransport(endpoint, connect_timeout_s=0.5)
    end = time.monotonic() + timeout_s
    try:
        while time.monotonic() < end:
            try:
                probe.call("noop", [], 0.2)
                return time.monotonic()
            except ConnectorError:
                continue
    finally:
        probe.close()
    raise AssertionError(f"{endpoint} did not answer within {timeout_s} s")


class DaemonStartError(RuntimeError):
    pass


@dataclass
class DaemonProcess:
    """One daemon on loopback. `http=True` adds the admin API (`/status` lock counts)."""

    port: int = 0
    host: str = "127.0.0.1"
    chunk_size: int = 16
    l1_size_gb: float = 0.25
    shm_name: str | None = None
    http: bool = False
    extra_args: list[str] = field(default_factory=list)
    log_dir: str | None = None
    #: `--l2-adapter` JSON (e.g. `testing.redis.RedisServer.l2_adapter()`): an L2 store shared
    #: with other daemons; None runs L1 only.
    l2_adapter: dict | None = None
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    http_port: int = field(default=0, init=False)
    starts: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.port == 0:
            self.port = free_port(self.host)
        if self.log_dir is None:
            self.log_dir = tempfile.mkdtemp(prefix="lmcache-daemon-")

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def log_path(self) -> Path:
        return Path(self.log_dir) / f"daemon-{self.port}.log"

    def command(self) -> list[str]:
        args = [
            "--host", self.host, "--port", str(self.port),
            "--l1-size-gb", str(self.l1_size_gb), "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto", "--chunk-size", str(self.chunk_size),
            "--disable-metrics", "--no-l1-use-lazy",
        ]
        if self.shm_name:
            args += ["--shm-name", self.shm_name]
        if self.l2_adapter is not None:
            args += ["--l2-adapter", json.dumps(self.l2_adapter)]
        if self.http:
            if not self.http_port:
                self.http_port = free_port(self.host)
            exe = Path(sys.executable).with_name("lmcache")
            head = [str(exe), "server"]
            args += ["--http-host", self.host, "--http-port", str(self.http_port)]
        else:
            head = [sys.executable, "-m", "lmcache.v1.multiprocess.server"]
        return head + args + list(self.extra_args)

    def start(self, timeout_s: float = 90.0) -> "DaemonProcess":
        if self.proc and self.proc.poll() is None:
            raise DaemonStartError(f"daemon pid {self.proc.pid} is already running")
        check_port_free(self.host, self.port)
        env = dict(os.environ, **QUIET_TELEMETRY, PYTHONWARNINGS="ignore")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )
        log.close()
        self.starts += 1
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        probe = ZmqTransport(self.endpoint, connect_timeout_s=0.5)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise DaemonStartError(
                        f"daemon exited with {self.proc.returncode} during start; "
                        f"log: {self.log_path}\n{self.log_tail()}"
                    )
                try:
                    probe.call("noop", [], 0.5)
                except ConnectorError:
                    continue
                if self.http and not self._http_ready():
                    time.sleep(0.05)
                    continue
                return
        finally:
            probe.close()
        self.kill()
        raise DaemonStartError(
            f"daemon on {self.endpoint} not ready within {timeout_s:.0f} s; "
            f"log: {self.log_path}\n{self.log_tail()}"
        )

    def _http_ready(self) -> bool:
        try:
            self.status()
            return True
        except OSError:
            return False

    def status(self) -> dict:
        """The daemon's `/status` (requires http=True): locks, sessions, registrations."""
        if not self.http:
            raise RuntimeError("start the daemon with http=True to read its status")
        url = f"http://{self.host}:{self.http_port}/status"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())

    def held(self) -> dict[str, int]:
        """What the daemon still holds for clients: read locks, sessions, registrations."""
        return held_in_status(self.status())

    def client_holds(self) -> dict[str, int]:
        """Every kind of hold in `CLIENT_HOLDS` the daemon still has, the zeros left out: `{}`
        is a daemon that holds nothing for any client."""
        held = self.held()
        return {k: held[k] for k in CLIENT_HOLDS if held[k]}

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    # -- faults --------------------------------------------------------------

    def _signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def pause(self, settle_s: float = 2.0) -> None:
        """SIGSTOP: the daemon hangs with its sockets open. Returns once the kernel shows it
        stopped (signals are delivered asynchronously), or after `settle_s`."""
        if self.proc and self.proc.poll() is None:
            stop_process(self.proc.pid, settle_s)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL and reap. No SIGCONT first: SIGKILL ends a stopped process as it is, and a
        paused daemon resumed even for an instant answers what is waiting in its sockets."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if not self.proc or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self, *, hard: bool = True, timeout_s: float = 90.0) -> None:
        """Kill (or stop) and start again on the same port: every client state is lost."""
        self.kill() if hard else self.stop()
        deadline = time.monotonic() + 10
        while True:
            try:
                check_port_free(self.host, self.port)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.start(timeout_s)

    def __enter__(self) -> "DaemonProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
