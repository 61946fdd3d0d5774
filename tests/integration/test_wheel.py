"""Installed as users install it: the built wheel, run from a directory that is not the
checkout. The wheel is built from a copy of the source tree, installed with --no-deps into a
fresh target directory (its dependencies come from this venv), and every `loadback` command
that needs shipped files is run from a temporary directory with the product imported from
the wheel, never from the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from lmcache_loadback.connectors.telemetry import QUIET_TELEMETRY

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "orchestrator", "connectors",
           "metrics", "engines", "harness", "testing", "cli", "configs")
CFG = "lmcache_loadback/orchestrator/configs/"

pytestmark = [pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    base = tmp_path_factory.mktemp("wheel")
    src, wheels, site = base / "src", base / "dist", base / "site"
    src.mkdir()
    for name in SOURCES:  # a copy: the build writes build/ and *.egg-info beside the sources
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(p, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    r = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(src), "-w",
                        str(wheels)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = wheels.glob("lmcache_loadback-*.whl")
    # A fresh venv outside the checkout; its dependencies (torch, lmcache, ...) come from this
    # venv's site-packages through a .pth line (whose own .pth files, among them the
    # checkout's editable finder, are not processed), the product only from the wheel.
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # ... and the daemon's console script, as installing lmcache there would provide it.
    (venv / "bin" / "lmcache").symlink_to(Path(sys.executable).with_name("lmcache"))
    r = subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps",
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = base / "elsewhere"
    run_dir.mkdir()
    return wheel, site, run_dir


def _loadback(installed, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The installed console script, from a directory that is not the checkout."""
    _, site, run_dir = installed
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(QUIET_TELEMETRY)
    script = site.parents[2] / "bin" / "loadback"
    return subprocess.run([str(script), *args], cwd=run_dir, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_wheel_ships_the_configs_and_the_console_script(installed):
    wheel, site, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("example_config_mp.yaml", "alerts.yaml", "grafana_dashboard.json",
              "prometheus.yml", "chaos/00_baseline.yaml", "chaos/10_version_skew.yaml"):
        assert CFG + f in names, f
    shipped = {n.removeprefix(CFG) for n in names if n.startswith(CFG)}
    in_repo = {str(p.relative_to(ROOT / "configs")) for p in (ROOT / "configs").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert shipped == in_repo  # one hand-edited copy: configs/ is what ships
    # One import name, nothing generic at the top level, no tests.
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"lmcache_loadback"}, tops
    assert not any("/tests/" in n or n.startswith(("tests/", ".venv")) for n in names)
    for f in ("harness/sglang/model/config.json", "harness/vllm/model/tokenizer.json",
              "harness/sglang/stubs/vllm/_custom_ops.py",
              "harness/sglang/probe/loadback_sched_probe.py", "harness/bench/results/gpu.json"):
        assert "lmcache_loadback/" + f in names, f
    for f in ("__init__.py", "__main__.py", "demo.py"):  # the CLI: a package of its own
        assert "lmcache_loadback/cli/" + f in names, f
    assert not any(n.startswith("lmcache_loadback/orchestrator/cli") for n in names)
    (eps,) = [n for n in names if n.endswith(".dist-info/entry_points.txt") and n.count("/") == 1]
    eps_text = zipfile.ZipFile(wheel).read(eps).decode()
    assert "loadback = lmcache_loadback.cli:main" in eps_text
    assert "loadback = lmcache_loadback.engines.sglang:register" in eps_text


def test_product_runs_from_the_wheel_not_the_checkout(installed):
    _, site, _ = installed
    r = _loadback(installed, "diagram")
    assert r.returncode == 0 and r.stdout.startswith("stateDiagram-v2"), r.stderr
    code = ("import lmcache_loadback.orchestrator as o, lmcache_loadback.connectors as c, "
            "lmcache_loadback.metrics as m, lmcache_loadback.engines.sglang as e, "
            "lmcache_loadback.cli as cli, "
            "lmcache_loadback.harness.sglang.server as s, "
            "lmcache_loadback.orchestrator.resources as res; "
            "print(o.__file__, c.__file__, m.__file__, e.__file__, cli.__file__, "
            "s.TINY_MODEL_DIR, "
            "res.configs_dir())")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(site.parents[2] / "bin" / "python"), "-c", code],
                         cwd=installed[2], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    paths = out.stdout.split()
    assert all(p.startswith(str(site)) for p in paths), paths


def test_version_is_the_wheels_metadata(installed):
    wheel, _, _ = installed
    r = _loadback(installed, "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"loadback {wheel.name.split('-')[1]}\n"  # lmcache_loadback-V-...whl
    r = _loadback(installed, "--help")
    assert r.returncode == 0 and "chaos" in r.stdout and "sglang-demo" in r.stdout, r.stderr


def test_console_script_runs_the_demo_verb(installed):
    r = _loadback(installed, "demo", "--help")
    assert r.returncode == 0 and "--engine {sglang,vllm,sim}" in r.stdout, r.stderr
    r = _loadback(installed, "demo", "--engine", "bogus")
    assert r.returncode == 64 and "(choose from 'sglang', 'vllm', 'sim')" in r.stderr, r.stderr


def test_configs_export_then_validate_from_any_directory(installed):
    r = _loadback(installed, "configs", "export", "shipped")
    assert r.returncode == 0, r.stderr
    out = installed[2] / "shipped"
    assert (out / "chaos" / "10_version_skew.yaml").is_file()
    assert (out / "grafana_dashboard.json").read_text() == \
        (ROOT / "configs" / "grafana_dashboard.json").read_text()
    for name in ("example_config_mp.yaml", "example_config_ip.yaml"):
        r = _loadback(installed, "config", "validate", f"shipped/{name}")
        assert r.returncode == 0 and "valid" in r.stdout, (name, r.stderr)
    again = _loadback(installed, "configs", "export", "shipped")
    assert again.returncode == 64 and "--force" in again.stderr


@pytest.mark.daemon
def test_chaos_run_from_the_wheel_finds_its_scenarios(installed):
    r = _loadback(installed, "chaos", "run", "--scenario", "baseline", "--requests", "50",
                  "--json", "chaos.json", timeout=240)
    report = installed[2] / "chaos.json"
    assert report.is_file(), r.stdout[-2000:] + r.stderr[-2000:]  # it ran and judged
    (row,) = json.loads(report.read_text())["scenarios"]
    assert row["name"] == "baseline" and row["requests"] == 50
    assert row["leaked"] == 0 and row["wrong_bytes"] == 0 and row["counters_ok"]
    # Deadline keeping is chaos's own subject (test_chaos_subset); on a loaded machine a call
    # may overshoot, and then the exit code says so.
    assert r.returncode == (0 if row["hung"] == 0 else 1), r.stdout[-2000:]
    unknown = _loadback(installed, "chaos", "run", "--scenario", "nope")
    assert unknown.returncode != 0 and "version_skew" in unknown.stderr  # known names listed
