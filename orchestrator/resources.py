"""The files shipped with the product: example configs, chaos scenarios, the Grafana
dashboard, Prometheus alert rules and scrape config (`configs_dir`, `export_configs`).
"""

from __future__ import annotations

import importlib.resources
import shutil
from pathlib import Path

__all__ = ["configs_dir", "export_configs"]


def configs_dir() -> Path:
    """The directory holding the shipped configs (packaged, else the source checkout's).

    One hand-edited copy lives in the repository's `configs/`; building the wheel copies it
    into the package as `orchestrator/configs` (setup.py), so the chaos harness and `loadback
    configs export` work from any directory either way."""
    packaged = importlib.resources.files(__package__) / "configs"
    if packaged.is_dir():
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parents[1] / "configs"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(
        f"no shipped configs: neither {packaged} (an installed wheel) nor {checkout} (a source "
        "checkout) exists; reinstall lmcache-loadback from its wheel")


def export_configs(dest: str | Path, *, force: bool = False) -> list[Path]:
    """Copy every shipped file into `dest` (created if missing), keeping sub-folders.

    Refuses to overwrite an existing file unless `force`; raises FileExistsError naming them.
    """
    src, dest = configs_dir(), Path(dest)
    files = sorted(p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    targets = [dest / p.relative_to(src) for p in files]
    clash = [str(t) for t in targets if t.exists()]
    if clash and not force:
        raise FileExistsError(f"{len(clash)} file(s) already exist, e.g. {clash[0]}; pass "
                              "--force to overwrite them, or export into an empty directory")
    for p, t in zip(files, targets):
        t.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, t)
    return targets
