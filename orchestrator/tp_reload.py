"""A live config reload under tensor parallelism. Two policy keys decide which collectives a
rank makes (`COLLECTIVE_KEYS`): `break_even.min_tokens` whether `match` returns before any,
`prepare_at_match` whether a marked prefix adds one. Each rank reads the file on its own
heartbeat, so ranks that applied them at once would issue different collectives until the
last rank read it (a verdict read as a hit length, a hang). So those two are staged and the
group adopts them at one step: the engine's per-pass collective carries each rank's `offered()`
digest, and `settle` adopts the staged values once every rank offered the same ones. Every
other key applies on each rank at once: it never changes which collectives run (the ranks
agree on what comes out of them).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any

import msgspec

from .config import LoadBackConfig

log = logging.getLogger("loadback")

#: Keys whose value changes which collectives `match` makes (orchestrator/core.py).
COLLECTIVE_KEYS = ("break_even.min_tokens", "prepare_at_match")


def values_of(config: LoadBackConfig) -> tuple:
    out = []
    for key in COLLECTIVE_KEYS:
        value: Any = config
        for part in key.split("."):
            value = getattr(value, part)
        out.append(value)
    return tuple(out)


def with_values(config: LoadBackConfig, values: tuple) -> LoadBackConfig:
    for key, value in zip(COLLECTIVE_KEYS, values):
        config = _replace(config, key.split("."), value)
    return config


def _replace(struct, parts: list[str], value):
    head = parts[0]
    if len(parts) > 1:
        value = _replace(getattr(struct, head), parts[1:], value)
    return msgspec.structs.replace(struct, **{head: value})


def digest(values: tuple) -> int:
    """A positive int64 naming the values (0 is a rank that offers nothing)."""
    return int.from_bytes(hashlib.sha256(repr(values).encode()).digest()[:7], "big") + 1


def _shown(values: tuple) -> str:
    return ", ".join(f"{k}={v}" for k, v in zip(COLLECTIVE_KEYS, values))


class AgreedReload:
    """One rank's side. `offer` runs on the thread that read the file (the heartbeat),
    `offered`/`settle` on the engine's scheduler thread around its collective; one lock
    orders the two, so an adoption is never undone by a later file's live part."""

    def __init__(self, orch) -> None:
        self.orch = orch
        self._lock = threading.Lock()
        self.staged: tuple | None = None  # the file's COLLECTIVE_KEYS values, not yet agreed

    def offer(self, config: LoadBackConfig) -> LoadBackConfig:
        """Apply `config` now except COLLECTIVE_KEYS, which keep their values in force and
        are staged when the file changes them. ConfigError as `orch.reload`; returns the
        config now in force."""
        with self._lock:
            force = values_of(self.orch.config)
            self.orch.reload(with_values(config, force))
            wanted = values_of(config)
            self.staged = wanted if wanted != force else None
            applied = self.orch.config
        if wanted != force:
            log.info("config: %s staged; it applies at the same scheduler step on every TP "
                     "rank once every rank has read it", _shown(wanted))
        return applied

    def offered(self) -> int:
        """This rank's side of the agreement: the staged values, else those in force."""
        with self._lock:
            return digest(self.staged if self.staged is not None
                          else values_of(self.orch.config))

    def settle(self, lowest: int, highest: int) -> LoadBackConfig | None:
        """After the group's all-reduce of `offered()` (its min and max over the ranks):
        adopt the staged values when every rank offered them; the config then in force,
        else None."""
        with self._lock:
            staged = self.staged
            if staged is None or not lowest == highest == digest(staged):
                return None
            self.orch.reload(with_values(self.orch.config, staged))
            self.staged = None
            applied = self.orch.config
        log.info("config: %s applied on every TP rank (generation %d)", _shown(staged),
                 self.orch.generation)
        return applied
