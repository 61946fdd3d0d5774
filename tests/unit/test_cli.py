"""`loadback` exit codes: 64 bad usage, 2 invalid config, 3 unreadable; one line, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_loadback.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse leaves through sys.exit
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv", [[], ["config", "validate"], ["config", "lint", "x.yaml"],
                                  ["nonsense"], ["config", "show", "a.yaml", "--jsonn"]])
def test_usage_errors_exit_64_not_the_invalid_config_code(capsys, argv):
    code, _, err = run(capsys, *argv)
    assert code == 64 and "usage: loadback" in err


def test_usage_error_exits_64_from_the_console_entry(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lmcache_loadback.cli", "config", "validate"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 64 and "the following arguments are required: file" in r.stderr


HOSTILE = {
    "non_utf8": b"mode: mp\nmodel_name: caf\xe9\n",
    "deep": b"deadlines: " + b"[" * 500 + b"]" * 500 + b"\n",
    "mq_timeout_0": b"extra_config:\n  lmcache.mp.mq_timeout: 0\n",
    "mq_timeout_text": b"extra_config:\n  lmcache.mp.mq_timeout: soon\n",
    "inf_deadline": b"deadlines:\n  retrieve_max_ms: .inf\n",
    "duplicate": b"mp_port: 5555\nmp_port: 6666\n",
    "empty_host": b"mp_host: \"\"\n",
    "control_char": b"mode: \x01\n",
    "bad_tag": b"chunk_size: !!int twelve\n",
    "python_tag": b"mode: !!python/object/apply:os.system ['true']\n",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
@pytest.mark.parametrize("action", ["validate", "show"])
def test_hostile_file_exits_2_with_one_line(capsys, tmp_path, name, action):
    f = tmp_path / f"{name}.yaml"
    f.write_bytes(HOSTILE[name])
    code, out, err = run(capsys, "config", action, str(f))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: {f}: ") and "Traceback" not in err


def test_unreadable_file_exits_3(capsys, tmp_path):
    code, _, err = run(capsys, "config", "validate", str(tmp_path))  # a directory
    assert code == 3 and err.startswith(f"error: {tmp_path}: cannot read config file")


# --- help, --version, exit codes in the help, light imports (issue 17) ---

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402

import yaml  # noqa: E402

from lmcache_loadback import cli  # noqa: E402

ENV = dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1")


def _parsers(parser, path=("loadback",)):
    """Every (command path, parser, the help its parent gives it) under `parser`."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_command_and_flag_has_help():
    parser = cli.build_parser()
    undocumented = []
    for path, p in _parsers(parser):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {a.dest for a in action._choices_actions if a.help}
                undocumented += [f"{' '.join(path)} {n}" for n in action.choices
                                 if n not in helped]
            elif not action.help:
                undocumented.append(f"{' '.join(path)} {action.option_strings or action.dest}")
    assert undocumented == []


def test_top_help_is_whole_sentences_and_shows_every_exit_code(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    desc = " ".join(cli.build_parser().description.split())
    assert desc.endswith(".") and len(desc.split()) > 12  # not cut mid-sentence any more
    assert desc in " ".join(out.split())
    assert "exit codes:" in out
    from lmcache_loadback.orchestrator import exit_codes

    codes = {v for k, v in vars(exit_codes).items() if k.startswith("EXIT_")}
    assert codes == {0, 1, 2, 3, 64, 69}
    for c in codes:
        assert f"\n  {c} " in out, c
    for cmd in ("demo", "sglang-demo", "chaos", "bench", "tune", "config", "configs", "diagram"):
        assert re.search(rf"^    {cmd}\s+\S", out, re.M), cmd  # listed with its help


def test_chaos_run_help_lists_every_shipped_scenario(capsys):
    names = [yaml.safe_load(f.read_text())["name"]
             for f in sorted((ROOT / "configs" / "chaos").glob("*.yaml"))]
    assert len(names) >= 10
    code, out, _ = run(capsys, "chaos", "run", "--help")
    assert code == 0
    flat = " ".join(out.split())
    for name in names:
        assert name in flat, name
    code, _, err = run(capsys, "chaos", "run", "--scenario", "nope")
    assert code == 64 and "version_skew" in err  # refused before any daemon starts


def test_demo_help_documents_requests_and_json(capsys):
    code, out, _ = run(capsys, "demo", "--help")
    flat = " ".join(out.split())
    assert code == 0
    assert "--requests N requests in the workload" in flat
    assert "--json FILE also write the result and the metrics" in flat


@pytest.mark.parametrize("argv", [
    ["demo", "--requests", "0"], ["demo", "--interval-ms", "-1"],
    ["bench", "core", "--samples", "-1"], ["chaos", "run", "--requests", "-5"],
    ["sglang-demo", "--sides", "theirs"], ["sglang-demo", "--duration-s", "0"],
    ["tune", "--daemon", "h:1", "--model-config", "c.json", "--tp-size", "0"],
])
def test_bad_values_exit_64_before_running_anything(capsys, argv):
    code, _, err = run(capsys, *argv)
    assert code == 64 and "usage: loadback" in err and "Traceback" not in err


def test_version_is_the_installed_distributions():
    r = subprocess.run([sys.executable, "-m", "lmcache_loadback.cli", "--version"], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"loadback {importlib.metadata.version('lmcache-loadback')}\n"


LIGHT = """
import sys
from lmcache_loadback.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in sys.modules if m in ("torch", "lmcache") or m.startswith((
    "torch.", "sglang", "lmcache.", "lmcache_loadback.harness", "lmcache_loadback.orchestrator.core")))
print("HEAVY", heavy, file=sys.stderr)
sys.exit(code if not heavy else 99)
"""


@pytest.mark.parametrize("argv", [["--help"], ["--version"],
                                  ["config", "validate", "configs/example_config_mp.yaml"],
                                  ["config", "show", "configs/example_config_upstream.yaml"],
                                  ["chaos", "run", "--help"]])
def test_help_version_and_config_import_neither_sglang_nor_torch(argv):
    """The config code needs no torch (orchestrator.config reads YAML with msgspec), so none
    of these may import it, nor SGLang, the demos or the orchestrator core."""
    r = subprocess.run([sys.executable, "-c", LIGHT, *argv], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "HEAVY []" in r.stderr


@pytest.mark.parametrize("argv", [["tune", "--help"], ["status", "--help"]])
def test_help_speaks_of_both_engines(capsys, argv):
    """The product serves SGLang and vLLM: the help a user reads first names both."""
    code, out, _ = run(capsys, *argv)
    flat = " ".join(out.split())
    assert code == 0 and "SGLang" in flat and "vLLM" in flat, flat
    desc = cli.build_parser().description   # what `loadback --help` opens with
    assert "SGLang" in desc and "vLLM" in desc, desc


def test_status_unreadable_hint_names_both_engines():
    from lmcache_loadback.orchestrator.status import fix_hint

    hint = fix_hint("http://127.0.0.1:1/metrics", "connection refused")
    assert "\n" not in hint and "SGLang" in hint and "vLLM" in hint, hint


def test_validate_says_the_vllm_connector_reads_lmcache_mp_host_and_port(capsys, tmp_path):
    """engines/vllm/settings.py reads lmcache.mp.host / port from vLLM's
    kv_connector_extra_config: validate must not say this product reads them nowhere."""
    f = tmp_path / "up.yaml"
    f.write_text("extra_config:\n  lmcache.mp.host: tcp://10.0.0.1\n  lmcache.mp.port: 6000\n")
    code, out, _ = run(capsys, "config", "validate", str(f))
    rows = [line for line in out.splitlines() if "lmcache.mp.host" in line or
            "lmcache.mp.port" in line]
    assert code == 0 and len(rows) == 2, out
    for row in rows:
        assert "nor this product" not in row and "kv_connector_extra_config" in row, row
        assert "LoadBackConnector" in row, row


# --- one demo verb: demo --engine sglang|vllm|sim, sglang-demo its alias ---

def test_demo_engine_outside_the_choices_exits_64_naming_them(capsys):
    code, _, err = run(capsys, "demo", "--engine", "bogus")
    line = err.strip().splitlines()[-1]
    assert code == 64 and "--engine" in line and "'bogus'" in line, err
    for engine in ("sglang", "vllm", "sim"):
        assert f"'{engine}'" in line, line


def test_demo_refuses_what_its_engine_does_not_take(capsys):
    code, _, err = run(capsys, "demo", "--engine", "vllm", "--requests", "3")
    assert code == 64 and "--requests applies to --engine sim only" in err, err
    code, _, err = run(capsys, "sglang-demo", "--duration-s", "5", "--requests", "3")
    assert code == 64 and "--requests applies to --engine sim only" in err, err
    code, _, err = run(capsys, "demo", "--engine", "vllm", "--sides", "ours")
    assert code == 64 and "loadback,upstream" in err and "usage: loadback demo" in err, err
    code, _, err = run(capsys, "demo", "--engine", "vllm", "--fleet")
    assert code == 64 and "--fleet applies to --engine sglang only" in err, err
    code, _, err = run(capsys, "demo", "--engine", "sglang", "--fleet", "--duration-s", "5")
    assert code == 64 and "--duration-s does not apply to --fleet" in err, err
    code, _, err = run(capsys, "demo", "--engine", "sglang", "--fleet", "--requests", "5")
    assert code == 64 and "--requests applies to --engine sim only" in err, err


class _Demo:
    """Stands for an engine's harness demo: records what the verb hands its run()."""

    def __init__(self, sides=()):
        self.SIDES = sides
        self.args = None

    def run(self, args):
        self.args = args
        return 0


@pytest.mark.parametrize("argv, module, expected", [
    (["demo"], "lmcache_loadback.harness.demo", {"requests": 800, "interval_ms": 50.0}),
    (["demo", "--engine", "sim", "--requests", "5"], "lmcache_loadback.harness.demo",
     {"requests": 5}),
    (["demo", "--engine", "sglang"], "lmcache_loadback.harness.sglang.demo",
     {"duration_s": 60.0, "interval_ms": 1000.0, "deadline_s": 10.0, "mq_timeout_s": 3.0,
      "sides": "ours,upstream", "probe": False, "sglang_python": None}),
    (["sglang-demo", "--sides", "ours", "--probe"], "lmcache_loadback.harness.sglang.demo",
     {"sides": "ours", "probe": True, "interval_ms": 1000.0}),
    (["demo", "--engine", "sglang", "--fleet", "--sides", "ours", "--json", "f.json"],
     "lmcache_loadback.harness.sglang.fleet_demo",
     {"deadline_s": 10.0, "mq_timeout_s": 3.0, "sides": "ours", "sglang_python": None,
      "json": "f.json", "duration_s": None, "interval_ms": None, "probe": None}),
    (["demo", "--engine", "vllm", "--duration-s", "7", "--json", "x.json"],
     "lmcache_loadback.harness.vllm.demo",
     {"duration_s": 7.0, "sides": "loadback,upstream", "json": "x.json"}),
])
def test_each_demo_engine_runs_its_harness_demo_with_its_defaults(capsys, monkeypatch, argv,
                                                                  module, expected):
    from lmcache_loadback.cli import demo

    fakes = {"lmcache_loadback.harness.demo": _Demo(),
             "lmcache_loadback.harness.sglang.demo": _Demo(("ours", "upstream")),
             "lmcache_loadback.harness.sglang.fleet_demo": _Demo(("ours", "upstream")),
             "lmcache_loadback.harness.vllm.demo": _Demo(("loadback", "upstream"))}
    monkeypatch.setattr(demo.importlib, "import_module", fakes.__getitem__)
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    got = vars(fakes[module].args)
    assert {k: got[k] for k in expected} == expected
    assert [m for m, f in fakes.items() if f.args is not None] == [module]


def test_each_engine_demo_in_the_harness_has_a_run_and_its_sides():
    """What the verb calls exists: run(args) in each module, SIDES where --sides applies."""
    import importlib

    from lmcache_loadback.cli import demo

    for engine, name in demo.MODULES.items():
        module = importlib.import_module(name)
        assert callable(module.run), name
        if "sides" in demo.DEFAULTS[engine]:
            assert module.SIDES and all(isinstance(s, str) for s in module.SIDES), name
