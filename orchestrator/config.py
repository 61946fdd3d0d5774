"""LoadBackConfig: one typed, frozen object, validated once at the edge (YAML -> msgspec).

Every key has a default; `configs/example_config_mp.yaml` documents each one. Single-field
limits are msgspec `Meta` constraints on the fields (their `description` is the fix shown to
the operator); checks across fields live in `__post_init__`. Every refusal is a ConfigError
whose one-line message names the file, the key path and the fix, whatever the input: bytes
that are not UTF-8, YAML nested deeper than any config needs, duplicate keys, non-finite
numbers. An upstream LMCache MP YAML loads too (`orchestrator.upstream` maps its keys).
`LoadBackConfig.explain(path)` tells where each effective value came from, for `loadback
config show`.
"""

from __future__ import annotations

import difflib
import logging
import math
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml
from msgspec import Meta
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from . import upstream

log = logging.getLogger("loadback")

_EXAMPLE = "see configs/example_config_mp.yaml"
_MAX_BYTES = 1 << 20    # a config is a few KiB; this bounds a wrong path such as /dev/zero
_MAX_DEPTH = 16         # ours nests 2 levels, an upstream file's values a few more


class ConfigError(ValueError):
    """A config file that cannot be used; the one-line message says which key and the fix."""

    def __init__(self, message: str, *, unreadable: bool = False, key: str | None = None) -> None:
        super().__init__(" ".join(message.splitlines()))  # one line, whatever a part held
        self.unreadable = unreadable
        self.key = key


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

    def retrieve_s(self, tokens: int) -> float:
        ms = self.retrieve_base_ms + self.retrieve_per_ki_token_ms * tokens / 1024
        return min(self.retrieve_max_ms, ms) / 1000


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
    cooldown_max_ms: _ms("the longest cooldown") = 30000.0


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


class Metrics(_Section):
    enabled: bool = False
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535, description="0 picks a free port")] = 9464


class SGLang(_Section):
    """The SGLang plugin's settings (orchestrator.hook)."""

    allow_untested: bool = False       # start on an SGLang release this product was not tested on


class LoadBackConfig(_Section):
    mode: Literal["mp", "ip"] = "mp"
    mp_host: Annotated[str, Meta(min_length=1, pattern=r"^\S+$",
                                 description="the daemon's --host, e.g. 127.0.0.1")] = "127.0.0.1"
    mp_port: Annotated[int, Meta(ge=1, le=65535, description="the daemon's --port")] = 5555
    transfer: Literal["auto", "pickle", "shm"] = "auto"  # auto: shm when the daemon offers a pool
    model_name: str = "loadback"
    chunk_size: Annotated[int, Meta(gt=0, description="must equal the daemon's --chunk-size")] = 256
    deadlines: Deadlines = Deadlines()
    retries: Retries = Retries()
    breaker: Breaker = Breaker()
    heartbeat: Heartbeat = Heartbeat()
    break_even: BreakEven = BreakEven()
    ip: InProcess = InProcess()
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
            raise ConfigError(f"{source}: {_named(ConfigError(f'{key}: {problem}', key=key), origin)}",
                              key=key) from None


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
        elif isinstance(value, float) and not math.isfinite(value):
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


def _cross_checks(c: LoadBackConfig):
    d, b = c.deadlines, c.breaker
    yield ("deadlines.retrieve_max_ms", d.retrieve_max_ms >= d.retrieve_base_ms,
           f"must be >= deadlines.retrieve_base_ms ({d.retrieve_base_ms:g}), got "
           f"{d.retrieve_max_ms:g}; raise it or lower the base")
    yield ("breaker.min_calls", b.min_calls <= b.window,
           f"must be between 1 and breaker.window ({b.window}), got {b.min_calls}")
    yield ("breaker.cooldown_max_ms", b.cooldown_max_ms >= b.cooldown_ms,
           f"must be >= breaker.cooldown_ms ({b.cooldown_ms:g}), got {b.cooldown_max_ms:g}")


# -- reading the file ---------------------------------------------------------------------

class _Loader(yaml.SafeLoader):
    """safe_load that refuses nesting deeper than _MAX_DEPTH (its composer recurses)."""

    def __init__(self, text: str, path: Path) -> None:
        super().__init__(text)
        self.path, self.keys = path, []  # key path of the node being composed

    def compose_node(self, parent: Any, index: Any) -> Any:
        self.keys.append(f".{index.value}" if isinstance(index, ScalarNode) else
                         f"[{index}]" if isinstance(index, int) else "")
        try:
            if len(self.keys) > _MAX_DEPTH:
                mark = self.peek_event().start_mark
                key = "".join(self.keys).lstrip(".")
                raise ConfigError(f"{self.path}: {key}: nested deeper than {_MAX_DEPTH} levels "
                                  f"(line {mark.line + 1}); a config nests 3 levels at most "
                                  f"({_EXAMPLE})", key=key)
            return super().compose_node(parent, index)
        finally:
            self.keys.pop()


def _key_at(node: Any, line: int, path: str = "") -> str:
    """The key path whose value spans 0-based `line` (for errors found before parsing)."""
    items = (node.value if isinstance(node, MappingNode) else
             [(None, v) for v in node.value] if isinstance(node, SequenceNode) else [])
    for k, _ in items:
        if isinstance(k, ScalarNode) and k.start_mark.line == line:
            return f"{path}.{k.value}".lstrip(".")
    for i, (k, v) in enumerate(items):
        end = v.end_mark  # a block ends at column 0 of the line after it
        if v.start_mark.line <= line and (line < end.line or line == end.line and end.column):
            sub = f"{path}.{k.value}" if isinstance(k, ScalarNode) else f"{path}[{i}]"
            return _key_at(v, line, sub) or sub.lstrip(".")
    return ""


def _refuse_duplicates(node: Any, path: str, p: Path, seen: set[int]) -> None:
    """A key given twice would silently take the last value: name it instead."""
    if id(node) in seen:  # an alias met again (or a recursive one): walked already
        return
    seen.add(id(node))
    if isinstance(node, MappingNode):
        first: dict[tuple[str, str], int] = {}
        for k, v in node.value:
            name = k.value if isinstance(k, ScalarNode) else "?"
            sub = f"{path}.{name}" if path else str(name)
            if isinstance(k, ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                line = k.start_mark.line + 1
                if first.setdefault((k.tag, k.value), line) != line:
                    raise ConfigError(f"{p}: {sub}: duplicate key (lines {first[(k.tag, k.value)]}"
                                      f" and {line}); keep one", key=sub)
            _refuse_duplicates(v, sub, p, seen)
    elif isinstance(node, SequenceNode):
        for i, v in enumerate(node.value):
            _refuse_duplicates(v, f"{path}[{i}]", p, seen)


def _read_yaml(path: str | Path) -> Any:
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found; pass an existing YAML file "
                          f"({_EXAMPLE})", unreadable=True) from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config file: {exc.strerror or exc}; check the "
                          "path and its permissions", unreadable=True) from None
    if len(raw) > _MAX_BYTES:
        raise ConfigError(f"{p}: larger than {_MAX_BYTES >> 10} KiB, not a config file; pass "
                          f"the YAML config ({_EXAMPLE})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start)
        try:  # name the key too, where the rest of the file parses
            key = _key_at(_Loader(raw.decode("utf-8", "replace"), p).get_single_node(), line)
        except Exception:
            key = ""
        raise ConfigError(f"{p}: {key + ': ' if key else ''}not UTF-8: byte "
                          f"0x{raw[exc.start]:02x} at line {line + 1}; save the file as UTF-8",
                          key=key or None) from None
    loader = None
    try:
        loader = _Loader(text, p)  # its reader refuses control characters right here
        node = loader.get_single_node()
        if node is None:
            return {}
        _refuse_duplicates(node, "", p, set())
        return loader.construct_document(node)
    except ConfigError:
        raise
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{p}: not valid YAML{where}: {exc.problem or exc.context}; fix the "
                          f"syntax ({_EXAMPLE})") from None
    except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        # ReaderError (control characters), or a tagged scalar such as `!!int x`
        first = str(exc).splitlines()[0][:120] if str(exc) else ""
        raise ConfigError(f"{p}: not valid YAML: {type(exc).__name__}: {first}; fix the "
                          f"value ({_EXAMPLE})") from None
    finally:
        if loader is not None:
            loader.dispose()
