"""Build hook: ship the repository's configs/ inside the package as `orchestrator/configs`.

configs/ stays the one hand-edited copy (operators read it at the repository root); every
wheel carries it, so an installed `loadback` finds its chaos scenarios, example configs,
dashboard and alert rules (orchestrator.resources.configs_dir) from any directory.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CONFIGS = Path(__file__).resolve().parent / "configs"


class BuildPyWithConfigs(build_py):
    def run(self):
        super().run()
        if not CONFIGS.is_dir():
            raise SystemExit(f"{CONFIGS} is missing: the wheel must ship the configs")
        dest = Path(self.build_lib) / "orchestrator" / "configs"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(CONFIGS, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildPyWithConfigs})
