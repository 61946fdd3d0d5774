"""LMCacheMPConnector: the LMCache 0.5.6 multi-process client (engine-driven transfer mode)
for one KV rank of one model. Every call returns or raises by its timeout, whatever the
daemon does; it keeps no policy (no retries, breaker or metrics). Its LOOKUP, RETRIEVE and
STORE sides are mp_lookup.py, mp_retrieve.py and mp_store.py; the segment, shm_pool.py.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Callable, Literal, Sequence

import msgspec
import torch

from . import wire
from .errors import DaemonRejected, ProtocolError, RequestDropped, VersionSkew
from .gpu_transfer import GpuTransfer
from .kv_layout import KVLayout
from .mp_lookup import LookupCalls
from .mp_retrieve import RetrieveCalls
from .mp_store import StoreCalls
from .retrieval import Outstanding
from .shm_pool import SegmentMapping, ShmPool, refuse_cuda_mla
from .transport import ZmqTransport

#: The transfer modes a connector can be configured with (README, "Transfer modes").
TransferMode = Literal["auto", "pickle", "shm"]
log = logging.getLogger(__name__)
_instance_ids = itertools.count(1)


def _new_instance_id() -> int:
    # Unique per process and per connector: the daemon keys registrations by it.
    return (os.getpid() << 20) | next(_instance_ids)






class LMCacheMPConnector(LookupCalls, RetrieveCalls, StoreCalls, SegmentMapping):
    """Client of one LMCache MP daemon for one KV rank of one model.

    KV bytes move by pickle (prepare_retrieve carries the chunks, loaded by a restricted
    unpickler; commit_store carries them) or through the daemon's shared-memory segment
    ("shm": slot descriptors into its L1 pool, no pickle); "auto" takes shm when the
    registration reply offers a pool, decided again at every registration. A KV pool on a
    CUDA device moves through `connectors.gpu_transfer` (`Retrieved.ready` an event)."""

    #: Told (op, seconds) of each call the daemon answered in time: from its send (its
    #: fence's or probe's, where one goes first) to its answer. The orchestrator's daemon
    #: link counts them in `loadback_daemon_call_duration_seconds{op}` (it sets this before
    #: its heartbeat's first registration); timed-out calls are not told.
    on_call: Callable[[str, float], None] | None = None

    def __init__(
        self,
        endpoint: str,
        layout: KVLayout,
        *,
        model_name: str = "loadback",
        world_size: int = 1,
        kv_rank: int = 0,
        transfer: TransferMode = "auto",
        instance_id: int | None = None,
        connect_timeout_s: float = 1.0,
        transport: ZmqTransport | None = None,
        device: torch.device | str | None = None,
        gpu_sync: bool = False,
        num_kv_readers: int = 1,
        writer: bool = True,
    ) -> None:
        """`device`: the KV pool's device when it is CUDA, so the daemon's segment is
        page-locked at registration (else at the first CUDA load). `gpu_sync`: a CUDA
        load waits for its copy before returning (`Retrieved.ready` is then None).
        `num_kv_readers`: ranks that read each stored object (TP-replicated MLA: the TP
        size); `writer`: False on a rank whose stores another rank makes for it."""
        if transfer not in ("auto", "pickle", "shm"):
            raise ValueError(f"transfer must be 'auto', 'pickle' or 'shm', got {transfer!r}")
        cuda = device is not None and torch.device(device).type == "cuda"
        if cuda:
            refuse_cuda_mla(layout)
        self.endpoint = endpoint
        self.layout = layout
        self.model_name = model_name
        self.world_size = world_size
        self.kv_rank = kv_rank
        self.transfer_setting = transfer
        #: The transfer in use: the setting, or for "auto" what the last registration chose.
        self.transfer: str = "pickle" if transfer == "auto" else transfer
        self._logged_transfer: str | None = None
        self.gpu_sync = gpu_sync
        self._gpu: GpuTransfer | None = GpuTransfer(device, sync=gpu_sync) if cuda else None
        #: Readers of each stored object: 1 when every rank holds its own shard of the KV,
        #: the TP size for TP-replicated MLA (a LOOKUP then read-locks once per rank).
        self.num_kv_readers = num_kv_readers
        #: Whether this rank STOREs: TP-replicated MLA has one writer (TP rank 0).
        self.writer = writer
        self.instance_id = instance_id if instance_id is not None else _new_instance_id()
        self.transport = transport or ZmqTransport(endpoint, connect_timeout_s=connect_timeout_s)
        self._shm: ShmPool | None = None
        self._map_lock = threading.Lock()  # one swap of _shm / _gpu at a time (readers: none)
        #: Tests only: n_chunks -> chunks per piece, pipelining any load (CPU pools too).
        self.force_pieces: Callable[[int], list[int]] | None = None
        #: A pipelined GPU load pays each piece's commit once its copy completed (`bench gpu`
        #: turns it off to compare with paying them all after the load).
        self.commit_behind = True
        #: On a GPU with shared memory, prepare at match only the first piece of `piece_plan`
        #: and let the load ask for the rest while it copies. Off by default: measured on the
        #: H200 (docs/benchmarks.md) it moves the round trips from match into the load and
        #: the commits without shortening the whole path.
        self.prepare_in_pieces = False
        #: Tests only: n_chunks -> pieces of a prepare (its first at match, the rest in the load).
        self.force_prepare_pieces: Callable[[int], list[int]] | None = None
        self.outstanding = Outstanding()  #: ranges whose shm prepare_retrieve is outstanding

    @property
    def chunk_size(self) -> int:
        return self.layout.chunk_size

    # -- keys ----------------------------------------------------------------

    def aligned(self, num_tokens: int) -> int:
        return num_tokens // self.chunk_size * self.chunk_size

    def key(
        self,
        token_ids: Sequence[int],
        request_id: str,
        *,
        start: int = 0,
        end: int | None = None,
        lookup: bool = False,
        cache_salt: str = "",
        readers: int | None = None,
    ) -> wire.CacheKey:
        """`readers`: read locks per object the call takes or releases (default
        `num_kv_readers`, what the group's LOOKUP took; 1 for one rank's own share)."""
        end = self.aligned(len(token_ids)) if end is None else end
        return wire.CacheKey(
            model_name=self.model_name,
            world_size=self.world_size,
            worker_id=None if lookup else self.kv_rank,
            token_ids=tuple(token_ids[:end]),
            start=start,
            end=end,
            request_id=request_id,
            cache_salt=cache_salt,
            num_kv_readers=self.num_kv_readers if readers is None else readers,
        )

    # -- plain operations ------------------------------------------------------

    def _call(self, op: str, payloads: Sequence[object], timeout_s: float, *,
              request_id: str | None = None, on_late=None):
        fence = None
        if wire.OP_PLACES.get(op) == "affinity" and request_id is not None:
            fence = self._affinity_fence(request_id)
        late = {} if on_late is None else {"on_late": on_late}  # a late answer's taker
        frame = self._send(op, [wire.encode(p) for p in payloads], timeout_s,
                           request_id=request_id, fence=fence, **late)
        decoder = wire.DECODERS.get(op)
        if frame is None or decoder is None:
            return None
        try:
            return decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"{op}: undecodable result ({exc})") from None

    def _send(self, op: str, frames: list[bytes], timeout_s: float, **kw):
        """The transport's call; its answer's time, from the send, told to `on_call`."""
        sent = time.perf_counter()
        frame = self.transport.call(op, frames, timeout_s, **kw)
        if self.on_call is not None:
            self.on_call(op, time.perf_counter() - sent)
        return frame

    def _affinity_fence(self, request_id: str) -> tuple[str, list[bytes]]:
        """A commit_retrieve of an empty range: served on the same worker thread as this
        connection's transfers, releases nothing (no transfer has that key) and touches
        only `request_id`'s session, which the deferred end_session removes."""
        key = wire.CacheKey(model_name=self.model_name, world_size=self.world_size,
                            worker_id=self.kv_rank, token_ids=(), start=0, end=0,
                            request_id=request_id)
        return "commit_retrieve", [wire.encode(key), wire.encode(self.instance_id)]

    def unanswered(self, request_id: str | None = None) -> int:
        return self.transport.unanswered(request_id)

    def noop(self, timeout_s: float) -> str:
        return self._call("noop", [], timeout_s)

    def ping(self, timeout_s: float) -> bool:
        return bool(self._call("ping", [self.instance_id], timeout_s))

    def get_chunk_size(self, timeout_s: float) -> int:
        return self._call("get_chunk_size", [], timeout_s)

    def register(self, timeout_s: float) -> wire.RegisterReply:
        """Register this rank's KV layout; idempotent. Raises VersionSkew when the
        endpoint answers the version-independent noop but ignores registration."""
        payload = wire.RegisterPayload(
            instance_id=self.instance_id, model_name=self.model_name,
            world_size=self.world_size, block_size=1,
            num_layers=self.layout.num_layers, hidden_dim_size=self.layout.hidden_dim,
            dtype_str=self.layout.dtype_str, use_mla=self.layout.mla,
            num_physical_slots=self.chunk_size,
        )
        # Registration and noop are both answered inline, in arrival order: a noop answer
        # without the registration's proves the daemon dropped it (another version).
        epoch = self.epoch
        try:
            frame = self._send("register_kv_cache_engine_driven_context",
                               [wire.encode(payload)], timeout_s, probe=True)
        except RequestDropped:
            raise VersionSkew(
                f"the daemon at {self.endpoint} answers noop but drops registration: it runs "
                f"another lmcache version. This client speaks lmcache=={wire.PROTOCOL_VERSION}; "
                "install exactly that version on both sides.") from None
        try:
            reply = None if frame is None else wire.DECODERS[
                "register_kv_cache_engine_driven_context"].decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"register: undecodable result ({exc})") from None
        if reply is None:
            raise ProtocolError("register: empty reply")
        offered = bool(reply.shm_name) and reply.pool_size > 0
        if self.transfer_setting == "shm":
            if not offered:
                raise DaemonRejected(
                    "transfer 'shm' needs a daemon started with --shm-name NAME "
                    "--no-l1-use-lazy (a lazy L1 silently disables shared memory on GPU "
                    "hosts); this one offers no shared-memory pool (use transfer 'pickle' "
                    "or restart it with both flags)"
                )
        mode = "shm" if offered and self.transfer_setting != "pickle" else "pickle"
        # The incarnation that answered: its handshake came before its reply. One that
        # changed during the call is not trusted to name the mapping we hold.
        answered = self.epoch if self.epoch == epoch else None
        with self._map_lock:
            self._swap_mapping(mode, reply, answered)
        if mode != self._logged_transfer:
            log.info("daemon %s: transfer %s (setting %s%s)", self.endpoint, mode,
                     self.transfer_setting, ", shared-memory pool offered" if offered else "")
            self._logged_transfer = mode
        return reply



    def unregister(self, timeout_s: float) -> None:
        self._call("unregister_kv_cache_engine_driven_context", [self.instance_id], timeout_s)





    def end_session(self, request_id: str, timeout_s: float) -> None:
        self._call("end_session", [request_id], timeout_s, request_id=request_id)



    @property
    def epoch(self) -> int:
        return self.transport.epoch

    @property
    def late_replies(self) -> int:
        return self.transport.late_replies

    @property
    def fences_dropped(self) -> int:
        """Abandoned calls no longer tracked (their fence never answered in time)."""
        return self.transport.fences_dropped



















    def close(self) -> None:
        with self._map_lock:
            gpu, self._gpu = self._gpu, None
            shm, self._shm = self._shm, None
        if gpu is not None:  # waits for copies still reading the segment
            gpu.close()
        if shm is not None:
            shm.close()
        self.transport.close()
