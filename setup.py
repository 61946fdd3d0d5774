"""Build hook: every source folder installs under the one import name `lmcache_loadback`.

The repository keeps one folder per part (orchestrator/, connectors/, metrics/, engines/,
harness/, testing/, cli/); installed, each is `lmcache_loadback.<folder>`, so no generic top-level
name (`orchestrator`, `metrics`, ...) can collide with another distribution's. configs/
stays the one hand-edited copy and ships inside the package as
`lmcache_loadback/orchestrator/configs` (orchestrator.resources.configs_dir).
"""

import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
NAME = "lmcache_loadback"
FOLDERS = ("orchestrator", "connectors", "metrics", "engines", "harness", "testing", "cli")
CONFIGS = ROOT / "configs"

packages, package_dir = [], {}
for folder in FOLDERS:
    package_dir[f"{NAME}.{folder}"] = folder
    packages.append(f"{NAME}.{folder}")
    packages += [f"{NAME}.{folder}.{sub}" for sub in find_packages(folder)]


class BuildPyWithConfigs(build_py):
    def run(self):
        super().run()
        if not CONFIGS.is_dir():
            raise SystemExit(f"{CONFIGS} is missing: the wheel must ship the configs")
        dest = Path(self.build_lib) / NAME / "orchestrator" / "configs"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(CONFIGS, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(packages=packages, package_dir=package_dir,
      package_data={f"{NAME}.harness": [
          "bench/results/*.json", "gpu/*.sh", "sglang/model/*.json", "vllm/model/*.json",
          "sglang/stubs/*.py",
          "sglang/stubs/*/*.py", "sglang/stubs/*/*/*.py",
          "sglang/stubs/*/*/*/*.py", "sglang/probe/*.py", "sglang/probe/*.dist-info/*"]},
      cmdclass={"build_py": BuildPyWithConfigs})
