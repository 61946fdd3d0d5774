"""LoadBackConfig: every bad input names the file, the key and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_loadback.orchestrator.config import ConfigError, LoadBackConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["example_config_mp.yaml", "example_config_ip.yaml",
                                  "example_config_upstream.yaml"])
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
    return subprocess.run([sys.executable, "-m", "lmcache_loadback.cli", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_cli_validate_and_show_exit_codes(tmp_path):
    good = ROOT / "configs" / "example_config_ip.yaml"
    assert _cli("config", "validate", str(good)).returncode == 0
    shown = _cli("config", "show", str(good))
    assert shown.returncode == 0
    assert "mode" in shown.stdout and "(file)" in shown.stdout and "(default)" in shown.stdout
    (line,) = [ln for ln in shown.stdout.splitlines() if ln.startswith("model_name ")]
    assert "\"\" = the engine's model (SGLang --model-path, vLLM --model)" in line
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


# -- hostile input: one ConfigError line naming file, key path and fix; never another error --

DEEP_LIST = "deadlines:\n  lookup_ms: " + "[" * 500 + "]" * 500 + "\n"


@pytest.mark.parametrize("data, key, fragment", [
    (b"mode: mp\nmodel_name: caf\xe9\n", "model_name", "not UTF-8: byte 0xe9 at line 2"),
    (DEEP_LIST.encode(), "deadlines.lookup_ms[0]", "nested deeper than 16 levels"),
    (b"extra_config:\n  lmcache.mp.mq_timeout: 0\n", "extra_config.lmcache.mp.mq_timeout",
     "must be a finite number of seconds > 0, got 0"),
    (b"extra_config:\n  lmcache.mp.mq_timeout: soon\n", "extra_config.lmcache.mp.mq_timeout",
     "got 'soon'"),
    (b"extra_config:\n  lmcache.mp.heartbeat_interval: .inf\n",
     "extra_config.lmcache.mp.heartbeat_interval", "finite number of seconds"),
    (b"deadlines:\n  lookup_ms: .inf\n", "deadlines.lookup_ms", "must be a finite number, got inf"),
    (b"deadlines:\n  retrieve_max_ms: .nan\n", "deadlines.retrieve_max_ms", "finite number"),
    (b"deadlines:\n  lookup_ms: 5\n  lookup_ms: 7\n", "deadlines.lookup_ms",
     "duplicate key (lines 2 and 3)"),
    (b"mode: mp\nmode: ip\n", "mode", "duplicate key (lines 1 and 2)"),
    (b"mp_host: ''\n", "mp_host", "must not be empty"),
    (b"mp_host: 'a b'\n", "mp_host", "must not be empty or hold spaces"),
    (b"mp_host: ipc:///tmp/d\n", "mp_host", "must be a host name or address (tcp:// is implied)"),
])
def test_hostile_config_is_one_line_naming_file_key_and_fix(tmp_path, data, key, fragment):
    f = tmp_path / "cfg.yaml"
    f.write_bytes(data)
    with pytest.raises(ConfigError) as err:
        LoadBackConfig.from_yaml(f)
    msg = str(err.value)
    assert msg.startswith(f"{f}: {key}") and fragment in msg, msg
    assert "\n" not in msg and not err.value.unreadable
    assert err.value.key.startswith(key)


def test_lmcache_key_error_names_the_lmcache_key_not_ours(tmp_path):
    """0.05 s sets deadlines.retrieve_max_ms below the base: say which file key did that."""
    f = tmp_path / "cfg.yaml"
    f.write_text("extra_config:\n  lmcache.mp.mq_timeout: 0.05\n")
    with pytest.raises(ConfigError, match=r"deadlines.retrieve_max_ms \(set by "
                                          r"extra_config.lmcache.mp.mq_timeout\): must be >="):
        LoadBackConfig.from_yaml(f)


@pytest.mark.parametrize("text, fragment", [
    ("mp_port: 0\n", "mp_port: must be in [1, 65535], got 0; the daemon's --port"),
    ("mp_port: 70000\n", "mp_port: must be in [1, 65535], got 70000"),
    ("metrics:\n  port: -1\n", "metrics.port: must be in [0, 65535], got -1; 0 picks a free port"),
    ("retries:\n  max_attempts: 0\n", "retries.max_attempts: must be >= 1, got 0; 1 = no retry"),
    ("retries:\n  jitter_ms: -1\n", "retries.jitter_ms: must be >= 0 ms, got -1"),
    ("break_even:\n  bandwidth_ema_alpha: 0\n", "break_even.bandwidth_ema_alpha: must be in (0, 1]"),
    ("chunk_size: 0\n", "chunk_size: must be > 0, got 0; must equal the daemon's --chunk-size"),
    ("ip:\n  l1_size_gb: 0\n", "ip.l1_size_gb: must be > 0, got 0"),
    ("breaker:\n  window: 5\n  min_calls: 6\n", "breaker.min_calls: must be between 1 and"),
    ("breaker:\n  cooldown_ms: 10\n  cooldown_max_ms: 5\n", "breaker.cooldown_max_ms: must be >="),
    ("breaker:\n  cooldown_ms: 0\n", "breaker.cooldown_ms: must be > 0 ms"),
    ("deadlines:\n  lookup_ms: true\n", "deadlines.lookup_ms: Expected `float`, got `bool`"),
])
def test_field_limits_are_declared_constraints(tmp_path, text, fragment):
    f = tmp_path / "cfg.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        LoadBackConfig.from_yaml(f)
    assert str(err.value).startswith(f"{f}: ") and fragment in str(err.value), str(err.value)


def test_limits_live_on_the_fields_as_msgspec_meta():
    """One source of truth: the bounds a message quotes are the ones msgspec enforces."""
    import msgspec

    def fields(cls):
        out = {}
        for f in msgspec.inspect.type_info(cls).fields:
            t = f.type
            while isinstance(t, msgspec.inspect.Metadata):  # description/extra wrap the type
                t = t.type
            out[f.name] = t
        return out

    top = fields(LoadBackConfig)
    assert (top["mp_port"].ge, top["mp_port"].le) == (1, 65535)
    assert fields(top["deadlines"].cls)["lookup_ms"].gt == 0
    with pytest.raises(msgspec.ValidationError):  # enforced by msgspec itself, not by us
        msgspec.convert({"lookup_ms": -1}, top["deadlines"].cls)


def test_unknown_key_suggests_the_nearest():
    with pytest.raises(ConfigError, match=r"deadlines.lookup: unknown key; did you mean "
                                          r"deadlines.lookup_ms\?"):
        LoadBackConfig.from_dict({"deadlines": {"lookup": 5}})


@pytest.mark.parametrize("path", ["/dev/zero", "/"])
def test_wrong_kind_of_path_is_refused_quickly(path):
    with pytest.raises(ConfigError) as err:
        LoadBackConfig.from_yaml(path)
    assert path in str(err.value)


def test_aliases_and_merge_keys_still_load(tmp_path):
    f = tmp_path / "cfg.yaml"
    f.write_text("deadlines: &d\n  lookup_ms: 9\nbreaker:\n  <<: {cooldown_ms: 7}\n  window: 30\n")
    cfg = LoadBackConfig.from_yaml(f)
    assert cfg.deadlines.lookup_ms == 9 and cfg.breaker.cooldown_ms == 7


def test_sglang_opt_in_is_read_from_the_yaml(tmp_path, monkeypatch):
    from lmcache_loadback.engines.sglang import compat

    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    f = tmp_path / "cfg.yaml"
    f.write_text("sglang:\n  allow_untested: true\n")
    assert compat.allow_untested(LoadBackConfig.from_yaml(f))
    assert not compat.allow_untested(LoadBackConfig())
    f.write_text("sglang:\n  allow_untested: yes please\n")
    with pytest.raises(ConfigError, match="sglang.allow_untested: Expected `bool`"):
        LoadBackConfig.from_yaml(f)
