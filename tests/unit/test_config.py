"""LoadBackConfig: every bad input names the file, the key and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config import ConfigError, LoadBackConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["example_config_mp.yaml", "example_config_ip.yaml"])
def test_shipped_examples_are_valid(name):
    cfg = LoadBackConfig.from_yaml(ROOT / "configs" / name)
    assert cfg.mode in ("mp", "ip")


def test_example_mp_spells_out_every_default():
    shipped = LoadBackConfig.from_yaml(ROOT / "configs" / "example_config_mp.yaml")
    assert shipped == LoadBackConfig()


@pytest.mark.parametrize("text, fragment", [
    ("deadlines:\n  lookup_ms: -5\n", "deadlines.lookup_ms: must be > 0 ms"),
    ("deadlinez: {}\n", "deadlinez: unknown key"),
    ("breaker:\n  cooldown: 3\n", "breaker.cooldown: unknown key"),
    ("retries:\n  max_attempts: lots\n", "retries.max_attempts: Expected `int`"),
    ("mode: hybrid\n", "mode: Invalid enum value 'hybrid'"),
    ("breaker:\n  failure_ratio: 1.5\n", "breaker.failure_ratio: must be in (0, 1]"),
    ("deadlines:\n  retrieve_base_ms: 500\n  retrieve_max_ms: 100\n", "retrieve_max_ms: must be >="),
    ("- just\n- a list\n", "the top level must be a mapping"),
    ("mode: [mp\n", "not valid YAML at line"),
    ("extra_config:\n  lmcache.mp.nope: 1\n", "extra_config: unknown key"),
])
def test_bad_config_names_file_key_and_fix(tmp_path, text, fragment):
    f = tmp_path / "cfg.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        LoadBackConfig.from_yaml(f)
    assert str(f) in str(err.value)
    assert fragment in str(err.value)


def test_missing_file_is_unreadable_not_invalid(tmp_path):
    with pytest.raises(ConfigError, match="config file not found") as err:
        LoadBackConfig.from_yaml(tmp_path / "absent.yaml")
    assert err.value.unreadable


def test_lmcache_keys_map_onto_ours():
    cfg = LoadBackConfig.from_dict({"extra_config": {"lmcache.mp.heartbeat_interval": 2.5,
                                                     "lmcache.mp.mq_timeout": 3}})
    assert cfg.heartbeat.interval_ms == 2500 and cfg.deadlines.retrieve_max_ms == 3000


def test_retrieve_deadline_scales_with_tokens_and_is_capped():
    d = LoadBackConfig.from_dict({"deadlines": {"retrieve_base_ms": 100,
                                                "retrieve_per_ki_token_ms": 50,
                                                "retrieve_max_ms": 300}}).deadlines
    assert d.retrieve_s(0) == pytest.approx(0.1)
    assert d.retrieve_s(2048) == pytest.approx(0.2)
    assert d.retrieve_s(1 << 20) == pytest.approx(0.3)


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        LoadBackConfig().mode = "ip"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_cli_validate_and_show_exit_codes(tmp_path):
    good = ROOT / "configs" / "example_config_ip.yaml"
    assert _cli("config", "validate", str(good)).returncode == 0
    shown = _cli("config", "show", str(good))
    assert shown.returncode == 0
    assert "mode" in shown.stdout and "(file)" in shown.stdout and "(default)" in shown.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("deadlines:\n  lookup_ms: -1\n")
    r = _cli("config", "validate", str(bad))
    assert r.returncode == 2 and "deadlines.lookup_ms" in r.stderr
    r = _cli("config", "validate", str(tmp_path / "absent.yaml"))
    assert r.returncode == 3 and "not found" in r.stderr


def test_cli_diagram_is_mermaid_of_the_table():
    r = _cli("diagram")
    assert r.returncode == 0 and r.stdout.startswith("stateDiagram-v2")
    assert "marked --> retrieving: start_retrieve" in r.stdout
