"""Seeded fuzzing of config files: valid, or one ConfigError line naming the file; nothing else.

Mutations of the shipped examples (mp, ip, upstream): byte flips, truncation, key deletion and
duplication, type swaps, deep nesting, bytes that are not UTF-8. Seeded, so a failure replays.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from lmcache_loadback.cli import main
from lmcache_loadback.orchestrator.config import ConfigError, LoadBackConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [(ROOT / "configs" / n).read_bytes() for n in
            ("example_config_mp.yaml", "example_config_ip.yaml", "example_config_upstream.yaml")]
VALUES = [b'"text"', b"[1, 2]", b"{a: 1}", b"true", b"null", b".inf", b"-.inf", b".nan", b"1e309",
          b"-1", b"0", b"99999999999999999999999", b"''", b"~", b"!!binary aGVsbG8=",
          b"2001-12-14", b"&a 5", b"*a", b"!!int x", b"!!python/name:os.system", b"0x1F",
          b"{lmcache.mp.mq_timeout: 0}", b"'\xc3\xa9'", b"\xff\xfe", b"\x00"]


def _lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")


def mutate(data: bytes, rng: random.Random) -> bytes:
    kind = rng.choice(["flip", "truncate", "delete", "duplicate", "swap", "nest", "junk"])
    if kind == "flip" and data:
        i = rng.randrange(len(data))
        return data[:i] + bytes([rng.randrange(256)]) + data[i + 1:]
    if kind == "truncate":
        return data[:rng.randrange(len(data) + 1)]
    lines = _lines(data)
    i = rng.randrange(len(lines))
    if kind == "delete":
        del lines[i]
    elif kind == "duplicate":
        lines.insert(rng.randrange(len(lines) + 1), lines[i])
    elif kind in ("swap", "nest") and b": " in lines[i]:
        key, _, value = lines[i].partition(b": ")
        if kind == "swap":
            value = rng.choice(VALUES)
        else:
            depth = rng.choice([1, 2, 5, 20, 100, 600])
            value = b"[" * depth + value.split(b"#")[0].strip() + b"]" * depth
        lines[i] = key + b": " + value
    elif kind == "junk":
        lines.insert(i, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8))))
    return b"\n".join(lines)


@pytest.mark.parametrize("seed", range(8))
def test_mutated_configs_are_valid_or_one_config_error_line(tmp_path, capsys, seed):
    rng = random.Random(seed)
    outcomes = {"valid": 0, "refused": 0}
    for n in range(150):
        data = rng.choice(EXAMPLES)
        for _ in range(rng.randint(1, 3)):
            data = mutate(data, rng)
        f = tmp_path / f"case{n}.yaml"
        f.write_bytes(data)
        try:
            cfg = LoadBackConfig.from_yaml(f)
        except ConfigError as exc:
            msg = str(exc)
            assert msg.startswith(f"{f}: ") and "\n" not in msg and not exc.unreadable, (data, msg)
            outcomes["refused"] += 1
        except Exception as exc:  # noqa: BLE001: the point is that nothing else escapes
            pytest.fail(f"seed {seed} case {n}: {type(exc).__name__}: {exc}\n{data!r}")
        else:
            assert isinstance(cfg, LoadBackConfig)
            assert LoadBackConfig.explain(f)  # show works on whatever validate accepts
            outcomes["valid"] += 1
        if n % 10 == 0:
            try:
                code = main(["config", "validate", str(f)])
            except SystemExit as exc:  # pragma: no cover - would be a usage bug
                code = exc.code
            assert code in (0, 2)
            capsys.readouterr()
    assert outcomes["valid"] and outcomes["refused"]  # the mutations reach both sides
