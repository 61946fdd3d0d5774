"""Find and run the real Prometheus server and promtool for tests.

Who calls what: tests/integration/test_prometheus.py calls `find_prometheus()` and
`PrometheusServer(...)` as a context manager, then `query()` / `wait_for()`; the server is
stopped by the PID this module started, never by name. Installing the binaries is the test
command's set-up (`make test` installs Debian's `prometheus` package when they are missing),
never a test's side effect.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lmcache_loadback.testing.daemon import free_port

__all__ = ["PrometheusTools", "PrometheusUnavailable", "find_prometheus", "PrometheusServer",
           "INSTALL_HINT"]

INSTALL_HINT = ("run the tests through `make test` (it installs them), or install them: "
                "apt-get update && apt-get install -y --no-install-recommends prometheus")


class PrometheusUnavailable(RuntimeError):
    """prometheus/promtool are not installed (the message says how to install them)."""


@dataclass(frozen=True)
class PrometheusTools:
    prometheus: str
    promtool: str


def _which() -> tuple[str | None, str | None]:
    # Debian installs to /usr/bin; a PATH without it (minimal CI shells) still finds it here.
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/bin" + os.pathsep + "/usr/local/bin"
    return shutil.which("prometheus", path=path), shutil.which("promtool", path=path)


def find_prometheus() -> PrometheusTools:
    """Return the installed binaries, or raise PrometheusUnavailable naming the fix."""
    prom, tool = _which()
    if prom and tool:
        return PrometheusTools(prom, tool)
    missing = " and ".join(n for n, b in (("prometheus", prom), ("promtool", tool)) if not b)
    raise PrometheusUnavailable(f"{missing} not found on PATH or in /usr/bin; {INSTALL_HINT}")


def _get_json(url: str, timeout: float = 2.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


class PrometheusServer:
    """A real `prometheus` process on 127.0.0.1:<free port> scraping the given targets."""

    def __init__(self, binary: str, targets: list[str], *, scrape_interval: str = "1s",
                 rule_files: list[str] | None = None, start_timeout_s: float = 60.0) -> None:
        self.binary = binary
        self.targets = targets
        self.scrape_interval = scrape_interval
        self.rule_files = [str(Path(p).resolve()) for p in (rule_files or [])]
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._tmp: tempfile.TemporaryDirectory | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        assert self._tmp is not None
        return Path(self._tmp.name) / "prometheus.log"

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _write_config(self, tmp: Path) -> Path:
        cfg = tmp / "prometheus.yml"
        lines = ["global:", f"  scrape_interval: {self.scrape_interval}",
                 f"  evaluation_interval: {self.scrape_interval}"]
        if self.rule_files:
            lines += ["rule_files:"] + [f"  - {json.dumps(p)}" for p in self.rule_files]
        lines += ["scrape_configs:", "  - job_name: loadback", f"    scrape_timeout: {self.scrape_interval}",
                  "    static_configs:", f"      - targets: {json.dumps(self.targets)}"]
        cfg.write_text("\n".join(lines) + "\n")
        return cfg

    def start(self) -> "PrometheusServer":
        self._tmp = tempfile.TemporaryDirectory(prefix="loadback-prom-")
        tmp = Path(self._tmp.name)
        cfg = self._write_config(tmp)
        self.port = free_port()
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp)
        log.close()
        try:
            self.wait_for(self._ready, self.start_timeout_s, "prometheus /-/ready")
        except Exception:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with rc={self.proc.returncode}:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.base_url}/-/ready", timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def stop(self) -> None:
        """Stop the process this object started (by its PID), then remove its files."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "PrometheusServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> dict:
        """GET /api/v1/<path>; returns `data` or raises with Prometheus' error."""
        url = f"{self.base_url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            body = _get_json(url)
        except urllib.error.HTTPError as e:
            body = json.loads(e.read().decode() or "{}")
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[tuple[dict, float]]:
        """Instant query: [(labels, value)] for a vector, [({}, value)] for a scalar."""
        data = self.api("query", query=expr)
        if data["resultType"] == "vector":
            return [(r["metric"], float(r["value"][1])) for r in data["result"]]
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        raise RuntimeError(f"unexpected resultType {data['resultType']} for {expr}")

    @staticmethod
    def wait_for(pred: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.2) -> float:
        """Poll `pred` until true or a bounded deadline; returns the seconds it took."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while True:
            if pred():
                return time.monotonic() - t0
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what}: not true after {timeout_s:.0f}s")
            time.sleep(poll_s)
