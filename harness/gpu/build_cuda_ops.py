"""Rebuild lmcache 0.5.6's `lmcache.cuda_ops` against the torch of this host: the PyPI wheel's
does not load against torch 2.11, and LMCache then silently falls back to slow torch copies.

Usage: python -m lmcache_loadback.harness.gpu.build_cuda_ops CSRC_DIR SITE_DIR (SITE_DIR holds
the installed `lmcache`; its cuda_ops is replaced only if the wheel's does not import).
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

# Sources: the 0.5.6 source release's csrc/ (`pip download --no-clean --no-deps --no-binary
# :all: lmcache==0.5.6`), the 13 files and flags of its CUDA build profile
# (setup_extensions/build_profiles/cuda.py).
SOURCES = ("pybind.cpp", "mem_kernels.cu", "mp_mem_kernels.cu", "phase_timing_recorder.cu",
           "blend_kernels.cu", "cal_cdf.cu", "ac_enc.cu", "ac_dec.cu", "pos_kernels.cu",
           "mem_alloc.cpp", "utils.cpp", "event_recorder.cpp", "completion_recorder.cpp")


def wheel_module_loads() -> str | None:
    """None if `lmcache.cuda_ops` imports, else the error."""
    try:
        importlib.import_module("lmcache.cuda_ops")
        return None
    except ImportError as exc:
        return str(exc)


def main(csrc: str, site: str) -> int:
    err = wheel_module_loads()
    if err is None and not os.environ.get("FORCE_REBUILD"):
        print("lmcache.cuda_ops from the wheel imports: nothing to rebuild")
        return 0
    print(f"lmcache.cuda_ops does not import ({err}); rebuilding", flush=True)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    from torch.utils import cpp_extension

    root = Path(csrc)
    build = Path("/tmp/cuda_ops_build")
    build.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    cpp_extension.load(
        name="cuda_ops", sources=[str(root / "cuda" / s) for s in SOURCES],
        extra_include_paths=[str(root), str(root / "cuda")],
        extra_cuda_cflags=["--threads=2"], build_directory=str(build), verbose=False)
    built = build / "cuda_ops.so"
    dest = Path(site) / "lmcache" / ("cuda_ops" + sysconfig.get_config_var("EXT_SUFFIX"))
    shutil.copyfile(built, dest)
    print(f"built in {time.monotonic() - t0:.0f} s -> {dest}", flush=True)
    # A fresh process: this one already holds the module's pybind types under another name.
    check = subprocess.run([sys.executable, "-c", "import lmcache.cuda_ops"],
                           capture_output=True, text=True)
    err = None if check.returncode == 0 else check.stderr.strip().splitlines()[-1]
    print("lmcache.cuda_ops imports now" if err is None else f"still fails: {err}")
    return 0 if err is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
