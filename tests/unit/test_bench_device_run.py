"""harness/gpu/device_run.sh exits with the bench's code (it pipes the bench through tee), and
with the GPU tests' code when the bench passed: run with stand-ins for python3 and nvidia-smi
that exit with chosen codes (the real ones need the GPU host)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/usr/bin/env bash
case "$*" in
  *"bench gpu --concurrency"*) echo "concurrency output $*"; exit "$FAKE_CONC_RC" ;;
  *"bench gpu"*) echo "bench output"; exit "$FAKE_BENCH_RC" ;;
  *"pytest tests/gpu"*) echo "1 failed"; exit "$FAKE_TESTS_RC" ;;
  *) exit 0 ;;
esac
"""


@pytest.mark.parametrize("bench,conc,tests,want", [
    (1, 0, 0, 1), (0, 0, 0, 0), (0, 0, 1, 1), (2, 0, 1, 2), (0, 1, 0, 1), (2, 1, 0, 2),
    (0, 3, 1, 3)])
def test_device_run_exits_with_the_bench_code(tmp_path, bench, conc, tests, want):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, body in (("python3", FAKE_PYTHON), ("nvidia-smi", "#!/usr/bin/env bash\n")):
        (bin_ / name).write_text(body)
        (bin_ / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "SITE": str(tmp_path / "site"), "FAKE_BENCH_RC": str(bench),
           "FAKE_CONC_RC": str(conc), "FAKE_TESTS_RC": str(tests)}
    run = subprocess.run(["bash", str(ROOT / "harness/gpu/device_run.sh")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == want, run.stdout + run.stderr
    assert "bench output" in run.stdout and f"bench rc={bench}" in run.stdout
    # the whole grid, its JSON beside gpu.json in $OUT, unchanged
    assert f"concurrency output -m lmcache_loadback.cli bench gpu --concurrency 1,4,8,16 " \
        f"--json {tmp_path / 'out'}/gpu_concurrency.json" in run.stdout
    assert f"concurrency bench rc={conc}" in run.stdout


def test_device_run_installs_every_package_folder_of_the_product(tmp_path):
    """Each folder setup.py installs as lmcache_loadback.<folder> is linked into the site the
    GPU host imports from (the CLI moved to cli/, and `python -m lmcache_loadback.cli` runs)."""
    folders = re.search(r"FOLDERS = \(([^)]*)\)", (ROOT / "setup.py").read_text()).group(1)
    script = (ROOT / "harness/gpu/device_run.sh").read_text()
    linked = re.search(r"for d in ([a-z ]+); do", script).group(1).split()
    assert sorted(linked) == sorted(re.findall(r'"(\w+)"', folders))
    assert "python3 -m lmcache_loadback.cli bench gpu" in script
