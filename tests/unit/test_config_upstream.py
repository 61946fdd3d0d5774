"""An upstream LMCache MP YAML loads unchanged, and validate says what each key became."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_loadback.orchestrator import upstream
from lmcache_loadback.cli import main
from lmcache_loadback.orchestrator.config import ConfigError, LoadBackConfig

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = ROOT / "configs" / "example_config_upstream.yaml"


def test_upstream_sglang_yaml_is_accepted_and_mapped():
    cfg, rows = LoadBackConfig.read(UPSTREAM)
    assert (cfg.mp_host, cfg.mp_port, cfg.chunk_size) == ("127.0.0.1", 5555, 256)
    assert cfg.deadlines.retrieve_max_ms == 10_000 and cfg.heartbeat.interval_ms == 5_000
    assert cfg.deadlines.lookup_ms == LoadBackConfig().deadlines.lookup_ms  # never 10 s
    by_key = {r.key: r for r in rows}
    assert by_key["extra_config.lmcache.mp.mq_timeout"].target == "deadlines.retrieve_max_ms"
    assert by_key["extra_config.lmcache.mp.heartbeat_interval"].target == "heartbeat.interval_ms"
    assert by_key["local_cpu"].target is None and "ignored" in by_key["local_cpu"].note


def test_our_key_wins_over_the_lmcache_one_and_says_so():
    cfg, rows = LoadBackConfig._load({"deadlines": {"retrieve_max_ms": 700},
                                      "extra_config": {"lmcache.mp.mq_timeout": 9}}, "x")
    assert cfg.deadlines.retrieve_max_ms == 700
    assert "deadlines.retrieve_max_ms is set in the file and wins" in rows[0].note


@pytest.mark.parametrize("extra, fragment", [
    ({"lmcache.mp.mp_transfer_mode": "fast"}, "must be one of auto, engine_driven"),
    ({"lmcache.mp.heartbeat_interval": True}, "finite number of seconds > 0, got True"),
    ({"lmcache.mp.mq_timeout": -3}, "got -3"),
    ({"lmcache.mp.mq_timeout": [1]}, "got [1]"),
])
def test_unparsable_lmcache_values_refused(extra, fragment):
    with pytest.raises(ConfigError, match=r"^x: extra_config\.lmcache\.mp\.") as err:
        LoadBackConfig.from_dict({"extra_config": extra}, source="x")
    assert fragment in str(err.value)


def test_numeric_strings_parse_as_upstream_parses_them():
    cfg = LoadBackConfig.from_dict({"extra_config": {"lmcache.mp.mq_timeout": "4"}})
    assert cfg.deadlines.retrieve_max_ms == 4000


def test_validate_explains_each_upstream_key(capsys):
    assert main(["config", "validate", str(UPSTREAM)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{UPSTREAM}: valid"
    mq = next(line for line in out if "lmcache.mp.mq_timeout = 10" in line)
    assert "-> deadlines.retrieve_max_ms = 10000" in mq and "default 300 s" in mq
    assert any(line.startswith("  local_cpu = False: ignored") for line in out)
    assert any("deadlines in force: lookup 50 ms" in line for line in out)


def test_show_names_the_lmcache_key_as_the_source(capsys):
    assert main(["config", "show", str(UPSTREAM)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines()
                if x.startswith("deadlines.retrieve_max_ms"))
    assert line.endswith("(extra_config.lmcache.mp.mq_timeout)")


def test_key_lists_match_the_installed_lmcache():
    """The keys named here are the ones lmcache 0.5.6 defines and reads, no more, no fewer."""
    import ast
    import importlib.metadata
    import re

    from lmcache.v1 import config as lmc

    assert importlib.metadata.version("lmcache") == "0.5.6"
    assert upstream.ENGINE_KEYS == set(lmc._CONFIG_DEFINITIONS) | set(lmc._CONFIG_ALIASES)
    root = Path(lmc.__file__).resolve().parents[1]
    read = set()  # keys spelled out where they are read ...
    for f in [*(root / "integration").rglob("*.py"), root / "v1" / "multiprocess" / "config.py"]:
        read |= set(re.findall(r"lmcache\.mp\.[a-z_]*[a-z]", f.read_text()))
    # ... and keys built from names: vLLM's ExtraConfigDefault members, lazy-offload tunables
    vllm = ast.parse((root / "integration/vllm/vllm_multi_process_adapter.py").read_text())
    lazy = ast.parse((root / "integration/vllm/lazy_offload_policy/eviction_aware.py").read_text())
    for node in ast.walk(vllm):
        if isinstance(node, ast.ClassDef) and node.name == "ExtraConfigDefault":
            read |= {f"lmcache.mp.{s.targets[0].id}" for s in node.body if isinstance(s, ast.Assign)}
    for node in ast.walk(lazy):
        if isinstance(node, ast.ClassDef) and node.name == "EvictionAwarePolicyConfig":
            read |= {f"lmcache.mp.lazy_offload_{s.target.id}" for s in node.body
                     if isinstance(s, ast.AnnAssign)}
    assert set(upstream.MP_KEYS) == read
