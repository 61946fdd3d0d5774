"""Start, drive and stop a real `python -m sglang.launch_server` on CPU (SGLang's own code,
dummy weights of a tiny llama config), for the SGLang end-to-end tests (tests/sglang/e2e) and
`loadback sglang-demo`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from lmcache_loadback.connectors.ports import free_port
from lmcache_loadback.connectors.telemetry import QUIET_TELEMETRY

HERE = Path(__file__).resolve().parent
TINY_MODEL_DIR = HERE / "model"
STUBS_DIR = HERE / "stubs"
PROBE_DIR = HERE / "probe"  # the scheduler-time probe plugin (`loadback sglang-demo --probe`)
SHM_PREFIX = "/dev/shm/sglang_loads_"


class ServerStartError(RuntimeError):
    pass


class PortTaken(ServerStartError):
    """The server's HTTP port was bound by something else before uvicorn bound it."""


#: What uvicorn logs when its port is taken (SGLang then hangs instead of exiting).
BIND_FAILED = "error while attempting to bind on address"


@dataclass
class Generation:
    """One /generate answer (or its failure): output ids, SGLang's meta_info, client latency."""

    prompt: list[int]
    output_ids: list[int] | None
    meta: dict
    latency_s: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_ids is not None

    @property
    def storage_hit(self) -> int:
        """Tokens SGLang reports as loaded from the storage tier (LMCache) for this request."""
        details = self.meta.get("cached_tokens_details") or {}
        return int(details.get("storage", 0) or 0)


def write_upstream_yaml(path: Path, port: int, *, mq_timeout_s: float) -> Path:
    """An upstream LMCache MP YAML (what `--enable-lmcache` alone reads), with a short mq_timeout
    so its blocking calls give up in seconds rather than 300 s."""
    path.write_text(
        f"mp_host: 127.0.0.1\nmp_port: {port}\n"
        f"extra_config:\n  lmcache.mp.mq_timeout: {mq_timeout_s}\n"
        f"  lmcache.mp.heartbeat_interval: 1\n"
    )
    return path


def write_loadback_yaml(path: Path, port: int, *, chunk_size: int, overrides: str = "") -> Path:
    """This product's YAML for the `loadback` backend; `overrides` is appended verbatim."""
    path.write_text(
        f"mode: mp\nmp_host: 127.0.0.1\nmp_port: {port}\nchunk_size: {chunk_size}\n" + overrides
    )
    return path


def _pids_in_group(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # pgrp is the 5th field, after "pid (comm) state ppid"; comm may hold spaces
        fields = stat.rsplit(")", 1)[1].split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def _shm_files_held(pids: list[int]) -> set[str]:
    held = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(SHM_PREFIX):
                held.add(target)
    return held


@dataclass
class SGLangServer:
    """One SGLang 0.5.23 server on loopback.

    `backend=None` with `lmcache_config` runs upstream's `--enable-lmcache` class; a backend name
    (e.g. "loadback") adds `--radix-cache-backend NAME`. Without `lmcache_config`, no LMCache.
    It runs from a temporary working directory (a folder named like a plugin module in the cwd
    would shadow the installed package), in its own process group (it has children), stopped
    by that group and only that group. The `/dev/shm/sglang_loads_*` file SGLang leaves behind
    is removed only when one of this server's processes held it open.
    """

    python: str
    lmcache_config: Path | None = None
    backend: str | None = None
    model_dir: Path = TINY_MODEL_DIR
    port: int = 0
    page_size: int = 16
    max_total_tokens: int = 4096
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    python_path: list[str] = field(default_factory=list)  # put before the stubs on PYTHONPATH
    log_path: Path | None = None
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    start_s: float = field(default=0.0, init=False)
    _cwd: str | None = field(default=None, init=False, repr=False)
    _shm: set[str] = field(default_factory=set, init=False, repr=False)
    _auto_port: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self._auto_port = self.port == 0
        if self._auto_port:
            self.port = free_port()
        if not (Path(self.model_dir) / "config.json").is_file():
            raise ValueError(f"model_dir {self.model_dir} holds no config.json (a tiny llama "
                             f"config; the repo ships one in {TINY_MODEL_DIR})")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            self.python, "-m", "sglang.launch_server", "--model-path", str(self.model_dir),
            "--device", "cpu", "--load-format", "dummy", "--skip-tokenizer-init",
            "--attention-backend", "torch_native", "--disable-cuda-graph",
            "--sampling-backend", "pytorch", "--disable-overlap-schedule",
            "--max-total-tokens", str(self.max_total_tokens), "--page-size", str(self.page_size),
            "--host", "127.0.0.1", "--port", str(self.port),
        ]
        if self.lmcache_config is not None:
            cmd += ["--enable-lmcache", "--lmcache-config-file", str(self.lmcache_config)]
        if self.backend:
            cmd += ["--radix-cache-backend", self.backend]
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ, **QUIET_TELEMETRY,
                   HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
        path = list(self.python_path) + [str(STUBS_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
        env.update(self.extra_env)
        return env

    # -- lifecycle --------------------------------------------------------------

    def start(self, timeout_s: float = 180.0) -> "SGLangServer":
        """Launch and wait until /health_generate answers 200 (503 during warm-up).

        SGLang whose HTTP port is taken by the time uvicorn binds it logs "address already in
        use" and hangs in its shutdown: that is told at once, and a port this object picked
        itself is picked anew for one more launch."""
        try:
            return self._start(timeout_s)
        except PortTaken as exc:
            if not self._auto_port:
                raise
            print(f"{exc}; starting again on another port", file=sys.stderr, flush=True)
            self.port = free_port()
            return self._start(timeout_s)

    def _start(self, timeout_s: float) -> "SGLangServer":
        if self.proc and self.proc.poll() is None:
            raise ServerStartError(f"server pid {self.proc.pid} is already running")
        self._cwd = tempfile.mkdtemp(prefix="sglang-cwd-")
        if self.log_path is None:
            self.log_path = Path(self._cwd) / "server.log"
        log = open(self.log_path, "ab")
        log_from = log.tell()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.command(), cwd=self._cwd, env=self.env(), stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        log.close()
        deadline = t0 + timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise ServerStartError(
                        f"sglang server exited with {self.proc.returncode} during start; "
                        f"log: {self.log_path}\n{self.log_tail()}")
                if self._healthy():
                    break
                if BIND_FAILED in self._log_since(log_from):
                    raise PortTaken(f"sglang server pid {self.proc.pid} could not bind "
                                    f"127.0.0.1:{self.port} (address already in use)")
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"sglang server on {self.url} not ready within {timeout_s:.0f} s; "
                        f"log: {self.log_path}\n{self.log_tail()}")
                time.sleep(0.5)  # poll interval of a readiness probe, not a wait for an event
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0
        self._shm |= _shm_files_held(_pids_in_group(self.proc.pid))
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health_generate", timeout=5) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def stop(self, timeout_s: float = 30.0) -> float:
        """SIGTERM the process group, SIGKILL what is left after `timeout_s`; returns seconds."""
        if self.proc is None:
            return 0.0
        t0 = time.monotonic()
        pgid = self.proc.pid
        self._shm |= _shm_files_held(_pids_in_group(pgid))
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            end = time.monotonic() + wait_s
            while _pids_in_group(pgid) and time.monotonic() < end:
                if self.proc.poll() is None:
                    try:
                        self.proc.wait(timeout=0.2)
                    except subprocess.TimeoutExpired:
                        pass
                else:
                    time.sleep(0.1)  # children still exiting
            if not _pids_in_group(pgid):
                break
        if self.proc.poll() is None:
            self.proc.wait(timeout=5)
        for path in self._shm:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._shm.clear()
        if self._cwd and not self._log_in_cwd():  # keep a log written there for the reader
            shutil.rmtree(self._cwd, ignore_errors=True)
        self.proc = None
        return time.monotonic() - t0

    def _log_in_cwd(self) -> bool:
        return self.log_path is not None and Path(self._cwd) in Path(self.log_path).parents

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except (OSError, TypeError):
            return ""

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- HTTP -------------------------------------------------------------------

    def _post(self, path: str, body: dict | None, timeout_s: float) -> dict:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            return {"text": raw.decode(errors="replace")}

    def generate(self, input_ids: list[int], *, max_new_tokens: int = 8,
                 timeout_s: float = 60.0) -> Generation:
        """Greedy (temperature 0) generation from token ids, bounded by a client deadline:
        a request not answered in `timeout_s` comes back with error "timeout"."""
        body = {"input_ids": list(input_ids),
                "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
        t0 = time.monotonic()
        try:
            out = self._post("/generate", body, timeout_s)
        except TimeoutError:
            return Generation(list(input_ids), None, {}, time.monotonic() - t0, "timeout")
        except urllib.error.URLError as exc:
            kind = "timeout" if isinstance(exc.reason, TimeoutError) else f"error: {exc}"
            return Generation(list(input_ids), None, {}, time.monotonic() - t0, kind)
        except OSError as exc:
            return Generation(list(input_ids), None, {}, time.monotonic() - t0, f"error: {exc}")
        return Generation(list(input_ids), out.get("output_ids"), out.get("meta_info", {}),
                          time.monotonic() - t0)

    def generate_async(self, input_ids: list[int], **kw) -> "Pending":
        return Pending(self, input_ids, kw)

    def flush_cache(self, timeout_s: float = 30.0) -> bool:
        """Drop SGLang's device radix tree (`/flush_cache`). SGLang refuses (400) while requests
        run or wait; retried until `timeout_s`. Returns whether the tree was flushed."""
        end = time.monotonic() + timeout_s
        while True:
            try:
                self._post("/flush_cache", None, 10)
                return True
            except (urllib.error.HTTPError, OSError):
                if time.monotonic() > end:
                    return False
                time.sleep(0.2)  # retry interval while SGLang drains its queue


class Pending:
    """A /generate running in a thread; `result()` waits for it (bounded by its deadline)."""

    def __init__(self, server: SGLangServer, input_ids: list[int], kw: dict) -> None:
        self._out: list[Generation] = []
        self._thread = threading.Thread(
            target=lambda: self._out.append(server.generate(input_ids, **kw)), daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout_s: float = 300.0) -> Generation:
        self._thread.join(timeout_s)
        if not self._out:
            raise TimeoutError("the /generate thread did not finish (its own deadline failed)")
        return self._out[0]
