"""LMCache 0.5.6 multi-process wire format: op ids, request keys, reply types.

Every frame is one msgpack value: a request `[uid, op, payload_0, ...]`, a reply `[uid,
op_echo]` (the handler returned None) or `[uid, op_echo, result]`. The structs encode exactly
like lmcache's own dataclasses (maps keyed by field name; checked by the wire tests).
"""

from __future__ import annotations

from typing import Any

import msgspec

#: The lmcache release whose protocol this module speaks; client and daemon must match.
PROTOCOL_VERSION = "0.5.6"

# Legacy integer op ids of 0.5.6 (frozen upstream; newer ops travel by name).
OP_IDS: dict[str, int] = {
    "store": 6,
    "retrieve": 7,
    "lookup": 8,
    "query_prefetch_status": 9,
    "wait_prefetch_status": 10,
    "free_lookup_locks": 12,
    "end_session": 13,
    "register_kv_cache_engine_driven_context": 14,
    "unregister_kv_cache_engine_driven_context": 15,
    "prepare_store": 16,
    "commit_store": 17,
    "prepare_retrieve": 18,
    "commit_retrieve": 19,
    "clear": 20,
    "get_chunk_size": 21,
    "ping": 22,
    "noop": 24,
}

_encoder = msgspec.msgpack.Encoder()
OP_FRAMES: dict[str, bytes] = {op: _encoder.encode(i) for op, i in OP_IDS.items()}

# Where the 0.5.6 daemon runs each handler (lmcache/v1/multiprocess/transport/zmq_impl):
# "inline" on its socket loop, in arrival order; "affinity" on the worker thread bound to
# the client connection, FIFO; "cpu" on the shared worker pool (FIFO only with the default
# single CPU worker, --max-cpu-workers 1). A reply to a later request of the same place
# and connection therefore proves an earlier one was served or dropped.
OP_PLACES: dict[str, str] = {
    "noop": "inline", "get_chunk_size": "inline",
    "register_kv_cache_engine_driven_context": "inline",
    "unregister_kv_cache_engine_driven_context": "inline",
    "prepare_store": "affinity", "commit_store": "affinity",
    "prepare_retrieve": "affinity", "commit_retrieve": "affinity",
    "store": "affinity", "retrieve": "affinity",
    "lookup": "cpu", "query_prefetch_status": "cpu", "wait_prefetch_status": "cpu",
    "free_lookup_locks": "cpu", "end_session": "cpu", "ping": "cpu", "clear": "cpu",
}


class CacheKey(msgspec.Struct, frozen=True):
    """IPCCacheServerKey of 0.5.6, field for field (order and names matter)."""

    model_name: str
    world_size: int
    worker_id: int | None
    token_ids: tuple[int, ...]
    start: int
    end: int
    request_id: str
    cache_salt: str = ""
    request_configs: dict[str, Any] | None = None
    # The daemon drops (no reply) any key with num_kv_readers < 1.
    num_kv_readers: int = 1


class RegisterPayload(msgspec.Struct):
    """RegisterEngineDrivenContextPayload of 0.5.6."""

    instance_id: int
    model_name: str
    world_size: int
    block_size: int
    num_layers: int
    hidden_dim_size: int
    dtype_str: str
    use_mla: bool
    num_physical_slots: int | None = None


class RegisterReply(msgspec.Struct):
    shm_name: str = ""
    pool_size: int = 0


class ShmSlot(msgspec.Struct):
    """One chunk's place in the daemon's shared-memory L1 pool."""

    offset: int
    length: int
    shape: list[int]
    dtype: str


class ShmContext(msgspec.Struct):
    slots: list[ShmSlot] = []
    chunk_indices: list[int] = []


class PrepareRetrieveReply(msgspec.Struct):
    success: bool
    # memoryview: the pickled chunks are not copied out of the ZMQ frame.
    data: memoryview = msgspec.field(default_factory=lambda: memoryview(b""))
    context: ShmContext = msgspec.field(default_factory=ShmContext)


class PrepareStoreReply(msgspec.Struct):
    context: ShmContext = msgspec.field(default_factory=ShmContext)


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


#: Decoders for the results of each op (None means the reply carries no result frame).
RESULT_TYPES: dict[str, Any] = {
    "noop": str,
    "get_chunk_size": int,
    "ping": bool,
    "register_kv_cache_engine_driven_context": RegisterReply,
    "unregister_kv_cache_engine_driven_context": None,
    "lookup": None,
    "query_prefetch_status": int | None,
    "wait_prefetch_status": int | None,
    "free_lookup_locks": None,
    "end_session": None,
    "prepare_store": PrepareStoreReply,
    "commit_store": bool,
    "prepare_retrieve": PrepareRetrieveReply,
    "commit_retrieve": bool,
    "clear": None,
}

DECODERS: dict[str, msgspec.msgpack.Decoder] = {
    op: msgspec.msgpack.Decoder(t) for op, t in RESULT_TYPES.items() if t is not None
}
