"""Reading a config file into plain data, for `orchestrator.config`; nothing here knows keys.
Whatever the bytes, the result is data or a ConfigError naming the file, the key path where
one is known, and the fix (`read_yaml`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

EXAMPLE = "see configs/example_config_mp.yaml"
_MAX_BYTES = 1 << 20    # a config is a few KiB; this bounds a wrong path such as /dev/zero
_MAX_DEPTH = 16         # ours nests 2 levels, an upstream file's values a few more


class ConfigError(ValueError):
    """A config file that cannot be used; the one-line message says which key and the fix."""

    def __init__(self, message: str, *, unreadable: bool = False, key: str | None = None) -> None:
        super().__init__(" ".join(message.splitlines()))  # one line, whatever a part held
        self.unreadable = unreadable
        self.key = key


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
                                  f"({EXAMPLE})", key=key)
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


def read_yaml(path: str | Path) -> Any:
    """The file's YAML as Python data; raises ConfigError (unreadable=True: cannot be read).

    Refused, each in one line: bytes that are not UTF-8 (the key found from the rest of the
    file), control characters, YAML nested deeper than any config needs (PyYAML's composer
    recurses), keys given twice (YAML would keep the last silently), tags safe_load refuses
    or cannot build, and paths that are no config file at all (a directory, /dev/zero)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found; pass an existing YAML file "
                          f"({EXAMPLE})", unreadable=True) from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config file: {exc.strerror or exc}; check the "
                          "path and its permissions", unreadable=True) from None
    if len(raw) > _MAX_BYTES:
        raise ConfigError(f"{p}: larger than {_MAX_BYTES >> 10} KiB, not a config file; pass "
                          f"the YAML config ({EXAMPLE})")
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
                          f"syntax ({EXAMPLE})") from None
    except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        # ReaderError (control characters), or a tagged scalar such as `!!int x`
        first = str(exc).splitlines()[0][:120] if str(exc) else ""
        raise ConfigError(f"{p}: not valid YAML: {type(exc).__name__}: {first}; fix the "
                          f"value ({EXAMPLE})") from None
    finally:
        if loader is not None:
            loader.dispose()
