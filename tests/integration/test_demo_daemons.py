"""The demos' daemons (harness/sglang/demo.py, also the vLLM demo's): ours as the README starts
one, with a shared-memory pool of its own name, which survives the demo's kill and restart;
upstream's without one."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_loadback.harness.sglang.demo import side_daemon

pytestmark = pytest.mark.daemon


def test_ours_has_a_pool_of_its_own_through_a_kill_and_restart(tmp_path):
    ours, other, upstream = (side_daemon(o, chunk_size=16, work=tmp_path)
                             for o in (True, True, False))
    assert ours.shm_name and ours.shm_name != other.shm_name
    assert upstream.shm_name is None and "--shm-name" not in upstream.command()
    pool = Path(f"/dev/shm/lmcache_l1_pool_{ours.shm_name}")
    ours.start()
    try:
        assert pool.exists()
        ours.kill()  # the demo's SIGKILL, then a new daemon on the same port and name
        ours.start()
        assert pool.exists()
    finally:
        ours.stop()
    assert not pool.exists()
