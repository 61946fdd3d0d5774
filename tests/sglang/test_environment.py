"""The SGLang test environment is the one the Makefile pins, and the plugin is registered in it.

Runs in every .venv-sglang-*: a venv that drifted from tests/sglang/requirements-<version>.txt,
or an install whose entry point is missing, fails here rather than as a confusing SGLang error.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

import sglang

HERE = Path(__file__).parent


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    path = HERE / f"requirements-{sglang.__version__}.txt"
    assert path.is_file(), (f"no pins for sglang {sglang.__version__}: expected {path} "
                            f"(the Makefile builds one venv per pinned version)")
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[_norm(name)] = version
    return pins


def test_installed_versions_match_the_pins():
    installed = {_norm(d.metadata["Name"]): d.version for d in metadata.distributions()}
    drift = {name: (want, installed.get(name)) for name, want in _pins().items()
             if installed.get(name) != want}
    assert not drift, f"venv differs from the pins (name: (pinned, installed)): {drift}"
    assert installed["lmcache"] == "0.5.6"
    assert installed["torch"].startswith("2.13.0")


def test_loadback_plugin_entry_point_is_registered():
    eps = {ep.name: ep.value for ep in metadata.entry_points(group="sglang.srt.plugins")}
    assert eps.get("loadback") == "lmcache_loadback.engines.sglang:register", (
        f"entry point missing from this venv (reinstall the package: pip install --no-deps -e .): "
        f"{eps}")


@pytest.mark.parametrize("module, name", [("vllm._custom_ops", "rotary_embedding"),
                                          ("torchvision.io", "decode_jpeg"),
                                          ("torchvision.transforms.functional", "resize")])
def test_stubs_raise_when_called(module, name):
    mod = __import__(module, fromlist=[name])
    assert "harness/sglang/stubs" in mod.__file__, f"{module} is not the test stub: {mod.__file__}"
    with pytest.raises(RuntimeError, match="test-only stub"):
        getattr(mod, name)()


def test_the_backend_and_the_demo_import_without_tests(tmp_path):
    """The SGLang backend, the plugin hook and the demo's launcher import from a directory
    that is not the checkout, and nothing they import comes from `tests/`."""
    import subprocess
    import sys

    code = ("import sys, lmcache_loadback.engines.sglang as e, "
            "lmcache_loadback.engines.sglang.radix_cache as rc, "
            "lmcache_loadback.harness.sglang.demo as d, lmcache_loadback.harness.sglang.server as s\n"
            "e.register()\n"
            "assert s.TINY_MODEL_DIR.joinpath('config.json').is_file(), s.TINY_MODEL_DIR\n"
            "bad = sorted(m for m in sys.modules if m == 'tests' or m.startswith('tests.'))\n"
            "print('TESTS', bad)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TESTS []" in r.stdout, r.stdout
