"""The LMCache 0.5.6 multi-process client, engine-driven transfer mode.

Who calls it: the orchestrator (match / load_back / store / heartbeat), the benchmarks,
the chaos harness. Every method takes a timeout and returns or raises by then, whatever
the daemon does; errors are the hierarchy in `connectors.errors`. It keeps no policy:
no retries, no breaker, no metrics (see `orchestrator/`).

KV bytes move in one of two ways, chosen by configuration (`transfer`):
- "pickle": prepare_retrieve carries pickled chunk tensors, loaded by a restricted
  unpickler (`connectors.safe_decode`); commit_store carries pickled chunks.
- "shm": the daemon (started with --shm-name) hands out slot descriptors into its L1
  pool in /dev/shm; chunks are copied through the mapping and no pickle is involved.
- "auto" (the default): shm when the daemon's registration reply offers a pool, pickle
  otherwise, decided again at every registration (a restarted daemon may differ).
A KV pool on a CUDA device moves through `connectors.gpu_transfer` (the segment page-locked
once per registration, H2D copy + scatter on side streams, `Retrieved.ready` an event).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import mmap
import os
import threading
import time
from typing import Callable, Literal, Sequence

import msgspec
import torch

from . import wire
from .base import Prepared, Retrieved
from .errors import (
    ConnectorError,
    DaemonRejected,
    DaemonTimeout,
    DaemonUnavailable,
    ProtocolError,
    RequestDropped,
    ShortRead,
    SlotsError,
    UnsupportedKVPool,
    VersionSkew,
)
from .gpu_transfer import GpuTransfer, on_cuda, pool_device
from .kv_layout import KVLayout, KVPool, check_slots, gather_chunks, scatter_skipping
from .retrieval import Retrieval
from .safe_decode import dump_tensor_list, load_tensor_list
from .transport import ZmqTransport

Transfer = Literal["auto", "pickle", "shm"]
#: One msgpack bin holds < 4 GiB: a pickled reply or store must stay under it (with framing).
PICKLE_MAX_BYTES = 2**32 - (64 << 20)
log = logging.getLogger(__name__)
_instance_ids = itertools.count(1)


def _new_instance_id() -> int:
    # Unique per process and per connector: the daemon keys registrations by it.
    return (os.getpid() << 20) | next(_instance_ids)


class _ShmPool:
    """A read/write mapping of the daemon's L1 pool (/dev/shm/<name>), as registration with
    daemon incarnation `epoch` (the connection epoch) named it."""

    def __init__(self, name: str, size: int, epoch: int | None = None) -> None:
        path = "/dev/shm/" + name.lstrip("/")
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise DaemonUnavailable(
                f"cannot open the daemon's shared-memory pool {path}: {exc}; the daemon "
                "must run on this host with --shm-name NAME --no-l1-use-lazy"
            ) from exc
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.name = name
        self.size = size
        self.epoch = epoch
        # Through a memoryview, every view holds a buffer export: close() then cannot unmap
        # the pool under a copy still reading it (the mapping goes with the last view).
        self.bytes: torch.Tensor | None = torch.frombuffer(memoryview(self._map),
                                                           dtype=torch.uint8)

    def names(self, name: str, size: int, epoch: int) -> bool:
        """This mapping is the segment a registration with incarnation `epoch` named."""
        return self.bytes is not None and (self.name, self.size, self.epoch) == (
            name, size, epoch)

    def view(self, slot: wire.ShmSlot, layout: KVLayout) -> torch.Tensor:
        data = self.bytes  # once: close() may run on another thread
        if data is None:
            raise DaemonUnavailable("the daemon's shared-memory pool was unmapped (a "
                                    "re-registration replaced it, or the client closed)")
        if slot.dtype != layout.dtype_str or tuple(slot.shape) != layout.chunk_shape:
            raise ProtocolError(
                f"shm slot of {slot.dtype}{slot.shape}, expected "
                f"{layout.dtype_str}{list(layout.chunk_shape)}"
            )
        if slot.length != layout.chunk_bytes or slot.offset < 0 or (
            slot.offset + slot.length > self.size
        ):
            raise ProtocolError(
                f"shm slot [{slot.offset}, +{slot.length}) outside the {self.size}-byte pool"
            )
        raw = data[slot.offset : slot.offset + slot.length]
        return raw.view(layout.dtype).view(layout.chunk_shape)

    def close(self) -> None:
        self.bytes = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with it


def _refuse_cuda_mla(layout: KVLayout) -> None:
    if layout.mla:
        raise UnsupportedKVPool(
            "loadback: an MLA KV pool on CUDA is not supported (the GPU data path moves "
            "K/V pools only; MLA load-back runs with the KV pool on CPU); start without "
            "--radix-cache-backend loadback to serve this model on GPU")


class LMCacheMPConnector:
    """Client of one LMCache MP daemon for one KV rank of one model."""

    def __init__(
        self,
        endpoint: str,
        layout: KVLayout,
        *,
        model_name: str = "loadback",
        world_size: int = 1,
        kv_rank: int = 0,
        transfer: Transfer = "auto",
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
        if device is not None and torch.device(device).type == "cuda":
            _refuse_cuda_mla(layout)
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
        self._gpu: GpuTransfer | None = None
        if device is not None and torch.device(device).type == "cuda":
            self._gpu = GpuTransfer(device, sync=gpu_sync)
        #: Readers of each stored object: 1 when every rank holds its own shard of the KV,
        #: the TP size for TP-replicated MLA (a LOOKUP then read-locks once per rank).
        self.num_kv_readers = num_kv_readers
        #: Whether this rank STOREs: TP-replicated MLA has one writer (TP rank 0).
        self.writer = writer
        self.instance_id = instance_id if instance_id is not None else _new_instance_id()
        self.transport = transport or ZmqTransport(endpoint, connect_timeout_s=connect_timeout_s)
        self._shm: _ShmPool | None = None
        self._map_lock = threading.Lock()  # one swap of _shm / _gpu at a time (readers: none)
        #: Tests only: n_chunks -> chunks per piece, pipelining any load (CPU pools too).
        self.force_pieces: Callable[[int], list[int]] | None = None

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
              request_id: str | None = None):
        fence = None
        if wire.OP_PLACES.get(op) == "affinity" and request_id is not None:
            fence = self._affinity_fence(request_id)
        frame = self.transport.call(op, [wire.encode(p) for p in payloads], timeout_s,
                                    request_id=request_id, fence=fence)
        decoder = wire.DECODERS.get(op)
        if frame is None or decoder is None:
            return None
        try:
            return decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"{op}: undecodable result ({exc})") from None

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
            frame = self.transport.call("register_kv_cache_engine_driven_context",
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

    def _swap_mapping(self, mode: str, reply: wire.RegisterReply, epoch: int | None) -> None:
        """After a registration (holding `_map_lock`): keep the mapping when the same daemon
        incarnation named the same segment (a suspect re-registration: no remap, no second
        page-locking), else map the new one, page-lock it, then publish it in one store.
        Readers take `self._shm` once and keep that object: an old mapping stays valid while
        views of it live, and a copy from it stays counted on its page-locking."""
        old = self._shm
        if mode == "shm" and old is not None and epoch is not None and old.names(
                reply.shm_name, reply.pool_size, epoch):
            self.transfer = mode
            return
        new = None
        try:
            if mode == "shm":
                new = _ShmPool(reply.shm_name, reply.pool_size, epoch)
            if self._gpu is not None:  # before anyone can take a view of the new mapping
                self._gpu.attach(new.bytes if new is not None else None)
        except BaseException:
            self._shm = None
            if new is not None:
                new.close()
            if old is not None:
                old.close()
            raise
        self._shm = new
        self.transfer = mode
        if old is not None:
            old.close()

    def _gpu_for(self, pool: KVPool) -> GpuTransfer:
        """The CUDA data path for this pool's device (made, and the segment page-locked, on
        first use when the connector was not built with `device=`)."""
        dev = pool_device(pool)
        gpu = self._gpu
        if gpu is not None and gpu.device == dev:
            return gpu
        with self._map_lock:
            gpu = self._gpu
            if gpu is None or gpu.device != dev:
                _refuse_cuda_mla(self.layout)
                if gpu is not None:
                    gpu.close()
                log.warning("KV pool on %s: page-locking the daemon's segment now; pass "
                            "device=%r to the connector to do it at registration", dev,
                            str(dev))
                gpu = GpuTransfer(dev, sync=self.gpu_sync)
                shm = self._shm
                gpu.attach(shm.bytes if shm is not None else None)
                self._gpu = gpu
            return gpu

    def unregister(self, timeout_s: float) -> None:
        self._call("unregister_kv_cache_engine_driven_context", [self.instance_id], timeout_s)

    def lookup(self, key: wire.CacheKey, timeout_s: float) -> None:
        """Start a prefetch of `key` (worker_id None); the hit comes from prefetch_status."""
        self._call("lookup", [key, self.world_size], timeout_s, request_id=key.request_id)

    def query_prefetch_status(self, request_id: str, timeout_s: float) -> int | None:
        """Hit chunks, or None while running. Answers once: a lost reply reads as a miss."""
        return self._call("query_prefetch_status", [request_id], timeout_s,
                          request_id=request_id)

    def wait_prefetch_status(self, request_id: str, wait_s: float, timeout_s: float) -> int | None:
        return self._call("wait_prefetch_status", [request_id, wait_s], timeout_s,
                          request_id=request_id)

    def free_lookup_locks(self, key: wire.CacheKey, timeout_s: float) -> None:
        self._call("free_lookup_locks", [key, self.world_size], timeout_s,
                   request_id=key.request_id)

    def end_session(self, request_id: str, timeout_s: float) -> None:
        self._call("end_session", [request_id], timeout_s, request_id=request_id)

    def free_locks(self, token_ids: Sequence[int], request_id: str, start: int, end: int,
                   timeout_s: float, *, cache_salt: str = "", shard: bool = False) -> None:
        """free_lookup_locks of [start, end): every KV rank's share of those chunks, as the
        group's LOOKUP locked them, or with `shard` this rank's alone (one read lock per
        object: under TP-replicated MLA the other ranks' locks on it stay theirs)."""
        if end > start:
            key = self.key(token_ids, request_id, start=start, end=end, lookup=not shard,
                           cache_salt=cache_salt, readers=1 if shard else None)
            self.free_lookup_locks(key, timeout_s)

    def abandon_lookup(self, token_ids: Sequence[int], request_id: str, timeout_s: float,
                       *, cache_salt: str = "") -> bool:
        """After a LOOKUP whose answer never came: once its prefetch has finished, release
        what it locked. False while it is still running (ask again later).

        The daemon derives the release from the lookup result it recorded for the session,
        so this is right whether the one-shot status was consumed by a lost reply (answers
        0 now), never arrived (nothing to release) or is answered now.
        """
        if self.query_prefetch_status(request_id, timeout_s) is None:
            return False
        self.free_locks(token_ids, request_id, 0, self.aligned(len(token_ids)), timeout_s,
                        cache_salt=cache_salt)
        return True

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

    # -- composite operations ------------------------------------------------

    def lookup_hit_tokens(
        self, token_ids: Sequence[int], request_id: str, timeout_s: float, *, cache_salt: str = ""
    ) -> int:
        """LOOKUP the whole chunks of `token_ids` and wait for the prefetch: hit tokens.

        On a hit the daemon holds read locks on the hit chunks until a retrieve of that
        range or free_lookup_locks. Raises on timeout; the caller then owes the daemon a
        free_lookup_locks for the range (the prefetch may still complete).
        """
        deadline = time.monotonic() + timeout_s
        end = self.aligned(len(token_ids))
        if end == 0:
            return 0
        self.lookup(self.key(token_ids, request_id, lookup=True, cache_salt=cache_salt), timeout_s)
        pause = 0.0001
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DaemonTimeout("query_prefetch_status", timeout_s, "prefetch still running")
            chunks = self.query_prefetch_status(request_id, remaining)
            if chunks is not None:
                hit = chunks * self.chunk_size
                if hit < 0 or hit > end:
                    raise ProtocolError(f"prefetch reports {chunks} chunks of a {end}-token key")
                return hit
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.002)

    def prepare(self, token_ids: Sequence[int], request_id: str, *, start: int, end: int,
                timeout_s: float, cache_salt: str = "",
                retrieval: Retrieval | None = None) -> Prepared:
        """prepare_retrieve of [start, end) now, the copy later (`retrieve_into(prepared=)`).

        The daemon moves the lookup's read locks on those chunks to this transfer and hands
        out where they are (shm) or their bytes (pickle); they stay put until the commit
        that `retrieval` (the caller's, made before this call) then owes is paid: after the
        copy when it loads, at once when it does not. Done at match time it takes the
        daemon's round trip off the load's critical path. Raises like `retrieve_into`;
        whatever the daemon is owed after a raise is in `retrieval`.
        """
        r = self._retrieval_for(start, end, retrieval)
        self._check_pickle_size(end - start)
        key = self.key(token_ids, request_id, start=start, end=end, cache_salt=cache_salt)
        chunks = self._prepare_range(key, (end - start) // self.chunk_size, timeout_s, r)
        return Prepared(start=start, end=end, chunks=chunks, retrieval=r,
                        transfer=self.transfer)

    def _retrieval_for(self, start: int, end: int, retrieval: Retrieval | None) -> Retrieval:
        """The caller's retrieval of exactly [start, end), or a new one on this epoch."""
        if retrieval is None:
            return Retrieval(self.epoch, start, end)
        if (retrieval.start, retrieval.end) != (start, end):
            raise ValueError(f"retrieval of [{retrieval.start}, {retrieval.end}) used for "
                             f"[{start}, {end})")
        return retrieval

    def _prepare_range(self, key: wire.CacheKey, n_chunks: int, timeout_s: float,
                       retrieval: Retrieval) -> list[torch.Tensor]:
        """One prepare_retrieve: its validated chunks. `retrieval` records the call's commit
        whenever the daemon may serve it, answered or not: abandoned at the deadline and
        served later, it parks the range's read locks (shm) until a commit_retrieve of the
        same key. Paid after the daemon answered the abandoned call, the commit releases
        them; if it was never served, or refused, the commit finds no transfer and releases
        nothing (in pickle mode it never does). Not sent (DaemonUnavailable) or refused
        (DaemonRejected): the locks stay the lookup's, nothing is recorded."""
        commit = self._owed_commit(key)
        try:
            reply = self._call("prepare_retrieve", [key, self.instance_id], timeout_s,
                               request_id=key.request_id)
        except (DaemonUnavailable, DaemonRejected):
            raise
        except BaseException:
            retrieval.asked(key.end, commit)  # sent: the daemon may serve it still
            raise
        if reply is None or not reply.success:
            raise DaemonRejected(
                f"prepare_retrieve [{key.start}, {key.end}) refused: the lookup locks are gone "
                "(expired, freed, or the daemon restarted)"
            )
        retrieval.asked(key.end, commit)
        return self._validated_chunks(reply, n_chunks)

    def retrieve_into(
        self,
        token_ids: Sequence[int],
        request_id: str,
        pool: KVPool,
        slots: torch.Tensor,
        *,
        start: int,
        end: int,
        timeout_s: float,
        skip: int = 0,
        cache_salt: str = "",
        prepared: Prepared | None = None,
        retrieval: Retrieval | None = None,
    ) -> Retrieved:
        """Copy tokens [start + skip, end) into `slots`; [start, end) is chunk-aligned and
        locked by a lookup of `request_id` (or already prepared: `prepared`, from
        `prepare` of exactly [start, end), whose retrieval this one is); `skip` leading
        tokens are already cached by the engine.

        validate -> copy -> return. commit_retrieve is not sent here: `retrieval` (the
        caller's, or a new one) records it as prepare_retrieve goes out, and the caller
        pays it off the request path (`Retrieved.commit` is its release). The shm views
        stay valid until that commit, so copying before it is sound.

        A CUDA pool on shared memory is loaded in pieces (`piece_plan`): the copy of one
        piece runs while the next piece's prepare_retrieve is in flight. A piece that fails
        after earlier pieces were queued waits for them (nothing writes the slots after the
        raise); the retrieval then owes the sent pieces' commits and the free of the pieces
        never asked for (the caller frees none of the range: `locks_moved`). Whatever
        reached the slots before a failure is not a load: the caller recomputes.
        """
        if prepared is not None:
            if retrieval is not None and retrieval is not prepared.retrieval:
                raise ValueError("a prepared range is retrieved under its own retrieval")
            retrieval = prepared.retrieval
        self._check_retrieve(pool, slots, start, end, skip, prepared)
        r = self._retrieval_for(start, end, retrieval)
        nbytes = (end - start) // self.chunk_size * self.layout.chunk_bytes
        if prepared is not None:
            if prepared.epoch != self.epoch:  # r owes the old incarnation: dropped, counted
                raise DaemonUnavailable("the daemon restarted after prepare_retrieve: its "
                                        "locks and buffers are gone")
            ready = self._land(pool, prepared.chunks, slots, skip, prepared.transfer,
                               check=lambda: self._check_slots(pool, slots, skip))
            return Retrieved(nbytes=nbytes, commit=r.release, ready=ready)
        self._check_pickle_size(end - start)
        n_chunks = (end - start) // self.chunk_size
        plan = self.piece_plan(n_chunks) if (on_cuda(pool) and self.transfer == "shm") \
            else [n_chunks]
        if self.force_pieces is not None:
            plan = self.force_pieces(n_chunks)
        if len(plan) > 1:
            ready = self._retrieve_pieces(token_ids, request_id, pool, slots, timeout_s,
                                          skip, cache_salt, plan, r)
            return Retrieved(nbytes=nbytes, commit=r.release, ready=ready)
        key = self.key(token_ids, request_id, start=start, end=end, cache_salt=cache_salt)
        chunks = self._prepare_range(key, n_chunks, timeout_s, r)
        ready = self._land(pool, chunks, slots, skip, self.transfer)
        del chunks
        return Retrieved(nbytes=nbytes, commit=r.release, ready=ready)

    def _check_retrieve(self, pool: KVPool, slots: torch.Tensor, start: int, end: int,
                        skip: int, prepared: Prepared | None) -> None:
        """Refuse bad arguments before anything is sent or copied. A prepared CUDA load
        checks the slots themselves while its first copy runs (before any scatter)."""
        if not 0 <= skip < self.chunk_size:
            raise ValueError(f"skip must be in [0, {self.chunk_size}), got {skip}")
        if prepared is not None and (prepared.start, prepared.end) != (start, end):
            raise ValueError(f"prepared range [{prepared.start}, {prepared.end}) is not the "
                             f"requested [{start}, {end})")
        if len(slots) != end - start - skip:
            raise SlotsError(f"retrieve of [{start}+{skip}, {end}) needs "
                             f"{end - start - skip} slots, got {len(slots)}")
        if not (prepared is not None and on_cuda(pool)):
            self._check_slots(pool, slots, skip)

    def _land(self, pool: KVPool, chunks, slots, skip: int, transfer: str, check=None):
        """Copy validated chunks into the slots: the CUDA path (returns `ready`; `check`,
        the slot checks, runs before its first scatter) or the host scatter (None)."""
        if on_cuda(pool):  # the commit is paid once `ready` completed (the copy read it)
            return self._gpu_for(pool).load(self.layout, chunks, pool, slots, skip,
                                            from_segment=transfer == "shm",
                                            before_scatter=check)
        scatter_skipping(self.layout, chunks, pool, slots, skip)
        return None

    @staticmethod
    def piece_plan(n_chunks: int) -> list[int]:
        """Chunks per prepare_retrieve of a pipelined load: 4, 8, 16, then 32 at a time.

        A prepare_retrieve costs a fixed round trip plus a share that grows with the prefix
        (the daemon hashes the whole prefix chain for every piece): up to 16 chunks the
        copies cannot hide the extra round trips, so no pipelining; past it, growing pieces
        (`loadback bench gpu` measures the trade-off; README, "The GPU data path").
        """
        if n_chunks <= 16:
            return [n_chunks]
        plan, size, left = [], 4, n_chunks
        while left:
            take = min(size, left)
            if 0 < left - take < size // 2:  # fold a small tail into this piece
                take = left
            plan.append(take)
            left -= take
            size = min(size * 2, 32)
        return plan

    def _retrieve_pieces(self, token_ids, request_id, pool, slots, timeout_s, skip,
                         cache_salt, plan, retrieval: Retrieval):
        """One prepare_retrieve per piece of `plan`, each piece copied while the next round
        trip is in flight; returns the last copy's `ready`."""
        deadline = time.monotonic() + timeout_s
        c = self.chunk_size
        ready, s, row = None, retrieval.start, 0
        gpu = self._gpu_for(pool) if on_cuda(pool) else None
        try:
            for i, cnt in enumerate(plan):
                e = s + cnt * c
                first = skip if i == 0 else 0
                rows = e - s - first
                key = self.key(token_ids, request_id, start=s, end=e, cache_salt=cache_salt)
                chunks = self._prepare_range(key, cnt, max(0.0, deadline - time.monotonic()),
                                             retrieval)
                ready = self._land(pool, chunks, slots[row:row + rows], first, self.transfer)
                del chunks
                s, row = e, row + rows
        except BaseException:
            self._fail_pieces(gpu, retrieval, token_ids, request_id, cache_salt)
            raise
        return ready

    def _fail_pieces(self, gpu, retrieval: Retrieval, token_ids, request_id,
                     cache_salt: str) -> None:
        """A pipelined load failed: nothing may write the slots after the raise, and once
        any piece may have moved the lookup's locks, the retrieval also owes the free of
        the pieces never asked for, [asked_to, end) (the caller frees none of the range)."""
        if gpu is not None:
            gpu.drain()
        s, e = retrieval.asked_to, retrieval.end
        if retrieval.locks_moved and s < e:
            retrieval.owe("free_locks", s, e, lambda t: self.free_locks(
                token_ids, request_id, s, e, t, cache_salt=cache_salt, shard=retrieval.shard))

    def _check_pickle_size(self, tokens: int) -> None:
        """Refuse, before anything is sent, a pickle message the wire cannot carry."""
        nbytes = tokens * self.layout.bytes_per_token
        if self.transfer == "pickle" and nbytes > PICKLE_MAX_BYTES:
            raise ProtocolError(
                f"{tokens} tokens are {nbytes} bytes, over the {PICKLE_MAX_BYTES}-byte limit "
                "of one pickle message: use shared memory (start the daemon with --shm-name "
                "NAME --no-l1-use-lazy, transfer auto or shm) or move fewer tokens at once")

    def _check_slots(self, pool: KVPool, slots: torch.Tensor, skip: int) -> None:
        """Refuse bad slots before prepare_retrieve: after it a raise would owe a commit,
        and a skip copies in two steps that must not fail between them."""
        head = self.chunk_size - skip if skip else 0
        if head:
            check_slots(dataclasses.replace(self.layout, chunk_size=head), slots[:head], head,
                        pool_size=pool.num_slots)
        check_slots(self.layout, slots[head:], len(slots) - head, pool_size=pool.num_slots)

    def _owed_commit(self, key: wire.CacheKey) -> Callable[[float], bool]:
        """commit_retrieve for `key`, unsent: releases the daemon's buffer and read locks
        (shm) once paid. An answered commit is paid whatever it says: 0.5.6 answers
        True even for a transfer it never created (an abandoned prepare never served, or
        refused), and a refusal would be no different sent again."""

        def commit(timeout_s: float) -> bool:
            ok = self._call("commit_retrieve", [key, self.instance_id], timeout_s,
                            request_id=key.request_id)
            if self.transfer == "shm" and not ok:
                log.debug("commit_retrieve [%d, %d) of %s refused: nothing to release",
                          key.start, key.end, key.request_id)
            return True

        return commit

    def _validated_chunks(self, reply: wire.PrepareRetrieveReply,
                          n_chunks: int) -> list[torch.Tensor]:
        """The reply's chunks, each of the layout's shape and dtype, exactly `n_chunks`."""
        if self.transfer == "shm":
            chunks = self._shm_views(reply.context, n_chunks)
        else:
            chunks = load_tensor_list(
                reply.data, expected_shape=self.layout.chunk_shape,
                expected_dtype=self.layout.dtype, max_items=n_chunks,
            )
        if len(chunks) != n_chunks:
            raise ShortRead(f"prepare_retrieve returned {len(chunks)} of {n_chunks} chunks")
        return chunks

    def _mapping(self, epoch: int | None = None) -> _ShmPool:
        """The mapping of the segment of the daemon we talk to now (and, given `epoch`, the
        one a call started then was answered by), read once: a re-registration may swap
        it on another thread; the object read stays valid. DaemonUnavailable otherwise."""
        shm = self._shm
        if shm is None:
            raise DaemonUnavailable("shared-memory pool not mapped: register first")
        if shm.epoch is None or shm.epoch != self.epoch or (
                epoch is not None and epoch != shm.epoch):
            raise DaemonUnavailable("the shared-memory pool mapped is another daemon "
                                    "incarnation's: register again first")
        return shm

    def _shm_views(self, context: wire.ShmContext, n_chunks: int) -> list[torch.Tensor]:
        shm = self._mapping()
        if len(context.slots) != n_chunks:
            raise ShortRead(f"daemon offered {len(context.slots)} of {n_chunks} chunks")
        return [shm.view(s, self.layout) for s in context.slots]

    def store_from(
        self,
        token_ids: Sequence[int],
        request_id: str,
        pool: KVPool,
        slots: torch.Tensor,
        *,
        timeout_s: float,
        cache_salt: str = "",
    ) -> bool:
        """STORE the whole chunks of `token_ids`, whose KV sits in `slots`. A rank that is not
        the writer (`writer` False: TP-replicated MLA, where rank 0 stores the one copy)
        answers True without calling the daemon."""
        deadline = time.monotonic() + timeout_s
        end = self.aligned(len(token_ids))
        if end == 0 or not self.writer:
            return True
        slots = check_slots(self.layout, slots[:end], end, pool_size=pool.num_slots)
        self._check_pickle_size(end)
        key = self.key(token_ids, request_id, end=end, cache_salt=cache_salt)
        epoch = self.epoch  # the mapping must be the one of the daemon that answers
        prep = self._call("prepare_store", [key, self.instance_id], timeout_s,
                          request_id=request_id)
        left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
        if self.transfer == "shm":
            ctx = prep.context if prep is not None else wire.ShmContext()
            if not ctx.slots:
                return True  # every chunk is cached already
            if len(ctx.slots) != len(ctx.chunk_indices):
                raise ProtocolError("prepare_store: slots and chunk_indices differ in length")
            shm = self._mapping(epoch)
            views = [shm.view(s, self.layout) for s in ctx.slots]
            if on_cuda(pool):
                self._gpu_for(pool).store(self.layout, pool, slots, list(ctx.chunk_indices),
                                          out=views)
            else:
                gather_chunks(self.layout, pool.k_buffer, pool.v_buffer, slots,
                              out=views, chunk_indices=list(ctx.chunk_indices))
            del views
            return bool(self._call("commit_store", [key, self.instance_id, b""], left(),
                                   request_id=request_id))
        if on_cuda(pool):  # our own host copies: the pinned staging went back to the ring
            chunks = self._gpu_for(pool).store(self.layout, pool, slots,
                                               range(end // self.chunk_size), out=None)
        else:
            chunks = gather_chunks(self.layout, pool.k_buffer, pool.v_buffer, slots)
        data = dump_tensor_list(chunks)
        return bool(self._call("commit_store", [key, self.instance_id, data], left(),
                               request_id=request_id))

    def close(self) -> None:
        with self._map_lock:
            gpu, self._gpu = self._gpu, None
            shm, self._shm = self._shm, None
        if gpu is not None:  # waits for copies still reading the segment
            gpu.close()
        if shm is not None:
            shm.close()
        self.transport.close()
