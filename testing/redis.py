"""Start, break and stop a real Redis server (Debian's `redis-server`) as a subprocess: the
L2 store that LMCache daemons share (`--l2-adapter`).

Who calls what: tests/integration/test_fleet_l2.py starts a `RedisServer` (one node) or a
`RedisCluster` (3 shards) and hands `l2_adapter(...)` to `DaemonProcess(l2_adapter=...)`;
`loadback fleet check` uses `resp_command` to PING an L2 node a daemon names. Every process
here is ended by the PID this module started, never by name. Installing the binaries is the
test command's set-up (`make redis-tools`), never a test's side effect.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from lmcache_loadback.connectors.ports import check_port_free, ephemeral_low, free_port

from .daemon import stop_process

__all__ = ["INSTALL_HINT", "RedisCluster", "RedisServer", "RedisUnavailable", "find_redis",
           "resp_command"]

INSTALL_HINT = ("run the tests through `make test` (its redis-tools target installs it), or: "
                "apt-get update && apt-get install -y --no-install-recommends redis-server")


class RedisUnavailable(RuntimeError):
    """redis-server / redis-cli are not installed (the message says how to install them)."""


def find_redis() -> tuple[str, str]:
    """(redis-server, redis-cli), or RedisUnavailable naming the fix."""
    # Debian installs to /usr/bin; a PATH without it (minimal CI shells) still finds it here.
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/bin"
    server, cli = shutil.which("redis-server", path=path), shutil.which("redis-cli", path=path)
    if server and cli:
        return server, cli
    raise RedisUnavailable(f"redis-server and redis-cli must be installed; {INSTALL_HINT}")


def resp_command(host: str, port: int, *args: str, timeout_s: float = 2.0) -> str:
    """One RESP command, its reply as text (simple string, integer, bulk string; an error
    raises). Enough for PING, INFO, DBSIZE, CLUSTER INFO: no client package needed."""
    req = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.settimeout(timeout_s)
        s.sendall(req.encode())
        f = s.makefile("rb")
        head = f.readline().decode().rstrip("\r\n")
        if not head:
            raise ConnectionError(f"{host}:{port} closed the connection")
        kind, rest = head[0], head[1:]
        if kind == "-":
            raise RuntimeError(f"{host}:{port} {args[0]}: {rest}")
        if kind == "$":
            n = int(rest)
            return "" if n < 0 else f.read(n + 2)[:n].decode(errors="replace")
        return rest


def _free_cluster_port() -> int:
    """A free port P whose cluster bus port P + 10000 is free too, both below the ephemeral
    range (`free_port` says why)."""
    for _ in range(200):
        p = free_port(below=ephemeral_low() - 10000)
        if p + 10000 < 65536:
            try:
                check_port_free("127.0.0.1", p + 10000)
                return p
            except OSError:
                pass
    raise OSError("no free port P with P + 10000 free for a cluster node")


@dataclass
class RedisServer:
    """One redis-server on 127.0.0.1: no persistence, `maxmemory` with `policy`."""

    port: int = 0
    maxmemory: str = "64mb"
    policy: str = "allkeys-lru"
    cluster: bool = False
    dir: str | None = None
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    starts: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.port == 0:
            self.port = _free_cluster_port() if self.cluster else free_port()
        if self.dir is None:
            self.dir = tempfile.mkdtemp(prefix="loadback-redis-")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def log_path(self) -> Path:
        return Path(self.dir) / f"redis-{self.port}.log"

    def command(self) -> list[str]:
        args = [find_redis()[0], "--bind", "127.0.0.1", "--port", str(self.port),
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", self.dir,
                "--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy]
        if self.cluster:
            # A dead shard then cuts only its own chunks; with `yes` it zeroes every hit.
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf",
                     "--cluster-require-full-coverage", "no"]
        return args

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        if self.proc and self.proc.poll() is None:
            raise RuntimeError(f"redis pid {self.proc.pid} is already running")
        check_port_free("127.0.0.1", self.port)
        log = open(self.log_path, "ab")
        # No `cd` or shell: the PID is redis's own, not a wrapper's.
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis on {self.address} no PONG within {timeout_s} s\n{self.log_tail()}")

    def ping(self) -> bool:
        try:
            return resp_command("127.0.0.1", self.port, "PING", timeout_s=0.5) == "PONG"
        except (OSError, RuntimeError):
            return False

    def command_reply(self, *args: str) -> str:
        return resp_command("127.0.0.1", self.port, *args)

    def dbsize(self) -> int:
        return int(self.command_reply("DBSIZE"))

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    # -- faults (as DaemonProcess's), each only to the PID this object started ----------

    def _alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pause(self, settle_s: float = 2.0) -> None:
        """SIGSTOP: the server hangs with its sockets open; returns once it shows stopped."""
        if self._alive():
            stop_process(self.proc.pid, settle_s)

    def resume(self) -> None:
        if self._alive():
            os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        self.stop(timeout_s=0)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (after SIGCONT: a paused server cannot exit), SIGKILL after `timeout_s`
        (0: SIGKILL at once, as a crash)."""
        for sig in ((signal.SIGCONT, signal.SIGTERM) if timeout_s > 0 else ()) + (signal.SIGKILL,):
            if not self._alive():
                return
            os.kill(self.proc.pid, sig)
            if sig == signal.SIGTERM:
                try:
                    self.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    pass
        self.proc.wait(timeout=30)

    def restart(self, *, hard: bool = True, timeout_s: float = 10.0) -> None:
        """Kill (or stop) and start again on the same port: empty (no persistence)."""
        self.kill() if hard else self.stop()
        for _ in range(200):  # the port can linger a moment after the exit
            try:
                check_port_free("127.0.0.1", self.port)
                break
            except OSError:
                time.sleep(0.05)
        self.start(timeout_s)

    def l2_adapter(self, kind: str = "resp", **extra) -> dict:
        """The daemon's `--l2-adapter` JSON for this server (resp: no extra package;
        valkey: bounded calls and reconnects, needs valkey-glide-sync)."""
        if kind == "resp":
            return {"type": "resp", "host": "127.0.0.1", "port": self.port, "num_workers": 8,
                    **extra}
        return {"type": "valkey", "startup_nodes": self.address, "request_timeout": 0.5, **extra}

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class RedisCluster:
    """`shards` redis-servers in cluster mode, joined with no replicas (every slot covered)."""

    shards: int = 3
    maxmemory: str = "64mb"
    nodes: list[RedisServer] = field(default_factory=list, init=False)

    def start(self, timeout_s: float = 20.0) -> "RedisCluster":
        root = tempfile.mkdtemp(prefix="loadback-redis-cluster-")
        try:
            for i in range(self.shards):
                d = Path(root) / f"n{i}"
                d.mkdir()
                self.nodes.append(RedisServer(maxmemory=self.maxmemory, cluster=True,
                                              dir=str(d)).start())
            cli = find_redis()[1]
            subprocess.run([cli, "--cluster", "create", *[n.address for n in self.nodes],
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, capture_output=True, timeout=timeout_s,
                           stdin=subprocess.DEVNULL)
            self._wait_ok(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.command_reply("CLUSTER", "INFO") for n in self.nodes):
                return
            time.sleep(0.05)
        raise RuntimeError(f"cluster {self.startup_nodes} not cluster_state:ok within {timeout_s} s")

    @property
    def startup_nodes(self) -> str:
        return ",".join(n.address for n in self.nodes)

    def dbsize(self) -> int:
        return sum(n.dbsize() for n in self.nodes)

    def l2_adapter(self, **extra) -> dict:
        """valkey in cluster_mode: the only 0.5.6 adapter that follows MOVED."""
        return {"type": "valkey", "startup_nodes": self.startup_nodes, "cluster_mode": True,
                "request_timeout": 0.5, **extra}

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> "RedisCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
