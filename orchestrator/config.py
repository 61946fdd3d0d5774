"""LoadBackConfig: one typed, frozen object, validated once at the edge (YAML -> msgspec).

Every key has a default; `configs/example_config_mp.yaml` documents each one. Errors name
the file, the key path and the fix. `LoadBackConfig.explain(path)` tells where each
effective value came from (file or default), for `loadback config show`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml


class ConfigError(ValueError):
    """A config file that cannot be used; the message says which key and how to fix it."""

    def __init__(self, message: str, *, unreadable: bool = False) -> None:
        super().__init__(message)
        self.unreadable = unreadable


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class Deadlines(_Section):
    lookup_ms: float = 50.0            # LOOKUP + prefetch wait, per match()
    retrieve_base_ms: float = 100.0    # retrieve deadline = min(max, base + per_ki * tokens/1024)
    retrieve_per_ki_token_ms: float = 25.0
    retrieve_max_ms: float = 2000.0
    control_ms: float = 200.0          # ping, register, free_lookup_locks, end_session
    store_ms: float = 2000.0
    connect_ms: float = 500.0          # TCP connect bound; never the OS's ~127 s

    def retrieve_s(self, tokens: int) -> float:
        ms = self.retrieve_base_ms + self.retrieve_per_ki_token_ms * tokens / 1024
        return min(self.retrieve_max_ms, ms) / 1000


class Retries(_Section):
    max_attempts: int = 3              # per operation, all inside its deadline
    backoff_initial_ms: float = 1.0
    backoff_max_ms: float = 20.0
    jitter_ms: float = 1.0


class Breaker(_Section):
    consecutive_failures: int = 5      # open after this many failures in a row
    failure_ratio: float = 0.5         # ... or this ratio over the last `window` calls
    window: int = 20
    min_calls: int = 10                # the ratio only counts once the window holds this many
    cooldown_ms: float = 500.0         # first half-open probe after this; doubles per failed probe
    cooldown_max_ms: float = 30000.0


class Heartbeat(_Section):
    interval_ms: float = 1000.0        # ping; the daemon reaps workers silent for 120 s
    enabled: bool = True


class BreakEven(_Section):
    min_tokens: int = 0                # never load fewer tokens than this
    prefill_tokens_per_s: float = 0.0  # engine's recompute speed; 0 disables the time test
    initial_bandwidth_gbps: float = 1.0  # load speed assumed until one is measured
    bandwidth_ema_alpha: float = 0.2


class InProcess(_Section):
    """mode: ip: the daemon's server runs inside the engine process."""

    l1_size_gb: float = 0.25
    chunk_size: int = 256


class Metrics(_Section):
    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 9464


class LoadBackConfig(_Section):
    mode: Literal["mp", "ip"] = "mp"
    mp_host: str = "127.0.0.1"
    mp_port: int = 5555
    transfer: Literal["auto", "pickle", "shm"] = "auto"  # auto: shm when the daemon offers a pool
    model_name: str = "loadback"
    chunk_size: int = 256              # must equal the daemon's --chunk-size
    deadlines: Deadlines = Deadlines()
    retries: Retries = Retries()
    breaker: Breaker = Breaker()
    heartbeat: Heartbeat = Heartbeat()
    break_even: BreakEven = BreakEven()
    ip: InProcess = InProcess()
    metrics: Metrics = Metrics()
    # LMCache's own keys, accepted where they mean the same thing.
    extra_config: dict[str, Any] = {}

    def __post_init__(self) -> None:
        for path, value, fix in _checks(self):
            if not value:
                raise ConfigError(f"{path}: {fix}")
        unknown = set(self.extra_config) - set(_LMCACHE_KEYS)
        if unknown:
            raise ConfigError(
                f"extra_config: unknown key(s) {sorted(unknown)}; supported: {sorted(_LMCACHE_KEYS)}"
            )

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.mp_host}:{self.mp_port}"

    # -- loading -------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "<dict>") -> "LoadBackConfig":
        data = _apply_lmcache_keys(dict(data or {}))
        try:
            return msgspec.convert(data, cls)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{source}: {_explain_validation(str(exc))}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "LoadBackConfig":
        data = _read_yaml(path)
        return cls.from_dict(data, source=str(path))

    def replace(self, **changes: Any) -> "LoadBackConfig":
        return msgspec.structs.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def explain(cls, path: str | Path) -> list[tuple[str, Any, str]]:
        """(key path, effective value, 'file' or 'default') for every leaf key."""
        raw = _apply_lmcache_keys(_read_yaml(path) or {})
        cfg = cls.from_dict(raw, source=str(path))
        rows: list[tuple[str, Any, str]] = []

        def walk(prefix: str, value: Any, given: Any) -> None:
            if isinstance(value, dict) and value and prefix != "extra_config":
                for k, v in value.items():
                    sub = given.get(k, _MISSING) if isinstance(given, dict) else _MISSING
                    walk(f"{prefix}.{k}" if prefix else k, v, sub)
            else:
                rows.append((prefix, value, "default" if given is _MISSING else "file"))

        walk("", cfg.to_dict(), raw)
        return rows


_MISSING = object()

# LMCache's `lmcache.mp.*` keys and the key each one sets here.
_LMCACHE_KEYS = {
    "lmcache.mp.heartbeat_interval": ("heartbeat", "interval_ms", 1000.0),  # seconds upstream
    "lmcache.mp.mq_timeout": ("deadlines", "retrieve_max_ms", 1000.0),     # seconds upstream
}


def _apply_lmcache_keys(data: dict[str, Any]) -> dict[str, Any]:
    extra = data.get("extra_config") or {}
    if not isinstance(extra, dict):
        return data
    for key, (section, field, scale) in _LMCACHE_KEYS.items():
        if key in extra and isinstance(extra[key], (int, float)):
            sec = dict(data.get(section) or {})
            sec.setdefault(field, float(extra[key]) * scale)
            data[section] = sec
    return data


def _read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(
            f"{p}: config file not found; pass an existing YAML file "
            "(see configs/example_config_mp.yaml)", unreadable=True) from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config file: {exc.strerror}", unreadable=True) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{p}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def _explain_validation(msg: str) -> str:
    # msgspec says "Object contains unknown field `x` - at `$.deadlines`"
    m = re.match(r"Object contains unknown field `([^`]+)`(?: - at `\$\.?([^`]*)`)?", msg)
    if m:
        path = f"{m.group(2)}.{m.group(1)}" if m.group(2) else m.group(1)
        return f"{path}: unknown key; remove it or check its spelling (see configs/example_config_mp.yaml)"
    m = re.match(r"(.*) - at `\$\.?([^`]*)`", msg)
    if m:
        return f"{m.group(2)}: {m.group(1)}; fix the value's type (see configs/example_config_mp.yaml)"
    return msg


def _checks(c: LoadBackConfig):
    d, r, b, h, be = c.deadlines, c.retries, c.breaker, c.heartbeat, c.break_even
    for name in ("lookup_ms", "retrieve_base_ms", "retrieve_max_ms", "control_ms", "store_ms", "connect_ms"):
        yield f"deadlines.{name}", getattr(d, name) > 0, f"must be > 0 ms, got {getattr(d, name)}; deadlines are positive milliseconds"
    yield "deadlines.retrieve_per_ki_token_ms", d.retrieve_per_ki_token_ms >= 0, f"must be >= 0, got {d.retrieve_per_ki_token_ms}"
    yield "deadlines.retrieve_max_ms", d.retrieve_max_ms >= d.retrieve_base_ms, "must be >= deadlines.retrieve_base_ms"
    yield "retries.max_attempts", r.max_attempts >= 1, f"must be >= 1 (1 = no retry), got {r.max_attempts}"
    for name in ("backoff_initial_ms", "backoff_max_ms", "jitter_ms"):
        yield f"retries.{name}", getattr(r, name) >= 0, f"must be >= 0, got {getattr(r, name)}"
    yield "breaker.consecutive_failures", b.consecutive_failures >= 1, "must be >= 1"
    yield "breaker.failure_ratio", 0 < b.failure_ratio <= 1, f"must be in (0, 1], got {b.failure_ratio}"
    yield "breaker.window", b.window >= 1, "must be >= 1"
    yield "breaker.min_calls", 1 <= b.min_calls <= b.window, "must be between 1 and breaker.window"
    yield "breaker.cooldown_ms", b.cooldown_ms > 0, "must be > 0"
    yield "breaker.cooldown_max_ms", b.cooldown_max_ms >= b.cooldown_ms, "must be >= breaker.cooldown_ms"
    yield "heartbeat.interval_ms", h.interval_ms > 0, "must be > 0"
    yield "break_even.min_tokens", be.min_tokens >= 0, "must be >= 0"
    yield "break_even.prefill_tokens_per_s", be.prefill_tokens_per_s >= 0, "must be >= 0 (0 disables)"
    yield "break_even.initial_bandwidth_gbps", be.initial_bandwidth_gbps > 0, "must be > 0"
    yield "break_even.bandwidth_ema_alpha", 0 < be.bandwidth_ema_alpha <= 1, "must be in (0, 1]"
    yield "chunk_size", c.chunk_size > 0, "must be > 0 and equal the daemon's --chunk-size"
    yield "mp_port", 0 < c.mp_port < 65536, f"must be a TCP port 1-65535, got {c.mp_port}"
    yield "ip.chunk_size", c.ip.chunk_size > 0, "must be > 0"
    yield "ip.l1_size_gb", c.ip.l1_size_gb > 0, "must be > 0"
    yield "metrics.port", 0 <= c.metrics.port < 65536, "must be 0-65535 (0 picks a free port)"
