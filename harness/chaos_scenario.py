"""Chaos scenarios: the fault a run injects, when, and against which config (YAML files in
configs/chaos/, shipped in the wheel). Process faults act on the real daemon (SIGKILL,
SIGSTOP/SIGCONT, restart, absent at start); wire faults go through the FaultProxy.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import torch
import yaml

from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.orchestrator.config import LoadBackConfig
from lmcache_loadback.orchestrator.resources import configs_dir

SCENARIO_DIR = configs_dir() / "chaos"
LAYOUT = KVLayout(num_layers=2, num_heads=4, head_dim=16, dtype=torch.float16, chunk_size=16)


class Fault(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    kind: Literal["none", "kill", "hang", "restart", "absent_at_start", "wire",
                  "flicker"] = "none"
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



def load_scenarios(which: str) -> list[Scenario]:
    files = sorted(SCENARIO_DIR.glob("*.yaml"))
    out = []
    for f in files:
        data = yaml.safe_load(f.read_text())
        try:
            scn = msgspec.convert(data, Scenario)
        except msgspec.ValidationError as exc:
            raise SystemExit(f"{f}: {exc}") from None
        if which in ("all", scn.name):
            out.append(scn)
    if not out:
        names = ", ".join(yaml.safe_load(f.read_text())["name"] for f in files)
        raise SystemExit(f"no chaos scenario named {which!r}; known: {names}, or all")
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
