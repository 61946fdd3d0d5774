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
import zipfile
from pathlib import Path

import pytest

from connectors.telemetry import QUIET_TELEMETRY

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "orchestrator", "connectors",
           "metrics", "configs")

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
    r = subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = base / "elsewhere"
    run_dir.mkdir()
    return wheel, site, run_dir


def _loadback(installed, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    _, site, run_dir = installed
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(site), **QUIET_TELEMETRY)
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=run_dir,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_wheel_ships_the_configs_and_the_console_script(installed):
    wheel, site, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("orchestrator/configs/example_config_mp.yaml", "orchestrator/configs/alerts.yaml",
              "orchestrator/configs/grafana_dashboard.json", "orchestrator/configs/prometheus.yml",
              "orchestrator/configs/chaos/00_baseline.yaml",
              "orchestrator/configs/chaos/10_version_skew.yaml"):
        assert f in names, f
    shipped = {n.removeprefix("orchestrator/configs/") for n in names
               if n.startswith("orchestrator/configs/")}
    in_repo = {str(p.relative_to(ROOT / "configs")) for p in (ROOT / "configs").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert shipped == in_repo  # one hand-edited copy: configs/ is what ships
    assert not any(n.startswith(("tests/", ".venv")) for n in names)
    (eps,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "loadback = orchestrator.cli:main" in zipfile.ZipFile(wheel).read(eps).decode()


def test_product_runs_from_the_wheel_not_the_checkout(installed):
    _, site, _ = installed
    r = _loadback(installed, "diagram")
    assert r.returncode == 0 and r.stdout.startswith("stateDiagram-v2"), r.stderr
    code = ("import orchestrator, connectors, metrics, orchestrator.resources as res; "
            "print(orchestrator.__file__, connectors.__file__, metrics.__file__, res.configs_dir())")
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-c", code], cwd=installed[2], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    paths = out.stdout.split()
    assert all(p.startswith(str(site)) for p in paths), paths


def test_version_is_the_wheels_metadata(installed):
    wheel, _, _ = installed
    r = _loadback(installed, "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"loadback {wheel.name.split('-')[1]}\n"  # lmcache_loadback-V-...whl


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
    r = _loadback(installed, "chaos", "run", "--scenario", "baseline", "--requests", "20",
                  "--json", "chaos.json", timeout=240)
    report = installed[2] / "chaos.json"
    assert report.is_file(), r.stdout[-2000:] + r.stderr[-2000:]  # it ran and judged
    (row,) = json.loads(report.read_text())["scenarios"]
    assert row["name"] == "baseline" and row["requests"] == 20
    assert row["leaked"] == 0 and row["wrong_bytes"] == 0 and row["counters_ok"]
    # Deadline keeping is chaos's own subject (test_chaos_subset); on a loaded machine a call
    # may overshoot, and then the exit code says so.
    assert r.returncode == (0 if row["hung"] == 0 else 1), r.stdout[-2000:]
    unknown = _loadback(installed, "chaos", "run", "--scenario", "nope")
    assert unknown.returncode != 0 and "version_skew" in unknown.stderr  # known names listed
