"""`loadback` exit codes: 64 bad usage, 2 invalid config, 3 unreadable; one line, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli import main

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
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "config", "validate"],
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
