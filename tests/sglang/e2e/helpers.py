"""Traffic and fault steps shared by the end-to-end tests (ours and upstream run the same ones).

Every wait is on a condition with a bound; every request carries a client deadline.
"""

from __future__ import annotations

import random
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.testing.fault_proxy import FaultProxy, FaultRule
from lmcache_loadback.harness.sglang.server import Generation, SGLangServer

CHUNK = 16
PROMPT_LEN = 160  # 10 whole chunks
NEW_TOKENS = 8


def prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def wait_until(cond, timeout_s: float, what: str, poll_s: float = 0.05) -> float:
    """Poll `cond` until true; returns the seconds it took, fails naming `what` after timeout_s."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(poll_s)  # poll interval while waiting on a condition
    return time.monotonic() - t0


def loaded_tokens(gen: Generation) -> int:
    """Tokens SGLang says came from LMCache (storage tier; no host tier runs in these servers)."""
    details = gen.meta.get("cached_tokens_details") or {}
    return int(details.get("storage", 0) or 0) + int(details.get("host", 0) or 0)


@dataclass
class Stack:
    """One SGLang server, its daemon and the fault proxy between them."""

    server: SGLangServer
    daemon: DaemonProcess
    proxy: FaultProxy | None
    deadline_s: float  # client deadline of every request
    proxy_port: int = 0
    seeds: int = 1000
    stored: bool = False  # whether the last cold() prompt reached the daemon
    config_path: Path | None = None  # the server's --lmcache-config-file
    log: list[Generation] = field(default_factory=list)

    def new_seed(self) -> int:
        self.seeds += 1
        return self.seeds

    def generate(self, ids: list[int], timeout_s: float | None = None) -> Generation:
        gen = self.server.generate(ids, max_new_tokens=NEW_TOKENS,
                                   timeout_s=timeout_s or self.deadline_s)
        self.log.append(gen)
        return gen

    def objects(self) -> int:
        try:
            return self.daemon.held()["objects"]
        except OSError:
            return 0

    def cold(self, ids: list[int], store_wait_s: float = 10.0) -> Generation:
        """First ever generation of a new prompt: nothing can hit, so it is the recompute
        reference; the daemon stores it (waited for, bounded) when the backend is connected."""
        before = self.objects()
        gen = self.generate(ids)
        if gen.ok:
            assert gen.meta.get("cached_tokens", 0) == 0, f"a new prompt hit a cache: {gen.meta}"
        self.stored = gen.ok and _try_wait(
            lambda: self.objects() >= before + len(ids) // CHUNK, store_wait_s)
        return gen

    def hit_cycle(self, seed: int, store_wait_s: float = 1.5) -> tuple[Generation, Generation]:
        """A new prompt computed (and stored), the device tree flushed, the prompt again."""
        ids = prompt(seed)
        # a connected backend stores as the request finishes (measured: within ms); a short
        # wait keeps recovery figures fine-grained while it is not connected yet
        ref = self.cold(ids, store_wait_s=store_wait_s)
        if not self.server.flush_cache(timeout_s=self.deadline_s):
            return ref, Generation(ids, None, {}, 0.0, "flush_cache refused (requests queued)")
        return ref, self.generate(ids)

    def until_hits(self, max_s: float) -> tuple[float, list[tuple[Generation, Generation]]]:
        """Hit cycles on new prompts until one loads from LMCache; seconds taken (inf if none
        within max_s) and every cycle run."""
        t0, cycles = time.monotonic(), []
        while time.monotonic() - t0 < max_s:
            ref, again = self.hit_cycle(self.new_seed())
            cycles.append((ref, again))
            if loaded_tokens(again) > 0:
                return time.monotonic() - t0, cycles
        return float("inf"), cycles

    def fault_before_answer(self, op: str, ids: list[int]):
        """Send `ids`; the proxy swallows its first `op` request, and the daemon is SIGKILLed once
        it has (so the daemon never answers it). Returns the pending generation."""
        rule = self.proxy.add_rule(FaultRule("drop", op=op, direction="request", count=1))
        pending = self.server.generate_async(ids, max_new_tokens=NEW_TOKENS,
                                              timeout_s=self.deadline_s)
        wait_until(lambda: self.proxy.fired(rule) >= 1, 60, f"the request's {op} reaching the proxy")
        self.daemon.kill()
        self.proxy.clear()
        return pending

    def metric(self, series: str) -> list[float]:
        """Every sample of `series` (a name, or a name with its labels as exposed) on SGLang's
        own /metrics (--enable-metrics): one per process for a per-process gauge."""
        with urllib.request.urlopen(self.server.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out = []
        for line in text.splitlines():
            name = line.split(" ", 1)[0]
            if name == series or (name.startswith(series + "{") and "{" not in series):
                out.append(float(line.rsplit(" ", 1)[1]))
        return out

    def close(self) -> float:
        """Stop server (by process group), proxy and daemon; idempotent. Returns stop seconds."""
        stop_s = self.server.stop()
        if self.proxy is not None:
            self.proxy.close()
        self.daemon.stop()
        return stop_s


def _try_wait(cond, timeout_s: float) -> bool:
    try:
        wait_until(cond, timeout_s, "stored")
        return True
    except AssertionError:
        return False
