"""Transfer "auto" against real daemons, and the shared-memory segment's lifetime when the
daemon dies in the middle of a copy (CPU pool, CPU copy; tests/gpu repeats it on a GPU)."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

import lmcache_loadback.connectors.lmcache_mp as mp
import lmcache_loadback.connectors.mp_retrieve as retrieve
from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.connectors.kv_layout import KVLayout

from ..conftest import kv_of, make_pool, same_kv

pytestmark = pytest.mark.daemon
CHUNK = 16
T = 30.0


@pytest.fixture(scope="module")
def shm_daemon():
    d = DaemonProcess(chunk_size=CHUNK, shm_name=f"lbta{os.getpid()}")
    d.start()
    yield d
    d.stop()


def _store_and_lookup(conn, layout, n, rid):
    src = make_pool(layout, 1024)
    toks = torch.randint(1, 30000, (n,)).tolist()
    stored = torch.randperm(1024)[:n]
    assert conn.store_from(toks, rid + "-s", src, stored, timeout_s=T)
    conn.end_session(rid + "-s", T)
    assert conn.lookup_hit_tokens(toks, rid, T) == n
    return src, toks, stored


def test_auto_follows_what_each_registration_offers(layout, caplog):
    d = DaemonProcess(chunk_size=CHUNK, shm_name=f"lbtb{os.getpid()}")
    d.start()
    conn = mp.LMCacheMPConnector(d.endpoint, layout)
    try:
        assert conn.transfer_setting == "auto"
        with caplog.at_level(logging.INFO, logger="lmcache_loadback.connectors.lmcache_mp"):
            conn.register(T)
            conn.register(T)  # same daemon, same choice: logged once
            assert conn.transfer == "shm"
            d.shm_name = None
            d.restart()  # same port, no pool offered now
            conn.register(T)
        assert conn.transfer == "pickle" and conn._shm is None
        logged = [r.getMessage() for r in caplog.records if "transfer" in r.getMessage()]
        assert len(logged) == 2 and "transfer shm" in logged[0] and "transfer pickle" in logged[1]
        n = 2 * CHUNK
        src, toks, stored = _store_and_lookup(conn, layout, n, "auto-p")
        dst = make_pool(layout, 1024, fill=False)
        slots = torch.randperm(1024)[:n]
        r = conn.retrieve_into(toks, "auto-p", dst, slots, start=0, end=n, timeout_s=T)
        r.commit(T)
        assert same_kv(kv_of(dst, slots), kv_of(src, stored))
    finally:
        conn.close()
        d.stop()


def test_explicit_shm_against_a_daemon_without_pool_names_both_flags(daemon, layout):
    conn = mp.LMCacheMPConnector(daemon.endpoint, layout, transfer="shm")
    try:
        with pytest.raises(mp.DaemonRejected, match="--shm-name NAME --no-l1-use-lazy"):
            conn.register(T)
    finally:
        conn.close()


def test_daemon_killed_mid_copy_cannot_unmap_the_segment(shm_daemon, monkeypatch):
    """A copy is reading the daemon's segment when the daemon is SIGKILLed, restarted, and
    the connector registers again (which replaces its mapping): the copy still reads this
    process's own mapping to the end and lands byte-exact."""
    layout = KVLayout(num_layers=2, num_heads=4, head_dim=16, dtype=torch.float16,
                      chunk_size=CHUNK)
    conn = mp.LMCacheMPConnector(shm_daemon.endpoint, layout)
    conn.register(T)
    assert conn.transfer == "shm"
    n = 4 * CHUNK
    src, toks, stored = _store_and_lookup(conn, layout, n, "kill")
    inside, resume = threading.Event(), threading.Event()
    real = retrieve.scatter_skipping

    def paused_scatter(*args):
        inside.set()  # the chunk views into the segment exist; hold the copy here
        assert resume.wait(60)
        real(*args)

    monkeypatch.setattr(retrieve, "scatter_skipping", paused_scatter)
    dst = make_pool(layout, 1024, fill=False)
    slots = torch.randperm(1024)[:n]
    out = {}

    def load():
        try:
            out["r"] = conn.retrieve_into(toks, "kill", dst, slots, start=0, end=n,
                                          timeout_s=T)
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            out["err"] = exc

    th = threading.Thread(target=load)
    th.start()
    try:
        assert inside.wait(30), "the load never reached its copy"
        old = conn._shm
        shm_daemon.kill()
        shm_daemon.start()
        conn.register(T)  # the heartbeat's re-registration closes the old mapping
        assert conn._shm is not old and not old._map.closed
    finally:
        resume.set()
        th.join(60)
        conn.close()
    assert "err" not in out, out.get("err")
    assert same_kv(kv_of(dst, slots), kv_of(src, stored))
