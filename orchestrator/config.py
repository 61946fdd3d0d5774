"""LoadBackConfig: one typed, frozen object, validated once at the edge (YAML -> msgspec).

Every key has a default (`configs/example_config_mp.yaml` documents each one); every refusal
is a ConfigError naming the file, the key path and the fix.
"""

from __future__ import annotations

import difflib
import logging
import math
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from . import upstream
from .config_file import EXAMPLE as _EXAMPLE
from .config_file import ConfigError  # noqa: F401 - raised and caught as config.ConfigError
from .config_file import read_yaml as _read_yaml

log = logging.getLogger("loadback")


def _ms(what: str) -> Any:
    return Annotated[float, Meta(gt=0, description=what, extra={"unit": "ms"})]


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class Deadlines(_Section):
    lookup_ms: _ms("deadlines are positive milliseconds") = 50.0  # LOOKUP + prefetch wait
    # retrieve deadline = min(max, base + per_ki * tokens/1024)
    retrieve_base_ms: _ms("deadlines are positive milliseconds") = 100.0
    retrieve_per_ki_token_ms: Annotated[float, Meta(
        ge=0, description="milliseconds added per 1024 tokens", extra={"unit": "ms"})] = 25.0
    retrieve_max_ms: _ms("deadlines are positive milliseconds") = 2000.0
    control_ms: _ms("deadlines are positive milliseconds") = 200.0  # ping, register, releases
    store_ms: _ms("deadlines are positive milliseconds") = 2000.0
    connect_ms: _ms("deadlines are positive milliseconds") = 500.0  # never the OS's ~127 s
    # close(): paying what the daemon is owed, then unregistering; the rest is left to its TTLs
    close_ms: _ms("the most close() waits on the daemon, in milliseconds") = 2000.0

    def retrieve_s(self, tokens: int) -> float:
        ms = self.retrieve_base_ms + self.retrieve_per_ki_token_ms * tokens / 1024
        return min(self.retrieve_max_ms, ms) / 1000

    def match_s(self, tokens: int, *, prepare: bool, lookup_s: float | None = None) -> float:
        """match's bound for a prefix that may load `tokens`: the LOOKUP's deadline
        (`lookup_s`, the orchestrator's `lookup_wait_s` where an L2 store may be waited
        for; lookup_ms when not given), plus the retrieve deadline where match also prepares
        the retrieve (prepare_at_match on shared memory takes that round trip)."""
        return ((self.lookup_ms / 1000 if lookup_s is None else lookup_s)
                + (self.retrieve_s(tokens) if prepare else 0.0))


_Backoff = Annotated[float, Meta(ge=0, description="milliseconds, 0 for none",
                                 extra={"unit": "ms"})]


class Retries(_Section):
    max_attempts: Annotated[int, Meta(ge=1, description="1 = no retry")] = 3  # per operation
    backoff_initial_ms: _Backoff = 1.0
    backoff_max_ms: _Backoff = 20.0
    jitter_ms: _Backoff = 1.0


_Ratio = Annotated[float, Meta(gt=0, le=1, description="a fraction")]


class Breaker(_Section):
    consecutive_failures: Annotated[int, Meta(ge=1, description="failures in a row")] = 5
    failure_ratio: _Ratio = 0.5        # ... or this ratio over the last `window` calls
    window: Annotated[int, Meta(ge=1, description="calls")] = 20
    min_calls: Annotated[int, Meta(ge=1, description="calls in the window")] = 10
    cooldown_ms: _ms("the first half-open probe waits this long") = 500.0  # doubles per failure
    # a probe is one ping: a 1 s cap costs a ping a second while the daemon is down, and the
    # first hit comes within ~2 s of it serving again (30 s before)
    cooldown_max_ms: _ms("the longest cooldown") = 1000.0


class Heartbeat(_Section):
    interval_ms: _ms("the ping period; the daemon reaps workers silent for 120 s") = 1000.0
    enabled: bool = True


class BreakEven(_Section):
    min_tokens: Annotated[int, Meta(ge=0, description="0 loads any hit")] = 0
    prefill_tokens_per_s: Annotated[float, Meta(ge=0, description="0 disables the time test")] = 0.0
    initial_bandwidth_gbps: Annotated[float, Meta(
        gt=0, description="load speed assumed until one is measured")] = 1.0
    bandwidth_ema_alpha: _Ratio = 0.2


class InProcess(_Section):
    """mode: ip: the daemon's server runs inside the engine process."""

    l1_size_gb: Annotated[float, Meta(gt=0, description="the cache's memory")] = 0.25
    chunk_size: Annotated[int, Meta(gt=0, description="tokens per cached chunk")] = 256


class L2(_Section):
    """The daemon's L2 store (its --l2-adapter), which the daemons of a fleet share: the
    canary and the fleet's hash algorithm, how long a LOOKUP waits for the daemon to copy a
    prefix from it, and when the store counts as stalled (`orchestrator/l2.py`; a daemon
    without an L2 answers every LOOKUP at once, so those keys do not apply to it)."""

    # every this often, off the request path, store a marker prefix through the daemon, drop
    # its L1 copy and load it back from L2 (the resp adapter loses stores silently); 0: off.
    # Runs only where mp_http_port names the daemon's admin API
    canary_interval_ms: Annotated[float, Meta(
        ge=0, description="milliseconds between canary checks, 0 for none",
        extra={"unit": "ms"})] = 60000.0
    # one whole canary check: its store, the wait for the L2 write, the load back; also the
    # fleet identity check at a registration (the model name's KV layout, kept in L2)
    canary_deadline_ms: _ms("deadlines are positive milliseconds") = 2000.0
    # the fleet's --hash-algorithm: a daemon with an L2 that hashes otherwise is refused at
    # registration (read from its admin API, mp_http_port)
    hash_algorithm: Annotated[str, Meta(min_length=1, pattern=r"^\S+$",
                                        description="the daemons' --hash-algorithm")] = "blake3"
    # the most a LOOKUP waits while the daemon says its prefetch from L2 is still running; at
    # or under deadlines.lookup_ms no LOOKUP waits past that (a fixed deadline, as before)
    max_wait_ms: _ms("the longest wait for L2, in milliseconds") = 500.0
    # a LOOKUP waits at most this many times the fetch its prefix is expected to take
    wait_slack: Annotated[float, Meta(ge=1, description="a factor, at least 1")] = 3.0
    # the fetch time per chunk is measured by LOOKUPs (the first answered one sets it; until
    # then only break-even and max_wait_ms bound a wait): the weight of a slower sample, a
    # faster one weighs a quarter
    fetch_ema_alpha: _Ratio = 0.2
    # LOOKUPs in a row whose prefetch was still running past its expected fetch: L2 stalled
    stall_after: Annotated[int, Meta(ge=1, description="LOOKUPs in a row")] = 2
    probe_interval_ms: _ms("milliseconds between probes of a stalled L2") = 500.0
    probe_timeout_ms: _ms("a probe LOOKUP answered within this: L2 answers again") = 200.0


class Metrics(_Section):
    enabled: bool = False
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535, description="0 picks a free port")] = 9464


class SGLang(_Section):
    """The SGLang plugin's settings (lmcache_loadback.engines.sglang)."""

    allow_untested: bool = False       # start on an SGLang release this product was not tested on
    # 0.5.23 (TP 1): matches run at once on the LOOKUP worker; read at start
    lookup_threads: Annotated[int, Meta(ge=1, le=64, description=(
        "LOOKUP worker threads, 1 to 64"))] = 1


class LoadBackConfig(_Section):
    """The whole config. Single-field limits are msgspec `Meta` constraints on the fields
    (their `description` is the fix shown to the operator); checks across fields live in
    `__post_init__`. Every refusal is a one-line ConfigError, whatever the input
    (`orchestrator.config_file` reads the file and refuses what is not sound YAML; here
    unknown keys and non-finite numbers). An upstream LMCache MP YAML loads too
    (`orchestrator.upstream` maps its keys). `explain(path)` tells where each effective value
    came from, for `loadback config show`."""

    mode: Literal["mp", "ip"] = "mp"
    mp_host: Annotated[str, Meta(min_length=1, pattern=r"^\S+$",
                                 description="the daemon's --host, e.g. 127.0.0.1")] = "127.0.0.1"
    mp_port: Annotated[int, Meta(ge=1, le=65535, description="the daemon's --port")] = 5555
    # the daemon's --http-port (`lmcache server`; 0: none): registration reads its settings
    # there and refuses a daemon whose CPU pool runs several workers (the fence needs one)
    mp_http_port: Annotated[int, Meta(ge=0, le=65535,
                                      description="the daemon's --http-port, 0 for none")] = 0
    transfer: Literal["auto", "pickle", "shm"] = "auto"  # auto: shm when the daemon offers a pool
    # shm: prepare_retrieve at match (under the retrieve deadline), so load_back only copies
    prepare_at_match: bool = True
    # a prepared range older than this is released and asked for again, never copied: keep it
    # well under the daemon's --l1-read-ttl-seconds (300 s by default)
    prepare_max_age_ms: _ms("milliseconds, under the daemon's read-lock TTL") = 60000.0
    # a LOOKUP's read locks older than this (from just before it was sent) are neither loaded
    # nor freed, only forfeited: the daemon's TTL may have ended them and lent them to another
    # reader, whose lock a late free would strip. At most 90% of that TTL (the margin covers
    # a load started just under it, and its releases)
    lease_max_age_ms: _ms("milliseconds, under daemon_read_ttl_s") = 240000.0
    # the daemon's --l1-read-ttl-seconds (lmcache 0.5.6: 300, refreshed by each new lock)
    daemon_read_ttl_s: Annotated[int, Meta(
        ge=1, description="the daemon's --l1-read-ttl-seconds")] = 300
    # the name the daemon keys this engine's chunks under (L1 and L2). "" (the default): the
    # engine's model, as LMCache's own integrations name it (SGLang's --model-path, vLLM's
    # --model), so engines of different models never read each other's KV; set one name for
    # engines that load the same model from different paths and share KV (a fleet)
    model_name: str = ""
    chunk_size: Annotated[int, Meta(gt=0, description="must equal the daemon's --chunk-size")] = 256
    deadlines: Deadlines = Deadlines()
    retries: Retries = Retries()
    breaker: Breaker = Breaker()
    heartbeat: Heartbeat = Heartbeat()
    break_even: BreakEven = BreakEven()
    ip: InProcess = InProcess()
    l2: L2 = L2()
    metrics: Metrics = Metrics()
    sglang: SGLang = SGLang()
    # LMCache's own `lmcache.mp.*` keys that took effect (orchestrator.upstream maps them).
    extra_config: dict[str, Any] = {}

    def __post_init__(self) -> None:
        for key, ok, fix in _cross_checks(self):
            if not ok:
                raise ConfigError(f"{key}: {fix}", key=key)

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.mp_host}:{self.mp_port}"

    def cache_model(self, engine_model: str | None = None) -> str:
        """The name the daemon keys chunks under: `model_name`, else the engine's model, else
        FALLBACK_MODEL (a tool or test with no engine)."""
        return self.model_name or engine_model or FALLBACK_MODEL

    def check_reload(self, new: "LoadBackConfig") -> None:
        """Raise ConfigError if `new` changes a key a running process cannot take on: where
        its daemon is and how it talks to it, what it registered (model, chunk size), the
        in-process daemon's settings. Policy keys reload live."""
        changed = [k for k in RESTART_KEYS if getattr(new, k) != getattr(self, k)]
        if changed:
            raise ConfigError(
                f"{', '.join(changed)}: cannot change while running; restart the engine to "
                "apply it (policy keys reload live: deadlines, retries, breaker, break_even, "
                "heartbeat, l2)")

    # -- loading -------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "<dict>") -> "LoadBackConfig":
        return cls._load(data, source)[0]

    @classmethod
    def from_yaml(cls, path: str | Path) -> "LoadBackConfig":
        cfg, rows = cls.read(path)
        ignored = [r.key for r in rows if r.target is None]
        if ignored:
            log.warning("%s: LMCache key(s) not used here: %s (`loadback config validate %s` "
                        "says why)", path, ", ".join(ignored), path)
        return cfg

    @classmethod
    def read(cls, path: str | Path) -> tuple["LoadBackConfig", list[upstream.Row]]:
        """The config of a file and one row per upstream LMCache key in it (what it set, why)."""
        return cls._load(_read_yaml(path), str(path))

    def replace(self, **changes: Any) -> "LoadBackConfig":
        return msgspec.structs.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def explain(cls, path: str | Path) -> list[tuple[str, Any, str]]:
        """(key path, effective value, 'file', 'default' or the upstream key) for every leaf."""
        raw = _read_yaml(path)
        cfg, rows = cls._load(raw, str(path))
        given, _, origin = upstream.translate(raw)
        out: list[tuple[str, Any, str]] = []

        def walk(prefix: str, value: Any, raw_value: Any) -> None:
            if isinstance(value, dict) and value and prefix != "extra_config":
                for k, v in value.items():
                    sub = raw_value.get(k, _MISSING) if isinstance(raw_value, dict) else _MISSING
                    walk(f"{prefix}.{k}" if prefix else k, v, sub)
            else:
                src = origin.get(prefix) or ("default" if raw_value is _MISSING else "file")
                out.append((prefix, value, src))

        walk("", cfg.to_dict(), given)
        return out

    @classmethod
    def _load(cls, data: Any, source: str) -> tuple["LoadBackConfig", list[upstream.Row]]:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of keys, got "
                              f"{type(data).__name__}; {_EXAMPLE}")
        origin: dict[str, str] = {}
        try:
            data, rows, origin = upstream.translate(data)
            _check_keys(data, cls, "")
            return msgspec.convert(data, cls), rows
        except upstream.UpstreamKeyError as exc:
            raise ConfigError(f"{source}: {exc.key}: {exc}", key=exc.key) from None
        except ConfigError as exc:
            raise ConfigError(f"{source}: {_named(exc, origin)}", key=exc.key) from None
        except msgspec.ValidationError as exc:
            if isinstance(exc.__cause__, ConfigError):  # raised by a __post_init__
                cause = exc.__cause__
                raise ConfigError(f"{source}: {_named(cause, origin)}", key=cause.key) from None
            key, problem = _explain_validation(str(exc), data)
            named = _named(ConfigError(f"{key}: {problem}", key=key), origin)
            raise ConfigError(f"{source}: {named}", key=key) from None


_MISSING = object()


def _named(exc: ConfigError, origin: dict[str, str]) -> str:
    """The message, its key marked with the upstream key that set it, if one did."""
    msg = str(exc)
    if exc.key in origin and msg.startswith(f"{exc.key}:"):
        return f"{exc.key} (set by {origin[exc.key]}){msg[len(exc.key):]}"
    return msg


def _check_keys(data: dict, struct: type, prefix: str) -> None:
    """Unknown keys (with the nearest known one) and non-finite numbers, by key path."""
    hints = typing.get_type_hints(struct, include_extras=True)
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in hints:
            near = difflib.get_close_matches(str(key), list(hints), n=1)
            hint = f"did you mean {prefix}{near[0]}? " if near else ""
            raise ConfigError(f"{path}: unknown key; {hint}remove it or check its spelling "
                              f"({_EXAMPLE})", key=path)
        kind = hints[key]
        if isinstance(kind, type) and issubclass(kind, msgspec.Struct) and isinstance(value, dict):
            _check_keys(value, kind, f"{path}.")
        elif isinstance(value, float) and not math.isfinite(value):  # Meta(gt=0) admits inf
            raise ConfigError(f"{path}: must be a finite number, got {value}; an unbounded "
                              f"value would let a call wait forever ({_EXAMPLE})", key=path)


def _field(path: str) -> tuple[Any, Meta | None]:
    """The declared type and Meta of a key path (None where the path names no field)."""
    kind: Any = LoadBackConfig
    for part in path.split("."):
        hints = typing.get_type_hints(kind, include_extras=True) if isinstance(kind, type) else {}
        if part not in hints:
            return None, None
        kind = hints[part]
    metas = [m for m in typing.get_args(kind)[1:] if isinstance(m, Meta)]
    return kind, (metas[0] if metas else None)


def _rule(m: Meta) -> str:
    """'> 0', 'in (0, 1]', ... from a field's declared bounds."""
    lo = (m.gt, "(") if m.gt is not None else (m.ge, "[") if m.ge is not None else None
    hi = (m.lt, ")") if m.lt is not None else (m.le, "]") if m.le is not None else None
    if lo and hi:
        return f"in {lo[1]}{lo[0]}, {hi[0]}{hi[1]}"
    if lo:
        return f"{'>' if lo[1] == '(' else '>='} {lo[0]}"
    if hi:
        return f"{'<' if hi[1] == ')' else '<='} {hi[0]}"
    return "valid"


def _explain_validation(msg: str, data: dict) -> tuple[str, str]:
    """(key path, problem and fix) for a msgspec error "<problem> - at `$.<path>`"."""
    problem, _, where = msg.rpartition(" - at `")
    key = where.rstrip("`").removeprefix("$").lstrip(".") if problem else ""
    problem = problem or msg
    value: Any = data
    for part in key.split(".") if key else ():
        value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
    _, meta = _field(key)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if meta is not None and number and (meta.gt, meta.ge, meta.lt, meta.le) != (None,) * 4:
        unit = (meta.extra or {}).get("unit", "")
        return key, f"must be {_rule(meta)}{' ' + unit if unit else ''}, got {value}; " \
                    f"{meta.description}"
    if meta is not None and isinstance(value, str) and meta.min_length:
        return key, f"must not be empty or hold spaces, got {upstream._show(value)}; " \
                    f"{meta.description}"
    got = f" ({upstream._show(value)})" if value is not _MISSING and "got" not in problem else ""
    fix = f"{meta.description}; " if meta is not None and meta.description else ""
    return key or "(top level)", f"{problem}{got}; {fix}fix the value ({_EXAMPLE})"


#: Keys a running orchestrator cannot take on in a reload (`LoadBackConfig.check_reload`).
#: The cache's model name where neither the YAML nor an engine names one.
FALLBACK_MODEL = "loadback"
RESTART_KEYS = ("mode", "mp_host", "mp_port", "transfer", "model_name", "chunk_size", "ip")


def _cross_checks(c: LoadBackConfig):
    d, b = c.deadlines, c.breaker
    yield ("deadlines.retrieve_max_ms", d.retrieve_max_ms >= d.retrieve_base_ms,
           f"must be >= deadlines.retrieve_base_ms ({d.retrieve_base_ms:g}), got "
           f"{d.retrieve_max_ms:g}; raise it or lower the base")
    yield ("breaker.min_calls", b.min_calls <= b.window,
           f"must be between 1 and breaker.window ({b.window}), got {b.min_calls}")
    ttl_ms = c.daemon_read_ttl_s * 1000
    yield ("lease_max_age_ms", c.lease_max_age_ms <= 0.9 * ttl_ms,
           f"must stay 10% under the daemon's read TTL (daemon_read_ttl_s, "
           f"{c.daemon_read_ttl_s}), so at most {0.9 * ttl_ms:g}, got {c.lease_max_age_ms:g}; "
           "lower it, or set daemon_read_ttl_s to the daemon's --l1-read-ttl-seconds")
    yield ("prepare_max_age_ms", c.prepare_max_age_ms <= c.lease_max_age_ms,
           f"must be <= lease_max_age_ms ({c.lease_max_age_ms:g}), got "
           f"{c.prepare_max_age_ms:g}: a prepared range holds its LOOKUP's locks")
    yield ("breaker.cooldown_max_ms", b.cooldown_max_ms >= b.cooldown_ms,
           f"must be >= breaker.cooldown_ms ({b.cooldown_ms:g}), got {b.cooldown_max_ms:g}")
