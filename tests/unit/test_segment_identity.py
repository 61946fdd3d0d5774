"""The daemon's segment is told apart by what it is (the inode of /dev/shm/<name>), never by
its name: a daemon restarted under the same --shm-name, behind something that hides the
restart from the connection's epoch, unlinks the old segment and creates another one. A
file under /dev/shm stands in for the daemon's segment (no daemon: the logic is ours)."""

from __future__ import annotations

import os
import threading
import uuid

import pytest
import torch

from lmcache_loadback.connectors import wire
from lmcache_loadback.connectors.errors import DaemonUnavailable
from lmcache_loadback.connectors.gpu_transfer import GpuTransfer
from lmcache_loadback.connectors.shm_pool import SegmentMapping, ShmPool

SIZE = 4096


@pytest.fixture
def segment():
    """A segment name; `make()` (re)creates it as a daemon starting under that name does."""
    name = f"lb-test-{uuid.uuid4().hex}"
    path = "/dev/shm/" + name

    def make() -> None:
        if os.path.exists(path):
            os.unlink(path)
        with open(path, "wb") as f:
            f.truncate(SIZE)

    make()
    yield name, make
    if os.path.exists(path):
        os.unlink(path)


class _Mapped(SegmentMapping):
    """The connector's mapping part alone: what registration swaps and loads read."""

    def __init__(self) -> None:
        self._shm = None
        self._gpu = None
        self._map_lock = threading.Lock()
        self.epoch = 3
        self.transfer = "shm"


def test_a_segment_replaced_under_the_same_name_is_mapped_again(segment):
    """Same name, size and epoch but a new inode: the registration maps the new segment."""
    name, make = segment
    m = _Mapped()
    reply = wire.RegisterReply(shm_name=name, pool_size=SIZE)
    with m._map_lock:
        m._swap_mapping("shm", reply, 3)
    first = m._shm
    with m._map_lock:
        m._swap_mapping("shm", reply, 3)
    assert m._shm is first  # the same segment: kept, not remapped
    make()  # the daemon restarted with the same --shm-name
    with m._map_lock:
        m._swap_mapping("shm", reply, 3)
    assert m._shm is not first and m._shm.identity != first.identity
    assert first.bytes is None
    m._shm.close()


def test_a_load_through_a_replaced_segment_is_refused_before_any_copy(segment):
    """Between the restart and the next registration, the mapping is not handed out."""
    name, make = segment
    m = _Mapped()
    with m._map_lock:
        m._swap_mapping("shm", wire.RegisterReply(shm_name=name, pool_size=SIZE), 3)
    assert m._mapping() is m._shm
    make()
    with pytest.raises(DaemonUnavailable, match="another segment"):
        m._mapping()
    with pytest.raises(DaemonUnavailable):
        m._shm_views(wire.ShmContext(), 0)
    m._shm.close()


def test_page_locking_follows_the_segment_not_its_address(segment):
    """The CUDA path keeps its page-locked segment only for the same segment at the same
    address; another segment is attached (page-locked) again, the old one retired."""
    name, make = segment
    gt = GpuTransfer("cpu")
    shm = ShmPool(name, SIZE, 0)
    try:
        gt.attach(shm.bytes, identity=shm.identity)
        first = gt.segment
        gt.attach(shm.bytes, identity=shm.identity)
        assert gt.segment is first
        other = (shm.identity[0], shm.identity[1] + 1)
        gt.attach(shm.bytes, identity=other)
        assert gt.segment is not first and gt.segment.identity == other
    finally:
        gt.close()
        shm.close()
