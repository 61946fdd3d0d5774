"""All or nothing holds when the daemon stops between prepare_retrieve and commit_retrieve:
once every chunk is validated and copied the load has landed, and the commit is a release
owed to the daemon, paid by the caller off the request path."""

from __future__ import annotations

import threading
import uuid

import msgspec
import pytest
import torch
import zmq

from lmcache_loadback.testing.os_delay import OsDelay
from lmcache_loadback.connectors import wire
from lmcache_loadback.testing.daemon import DaemonProcess, free_port
from lmcache_loadback.connectors.errors import DaemonTimeout
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.connectors.safe_decode import dump_tensor_list
from tests.conftest import CHUNK, kv_of, make_pool, same_kv

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(120)]

_OP_NAMES = {i: op for op, i in wire.OP_IDS.items()}


class CommitNeverAnswered:
    """A daemon that answers everything up to prepare_retrieve and never commit_retrieve.

    A fake, because the real daemon cannot be stopped exactly between the two: its
    prepare_retrieve answer and the client's commit are microseconds apart. It serves
    `chunks` for any retrieve and counts the commits it swallowed.
    """

    def __init__(self, chunks: list[torch.Tensor]) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._payload = dump_tensor_list(chunks)
        self._n_chunks = len(chunks)
        self.commits_swallowed = 0
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.bind(self.endpoint)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _result(self, op: str):
        return {
            "noop": "OK", "ping": True, "get_chunk_size": CHUNK,
            "register_kv_cache_engine_driven_context": {"shm_name": "", "pool_size": 0},
            "query_prefetch_status": self._n_chunks,
            "prepare_retrieve": {"success": True, "data": self._payload,
                                 "context": {"slots": [], "chunk_indices": []}},
        }.get(op)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(10):
                continue
            ident, uid, op_frame, *_ = self._sock.recv_multipart()
            op = _OP_NAMES.get(msgspec.msgpack.decode(op_frame))
            if op == "commit_retrieve":
                self.commits_swallowed += 1
                continue
            result = self._result(op)
            tail = [] if result is None else [msgspec.msgpack.encode(result)]
            self._sock.send_multipart([ident, uid, op_frame, *tail])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()


def test_commit_never_answered_still_lands_every_byte_and_owes_the_commit(layout):
    chunks = [torch.randn(layout.chunk_shape).to(layout.dtype) for _ in range(4)]
    fake = CommitNeverAnswered(chunks)
    pool = make_pool(layout, 512, fill=False)
    slots = torch.randperm(512)[:64]
    c = LMCacheMPConnector(fake.endpoint, layout)
    try:
        c.register(2.0)
        toks = list(range(64))
        assert c.lookup_hit_tokens(toks, "r1", 2.0) == 64
        with OsDelay() as delay:
            landed = c.retrieve_into(toks, "r1", pool, slots, start=0, end=64, timeout_s=0.2)
        # the commit is not waited for on the request path
        assert delay.took_s < 0.2 + delay.seconds, delay.describe()
        assert landed.nbytes == 64 * layout.bytes_per_token
        want = [torch.cat([ch[0, layer] for ch in chunks]) for layer in range(layout.num_layers)]
        want += [torch.cat([ch[1, layer] for ch in chunks]) for layer in range(layout.num_layers)]
        got = [t.reshape(64, -1) for t in kv_of(pool, slots)]
        assert same_kv(got, want)
        assert fake.commits_swallowed == 0  # nothing sent yet: the caller owes it
        assert landed.commit is not None
        with pytest.raises(DaemonTimeout):
            landed.commit(0.05)
        assert fake.commits_swallowed >= 1
        assert c.unanswered("r1") >= 1  # the daemon may still serve the commit
    finally:
        c.close()
        fake.close()


@pytest.fixture(scope="module")
def real_daemon():
    d = DaemonProcess(chunk_size=CHUNK, http=True).start()
    yield d
    d.stop()


@pytest.mark.parametrize("delay_ms", [0, 1, 2, 3, 5, 8])
def test_sigstop_a_few_ms_into_retrieve_lands_all_or_nothing(real_daemon, layout, delay_ms):
    """Whichever step the stop lands on, the slots hold every byte (Retrieved) or none."""
    d = real_daemon
    d.resume()
    n = 1024  # 64 chunks: the retrieve takes a few ms on the daemon
    pool = make_pool(layout, 3 * n)
    src, dst = torch.arange(0, n), torch.arange(n, 2 * n)
    c = LMCacheMPConnector(d.endpoint, layout)
    rid = "stop-" + uuid.uuid4().hex
    toks = torch.randint(0, 32000, (n,)).tolist()
    try:
        c.register(5.0)
        assert c.store_from(toks, rid + "-s", pool, src, timeout_s=10.0)
        c.end_session(rid + "-s", 2.0)
        assert c.lookup_hit_tokens(toks, rid, 5.0) == n
        before = kv_of(pool, dst)
        stop = threading.Timer(delay_ms / 1000, d.pause)
        stop.start()
        try:
            landed = c.retrieve_into(toks, rid, pool, dst, start=0, end=n, timeout_s=0.15)
        except DaemonTimeout:
            landed = None
        stop.join()
        d.resume()
        if landed is None:
            assert same_kv(kv_of(pool, dst), before)
        else:
            assert landed.nbytes == n * layout.bytes_per_token
            assert same_kv(kv_of(pool, dst), kv_of(pool, src))
            assert landed.commit(5.0) is True  # paid once the daemon runs again
    finally:
        d.resume()
        c.close()
