"""Traffic and fault steps shared by the end-to-end tests (ours and upstream run the same ones).

Every wait is on a condition with a bound; every request carries a client deadline.
"""

from __future__ import annotations

import dataclasses
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from lmcache_loadback.testing.daemon import DaemonProcess, first_answer
from lmcache_loadback.testing.fault_proxy import FaultProxy, FaultRule
from lmcache_loadback.harness.sglang.server import Generation, SGLangServer

CHUNK = 16
PROMPT_LEN = 160  # 10 whole chunks
NEW_TOKENS = 8
#: How the daemon stops serving and serves again in a recovery phase: SIGSTOP then SIGCONT;
#: SIGKILL and a new daemon behind the proxy (the engine's connection stays open); SIGKILL and
#: a new daemon on the address the engine dials (its connection drops). The direct restart
#: takes the proxy away for good, so it runs last.
RECOVERY_FAULTS = ("hang", "restart_behind_proxy", "restart")
#: The first hit after the daemon serves again, on the defaults: the product's part is within
#: 2 s (tests/integration/test_recovery_defaults.py); the rest of this bound is a loaded 2-core
#: machine (a CPU prefill, the store, a flush and the repeat, each maybe seconds there).
SERVING_TO_HIT_BOUND_S = 15.0


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

    def until_hits(self, max_s: float, store_wait_s: float = 1.5
                   ) -> tuple[float, list[tuple[Generation, Generation]]]:
        """Hit cycles on new prompts until one loads from LMCache; seconds taken (inf if none
        within max_s) and every cycle run."""
        t0, cycles = time.monotonic(), []
        while time.monotonic() - t0 < max_s:
            ref, again = self.hit_cycle(self.new_seed(), store_wait_s=store_wait_s)
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

    def serve_again(self, fault: str, ranks: int = 1) -> float:
        """Stop the daemon serving as `fault` (RECOVERY_FAULTS) says and make it serve again;
        where the engine's connection cannot tell (a hang, a restart behind the proxy) only
        after a probe failed with the breaker's backoff at its cap, every rank's (the worst
        moment). Returns when a client of the test's own first got an answer on the address
        the engine dials. Needs the loadback_* series on SGLang's /metrics (metrics=True)."""
        dialed = f"tcp://127.0.0.1:{self.proxy_port}"
        if fault == "restart":
            self.daemon.kill()
            self.proxy.close()  # the engine's connection drops, as when the daemon it dials dies
            self.daemon = dataclasses.replace(self.daemon, port=self.proxy_port)
            with ThreadPoolExecutor(1) as pool:
                served = pool.submit(first_answer, dialed, 120.0)
                self.daemon.start()
                return served.result()
        opened = self.breaker_opened()
        if fault == "hang":
            self.daemon.pause()
        elif fault == "restart_behind_proxy":
            # nothing of ours reaches the new daemon until it serves (the proxy swallows it)
            self.proxy.add_rule(FaultRule("silence", direction="request"))
            self.daemon.kill()
            self.daemon.start()
        else:
            raise ValueError(f"fault must be one of {RECOVERY_FAULTS}, got {fault!r}")
        # requests' LOOKUPs fail (each at its deadline): the breaker opens sooner than by
        # heartbeats alone; open twice = a probe failed after the first cooldown, at the cap
        wait_until(lambda: self.generate(prompt(self.new_seed())).ok
                   and self.breaker_opened() >= opened + 2 * ranks, 120,
                   f"{fault}: the breaker opened, probed and opened again on every rank")
        if fault == "hang":
            self.daemon.resume()
        else:
            self.proxy.clear()
        return first_answer(dialed, 60.0)

    def first_hit_after(self, served_at: float, max_s: float
                        ) -> tuple[float, list[tuple[Generation, Generation]]]:
        """Hit cycles (a prompt computed after `served_at`, the device tree flushed, asked
        again) until a storage hit: seconds from `served_at` to that hit's answer (inf if none
        within max_s), and the cycles. A short store wait keeps the figure fine-grained."""
        took, cycles = self.until_hits(max_s, store_wait_s=0.25)
        return (time.monotonic() - served_at if took != float("inf") else took), cycles

    def breaker_opened(self) -> float:
        """Times any rank's breaker opened, from SGLang's /metrics (summed over ranks)."""
        return sum(self.metric('loadback_breaker_transitions_total{to="open"}'))

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
