"""Chaos scenarios: the fault a run injects, when, and against which config (YAML files in
configs/chaos/, shipped in the wheel). Process faults act on the real daemon (SIGKILL,
SIGSTOP/SIGCONT, restart, absent at start); wire faults go through the FaultProxy; `l2_*`
faults act on the daemon's L2 store, a real redis-server (harness/chaos_l2.py).
"""

from __future__ import annotations

from typing import Literal

import msgspec
import torch
import yaml

from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.orchestrator.config import LoadBackConfig
from lmcache_loadback.orchestrator.resources import configs_dir

from .chaos_l2 import L2_KINDS, L2Setup

SCENARIO_DIR = configs_dir() / "chaos"
LAYOUT = KVLayout(num_layers=2, num_heads=4, head_dim=16, dtype=torch.float16, chunk_size=16)


class Fault(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    kind: Literal["none", "kill", "hang", "restart", "absent_at_start", "wire",
                  "flicker", "l2_kill", "l2_hang", "l2_restart", "l2_absent_at_start",
                  "l2_shard_lost", "l2_full"] = "none"
    start: float = 0.3          # fraction of the requests when the fault begins
    end: float = 0.6            # ... and when it is lifted
    # flicker: in this share of the rounds between start and end, the daemon is stopped
    # (SIGSTOP) for pause_ms, from a random instant in the round's first `within_ms`.
    probability: float = 0.1
    pause_ms: float = 30.0
    within_ms: float = 20.0
    rules: list[dict] = []      # wire: FaultRule fields
    # wire: the rules are in force before the orchestrator's first registration (a daemon of
    # another version at start), lifted at `end`; `start` is then unused.
    from_start: bool = False
    # l2_full: the store's maxmemory while the fault lasts (allkeys-lru evicts down to it).
    maxmemory: str = "3mb"
    # The operator's remedy: the daemon restarted at this fraction of the requests (resp never
    # reconnects to a restarted store: only a daemon restart brings its L2 back).
    daemon_restart_at: float | None = None

    @property
    def on_l2(self) -> bool:
        return self.kind in L2_KINDS

    @property
    def registers_late(self) -> bool:
        """The engines cannot register when they start (no daemon, or one that cannot
        answer yet): the run does not wait for their registration."""
        return self.kind in ("absent_at_start", "l2_absent_at_start") or self.from_start


class Scenario(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    description: str = ""
    seed: int = 0
    requests: int = 500
    max_seconds: float = 120.0  # the run stops by itself after this, whatever is left
    # Requests arrive at most this often, like traffic, not a tight loop: with the breaker
    # open a request costs microseconds, and recovery is judged in wall time.
    request_interval_ms: float = 10.0
    transfer: Literal["pickle", "shm"] = "pickle"
    fault: Fault = msgspec.field(default_factory=Fault)
    config: dict = {}           # LoadBackConfig overrides for this scenario
    # Error classes the orchestrator must have logged (its `loadback` logger) during the run.
    expect_logged: list[str] = []
    # The daemon's L2 store (a real redis-server); required by the l2_* faults.
    l2: L2Setup | None = None

    def __post_init__(self) -> None:
        f = self.fault
        if f.on_l2 and self.l2 is None:
            raise ValueError(f"fault {f.kind} breaks the L2 store: give the scenario an l2 section")
        if f.kind == "l2_shard_lost" and self.l2.shards < 3:
            raise ValueError("fault l2_shard_lost needs l2.shards: 3 (a Redis Cluster)")
        if f.kind == "l2_absent_at_start" and self.l2.shards > 1:
            raise ValueError("fault l2_absent_at_start runs on one redis-server (l2.shards: 1)")



def load_scenarios(which: str) -> list[Scenario]:
    files = sorted(SCENARIO_DIR.glob("*.yaml"))
    out = []
    for f in files:
        data = yaml.safe_load(f.read_text())
        try:
            scn = msgspec.convert(data, Scenario)
        except msgspec.ValidationError as exc:
            raise SystemExit(f"{f}: {exc}") from None
        if which in ("all", scn.name) or (which == "l2" and scn.l2 is not None):
            out.append(scn)
    if not out:
        names = ", ".join(yaml.safe_load(f.read_text())["name"] for f in files)
        raise SystemExit(f"no chaos scenario named {which!r}; known: {names}, l2 or all")
    return out


def base_config(port: int, overrides: dict) -> LoadBackConfig:
    cfg = {
        "mp_port": port, "chunk_size": LAYOUT.chunk_size,
        "deadlines": {"lookup_ms": 50, "retrieve_base_ms": 100, "retrieve_per_ki_token_ms": 20,
                      "retrieve_max_ms": 300, "control_ms": 100, "store_ms": 300},
        "heartbeat": {"interval_ms": 100},
        "breaker": {"consecutive_failures": 3, "cooldown_ms": 100, "cooldown_max_ms": 800},
    }
    for k, v in overrides.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    return LoadBackConfig.from_dict(cfg, source="scenario")
