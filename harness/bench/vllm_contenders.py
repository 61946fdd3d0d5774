"""`loadback bench vllm`'s contenders (vllm_load.py runs them): each loads a stored prefix into
vLLM 0.32's CPU paged KV cache, timed by phase (`PHASES`). `Ours` is what our vLLM worker does
(engines/vllm/worker.py), over shared memory or pickle; `LMCache` is LMCache 0.5.6's worker-side
load as its vLLM connector runs it on CPU (LMCacheMPWorkerAdapter).
"""

from __future__ import annotations

import itertools
import os
import time

from lmcache_loadback.connectors.telemetry import quiet_telemetry

quiet_telemetry()
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool  # noqa: E402
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector  # noqa: E402
from lmcache_loadback.engines.vllm.paged import PagedCPUView  # noqa: E402

from .client import _quiet_lmcache  # noqa: E402

CHUNK = 256
T = 30.0  # per-operation timeout, seconds
PHASES = ("lookup", "retrieve", "blocks", "end")
OURS_MODEL, LMC_MODEL = "loadback", "lmcache-vllm"  # each family its own keys on the daemon
#: Request ids unique within the run (stores, proofs and samples).
request_ids = itertools.count(1)


class BenchFailure(RuntimeError):
    """A contender could not run or did not land the stored bytes."""


class Ours:
    """Our vLLM worker's load: lookup, retrieve_into the staging slots, to_blocks, commit."""

    def __init__(self, endpoint: str, view: PagedCPUView, transfer: str) -> None:
        self.view = view
        self.conn = LMCacheMPConnector(endpoint, view.layout, transfer=transfer,
                                       model_name=OURS_MODEL)
        self.conn.register(T)
        if self.conn.transfer != transfer:
            raise BenchFailure(f"ours-{transfer}: the daemon's registration gave "
                               f"{self.conn.transfer}")
        self.note = ("shm views -> staging -> to_blocks" if transfer == "shm"
                     else "safe_decode -> staging -> to_blocks")

    def store(self, toks, ref: KVPool) -> None:
        rid = f"store-ours-{next(request_ids)}"
        slots = torch.arange(len(toks), dtype=torch.int64)
        if not self.conn.store_from(toks, rid, ref, slots, timeout_s=T):
            raise BenchFailure(f"ours-{self.conn.transfer}: store of {len(toks)} tokens failed")
        self.conn.end_session(rid, T)

    def run(self, toks, rid, ids, ph) -> None:
        n = len(toks)
        t0 = time.perf_counter()
        hit = self.conn.lookup_hit_tokens(toks, rid, T)
        if hit != n:
            raise BenchFailure(f"ours-{self.conn.transfer}: {hit} of {n} tokens hit")
        t1 = time.perf_counter()
        got = self.conn.retrieve_into(toks, rid, self.view.pool, self.view.slots(n), start=0,
                                      end=n, timeout_s=T)
        t2 = time.perf_counter()
        self.view.to_blocks(ids, n, ready=got.ready)
        t3 = time.perf_counter()
        if got.commit is not None:
            got.commit(T)
        self.conn.end_session(rid, T)
        for p, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)):
            ph[p].append(dt)

    def close(self) -> None:
        self.conn.close()


class LMCache:
    """LMCache 0.5.6's worker-side load as its vLLM connector runs it on CPU."""

    def __init__(self, endpoint: str, kv: dict, bs: int) -> None:
        import zmq
        from lmcache.integration.vllm.utils import translate_vllm_kv_cache_layout
        from lmcache.utils import EngineType
        from lmcache.v1.multiprocess.transfer_context import (
            EngineDrivenContextPickle, EngineDrivenTransferContext, compute_kv_layout,
            create_transfer_context)
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        _quiet_lmcache()
        # vllm_layout_hints() on CPU: vLLM resolves the CPU backend's only layout
        self.hints = {"kv_layout": translate_vllm_kv_cache_layout(
            CPUAttentionBackend.supported_kv_cache_layouts()[0].name)}
        self.engine, self.kv, self.bpc = EngineType.VLLM, kv, CHUNK // bs
        self.rc = RequestClientFactory.create(endpoint, context=zmq.Context.instance())
        self.iid = (os.getpid() << 20) | 0x90000 | next(request_ids)
        self.tc = create_transfer_context(kv, instance_id=self.iid, req_client=self.rc,
                                          mode="auto")
        if type(self.tc) is not EngineDrivenTransferContext:
            raise BenchFailure(f"lmc-pickle: mode auto on CPU gave {type(self.tc).__name__}")
        try:
            got_bs, _, hidden, _, self.fmt, kv_size = compute_kv_layout(
                kv, layout_hints=self.hints, engine_type=self.engine)
            self.tc.register(kv, LMC_MODEL, 1, self.bpc, T, layout_hints=self.hints,
                             engine_type=self.engine)
        except Exception as exc:
            raise BenchFailure(f"lmc-pickle: LMCache cannot address vLLM's CPU layout "
                               f"(hints {self.hints}): {exc!r}") from exc
        if got_bs != bs:
            raise BenchFailure(f"lmc-pickle: LMCache reads block size {got_bs}, vLLM's is {bs}")
        self.ctx = self.tc.engine_driven_context
        if not isinstance(self.ctx, EngineDrivenContextPickle):
            raise BenchFailure(f"lmc-pickle: got {type(self.ctx).__name__}, not pickle")
        self.format = f"{self.fmt.name} (planes {kv_size}, {hidden} per token)"
        self.note = "pickle.loads -> scatter_cpu_to_paged_kv"

    def key(self, toks, rid, worker_id=0):
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
        return IPCCacheServerKey(model_name=LMC_MODEL, world_size=1, worker_id=worker_id,
                                 token_ids=tuple(toks), start=0, end=len(toks), request_id=rid,
                                 num_kv_readers=1)

    def store(self, toks, src: dict, src_ids) -> None:
        """Its own store (submit_store: prepare_store, gather from the paged cache, commit)."""
        rid = f"store-lmc-{next(request_ids)}"
        ok = self.tc.submit_store(rid, self.key(toks, rid), src, [list(src_ids)], None,
                                  self.bpc).result(timeout=T)
        self.rc.end_session(rid).result(timeout=T)
        if not ok:
            raise BenchFailure(f"lmc-pickle: its store of {len(toks)} tokens failed")

    def token_major(self, src: dict, src_ids, ref: KVPool, layout: KVLayout) -> bool:
        """Whether LMCache's chunk of the first CHUNK tokens holds each token's K|V per head."""
        from lmcache.v1.multiprocess.transfer_context import gather_paged_kv_to_cpu
        chunk = gather_paged_kv_to_cpu(src, list(src_ids[:self.bpc]), self.bpc,
                                       layout_hints=self.hints, engine_kv_format=self.fmt,
                                       engine_type=self.engine)[0]
        h, d = layout.num_heads, layout.head_dim
        want = torch.stack([torch.cat((k[:CHUNK], v[:CHUNK]), -1).reshape(CHUNK, h * 2 * d)
                            for k, v in zip(ref.k_buffer, ref.v_buffer)])
        return tuple(chunk.shape) == tuple(want.shape) and torch.equal(chunk, want)

    def run(self, toks, rid, ids, ph) -> None:
        from lmcache.v1.multiprocess.transfer_context import scatter_cpu_to_paged_kv
        n = len(toks)
        t0 = time.perf_counter()
        self.rc.lookup(self.key(toks, rid).no_worker_id_version(), 1).result(timeout=T)
        chunks = self.rc.wait_prefetch_status(rid, T).result(timeout=T + 5)
        if chunks is None or chunks * CHUNK != n:
            raise BenchFailure(f"lmc-pickle: {chunks} chunks hit of {n} tokens")
        t1 = time.perf_counter()
        key = self.key(toks, rid)
        src = self.ctx.prepare_retrieve(key, self.iid)
        if src is None or len(src) != n // CHUNK:
            raise BenchFailure("lmc-pickle: prepare_retrieve missed")
        t2 = time.perf_counter()
        scatter_cpu_to_paged_kv(self.kv, list(ids), src, self.bpc, layout_hints=self.hints,
                                engine_kv_format=self.fmt, engine_type=self.engine)
        del src
        t3 = time.perf_counter()
        self.ctx.commit_retrieve(key, self.iid)
        self.rc.end_session(rid).result(timeout=T)
        for p, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)):
            ph[p].append(dt)

    def close(self) -> None:
        try:
            self.tc.unregister().result(timeout=2)
        except Exception:  # noqa: BLE001 - the daemon is about to stop anyway
            pass
        self.rc.close()
