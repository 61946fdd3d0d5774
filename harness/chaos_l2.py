"""L2 chaos: the daemon's L2 store, a real redis-server (one node, or a 3-shard Redis Cluster),
broken on purpose while the daemon itself stays up.

A scenario with an `l2` section (`L2Setup`) starts the store, then the engines' daemon and a
second node on the same store (`Peer`): its own daemon, and a writer that stores through it
each engine's next prompts a few rounds before the engine asks for them. The engines' daemon
has never seen those prompts, so their chunks are hits only through L2, as in a fleet where
another server computed them (each engine still stores what it computed, through its own
daemon, as production does). The fault (`l2_*` kinds) acts on the store's PIDs: SIGKILL,
SIGSTOP, a restart (empty: no persistence), absent when the daemons start, one cluster shard
killed, maxmemory lowered (the store full, evicting chunk by chunk). The harness samples the
store's reads (GET calls) after every round, so the verdict says how many reads the store
served in each phase, and when an engine hit again in a round the store served reads
(`L2Verdict`).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import torch

from lmcache_loadback.connectors.errors import ConnectorError
from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.testing.daemon import DaemonProcess, DaemonStartError
from lmcache_loadback.testing.redis import RedisCluster, RedisServer, resp_command

from .workload import Workload, prefix_kv, write_kv

__all__ = ["L2_KINDS", "L2Rig", "L2Setup", "L2Verdict", "RoundSamples", "Supervisor", "l2_verdict"]

#: Fault kinds that act on the store, never on the daemon.
L2_KINDS = ("l2_kill", "l2_hang", "l2_restart", "l2_absent_at_start", "l2_shard_lost",
            "l2_full")
#: A store node the harness reads its counters from answers within this, or is skipped.
SAMPLE_TIMEOUT_S = 0.2


class L2Setup(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A scenario's L2 store and the engines' daemon in front of it."""

    # valkey: bounded calls, reconnects (the safe default); resp: no timeout, never reconnects
    adapter: Literal["valkey", "resp"] = "valkey"
    shards: int = 1             # 3: a Redis Cluster, the valkey adapter in cluster_mode
    maxmemory: str = "64mb"     # the store's, with allkeys-lru (as docs/operations.md says)
    request_timeout_s: float = 0.5  # valkey's request_timeout
    # The first engine runs the L2 canary this often (0: none); production runs one per engine.
    canary_interval_ms: float = 500.0
    # The peer stores each engine's prompt this many rounds before the engine asks for it:
    # time for its daemon's L2 write, which starts after STORE returns.
    peer_lead_rounds: int = 5

    def __post_init__(self) -> None:
        if self.shards not in (1, 3):
            raise ValueError("l2.shards: 1 (one redis-server) or 3 (a Redis Cluster)")
        if self.shards > 1 and self.adapter != "valkey":
            raise ValueError("l2.shards 3 needs adapter valkey: resp does not speak Redis Cluster")


class L2Rig:
    """The store of one run: started before the daemon (unless absent at start), broken and
    healed by the fault, its read counters sampled, stopped last. Every process it ends is
    one it started (by PID, through testing.redis)."""

    def __init__(self, setup: L2Setup) -> None:
        self.setup = setup
        self.cluster = RedisCluster(shards=3, maxmemory=setup.maxmemory) if setup.shards > 1 else None
        self.single = None if self.cluster else RedisServer(maxmemory=setup.maxmemory)
        #: Nodes the fault took down (killed or stopped): never asked for their counters.
        self.down: set[int] = set()
        self._last: dict[int, int] = {}   # each node's GET calls, as last read
        self._base: dict[int, int] = {}   # what its earlier incarnations served

    @property
    def nodes(self) -> list[RedisServer]:
        return self.cluster.nodes if self.cluster else [self.single]

    def start(self) -> None:
        if self.cluster:
            self.cluster.start()
        else:
            self.single.start()

    def adapter(self) -> dict:
        """The daemon's `--l2-adapter` JSON."""
        timeout = {"request_timeout": self.setup.request_timeout_s}
        if self.cluster:
            return self.cluster.l2_adapter(**timeout)
        if self.setup.adapter == "resp":
            return self.single.l2_adapter("resp")
        return self.single.l2_adapter("valkey", **timeout)

    # -------------------------------------------------------------- the faults

    def begin(self, kind: str, maxmemory: str) -> None:
        if kind == "l2_kill":
            self._take_down(0, RedisServer.kill)
        elif kind == "l2_hang":
            self._take_down(0, RedisServer.pause)
        elif kind == "l2_restart":
            self._restart(0)
        elif kind == "l2_shard_lost":
            self._take_down(len(self.nodes) - 1, RedisServer.kill)
        elif kind == "l2_full":
            for node in self.nodes:
                node.command_reply("CONFIG", "SET", "maxmemory", maxmemory)

    def end(self, kind: str) -> None:
        if kind in ("l2_kill", "l2_shard_lost"):
            i = 0 if kind == "l2_kill" else len(self.nodes) - 1
            self.nodes[i].start()  # the same port (and cluster config): empty
            self.down.discard(i)
        elif kind == "l2_hang":
            self.nodes[0].resume()
            self.down.discard(0)
        elif kind == "l2_absent_at_start":
            self.start()
        elif kind == "l2_full":
            for node in self.nodes:
                node.command_reply("CONFIG", "SET", "maxmemory", self.setup.maxmemory)

    def _take_down(self, i: int, how) -> None:
        self.down.add(i)
        how(self.nodes[i])

    def _restart(self, i: int) -> None:
        self.down.add(i)
        self.nodes[i].restart()
        self.down.discard(i)

    # -------------------------------------------------------------- what it served

    def reads(self) -> int:
        """GET calls the store served since it first started, over every node and every
        incarnation (a restarted node counts from 0 again); nodes the fault took down keep
        their last count."""
        for i, node in enumerate(self.nodes):
            if i in self.down or node.proc is None or node.proc.poll() is not None:
                continue
            try:
                stats = resp_command("127.0.0.1", node.port, "INFO", "commandstats",
                                     timeout_s=SAMPLE_TIMEOUT_S)
            except (OSError, RuntimeError):
                continue
            n = _calls(stats, "get")
            if n < self._last.get(i, 0):  # a new incarnation
                self._base[i] = self._base.get(i, 0) + self._last[i]
            self._last[i] = n
        return sum(self._base.values()) + sum(self._last.values())

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _calls(commandstats: str, command: str) -> int:
    """`calls=` of one command in an `INFO commandstats` reply (0 when never called)."""
    for line in commandstats.splitlines():
        if line.startswith(f"cmdstat_{command}:"):
            return int(line.split("calls=", 1)[1].split(",", 1)[0])
    return 0


#: The peer's KV pool, in slots: the longest prompt it stores (longer ones are skipped).
PEER_SLOTS = 8192
#: The peer's bound on one STORE (its store may hang with the L2 store: it then skips ahead).
PEER_STORE_S = 2.0


class Peer:
    """The second node: daemon B on the same store, and a writer process that stores each
    engine's prompts through it `lead` rounds ahead (its own replica of every engine's
    workload stream, seed and stream alike: the same prompts in the same order; the KV as the
    engines' prefill makes it, so loads of it are checked byte for byte). `ahead(i)` from the
    harness before round i; the writer never blocks a round."""

    def __init__(self, layout: KVLayout, seed: int, engines: int, adapter: dict,
                 lead: int) -> None:
        self.daemon = DaemonProcess(chunk_size=layout.chunk_size, l2_adapter=adapter)
        self._args = (layout, seed, engines, lead)
        self._ctx = mp.get_context("spawn")
        self._target = self._ctx.Value("i", 0)
        self._stored = self._ctx.Array("i", 2)  # prompts stored, stores that failed
        self._wake = self._ctx.Event()
        self._stop = self._ctx.Event()
        self.proc = None

    def start_writer(self) -> None:
        self.proc = self._ctx.Process(target=peer_main, name="chaos-l2-peer", daemon=True, args=(
            self.daemon.endpoint, *self._args, self._target, self._stored, self._wake,
            self._stop))
        self.proc.start()

    def ahead(self, round_index: int) -> None:
        self._target.value = round_index + self._args[3]
        self._wake.set()

    @property
    def stored(self) -> tuple[int, int]:
        """(prompts stored through B, stores that failed)."""
        return self._stored[0], self._stored[1]

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.proc is not None:
            self.proc.join(timeout=PEER_STORE_S * 4 + 10)
            if self.proc.is_alive():
                self.proc.kill()  # our own child, by its handle
                self.proc.join(timeout=5)
        self.daemon.stop()


def peer_main(endpoint: str, layout: KVLayout, seed: int, engines: int, lead: int, target,
              stored, wake, stop) -> None:
    """The peer's writer process: for every round up to the harness's target, draw each
    engine's prompt from its replica stream; store it through B unless its round is already
    closer than `lead` (the engine may be asking for it)."""
    torch.set_num_threads(1)
    streams = [Workload(layout, seed, stream=i) for i in range(engines)]
    pool = KVPool([torch.zeros(PEER_SLOTS, layout.num_heads, layout.head_dim, dtype=layout.dtype)
                   for _ in range(layout.num_layers)],
                  [torch.zeros(PEER_SLOTS, layout.num_heads, layout.head_dim, dtype=layout.dtype)
                   for _ in range(layout.num_layers)])
    conn = LMCacheMPConnector(endpoint, layout, transfer="pickle")
    registered, done = False, 0
    try:
        while not stop.is_set():
            wake.wait(0.5)  # the harness wakes it each round; the timeout bounds a stop
            wake.clear()
            goal = target.value
            while done < goal and not stop.is_set():
                prompts = [w.next_prompt()[0] for w in streams]
                if done > goal - lead:  # at least a round ahead; else the engines ask now
                    registered = _peer_store(conn, layout, pool, prompts, done, registered,
                                             stored)
                done += 1
    finally:
        try:
            conn.unregister(1.0)
        except ConnectorError:
            pass
        conn.close()


def _peer_store(conn: LMCacheMPConnector, layout: KVLayout, pool: KVPool,
                prompts: list[list[int]], round_index: int, registered: bool, stored) -> bool:
    """Store one round's prompts through B; whether B knows this connector now."""
    for stream, prompt in enumerate(prompts):
        n = len(prompt) // layout.chunk_size * layout.chunk_size
        if n == 0 or n > PEER_SLOTS:
            continue
        slots = torch.arange(n)
        write_kv(pool, layout, prefix_kv(layout, prompt, 0, n), slots)
        rid = f"peer-s{stream}-r{round_index}"
        try:
            if not registered:
                conn.register(PEER_STORE_S)
                registered = True
            ok = conn.store_from(prompt[:n], rid, pool, slots, timeout_s=PEER_STORE_S)
            conn.end_session(rid, PEER_STORE_S)
        except ConnectorError:
            ok, registered = False, False  # B restarting or hung: register again next time
        stored[0 if ok else 1] += 1
    return registered


class Supervisor:
    """What production's service manager does for a daemon that exits at start (the valkey
    adapter refuses to start while its store is down): start it again, until it serves or
    the run ends. On its own thread (the daemon's `starts` counts the attempts)."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-daemon-supervisor",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.daemon.start(timeout_s=120)
                return
            except DaemonStartError:
                self._stop.wait(0.1)  # systemd's RestartSec default

    def wait(self, timeout_s: float) -> bool:
        """Until the daemon serves (or the attempts ended): whether it serves."""
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive() and self.daemon.proc is not None \
            and self.daemon.proc.poll() is None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        if self._thread.is_alive():  # a start still waiting on its store: ends it at once
            self.daemon.kill()
            self._thread.join(timeout=30)


@dataclass
class L2Verdict:
    """What the store did in a run: its reads (GET calls) in each phase of the run (before
    the fault, during it, after it, after the operator's daemon restart; empty phases left
    out), when L2 served a hit again (the end of the fault to the first round in which an
    engine loaded and the store served reads; None: never in the run), how often the daemon
    was started, and what the engines' metrics told (the L2 canary's checks by result, the
    stalls found, the misses answered at once: chaos_judge.L2_SIGNALS)."""

    adapter: str
    reads: dict[str, int] = field(default_factory=dict)
    recovery_s: float | None = None
    #: The scenario broke the store, so it must serve a hit again (no fault: nothing to wait for).
    needs_recovery: bool = True
    daemon_starts: int = 0
    signals: dict[str, int] = field(default_factory=dict)
    #: The peer's STOREs through its daemon: (taken, failed).
    peer_stores: tuple[int, int] = (0, 0)


@dataclass
class RoundSamples:
    """Per round, as the harness saw it at the round's end: its time, the engines' loads so
    far, the store's reads so far."""

    times: list[float] = field(default_factory=list)
    loads: list[int] = field(default_factory=list)
    reads: list[int] = field(default_factory=list)

    def add(self, t: float, loads: int, reads: int) -> None:
        self.times.append(t)
        self.loads.append(loads)
        self.reads.append(reads)

    def reads_by_phase(self, bounds: list[tuple[str, int]]) -> dict[str, int]:
        """Reads in each phase; `bounds`: (label, first round), in order."""
        n = len(self.reads)
        at = lambda i: 0 if i <= 0 else self.reads[min(i, n) - 1]  # noqa: E731 - before round i
        out = {}
        for k, (label, first) in enumerate(bounds):
            last = bounds[k + 1][1] if k + 1 < len(bounds) else n
            if last > first:
                out[label] = at(last) - at(first)
        return out

    def served_hit_after(self, first: int, t0: float) -> float | None:
        """Seconds from `t0` to the end of the first round from `first` on in which an
        engine loaded and the store served reads."""
        for i in range(max(first, 1), len(self.reads)):
            if self.reads[i] > self.reads[i - 1] and self.loads[i] > self.loads[i - 1]:
                return self.times[i] - t0
        return None


def l2_verdict(scn, played, reports, daemon_starts: int, peer_stores: tuple[int, int]
               ) -> L2Verdict:
    """The L2 part of a run's verdict (chaos.run_scenario, after the judge)."""
    begin, end, restart = played.fault_rounds
    bounds = [("before", 0), ("fault", begin), ("after", end)]
    if scn.fault.kind == "none":
        bounds = [("run", 0)]
    if restart is not None:
        bounds.append(("after daemon restart", restart))
    samples = played.l2
    signals: dict[str, int] = {}
    for r in reports:
        for k, v in r.l2_signals.items():
            signals[k] = signals.get(k, 0) + v
    t_end = played.t_fault_end
    return L2Verdict(scn.l2.adapter + (" cluster" if scn.l2.shards > 1 else ""),
                     reads=samples.reads_by_phase(bounds),
                     recovery_s=None if t_end is None else samples.served_hit_after(end, t_end),
                     needs_recovery=scn.fault.kind != "none",
                     daemon_starts=daemon_starts, signals=signals,
                     peer_stores=peer_stores)
